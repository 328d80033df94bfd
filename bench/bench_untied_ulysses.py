#!/usr/bin/env python3
"""Untied Ulysses against Ulysses: attention-layer memory, and the speed of a training step.

memory: one attention layer (forward + backward of the backend) as cp rank 0 sees it,
    measured with MemTracker on fake tensors over a fake process group of `--cp` ranks,
    so any length costs nothing to measure. Reported per backend:
    - peak: bytes above what was live before the call (inputs, weights, rotary tables,
      output gradient), everything included;
    - intermediates: the peak without the op's interface tensors, which every backend
      must produce: the output O (kept for `o_proj` anyway) and, once they exist, the
      gradients dx, dWq, dWk, dWv. Ulysses creates its gradients only after its
      attention backward: its value is the larger of (peak until that backward
      returns - O) and (overall peak - O - gradients). Untied Ulysses allocates its
      gradient buffers when its backward starts: its value is overall peak - O - gradients.
    The reduction is compared with the ideal 1 - U/H.

speed: a training step (forward + backward) of a small LLaMA under FSDP with cp = world
    size, in `--world` gloo processes on this machine; Ulysses and Untied Ulysses (each
    `--heads-per-stage`) are built from the same weights and timed alternately, step by
    step; medians, minima and their ratios to Ulysses are reported.

Examples:
    python bench/bench_untied_ulysses.py memory
    python bench/bench_untied_ulysses.py speed --seq-length 4096 --steps 6
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.common import time_alternately  # noqa: E402
from megatron_lc.attention.kernel_selection import select_kernel  # noqa: E402
from megatron_lc.attention.kernels import Kernel  # noqa: E402
from megatron_lc.attention.ulysses import UlyssesAttention
from megatron_lc.attention.untied_plan import check_untied_shapes  # noqa: E402
from megatron_lc.attention.untied_ulysses import UntiedUlyssesAttention  # noqa: E402

MIB = 1 << 20
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# --- memory --------------------------------------------------------------------------------


def _total(tracker, kind: str) -> int:
    (device_snapshot,) = tracker.get_tracker_snapshot(kind).values()
    return device_snapshot["Total"]


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _peak_recording_kernel(kernel: Kernel, tracker, record: dict) -> Kernel:
    """`kernel`, noting the tracker's peak when its first backward returns."""

    def backward(*args, **kwargs):
        grads = kernel.backward(*args, **kwargs)
        record.setdefault("peak_after_attention_backward", _total(tracker, "peak"))
        return grads

    return Kernel(kernel.name, kernel.forward, backward)


