"""Memory of one training step per rank for cp = 1, 2, 4 (FSDP2 + Ulysses), measured with MemTracker.

    python bench/bench_cp_memory.py [--seq-length 8192] [--cp-impl ulysses]

Rank 0's peak by category: activations should fall close to 1/cp (parameters, gradients and
optimizer state fall with the FSDP degree, which is cp here).
"""

from __future__ import annotations

import argparse

from bench.common import CPU, batch_for, bench_model_config, run_ranks
from megatron_lc.memory.measure import measure_peak
from megatron_lc.models.llama import build_model
from megatron_lc.attention.context_parallel import ContextParallel
from megatron_lc.models.llama.parallelize import ParallelizeOptions, materialize, parallelize_llama
from megatron_lc.parallel_state import ParallelDims, ParallelState
from megatron_lc.training.optim import build_optimizer
from megatron_lc.training.step import forward_backward


def measure_rank(rank, world, seq_length, cp_impl):
    config = bench_model_config()
    pstate = ParallelState(ParallelDims(world, cp=world))
    model = build_model(config, device="meta")
    parallelize_llama(model, pstate, ParallelizeOptions(cp=ContextParallel(impl=cp_impl)), CPU)
    materialize(model, CPU)
    opt = build_optimizer(model, lr=1e-4)
    batch = batch_for(config, seq_length, pstate.cp_rank, world)

    def step():
        forward_backward(model, [batch], pstate, CPU.accelerator)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer state exists, as in every later step
    peak = measure_peak(step, model, opt)
    return peak.by_device["cpu"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--cp-impl", default="ulysses")
    p.add_argument("--cp", type=int, nargs="*", default=[1, 2, 4])
    args = p.parse_args()
    rows = {cp: run_ranks(measure_rank, cp, args.seq_length, args.cp_impl) for cp in args.cp}
    base = rows[args.cp[0]]["activations"]
    print(f"seq_length {args.seq_length}, model {bench_model_config()}")
    print("| cp | activations MiB | x of cp=1 | ideal 1/cp | params+grads+optim MiB | peak total MiB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for cp, r in rows.items():
        state = r["parameters"] + r["gradients"] + r["optimizer_state"]
        print(f"| {cp} | {r['activations'] / 2**20:.1f} | {r['activations'] / base:.3f} | {1 / cp:.3f} | "
              f"{state / 2**20:.1f} | {r['total'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
