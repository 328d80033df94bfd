#!/usr/bin/env python3
"""Ring and hierarchical context parallelism against Ulysses: the speed of a training step.

A training step (forward + backward) of a small LLaMA under FSDP with cp = world size,
in `--world` gloo processes on this machine, for each layout: Ulysses (all-to-all over
every rank), ring attention over every rank with its transfers overlapped with attention
and without (each transfer waited for before the block is computed), and all-to-all
pairs inside a ring (a2a+p2p). Every model has the same weights and sees the same
tokens; they are timed alternately, step by step; medians, minima, all ranks' CPU
seconds and their ratios to Ulysses are reported, with each layout's loss (equal up to
rounding: the layouts compute the same function).

What the ratios mean on a CPU: gloo moves the ring's blocks over loopback TCP while
the attention runs on the same cores, so the overlap can only hide what the cores
leave idle; on GPUs the transfers use NVLink/network engines and the overlap is the
point of the design. These are ratios from one machine, not GPU figures.

Example:
    python bench/bench_ring_attention.py --seq-length 4096 --steps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.common import CPU, bench_model_config, run_ranks, time_alternately  # noqa: E402

LAYOUTS = {  # name -> (all-to-all degree, None: every rank; overlap); the ring is the rest of cp
    "ulysses (a2a)": (None, True),
    "ring (p2p)": (1, True),
    "ring (p2p), not overlapped": (1, False),
    "ulysses 2 x ring (a2a+p2p)": (2, True),
}


def _build(name, config, world, seq_length, reference_state):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from megatron_lc.models.llama import build_model
    from megatron_lc.models.llama.parallelize import ParallelizeOptions, materialize, parallelize_llama
    from megatron_lc.parallel_state import ParallelDims, ParallelState

    a2a, overlap = LAYOUTS[name]
    pstate = ParallelState(ParallelDims(world_size=world, cp=world, cp_ring=world // (a2a or world)))
    model = build_model(config, device="meta")
    parallelize_llama(model, pstate, ParallelizeOptions(seq_length=seq_length), CPU)
    materialize(model, CPU)
    set_model_state_dict(model, reference_state, options=StateDictOptions(full_state_dict=True))
    if not overlap:
        for layer in model.layers:  # the ring object behind the backend's kernel
            layer.self_attn.backend.kernel.forward.__self__.overlap = False
    return model, pstate


def _speed_worker(rank, world, args):
    from megatron_lc.models.llama import build_model
    from megatron_lc.testing import make_batch, shard_batch

    config = bench_model_config(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads)
    reference_state = build_model(config, device="cpu", seed=0).state_dict()
    batch, per_sample = make_batch(1, args.seq_length, config.vocab_size, seed=0, num_docs=3)
    runs = {}
    for name in LAYOUTS:
        model, pstate = _build(name, config, world, args.seq_length, reference_state)
        runs[name] = (model, pstate, shard_batch(batch, per_sample, 0, 1, pstate.cp_rank, world,
                                                 pstate.context_layout))
    return time_alternately(runs, args.warmup, args.steps)


def run_speed(args) -> dict:
    out = run_ranks(_speed_worker, args.world, args)
    base = "ulysses (a2a)"
    summary = {}
    for name in LAYOUTS:
        row = {"median_s": statistics.median(out["times"][name]), "min_s": min(out["times"][name]),
               "cpu_s": statistics.median(out["cpu_times"][name]), "loss": out["losses"][name]}
        summary[name] = row
    for row in summary.values():
        for key in ("median_s", "min_s", "cpu_s"):
            row[key.replace("_s", "_ratio")] = row[key] / summary[base][key]
    overlap = summary["ring (p2p)"]["median_s"] / summary["ring (p2p), not overlapped"]["median_s"]
    return {"summary": summary, "overlapped_over_not_overlapped": overlap, **out}


def print_speed(args, result) -> None:
    print(f"training step (forward + backward), {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
          f"({args.kv_heads} kv), {args.seq_length} tokens, FSDP + cp={args.world}, {args.world} gloo processes, "
          f"{args.steps} timed steps after {args.warmup} warm-up")
    print("| layout | median step (s) | min step (s) | CPU s (all ranks) | median / Ulysses | min / Ulysses "
          "| CPU / Ulysses | loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in result["summary"].items():
        print(f"| {name} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['cpu_s']:.2f} | {r['median_ratio']:.3f} | "
              f"{r['min_ratio']:.3f} | {r['cpu_ratio']:.3f} | {r['loss']:.6f} |")
    print(f"overlapped ring / not overlapped (median step): {result['overlapped_over_not_overlapped']:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="gloo processes = cp degree (even, >= 4)")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.world < 4 or args.world % 2:
        p.error("--world must be even and at least 4 (a2a+p2p uses pairs inside a ring)")
    result = run_speed(args)
    print_speed(args, result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
