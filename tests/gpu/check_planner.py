"""Check the memory planner against a real GPU: predicted peak vs torch.cuda.max_memory_allocated.

    python tests/gpu/check_planner.py                 # llama3-3b, one GPU, full memory stack
    python tests/gpu/check_planner.py --model llama3-8b --seq-length 131072
    python tests/gpu/check_planner.py --smoke         # tiny model on CPU (no GPU needed)

Without --seq-length the planner first finds the longest context that fits this GPU
(its total memory minus --reserve-gib); then one real training step runs at that length
on one GPU (model, parallelize, materialize, AdamW state, `train_step`) and its
`torch.cuda.max_memory_allocated` is compared with the planner's per-GPU peak (NCCL and
the reserve excluded: one GPU has no communicators, and the reserve is not allocated by
PyTorch). Figures are printed as JSON and written to $OUT/check_planner.json when OUT is
set. Installs nothing; meant to finish well under 8 minutes on an H100/H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from megatron_lc.attention.kernels import select_kernel
from megatron_lc.config import config_from_values
from megatron_lc.data.loader import Batch
from megatron_lc.devices import Devices
from megatron_lc.models.llama import build_model
from megatron_lc.models.llama.parallelize import materialize, parallelize_llama
from megatron_lc.parallel_state import ParallelDims, ParallelState
from megatron_lc.planning.estimate import GIB, Machine, estimate, planning_config
from megatron_lc.planning.search import find_max_seq_length
from megatron_lc.planning.trace import (
    initialize_optimizer_state,
    make_optimizer,
    run_tracked_step,
)
from megatron_lc.planning.tracker import make_tracker
from megatron_lc.training.step import train_step

FULL_STACK = dict(recompute_granularity="full", offload_activations=True, tiled_mlp=True, tiled_loss=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-3b", help="zoo flavour (default: llama3-3b)")
    parser.add_argument("--seq-length", type=int, default=None, help="default: the longest the planner fits")
    parser.add_argument("--reserve-gib", type=float, default=3.0, help="kept free when searching (default: 3)")
    parser.add_argument("--no-stack", action="store_true", help="plain step: no checkpointing/offload/tiling")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, not a GPU")
    return parser.parse_args(argv)


def run_config(args: argparse.Namespace, device: str):
    values = dict(model="debug" if args.smoke else args.model, bf16=not args.smoke, mock_data=True,
                  device=device, seq_length=args.seq_length or (2048 if args.smoke else 1024))
    if device == "cuda":
        values["attention_kernel"] = select_kernel(torch.device("cuda")).name  # what this machine runs
    if not args.no_stack:
        values.update(FULL_STACK)
    return config_from_values(values)


def plan(cfg, args: argparse.Namespace, device: str) -> tuple[int, object, float]:
    """(length, the planner's estimate there, seconds): the requested length, or the longest that fits."""
    start = time.perf_counter()
    memory = torch.cuda.get_device_properties(0).total_memory / GIB if device == "cuda" else 0.02
    machine = Machine(num_gpus=1, gpus_per_node=1, gpu_memory_gib=memory, reserve_gib=args.reserve_gib
                      if device == "cuda" else 0.0, host_memory_gib=1e6, device=device)
    if args.seq_length:
        e = estimate(cfg, machine)
        return args.seq_length, e, time.perf_counter() - start
    result = find_max_seq_length(cfg, machine, start=8192 if device == "cuda" else 1024)
    if result.best is None:
        raise SystemExit(f"the planner finds no length of {cfg.model.model} that fits {memory:.1f} GiB")
    return result.max_seq_length, result.best, time.perf_counter() - start


def real_batch(cfg, seq_length: int) -> Batch:
    B = cfg.data.micro_batch_size
    tokens = torch.randint(0, cfg.model_config().vocab_size, (B, seq_length))
    positions = torch.arange(seq_length).expand(B, seq_length).contiguous()
    return Batch(tokens, tokens.roll(-1, dims=1), positions, tuple(range(0, B * seq_length + 1, seq_length)))


def measure(cfg, device: str) -> tuple[int, float]:
    """(peak accelerator bytes of one real step with AdamW state present, seconds of the step)."""
    devices = Devices(torch.device(device), torch.device("cpu"))
    pstate = ParallelState(ParallelDims(world_size=1))
    model = build_model(cfg.model_config(), device="meta")
    offload = parallelize_llama(model, pstate, cfg.parallelize_options(), devices)
    materialize(model, devices, cfg.train.seed)
    optimizer = make_optimizer(model, cfg, fused=device == "cuda")
    initialize_optimizer_state(model, optimizer)
    batch = real_batch(cfg, cfg.data.seq_length)
    start = time.perf_counter()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        train_step(model, optimizer, [batch], pstate, devices.accelerator, cfg.optim.clip_grad)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), time.perf_counter() - start
    # CPU smoke path: the tracker stands in for the allocator's statistics.
    probe = (lambda: offload.host_bytes_reserved) if offload else None
    tracker = make_tracker(model, optimizer, probe, extra=(batch.input_ids, batch.labels, batch.position_ids))
    analysis = run_tracked_step(tracker, model, optimizer, [batch], pstate, devices, cfg.optim.clip_grad)
    return analysis.peak.total, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        print("no CUDA device: running the --smoke path on CPU", file=sys.stderr)
        args.smoke = True
    cfg = run_config(args, device)
    seq_length, predicted, plan_seconds = plan(cfg, args, device)
    cfg = planning_config(cfg, seq_length)
    try:
        measured, step_seconds = measure(cfg, device)
        error = None
    except torch.OutOfMemoryError as e:  # the planner said it fits: worth reporting, not hiding
        measured, step_seconds, error = None, None, f"out of memory: {str(e).splitlines()[0]}"
    figures = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__, "model": cfg.model.model, "seq_length": seq_length,
        "attention_kernel": cfg.parallel.attention_kernel, "stack": not args.no_stack,
        "predicted_gib": round(predicted.gpu_peak_bytes / GIB, 3),
        "predicted_by_category_gib": {k: round(v / GIB, 3) for k, v in predicted.gpu_bytes_by_category.items()},
        "measured_max_allocated_gib": None if measured is None else round(measured / GIB, 3),
        "ratio_predicted_over_measured": None if measured is None else round(predicted.gpu_peak_bytes / measured, 4),
        "max_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3) if device == "cuda" else None,
        "total_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / GIB, 3)
        if device == "cuda" else None,
        "planner_seconds": round(plan_seconds, 1), "step_seconds": None if step_seconds is None else round(step_seconds, 1),
        "error": error,
    }
    print(json.dumps(figures, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "check_planner.json").write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
