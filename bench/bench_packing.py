"""The `--packing documents` index of 10^6 documents: build time and padding on a realistic length mix.

    python bench/bench_packing.py [--documents 1000000] [--seq-length 32768 1048576]

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


if __name__ == "__main__":
    main()
