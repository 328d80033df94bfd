"""The memory stack, one layer at a time: memory (MemTracker) and step-time overhead, one process.

    python -m bench.bench_memory_stack [--seq-length 8192] [--repeats 3]

Memory rows switch the layers on cumulatively (none -> +checkpointing -> +offload -> +tiled
MLP -> +tiled loss). Each row is one real training step (forward, backward, AdamW) tracked
by the planner's MemTracker timeline (`measure_real_step`, the same measurement the planner
is validated against): accelerator peak with its phase, and host bytes. On CPU the offload
pool lives on the accelerator's device, so the tracker moves its bytes to the host column.
Overhead rows switch each technique on alone and give its step time as a ratio to the plain
step, all measured in this one run.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import CPU, batch_for, bench_model_config
from megatron_lc.arguments import config_from_values
from megatron_lc.models.llama import build_model
from megatron_lc.models.llama.parallelize import apply_memory_stack
from megatron_lc.parallel_state import ParallelDims, ParallelState
from megatron_lc.planning.trace import measure_real_step
from megatron_lc.training.optim import build_optimizer
from megatron_lc.training.step import forward_backward

PSTATE = ParallelState(ParallelDims(world_size=1))
FULL = dict(recompute_granularity="full")
OFFLOAD = dict(FULL, offload_mode="prefetch")
MLP_TILES = dict(tiled_mlp=True, tiled_mlp_tiles=8)
LOSS_TILES = dict(tiled_loss=True, tiled_loss_tiles=8)
# Training flags, switched on cumulatively (memory) and alone (overhead).
CUMULATIVE = {
    "none": {},
    "+ checkpointing (full)": FULL,
    "+ offload block inputs": OFFLOAD,
    "+ tiled MLP": dict(OFFLOAD, **MLP_TILES),
    "+ tiled loss": dict(OFFLOAD, **MLP_TILES, **LOSS_TILES),
    "+ offload fetch on demand": dict(OFFLOAD, offload_mode="on_demand", **MLP_TILES, **LOSS_TILES),
}
ALONE = {
    "checkpointing (full)": FULL,
    "checkpointing (selective)": dict(recompute_granularity="selective"),
    "checkpointing + offload": OFFLOAD,
    "tiled MLP (8 tiles)": MLP_TILES,
    "tiled loss (8 tiles)": LOSS_TILES,
    "all of them": dict(OFFLOAD, **MLP_TILES, **LOSS_TILES),
}


def train_config(flags: dict, args):
    """The benchmark model (as in `bench_model_config`) with these training flags."""
    c = bench_model_config(layers=args.layers, hidden=args.hidden_size, vocab=args.vocab_size)
    model = dict(model="debug", num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
                 num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups,
                 kv_channels=c.kv_channels, vocab_size=c.vocab_size)
    return config_from_values({**model, "seq_length": args.seq_length, **flags})


def build(flags: dict, args):
    cfg = train_config(flags, args)
    model = build_model(cfg.model_config(), device="cpu", seed=0)
    offload = apply_memory_stack(model, cfg.parallelize_options(), CPU)
    return model, build_optimizer(model, lr=1e-4), offload


def step_fn(model, opt, batch):
    def step():
        forward_backward(model, [batch], PSTATE, CPU.accelerator)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def memory_row(flags: dict, args, batch):
    """Accelerator peak overall, within the blocks, within the loss head, its phase; host peak."""
    analysis, host = measure_real_step(train_config(flags, args), PSTATE, batch, CPU)

    def phase_peak(unit: str) -> int:  # phases are 'fw:layer:3', 'bw:head', 'optimizer', ...
        return max(p.total for phase, p in analysis.phase_peaks.items() if unit in phase)

    where = analysis.events[analysis.peak.event_index].phase
    return analysis.peak.total, phase_peak(":layer:"), phase_peak(":head"), where, host


def time_row(flags, args, batch, repeats):
    model, opt, _ = build(flags, args)
    step = step_fn(model, opt, batch)
    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(2)
    config = train_config({}, args).model_config()
    batch = batch_for(config, args.seq_length)
    print(f"seq_length {args.seq_length}, {config.num_layers} layers, hidden {config.hidden_size}, "
          f"ffn {config.ffn_hidden_size}, vocab {config.vocab_size}\n")
    if not args.skip_memory:
        memory_table(args, batch)
    if not args.skip_timing:
        timing_table(args, batch)


def memory_table(args, batch) -> None:
    print("| stack | accelerator peak MiB | peak during | peak in blocks | peak in loss head | host (offload) MiB |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for name, flags in CUMULATIVE.items():
        peak, blocks, head, where, host = memory_row(flags, args, batch)
        print(f"| {name} | {peak / 2**20:.1f} | {where} | {blocks / 2**20:.1f} | {head / 2**20:.1f} | "
              f"{host / 2**20:.1f} |", flush=True)


def timing_table(args, batch) -> None:
    base = time_row({}, args, batch, args.repeats)
    print(f"\nplain step: {base:.2f} s\n\n| technique alone | step time / plain |\n| --- | ---: |")
    for name, flags in ALONE.items():
        print(f"| {name} | {time_row(flags, args, batch, args.repeats) / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
