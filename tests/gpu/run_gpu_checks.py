"""The GPU check: kernels, one GPU against the planner, one rank of an 8-way cp world, step ratios.

    python tests/gpu/run_gpu_checks.py --out DIR      # on one CUDA GPU (default DIR: $OUT)
    python tests/gpu/run_gpu_checks.py --dry-run --out DIR   # every section on CPU at tiny sizes

Writes DIR/gpu_checks.json (rewritten after every section, so a run that dies leaves what
it measured so far) and DIR/gpu_checks.log. Each section catches its own failure and
records it as {"ok": false, "error": ...}. Installs nothing; uses flash-attn when present.
See docs/gpu_checks.md for what each figure means.

Sections (JSON keys):
- kernels: every CUDA attention kernel available, forward and backward, packed documents,
  grouped-query attention, against the reference kernel (bf16; fp32 for sdpa_efficient).
- single_gpu: a Llama3-8B-shaped model with 4 layers, bf16, full memory stack, at three
  lengths: measured max_memory_allocated / max_memory_reserved / page-locked host bytes
  against the planner's prediction; step time, tokens/s, MFU.
- cp_rank: rank 0 of an 8-way context-parallel world over torch's fake process group
  (collectives move nothing, so values are meaningless but every allocation is the real
  kernel's): Llama3-8B shape, 4 layers, 1M tokens, Untied Ulysses and Ulysses, full stack,
  against the planner.
- ratios: step-time ratios in one run: no stack, + checkpointing, + offload (prefetch and on
  demand), + tiled MLP and loss; Untied vs Ulysses in the cp_rank setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from megatron_lc.attention import kernels
from megatron_lc.config import config_from_values
from megatron_lc.data.loader import Batch
from megatron_lc.devices import Devices
from megatron_lc.memory.tiling import addmm_fp32_, fp32_out_gemm_available
from megatron_lc.models.llama import build_model
from megatron_lc.models.llama.parallelize import materialize, parallelize_llama
from megatron_lc.parallel_state import ParallelState
from megatron_lc.planning.estimate import GIB, Machine, estimate, planning_config
from megatron_lc.planning.fakes import fake_process_group
from megatron_lc.planning.trace import (
    initialize_optimizer_state,
    make_optimizer,
    parallel_dims,
    run_tracked_step,
)
from megatron_lc.planning.tracker import make_tracker
from megatron_lc.training.step import step_autocast, train_step

LOG = logging.getLogger("gpu_checks")
NO_STACK = dict(recompute_granularity="none", offload_activations=False, tiled_mlp=False, tiled_loss=False)
FULL_STACK = dict(recompute_granularity="full", offload_activations=True, tiled_mlp=True, tiled_loss=True)
STACKS = {  # the ratios section, in order: each adds one layer of the memory stack
    "none": NO_STACK,
    "checkpoint": {**NO_STACK, "recompute_granularity": "full"},
    "offload_prefetch": {**NO_STACK, "recompute_granularity": "full", "offload_activations": True},
    "offload_on_demand": {**NO_STACK, "recompute_granularity": "full", "offload_activations": True,
                          "no_offload_prefetch": True},
    "full_stack": FULL_STACK,
}
PEAK_BF16_FLOPS = 989e12
"""Dense bf16 peak of an H100/H200 SXM (NVIDIA's datasheet), the MFU denominator."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Everything that differs between the GPU run and the CPU dry run."""

    device: str
    dtype: torch.dtype
    model: dict
    lengths: tuple[int, ...]
    cp_length: int
    ratio_length: int
    kernel_shape: tuple[int, int, int, int]  # tokens, q heads, kv heads, head dim
    kernels: tuple[str, ...]
    steps: int


def sizes(dry_run: bool) -> Sizes:
    if dry_run:
        return Sizes("cpu", torch.bfloat16, dict(model="debug", num_layers=4), (256, 512, 1024), 1024, 512,
                     (256, 8, 2, 16), ("cpu_flash",), 1)
    cuda_kernels = tuple(n for n in kernels.CUDA_KERNELS if n != "flash_attn" or kernels.flash_attn_available())
    return Sizes("cuda", torch.bfloat16, dict(model="llama3-8b", num_layers=4), (32768, 65536, 131072),
                 1 << 20, 32768, (4096, 32, 8, 128), cuda_kernels, 2)


# --- kernels --------------------------------------------------------------------------------


def _packed_cu(tokens: int) -> tuple[int, ...]:
    """Packed documents of uneven lengths, one of a single token."""
    return (0, tokens // 4, tokens // 4 + 1, tokens * 5 // 8, tokens)


def check_kernel(kernel: kernels.Kernel, dtype: torch.dtype, s: Sizes) -> dict:
    """Forward and backward of `kernel` against the reference kernel: max abs error over max abs value."""
    T, H, Hkv, d = s.kernel_shape
    g = torch.Generator(device=s.device).manual_seed(0)
    q, k, v, dout = (torch.randn(T, h, d, device=s.device, generator=g, dtype=dtype) for h in (H, Hkv, Hkv, H))
    cu = _packed_cu(T)
    got = _fwd_bwd(kernel, q, k, v, dout, cu)
    want = _fwd_bwd(kernels.KERNELS["reference"], q.float(), k.float(), v.float(), dout.float(), cu)
    errors = {key: float((a.float() - b).abs().max() / b.abs().max()) for key, a, b in
              zip(("out", "dq", "dk", "dv"), got, want)}
    return {"kernel": kernel.name, "dtype": str(dtype), "shape": [T, H, Hkv, d], "cu_seqlens": list(cu),
            "relative_error": errors,
            "within_tolerance": max(errors.values()) < (3e-2 if dtype in kernels.FLASH_DTYPES else 1e-3)}


def check_unmasked(kernel: kernels.Kernel, dtype: torch.dtype, s: Sizes) -> dict:
    """Ring attention's call for an earlier key block: unmasked, separate query and key boundaries, the
    backward given the lse of the forward (as the ring gives the merged one); against the reference."""
    T, H, Hkv, d = s.kernel_shape
    g = torch.Generator(device=s.device).manual_seed(1)
    q, dout = (torch.randn(T // 2, H, d, device=s.device, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(T, Hkv, d, device=s.device, generator=g, dtype=dtype) for _ in range(2))
    cu_q, cu_k = (0, T // 8, T // 2), (0, T // 3, T)

    def run(kern, *tensors):
        q_, k_, v_, do_ = tensors
        out, lse, state = kern.forward(q_, k_, v_, cu_q, cu_seqlens_k=cu_k, causal=False)
        grads = kern.backward(do_, q_, k_, v_, out, lse, cu_q, state=state, cu_seqlens_k=cu_k, causal=False)
        return out, *grads

    got = run(kernel, q, k, v, dout)
    want = run(kernels.KERNELS["reference"], q.float(), k.float(), v.float(), dout.float())
    errors = {key: float((a.float() - b).abs().max() / b.abs().max()) for key, a, b in
              zip(("out", "dq", "dk", "dv"), got, want)}
    return {"kernel": kernel.name, "dtype": str(dtype), "cu_seqlens_q": list(cu_q), "cu_seqlens_k": list(cu_k),
            "relative_error": errors,
            "within_tolerance": max(errors.values()) < (3e-2 if dtype in kernels.FLASH_DTYPES else 1e-3)}


def _fwd_bwd(kernel, q, k, v, dout, cu):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = kernels.attention(q, k, v, cu, kernel)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def section_kernels(s: Sizes) -> dict:
    """Each kernel in its dtype (sdpa_efficient in fp32), and `auto` for bf16 and fp32 inputs; each also
    unmasked between different query and key tokens, as ring attention calls it."""
    device = torch.device(s.device)
    runs = {name: (kernels.KERNELS[name], torch.float32 if name == "sdpa_efficient" else s.dtype)
            for name in s.kernels}
    runs.update({f"auto_{str(dt).removeprefix('torch.')}": (kernels.select_kernel(device, "auto"), dt)
                 for dt in (torch.bfloat16, torch.float32)})
    result = {label: check_kernel(kernel, dtype, s) for label, (kernel, dtype) in runs.items()}
    result.update({f"unmasked_{label}": check_unmasked(kernel, dtype, s) for label, (kernel, dtype) in runs.items()})
    bad = {label: r["relative_error"] for label, r in result.items() if not r["within_tolerance"]}
    if bad:
        raise AssertionError(f"kernel errors beyond tolerance: {json.dumps(bad)}")
    return result


# --- one step, measured ---------------------------------------------------------------------


def config(s: Sizes, seq_length: int, stack: dict, **extra):
    values = dict(**s.model, bf16=s.dtype == torch.bfloat16, mock_data=True, device=s.device,
                  seq_length=seq_length, **stack, **extra)
    return planning_config(config_from_values(values), seq_length)


def synthetic_batch(cfg, pstate: ParallelState) -> Batch:
    """Random tokens of this rank's slice, one document per sample."""
    B, S, cp = cfg.data.micro_batch_size, cfg.data.seq_length, pstate.cp_size
    tokens = torch.randint(0, cfg.model_config().vocab_size, (B, S // cp))
    positions = (torch.arange(S // cp) + pstate.cp_rank * (S // cp)).expand(B, S // cp).contiguous()
    return Batch(tokens, tokens.roll(-1, dims=1), positions, tuple(range(0, B * S + 1, S)))


def measure_step(cfg, world_size: int, s: Sizes) -> dict:
    """Build, materialize and run `s.steps` real training steps on rank 0; the last one is measured."""
    devices = Devices(torch.device(s.device), torch.device("cpu"))
    pstate = ParallelState(parallel_dims(cfg, world_size), device_type=s.device)
    model = build_model(cfg.model_config(), device="meta")
    offload = parallelize_llama(model, pstate, cfg.parallelize_options(), devices)
    materialize(model, devices, cfg.train.seed)
    optimizer = make_optimizer(model, cfg, fused=s.device == "cuda")
    initialize_optimizer_state(model, optimizer)
    batch = synthetic_batch(cfg, pstate)
    for _ in range(s.steps - 1):  # warm-up: kernels chosen, allocator and host memory in place
        with step_autocast(cfg.train.bf16, pstate, s.device):  # as the trainer runs a step
            train_step(model, optimizer, [batch], pstate, devices.accelerator, cfg.optim.clip_grad)
    if s.device == "cuda":
        return _measure_cuda(model, optimizer, batch, pstate, devices, cfg, offload)
    probe = (lambda: offload.host_bytes_reserved) if offload else None
    tracker = make_tracker(model, optimizer, probe, extra=(batch.input_ids, batch.labels, batch.position_ids))
    start = time.perf_counter()
    analysis = run_tracked_step(tracker, model, optimizer, [batch], pstate, devices, cfg.optim.clip_grad,
                                cfg.train.bf16)
    return {"allocated_peak_bytes": analysis.peak.total, "reserved_peak_bytes": None,
            **_host_bytes(offload), "step_seconds": time.perf_counter() - start}


def _measure_cuda(model, optimizer, batch, pstate, devices, cfg, offload) -> dict:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with step_autocast(cfg.train.bf16, pstate, "cuda"):
        train_step(model, optimizer, [batch], pstate, devices.accelerator, cfg.optim.clip_grad)
    torch.cuda.synchronize()
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return {"allocated_peak_bytes": torch.cuda.max_memory_allocated(),
            "reserved_peak_bytes": torch.cuda.max_memory_reserved(),
            **_host_bytes(offload),
            "caching_host_allocator_bytes": host.get("reserved_bytes.current", host.get("segment.current")),
            "step_seconds": time.perf_counter() - start}


def _host_bytes(offload) -> dict:
    """Host bytes of the offload arenas, and how many of them are page-locked (all of them on CUDA)."""
    return {"offload_host_bytes": 0 if offload is None else offload.host_bytes_reserved,
            "page_locked_host_bytes": 0 if offload is None else offload.page_locked_bytes}


def model_flops_per_step(cfg) -> float:
    """6 x parameters x tokens for the matmuls, plus causal attention (6 x S x d x heads per token per layer
    in forward and backward, halved by causality: 2 x 3 x S/2 ...); recomputation is not counted."""
    c, S = cfg.model_config(), cfg.data.seq_length
    h, L = c.hidden_size, c.num_layers
    kv = c.num_query_groups * c.kv_channels
    per_layer = h * c.num_attention_heads * c.kv_channels * 2 + 2 * h * kv + 3 * h * c.ffn_hidden_size
    dense = 6 * (L * per_layer + c.vocab_size * h) * S
    attention = 6 * L * S * S * c.num_attention_heads * c.kv_channels  # 12 S^2 H d, halved for causality
    return float(dense + attention) * cfg.data.micro_batch_size


def predicted(cfg, world_size: int, s: Sizes) -> dict:
    machine = Machine(num_gpus=world_size, gpus_per_node=min(world_size, 8), reserve_gib=0.0, device=s.device,
                      gpu_memory_gib=torch.cuda.get_device_properties(0).total_memory / GIB if s.device == "cuda"
                      else 1e3, host_memory_gib=1e6, flash_attn=kernels.flash_attn_available())
    e = estimate(cfg, machine)
    return {"gpu_peak_bytes": e.gpu_peak_bytes, "nccl_bytes": e.nccl_bytes, "host_bytes_per_gpu": e.host_bytes_per_gpu,
            "peak_phase": e.peak_phase, "by_category_gib": {k: round(v / GIB, 3) for k, v in
                                                          e.gpu_bytes_by_category.items()}}


def compare(cfg, world_size: int, s: Sizes) -> dict:
    """Planner against a real step of the same configuration."""
    plan = predicted(cfg, world_size, s)  # the planner brings its own fake world
    with fake_process_group(world_size):  # rank 0 of the world; nothing for one rank
        real = measure_step(cfg, world_size, s)
    modelled = plan["gpu_peak_bytes"] - plan["nccl_bytes"]  # NCCL allocates outside torch's allocator
    tokens = cfg.data.seq_length * cfg.data.micro_batch_size / world_size
    flops = model_flops_per_step(cfg) / world_size
    return {"seq_length": cfg.data.seq_length, "predicted": plan, "measured": real,
            "predicted_over_measured": modelled / real["allocated_peak_bytes"],
            "host_predicted_over_measured": plan["host_bytes_per_gpu"] / max(real["offload_host_bytes"], 1),
            "tokens_per_s": tokens / real["step_seconds"],
            "mfu": flops / real["step_seconds"] / PEAK_BF16_FLOPS if s.device == "cuda" else None}


def _release() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def section_single_gpu(s: Sizes) -> dict:
    result = {}
    for length in s.lengths:
        result[str(length)] = compare(config(s, length, FULL_STACK), 1, s)
        _release()
    return result


def section_cp_rank(s: Sizes) -> dict:
    result = {}
    for impl in ("untied_ulysses", "ulysses"):
        cfg = config(s, s.cp_length, FULL_STACK, context_parallel_size=8, cp_impl=impl)
        result[impl] = compare(cfg, 8, s)
        _release()
    return result


def section_ratios(s: Sizes, results: dict) -> dict:
    seconds = {}
    for name, stack in STACKS.items():
        seconds[name] = measure_step(config(s, s.ratio_length, stack), 1, s)["step_seconds"]
        _release()
    base = seconds["none"]
    ratios = {name: t / base for name, t in seconds.items()}
    cp = results.get("cp_rank", {})
    if cp.get("ok"):
        untied, ulysses = (cp["result"][i]["measured"]["step_seconds"] for i in ("untied_ulysses", "ulysses"))
        ratios["untied_over_ulysses_cp_rank"] = untied / ulysses
    return {"seq_length": s.ratio_length, "step_seconds": seconds, "ratio_to_no_stack": ratios}


# --- driver ---------------------------------------------------------------------------------


def run_section(name: str, fn, results: dict, out: Path) -> None:
    """Run one section, recording its result or its failure, and rewrite the JSON."""
    LOG.info("section %s: start", name)
    start = time.perf_counter()
    try:
        results[name] = {"ok": True, "result": fn()}
    except Exception as e:  # noqa: BLE001 - each section records its own failure
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        LOG.error("section %s failed: %s", name, results[name]["traceback"])
    results[name]["seconds"] = round(time.perf_counter() - start, 2)
    LOG.info("section %s: %s in %.1f s", name, "ok" if results[name]["ok"] else "FAILED", results[name]["seconds"])
    (out / "gpu_checks.json").write_text(json.dumps(results, indent=1, default=str))


def environment(s: Sizes, dry_run: bool) -> dict:
    device = torch.device(s.device)
    probe = torch.zeros(2, 2, device=device)
    addmm_fp32_(probe, *(torch.ones(2, 2, device=device, dtype=torch.bfloat16) for _ in range(2)))
    return {"dry_run": dry_run, "torch": torch.__version__, "device": s.device,
            "gpu": torch.cuda.get_device_name(0) if s.device == "cuda" else None,
            "flash_attn": kernels.flash_attn_available(), "flash_attn_problem": kernels.FLASH_ATTN_PROBLEM or None,
            "fp32_output_gemm": fp32_out_gemm_available(device)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every section on CPU at tiny sizes")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="output directory (default: $OUT)")
    parser.add_argument("--sections", default="kernels,single_gpu,cp_rank,ratios",
                        help="comma-separated subset to run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.FileHandler(out / "gpu_checks.log", mode="w"), logging.StreamHandler()])
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run for the CPU rehearsal")
    s = sizes(args.dry_run)
    torch.manual_seed(0)
    results: dict = {"environment": environment(s, args.dry_run)}
    sections = {"kernels": lambda: section_kernels(s), "single_gpu": lambda: section_single_gpu(s),
                "cp_rank": lambda: section_cp_rank(s), "ratios": lambda: section_ratios(s, results)}
    for name in args.sections.split(","):
        run_section(name, sections[name], results, out)
    return results


if __name__ == "__main__":
    main()
