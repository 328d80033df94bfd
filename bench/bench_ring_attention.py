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
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.common import CPU, bench_model_config, run_ranks  # noqa: E402

LAYOUTS = {  # name -> (cp_ring, cp_impl, overlap)
    "ulysses (a2a)": (1, "ulysses", True),
    "ring (p2p)": (None, "ulysses", True),
    "ring (p2p), not overlapped": (None, "ulysses", False),
    "ulysses 2 x ring (a2a+p2p)": (None, "ulysses", True),
}


def _ring_degree(name: str, world: int) -> int:
    ring, _, _ = LAYOUTS[name]
    if ring is not None:
        return ring
    return world // 2 if "a2a+p2p" in name else world


def _build(name, config, world, seq_length, reference_state):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from megatron_lc.models.llama import build_model
    from megatron_lc.models.llama.parallelize import ParallelizeOptions, materialize, parallelize_llama
    from megatron_lc.parallel_state import ParallelDims, ParallelState

    _, cp_impl, overlap = LAYOUTS[name]
    pstate = ParallelState(ParallelDims(world_size=world, cp=world, cp_ring=_ring_degree(name, world)))
    model = build_model(config, device="meta")
    parallelize_llama(model, pstate, ParallelizeOptions(cp_impl=cp_impl, seq_length=seq_length), CPU)
    materialize(model, CPU)
    set_model_state_dict(model, reference_state, options=StateDictOptions(full_state_dict=True))
    if not overlap:
        for layer in model.layers:  # the ring object behind the backend's kernel
            layer.self_attn.backend.kernel.forward.__self__.overlap = False
    return model, pstate


def _speed_worker(rank, world, args):
    from megatron_lc.models.llama import build_model
    from megatron_lc.training.step import forward_backward
    from tests.helpers import make_batch, shard_batch

    config = bench_model_config(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads)
    reference_state = build_model(config, device="cpu", seed=0).state_dict()
    batch, per_sample = make_batch(1, args.seq_length, config.vocab_size, seed=0, num_docs=3)
    runs = {}
    for name in LAYOUTS:
        model, pstate = _build(name, config, world, args.seq_length, reference_state)
        runs[name] = (model, pstate, shard_batch(batch, per_sample, 0, 1, pstate.cp_rank, world,
                                                 pstate.context_layout))
    times = {name: [] for name in runs}
    cpu_times = {name: [] for name in runs}
    losses = {}
    for step in range(args.warmup + args.steps):
        for name, (model, pstate, local) in runs.items():  # alternate: load changes hit every layout alike
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            result = forward_backward(model, [local], pstate, CPU.accelerator)
            cpu_seconds = torch.tensor(time.process_time() - cpu_start)
            dist.barrier()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
                dist.all_reduce(cpu_seconds)
                cpu_times[name].append(float(cpu_seconds))
            losses[name] = float(result.loss)
            model.zero_grad(set_to_none=True)
    return {"times": times, "cpu_times": cpu_times, "losses": losses}


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