def measure_layer(backend_name: str, heads: int, kv_heads: int, head_dim: int, hidden: int, seq_length: int,
                  cp: int, heads_per_stage: int | None, dtype: torch.dtype) -> dict:
    """Peak and intermediate bytes of one attention layer's forward + backward on cp rank 0 (fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    local = seq_length // cp
    with FakeTensorMode():
        x = torch.randn(1, local, hidden, dtype=dtype, requires_grad=True)
        weights = [torch.randn(n * head_dim, hidden, dtype=dtype, requires_grad=True) for n in (heads, kv_heads, kv_heads)]
        cos, sin = (torch.randn(1, local, head_dim, dtype=dtype) for _ in range(2))
        dout = torch.randn(1, local, heads * head_dim, dtype=dtype)
        tracker, record = MemTracker(), {}
        kernel = _peak_recording_kernel(select_kernel(torch.device("cpu")), tracker, record)
        if backend_name == "ulysses":
            backend = UlyssesAttention(head_dim, kernel, dist.group.WORLD, cp)
        else:
            plan = check_untied_shapes(heads, kv_heads, cp, heads_per_stage or cp)
            backend = UntiedUlyssesAttention(head_dim, kernel, dist.group.WORLD, plan)
        tracker.track_external(x, *weights, cos, sin, dout)
        held = [0]  # the stage buffers' size when the op releases them (its largest)
        if backend_name != "ulysses":
            release = backend.workspace.release
            backend.workspace.release = lambda: (held.__setitem__(0, max(held[0], backend.workspace.nbytes())),
                                                 release())
        with tracker:
            before = _total(tracker, "current")
            out = backend(x, *weights, cos, sin, (0, seq_length))  # one document: the longest segment
            out.backward(dout)
        peak = _total(tracker, "peak") - before
        grads = _nbytes(x, *weights)
        output = _nbytes(out)
        intermediates = peak - output - grads
        if backend_name == "ulysses":
            intermediates = max(intermediates, record["peak_after_attention_backward"] - before - output)
        workspace = held[0]
    return {"backend": backend_name, "U": heads_per_stage or (cp if backend_name != "ulysses" else heads),
            "peak_mib": peak / MIB, "intermediates_mib": intermediates / MIB, "workspace_mib": workspace / MIB}


def run_memory(args) -> list[dict]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.cp)
    rows = []
    for kv_heads in args.kv_heads:
        shape = {"heads": args.heads, "kv_heads": kv_heads, "head_dim": args.head_dim, "hidden": args.hidden,
                 "seq_length": args.seq_length, "cp": args.cp, "dtype": DTYPES[args.dtype]}
        base = measure_layer("ulysses", heads_per_stage=None, **shape)
        rows.append({**base, "kv_heads": kv_heads})
        for stage_heads in args.heads_per_stage or [args.cp, 2 * args.cp]:
            row = measure_layer("untied_ulysses", heads_per_stage=stage_heads, **shape)
            ideal = 1 - stage_heads / args.heads
            reduction = 1 - row["intermediates_mib"] / base["intermediates_mib"]
            rows.append({**row, "kv_heads": kv_heads, "reduction": reduction, "ideal": ideal,
                         "of_ideal": reduction / ideal})
    dist.destroy_process_group()
    return rows


def print_memory(args, rows) -> None:
    print(f"\nattention layer, H={args.heads}, d={args.head_dim}, hidden={args.hidden}, "
          f"{args.seq_length} tokens, cp={args.cp}, {args.dtype}, rank 0 (MiB)")
    print("| kv heads | backend | U | peak | intermediates | reduction | ideal 1-U/H | of ideal | workspace |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        extra = (f"{r['reduction']:.1%} | {r['ideal']:.1%} | {r['of_ideal']:.0%}" if "reduction" in r
                 else "- | - | -")
        print(f"| {r['kv_heads']} | {r['backend']} | {r['U']} | {r['peak_mib']:.0f} | "
              f"{r['intermediates_mib']:.0f} | {extra} | {r['workspace_mib']:.0f} |")


# --- speed ---------------------------------------------------------------------------------


def _speed_worker(rank, world, args, results):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    from megatron_lc.attention.context_parallel import ContextParallel
    from megatron_lc.devices import Devices
    from megatron_lc.models.llama import build_model, get_config
    from megatron_lc.models.llama.parallelize import (
        ParallelizeOptions,
        materialize,
        parallelize_llama,
    )
    from megatron_lc.parallel_state import ParallelDims, ParallelState
    from megatron_lc.testing import make_batch, shard_batch

    cpu = Devices(torch.device("cpu"), torch.device("cpu"))
    config = dataclasses.replace(get_config("debug"), hidden_size=args.hidden, num_attention_heads=args.heads,
                                 num_query_groups=args.kv_heads[0], kv_channels=args.head_dim,
                                 ffn_hidden_size=3 * args.hidden, num_layers=args.layers, vocab_size=args.vocab)
    reference_state = build_model(config, device="cpu", seed=0).state_dict()
    pstate = ParallelState(ParallelDims(world_size=world, cp=world))
    models = {}
    for name, stage_heads, overlap in _speed_backends(args):
        model = build_model(config, device="meta")
        cp_impl = "ulysses" if stage_heads is None else "untied_ulysses"
        opts = ParallelizeOptions(cp=ContextParallel(impl=cp_impl, heads_per_stage=stage_heads, overlap=overlap))
        parallelize_llama(model, pstate, opts, cpu)
        materialize(model, cpu)
        set_model_state_dict(model, reference_state, options=StateDictOptions(full_state_dict=True))
        models[name] = model
    batch, per_sample = make_batch(1, args.seq_length, args.vocab, seed=0, num_docs=3)
    local = shard_batch(batch, per_sample, 0, 1, pstate.cp_rank, world)
    timed = time_alternately({name: (model, pstate, local) for name, model in models.items()}, args.warmup,
                             args.steps)
    if rank == 0:
        results.put(timed)


def _speed_backends(args) -> list[tuple[str, int | None, bool]]:
    """(name, heads per stage, pipelined stages) of each timed model; None is Ulysses. Each U is timed with
    synchronous and with pipelined stages (`--untied-overlap-stages`)."""
    stages = args.heads_per_stage or [args.world, 2 * args.world]
    return [("ulysses", None, False)] + [(f"untied_ulysses U={u}{' overlapped' if overlap else ''}", u, overlap)
                                         for u in stages for overlap in (False, True)]


def run_speed(args) -> dict:
    import torch.multiprocessing as mp

    from megatron_lc.testing import run_distributed

    results = mp.get_context("spawn").SimpleQueue()
    run_distributed(_speed_worker, args.world, args, results)
    out = results.get()
    times, cpu_times = out["times"], out["cpu_times"]
    summary = {name: {"median_s": statistics.median(times[name]), "min_s": min(times[name]),
                      "cpu_s": statistics.median(cpu_times[name])} for name in times}
    for name, row in summary.items():
        for key in ("median_s", "min_s", "cpu_s"):
            row[key.replace("_s", "_ratio")] = row[key] / summary["ulysses"][key]
        row["loss"] = out["losses"][name]
        synchronous = summary.get(name.removesuffix(" overlapped"))
        row["vs_synchronous"] = row["median_s"] / synchronous["median_s"] if name.endswith("overlapped") else None
    return {"summary": summary, "times": times, "cpu_times": cpu_times}


def print_speed(args, result) -> None:
    print(f"\ntraining step (forward + backward), {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
          f"({args.kv_heads[0]} kv), d={args.head_dim}, {args.seq_length} tokens, FSDP + cp={args.world}, "
          f"{args.world} gloo processes, {args.steps} timed steps after {args.warmup} warm-up")
    print("| backend | median step (s) | min step (s) | CPU s (all ranks) | median / Ulysses | min / Ulysses "
          "| CPU / Ulysses | median / synchronous | loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in result["summary"].items():
        sync = "" if r["vs_synchronous"] is None else f"{r['vs_synchronous']:.3f}"
        print(f"| {name} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['cpu_s']:.2f} | {r['median_ratio']:.3f} | "
              f"{r['min_ratio']:.3f} | {r['cpu_ratio']:.3f} | {sync} | {r['loss']:.6f} |")


# --- main ----------------------------------------------------------------------------------


def _with_shape_defaults(args: argparse.Namespace, head_dim: int, seq_length: int) -> argparse.Namespace:
    """A copy of ``args`` with the shapes not given on the command line filled in."""
    out = argparse.Namespace(**vars(args))
    out.head_dim = args.head_dim or head_dim
    out.hidden = args.hidden or args.heads * out.head_dim
    out.seq_length = args.seq_length or seq_length
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("memory", "speed", "all"))
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=None,
                        help="kv heads (memory: one table row group each; speed: the first); default: heads, heads/4")
    parser.add_argument("--head-dim", type=int, default=None, help="default: 128 (memory), 32 (speed)")
    parser.add_argument("--hidden", type=int, default=None, help="default: heads * head_dim")
    parser.add_argument("--heads-per-stage", type=int, nargs="+", default=None, help="default: cp and 2*cp")
    parser.add_argument("--seq-length", type=int, default=None, help="global tokens; default 16384 (memory), 4096 (speed)")
    parser.add_argument("--cp", type=int, default=4, help="memory: fake context-parallel ranks")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="memory: tensor dtype")
    parser.add_argument("--world", type=int, default=4, help="speed: gloo processes (= cp)")
    parser.add_argument("--layers", type=int, default=2, help="speed: transformer blocks")
    parser.add_argument("--vocab", type=int, default=1024, help="speed: vocabulary")
    parser.add_argument("--steps", type=int, default=6, help="speed: timed steps per backend")
    parser.add_argument("--warmup", type=int, default=1, help="speed: untimed steps per backend")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args(argv)
    args.kv_heads = args.kv_heads or [args.heads, args.heads // 4]
    torch.set_num_threads(1)
    report = {}
    if args.what in ("memory", "all"):
        mem = _with_shape_defaults(args, head_dim=128, seq_length=16384)
        report["memory"] = run_memory(mem)
        print_memory(mem, report["memory"])
    if args.what in ("speed", "all"):
        speed = _with_shape_defaults(args, head_dim=32, seq_length=4096)
        report["speed"] = run_speed(speed)
        print_speed(speed, report["speed"])
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
