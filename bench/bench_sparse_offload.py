"""Sparse block-input offload and kept attention: host bytes and step time for k = 1, 2, 4, and k = 1, 2 with
`--keep-attention-output`, as ratios measured in one run.

    python -m bench.bench_sparse_offload [--seq-length 4096] [--layers 9] [--repeats 3] [--no-keep]

One process, full checkpointing with the block inputs offloaded (`--offload-every-k-layers k`), tiled MLP
and loss; "k+keep" rows also keep each block's attention output and lse on the host, so that the recompute
runs no attention forward. For each row: one real training step tracked by the planner's MemTracker timeline
(`measure_real_step`: accelerator peak, and host bytes as the offload scheduler counts them), the planner's
prediction of the same step (`estimate` on this CPU, fake tensors: GPU peak and host bytes), the step time
(median of `--repeats` steps, the k values alternated step by step so that they share the machine's load
alike), and the time model's predicted step at this machine's measured rates (`--machine local`). With 9
layers, 8 offload (the last keeps its input on the accelerator): 8, 4 and 2 host slots of block inputs, and
8 of attention outputs with lse for the "+keep" rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import CPU, batch_for, bench_model_config
from megatron_lc.arguments import config_from_values
from megatron_lc.models.llama import build_model
from megatron_lc.models.llama.parallelize import apply_memory_stack
from megatron_lc.parallel_state import ParallelDims, ParallelState
from megatron_lc.planning.estimate import Machine, estimate
from megatron_lc.planning.calibration import calibrate_local
from megatron_lc.planning.timing import predict
from megatron_lc.planning.trace import measure_real_step
from megatron_lc.training.optim import build_optimizer
from megatron_lc.training.step import forward_backward

PSTATE = ParallelState(ParallelDims(world_size=1))
KS = (1, 2, 4)
KEPT = (1, 2)
"""k values measured with --keep-attention-output too."""


def train_config(k: int, args, keep: bool = False):
    c = bench_model_config(layers=args.layers, hidden=args.hidden_size, vocab=args.vocab_size)
    model = dict(model="debug", num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
                 num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups,
                 kv_channels=c.kv_channels, vocab_size=c.vocab_size)
    return config_from_values({**model, "seq_length": args.seq_length, "mock_data": True,
                               "recompute_granularity": "full", "offload_mode": "prefetch",
                               "offload_every_k_layers": k, "keep_attention_output": keep, "tiled_mlp": True, "tiled_mlp_tiles": 4,
                               "tiled_loss": True, "tiled_loss_tiles": 4})


def stepper(k: int, args, batch, keep: bool = False):
    cfg = train_config(k, args, keep)
    model = build_model(cfg.model_config(), device="cpu", seed=0)
    apply_memory_stack(model, cfg.parallelize_options(), CPU)
    opt = build_optimizer(model, lr=1e-4)

    def step():
        start = time.perf_counter()
        forward_backward(model, [batch], PSTATE, CPU.accelerator)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-keep", action="store_true", help="leave out the --keep-attention-output rows")
    args = p.parse_args()
    variants = [(k, False) for k in KS] + ([] if args.no_keep else [(k, True) for k in KEPT])
    torch.set_num_threads(1)
    config = train_config(1, args).model_config()
    batch = batch_for(config, args.seq_length)
    print(f"seq_length {args.seq_length}, {config.num_layers} layers, hidden {config.hidden_size}, "
          f"ffn {config.ffn_hidden_size}, vocab {config.vocab_size}, 1 thread\n")
    rows = {}
    for k, keep in variants:
        cfg = train_config(k, args, keep)
        analysis, host = measure_real_step(cfg, PSTATE, batch, CPU)
        planned = estimate(cfg, Machine(num_gpus=1, device="cpu", reserve_gib=0.0))
        rows[k, keep] = dict(peak=analysis.peak.total, host=host, planned_peak=planned.gpu_peak_bytes,
                             planned_host=planned.host_bytes_per_gpu,
                             predicted_s=predict(cfg, 1, calibrate_local(), 1, "cpu").step_s)
    steps = {v: stepper(*v[:1], args, batch, v[1]) for v in variants}
    for step in steps.values():
        step()  # warm-up
    times = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            times[v].append(steps[v]())
    for v in variants:
        rows[v]["step_s"] = statistics.median(times[v])
    one = rows[1, False]
    print("| k | host bytes (measured) | / k=1 | planner host bytes | planner / measured | accelerator peak / "
          "k=1 (measured) | planner peak / measured | step time / k=1 (measured) | predicted step / k=1 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (k, keep), r in rows.items():
        print(f"| {k}{'+keep' if keep else ''} | {r['host']:,} | {r['host'] / one['host']:.3f} | {r['planned_host']:,} | "
              f"{r['planned_host'] / r['host']:.4f} | {r['peak'] / one['peak']:.3f} | "
              f"{r['planned_peak'] / r['peak']:.3f} | {r['step_s'] / one['step_s']:.3f} | "
              f"{r['predicted_s'] / one['predicted_s']:.3f} |")
    print(f"\nk=1 step: {one['step_s']:.2f} s measured (median of {args.repeats}), {one['predicted_s']:.2f} s predicted")


if __name__ == "__main__":
    main()
