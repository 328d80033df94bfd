"""The `--packing documents` index of 10^6 documents: build time and padding on a realistic length mix.

    python bench/bench_packing.py [--documents 1000000] [--seq-length 32768 1048576]
    python bench/bench_packing.py --documents 300000 --ring-balance 2 4 8 16 32 64

`--ring-balance R...`: per ring size, the slowest ring rank's attention pairs over the mean
(`context_layout.packed_rank_work`) under each `--cp-document-layout`, median and worst of the first
40 samples, and the share of tokens `local` keeps off the ring.

The mix (a prediction of what chat fine-tuning data looks like, not a measured corpus): log-normal lengths,
median 1,500 tokens (sigma 1.0, so a tenth are over 5,400 tokens), capped at 32K, plus 2% long documents of
16K to 128K tokens (books, repositories) where the sample holds them. Each line: one epoch's index (the seeded
permutation and the packing, as `PackedDocumentSamples` builds it), its seconds (best of --repeats), the
samples and the padding's share of their tokens (the epoch's last, partly filled sample aside, and with it).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from megatron_lc.data.packing import pack_epoch
from megatron_lc.planning.packed_work import assumed_lengths


realistic_lengths = assumed_lengths  # the mix the planner assumes without --data-path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--documents", type=int, default=1_000_000)
    p.add_argument("--seq-length", type=int, nargs="+", default=[32_768, 131_072, 1_048_576])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ring-balance", type=int, nargs="*", default=[], metavar="R")
    args = p.parse_args()
    lengths = realistic_lengths(args.documents)
    print(f"{args.documents:,} documents, {lengths.sum():,} tokens, median {int(np.median(lengths)):,}, "
          f"longest {lengths.max():,}", flush=True)
    for S in args.seq_length:
        fitting = lengths[lengths <= S]  # --long-documents drop: what does not fit is left out
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            order = np.random.default_rng([1234, 0]).permutation(len(fitting))
            packed = pack_epoch(fitting[order], S)
            times.append(time.perf_counter() - start)
        used = packed["used"]
        whole = 1 - used[:-1].sum() / ((len(used) - 1) * S) if len(used) > 1 else float("nan")
        print(f"--seq-length {S:>9,}: {len(fitting):,} documents ({len(lengths) - len(fitting):,} longer left out) "
              f"in {len(used):,} samples, {min(times):.1f} s, padding {whole:.2%} "
              f"({1 - used.sum() / (len(used) * S):.2%} with the last sample)", flush=True)
        if args.ring_balance:
            ring_balance(fitting[order], packed, S, args.ring_balance)


def ring_balance(lengths: np.ndarray, packed: dict, seq_length: int, rings: list[int], samples: int = 40) -> None:
    from megatron_lc.context_layout import DOCUMENT_LAYOUTS, ContextLayout, packed_rank_work

    cus = []
    for k in range(min(samples, len(packed["used"]) - 1)):
        docs = lengths[packed["documents"][packed["sample_starts"][k]:packed["sample_starts"][k + 1]]]
        cu = [0, *np.cumsum(docs).tolist()]
        cus.append(tuple(cu + ([seq_length] if cu[-1] < seq_length else [])))
    for R in rings:
        if seq_length % (2 * R):
            continue
        cells = []
        for documents in DOCUMENT_LAYOUTS:
            layout = ContextLayout(ring_size=R, documents=documents)
            ratios = [max(p) * R / sum(p) for p in
                      ([w.pairs for w in packed_rank_work(layout, cu, seq_length)] for cu in cus)]
            cells.append(f"{documents} {np.median(ratios):.3f} (worst {max(ratios):.3f})")
        home = np.median([1 - ContextLayout(ring_size=R, documents="local").sample_cut(seq_length, cu).sent_rows * R
                          / seq_length for cu in cus])
        print(f"    ring {R:>2}: max/mean pairs " + ", ".join(cells) + f"; local keeps {home:.0%} home", flush=True)


if __name__ == "__main__":
    main()
