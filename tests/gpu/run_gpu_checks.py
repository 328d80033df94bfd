"""The GPU check: kernels, one GPU against the planner, one rank of an 8-way cp world, step ratios.

    python tests/gpu/run_gpu_checks.py --out DIR      # on one CUDA GPU (default DIR: $OUT)
    python tests/gpu/run_gpu_checks.py --dry-run --out DIR   # every section on CPU at tiny sizes
    python tests/gpu/run_gpu_checks.py --list --out DIR      # the command of each section, run alone

Each section is sized to finish within SECTION_BUDGET_S on one H100 (SECTION_ESTIMATES_S: estimates, not
measurements) and runs alone with `--sections NAME`; the commands are printed at the start of every run.

Writes DIR/gpu_checks.json (rewritten after every section, so a run that dies leaves what
it measured so far) and DIR/gpu_checks.log. Each section catches its own failure and
records it as {"ok": false, "error": ...}. Installs nothing; uses flash-attn when present.
See docs/gpu_checks.md for what each figure means.

Sections (JSON keys), besides `environment` and `memory_timeline` (device memory as the driver
reports it, after CUDA init, NCCL's first use of each collective, and around each page-locking):
- nccl: a one-rank communicator's device memory after init and after the first use of each
  collective kind the step runs (NCCL's per-communicator base; peers' buffers need several GPUs).
- kernels: every CUDA attention kernel available, forward and backward, packed documents,
  grouped-query attention, against the reference kernel (bf16; fp32 for sdpa_efficient).
- kernel_cases: 16-bit sdpa_efficient on strided views; > 65,535 documents in one varlen call per
  kernel; the efficient backward's peak on packed fp32 documents against the planner's model.
- single_gpu: rank 0 of an 8-way data-parallel world over torch's fake process group, so that the
  step runs FSDP's bf16 policy as every multi-GPU run does (bf16 residual stream, block inputs and
  arenas; no autocast): a Llama3-8B-shaped model with 4 layers, full memory stack, at three lengths:
  measured max_memory_allocated / max_memory_reserved / allocator retries / page-locked host bytes
  against the planner's prediction; compute-only step time, tokens/s, MFU.
- cp_rank: rank 0 of an 8-way context-parallel world over torch's fake process group
  (collectives move nothing, so values are meaningless and times are compute only, but every
  allocation is the real kernel's): Llama3-8B shape, 4 layers, 512K tokens, Untied Ulysses and
  Ulysses, full stack, against the planner.
- contracts: `--flash-attention-impl auto` activated and proven by its start-up probe (what runs, and the
  probe's verdict), then torch's default kernels restored for the sections after it; offload with the
  early prefetch and kept attention outputs at k = 1 and 2, loss and every gradient against the same
  blocks without offload under torch's deterministic algorithms, bitwise where two runs without offload
  agree bitwise and within their spread where they do not, under TORCH_CUDA_SANITIZER=1 (a subprocess
  whose timeout is a recorded failure); the caching allocator's segments all expandable.
- ratios: step-time ratios in one run, in the single_gpu setting: no stack, + checkpointing, + offload
  (prefetch and on demand), + tiled MLP and loss; Untied vs Ulysses in the cp_rank setting (compute only).
- model_steps (tests/gpu/model_step_checks.py): --optimizer-cpu-offload against the resident AdamW and its host
  bytes planned against page-locked; --replay-kept-attention bitwise; ring attention in a model step; packed
  documents.
Every case is sized to the card it finds, or skipped with the reason recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from megatron_lc.devices import set_cuda_allocator_settings

set_cuda_allocator_settings()  # as the trainer: expandable segments merged in before CUDA initialises

import torch.distributed as dist

from megatron_lc.attention import flash_impl, kernel_selection, kernels
from megatron_lc.arguments import config_from_values
from megatron_lc.data.loader import Batch
from megatron_lc.devices import PEAK_DENSE_BF16_FLOPS, Devices
from megatron_lc.memory import offload as offload_module
from megatron_lc.memory.tiling import addmm_fp32_, fp32_out_gemm_available
from megatron_lc.parallel_state import ParallelState, run_collective
from megatron_lc.planning.estimate import GIB, Machine, estimate, planning_config
from megatron_lc.planning.fake_world import fake_process_group
from megatron_lc.planning import gpu_allocations
from megatron_lc.planning.rates import RATES
from megatron_lc.planning.timing import predict as predict_step_time
from megatron_lc.planning.trace import (
    initialize_optimizer_state,
    parallel_dims,
    run_tracked_step,
)
from megatron_lc.planning.tracker import make_tracker
from megatron_lc.training.build import build_run_optimizer, build_sharded_model
from megatron_lc.training.step import step_autocast, train_step
from tests.gpu import model_step_checks

LOG = logging.getLogger("gpu_checks")
NO_STACK = dict(recompute_granularity="none", offload_mode="none", tiled_mlp=False, tiled_loss=False)
FULL_STACK = dict(recompute_granularity="full", offload_mode="prefetch", tiled_mlp=True, tiled_loss=True)
STACKS = {  # the ratios section, in order: each adds one layer of the memory stack
    "none": NO_STACK,
    "checkpoint": {**NO_STACK, "recompute_granularity": "full"},
    "offload_prefetch": {**NO_STACK, "recompute_granularity": "full", "offload_mode": "prefetch"},
    "offload_on_demand": {**NO_STACK, "recompute_granularity": "full", "offload_mode": "on_demand"},
    "offload_prefetch_early": {**NO_STACK, "recompute_granularity": "full", "offload_mode": "early"},  # the copy back during the layer above's backward
    "full_stack": FULL_STACK,
}
PEAK_BF16_FLOPS = PEAK_DENSE_BF16_FLOPS["H100"][0]
"""Dense bf16 peak of an H100/H200 SXM (`megatron_lc.devices`), the MFU denominator."""
WORLD_SIZE = 8
"""The fake world the single_gpu, cp_rank and ratios sections run rank 0 of: FSDP's bf16 policy, as a real run."""
SECTION_BUDGET_S = 300
"""What each section may take on one H100: a first GPU contact is minutes long."""
SECTION_ESTIMATES_S = {"nccl": 15, "kernels": 30, "kernel_cases": 60, "contracts": 150, "single_gpu": 120,
                       "cp_rank": 150, "ratios": 150, "model_steps": 180}
"""Each section's time on one H100, by estimate (docs/gpu_checks.md derives them); not measured."""


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
    many_segments: int = 70_000
    """Documents in one varlen call: more than 65,535, the CUDA grid's y/z limit."""
    workspace_docs: tuple[int, int, int, int] = (200, 16384, 4, 128)
    """Packed fp32 documents for the efficient backward's workspace: count, longest, heads, head dim."""
    bitwise_length: int = 8192
    """Tokens of the offload bitwise check (four steps under the stream sanitizer)."""


def sizes(dry_run: bool) -> Sizes:
    if dry_run:
        return Sizes("cpu", torch.bfloat16, dict(model="debug", num_layers=4), (128, 256, 512), 512, 256,
                     (256, 8, 2, 16), ("cpu_flash",), 1, many_segments=300, workspace_docs=(20, 256, 2, 16),
                     bitwise_length=256)
    cuda_kernels = tuple(n for n in kernels.CUDA_KERNELS if n != "flash_attn" or kernels.flash_attn_available())
    return Sizes("cuda", torch.bfloat16, dict(model="llama3-8b", num_layers=4), (32768, 65536, 131072),
                 1 << 19, 32768, (4096, 32, 8, 128), cuda_kernels, 2)


# --- device memory as the driver sees it ------------------------------------------------------


class MemoryTimeline:
    """Free and total device memory (torch.cuda.mem_get_info: the driver's figures, so NCCL's buffers and
    page-locking count too) and the allocator's allocated/reserved bytes, at named moments; None on CPU."""

    def __init__(self, device: str):
        self.device = device
        self.events: list[dict] = []

    def record(self, event: str, **extra) -> dict:
        row = {"event": event, "free_bytes": None, "total_bytes": None, "allocated_bytes": None,
               "reserved_bytes": None, **extra}
        if self.device == "cuda":
            row["free_bytes"], row["total_bytes"] = torch.cuda.mem_get_info()
            row.update(allocated_bytes=torch.cuda.memory_allocated(), reserved_bytes=torch.cuda.memory_reserved())
        self.events.append(row)
        return row


TIMELINE = MemoryTimeline("cpu")
"""The run's timeline (main() replaces it with one for the run's device)."""


def recording_page_lock(lock, timeline: MemoryTimeline):
    """`lock` (offload.page_lock) with the device memory recorded before and after each registration."""

    def page_lock(buffer: torch.Tensor) -> None:
        nbytes = buffer.numel() * buffer.element_size()
        timeline.record("before page-locking", host_bytes=nbytes)
        lock(buffer)
        timeline.record("after page-locking", host_bytes=nbytes)

    return page_lock


def device_total_bytes(s: Sizes) -> int | None:
    return torch.cuda.get_device_properties(0).total_memory if s.device == "cuda" else None


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def skip_reason(needed_gpu: int, needed_host: int, gpu_total: int | None, host_total: int) -> str | None:
    """Why a case cannot run here (None: it fits). GPU: 95% of the card (the context and workspaces take the
    rest); host: 80% of RAM. gpu_total None: not a GPU run, nothing to size."""
    if gpu_total is not None and needed_gpu > 0.95 * gpu_total:
        return f"needs {needed_gpu / GIB:.1f} GiB of device memory, the card has {gpu_total / GIB:.1f} GiB"
    if needed_host > 0.8 * host_total:
        return f"needs {needed_host / GIB:.1f} GiB of host memory, the machine has {host_total / GIB:.1f} GiB"
    return None


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
    runs.update({f"auto_{str(dt).removeprefix('torch.')}": (kernel_selection.select_kernel(device, "auto"), dt)
                 for dt in (torch.bfloat16, torch.float32)})
    result = {label: check_kernel(kernel, dtype, s) for label, (kernel, dtype) in runs.items()}
    result.update({f"unmasked_{label}": check_unmasked(kernel, dtype, s) for label, (kernel, dtype) in runs.items()})
    bad = {label: r["relative_error"] for label, r in result.items() if not r["within_tolerance"]}
    if bad:
        raise AssertionError(f"kernel errors beyond tolerance: {json.dumps(bad)}")
    return result


# --- kernel cases that would catch known kernel defects ------------------------------------------


def _errors(got, want) -> dict:
    return {key: float((a.float() - b).abs().max() / b.abs().max()) for key, a, b in
            zip(("out", "dq", "dk", "dv"), got, want)}


def case_strided_efficient(s: Sizes) -> dict:
    """16-bit sdpa_efficient on column-slice views, as a fused projection hands them over: q, k, v the
    columns of one [T, 3 x H x d] tensor, out and dout the columns of wider ones (row stride != H x d);
    equal heads so the views reach the kernel unexpanded. Against the fp32 reference on contiguous copies."""
    name = "sdpa_efficient" if s.device == "cuda" else s.kernels[0]  # the dry run: the same code, cpu_flash
    kernel = kernels.KERNELS[name]
    T, H, _, d = s.kernel_shape
    cu, width = _packed_cu(T), H * d
    result = {}
    for dtype in (torch.bfloat16, torch.float16) if s.device == "cuda" else (torch.bfloat16,):
        g = torch.Generator(device=s.device).manual_seed(2)
        fused = torch.randn(T, 3 * width, device=s.device, generator=g, dtype=dtype)
        q, k, v = (fused[:, i * width:(i + 1) * width].view(T, H, d) for i in range(3))
        dout = torch.randn(T, 2 * width, device=s.device, generator=g, dtype=dtype)[:, width:].view(T, H, d)
        out_contiguous, lse, state = kernel.forward(q, k, v, cu)
        out = torch.zeros(T, 2 * width, device=s.device, dtype=dtype)[:, :width].view(T, H, d)
        out.copy_(out_contiguous)
        got = (out, *kernel.backward(dout, q, k, v, out, lse, cu, state=state))
        want = _fwd_bwd(kernels.KERNELS["reference"], *(t.float().contiguous() for t in (q, k, v, dout)), cu)
        errors = _errors(got, want)
        result[str(dtype).removeprefix("torch.")] = {
            "kernel": name, "strides": {"q": list(q.stride()), "out": list(out.stride())},
            "relative_error": errors, "within_tolerance": max(errors.values()) < 3e-2}
    return result


def _segment_lengths(count: int) -> list[int]:
    return [(1, 2, 5, 8)[i % 4] for i in range(count)]  # single-token documents included


def grouped_reference(q, k, v, dout, lengths: list[int]):
    """fp32 causal attention per document for many short documents, batched by length (O(T) memory, fast
    where the blockwise reference would loop over every document): out, dq, dk, dv."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    H, d = q.shape[1], q.shape[2]
    starts = torch.tensor([0, *lengths[:-1]], device=q.device).cumsum(0)
    lengths_t = torch.tensor(lengths, device=q.device)
    out = torch.zeros_like(q)
    for length in sorted(set(lengths)):
        index = (starts[lengths_t == length][:, None] + torch.arange(length, device=q.device)).flatten()
        qs, ks, vs = (t[index].unflatten(0, (-1, length)) for t in (q, k, v))  # [docs, L, heads, d]
        ks, vs = (kernels._expand_kv(t.flatten(0, 1), H).unflatten(0, qs.shape[:2]) for t in (ks, vs))
        scores = torch.einsum("nlhd,nmhd->nhlm", qs, ks) / d ** 0.5
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out = out.index_put((index,), torch.einsum("nhlm,nmhd->nlhd", probs, vs).flatten(0, 1))
    out.backward(dout.float())
    return out.detach(), q.grad, k.grad, v.grad


def case_many_segments(s: Sizes) -> dict:
    """More than 65,535 documents in one varlen call (the CUDA grid's y/z limit), each kernel, fwd and bwd."""
    lengths = _segment_lengths(s.many_segments)
    T, (H, Hkv, d) = sum(lengths), ((4, 2, 64) if s.device == "cuda" else (4, 2, 16))
    cu = tuple(itertools.accumulate(lengths, initial=0))
    reason = skip_reason(40 * T * H * d * 4, 0, device_total_bytes(s), host_ram_bytes())  # generous: fp32 copies
    if reason:
        return {"segments": len(lengths), "skipped": reason}
    result = {"segments": len(lengths), "tokens": T, "heads": [H, Hkv, d]}
    for name in s.kernels:
        dtype = torch.float32 if name == "sdpa_efficient" else s.dtype
        g = torch.Generator(device=s.device).manual_seed(3)
        q, k, v, dout = (torch.randn(T, h, d, device=s.device, generator=g, dtype=dtype) for h in (H, Hkv, Hkv, H))
        try:
            errors = _errors(_fwd_bwd(kernels.KERNELS[name], q, k, v, dout, cu), grouped_reference(q, k, v, dout, lengths))
        except Exception as e:  # noqa: BLE001 - a launch failure is the defect this case looks for
            result[name] = {"dtype": str(dtype), "error": f"{type(e).__name__}: {e}", "within_tolerance": False}
            continue
        tolerance = 3e-2 if dtype in kernels.FLASH_DTYPES else 1e-3
        result[name] = {"dtype": str(dtype), "relative_error": errors, "within_tolerance": max(errors.values()) < tolerance}
        _release()
    return result


def peak_bytes_of(fn, device: str):
    """(fn's result, the peak bytes it allocated above what was allocated before it)."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        value = fn()
        torch.cuda.synchronize()
        return value, torch.cuda.max_memory_allocated() - before
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:  # counts the tensors made inside
        value = fn()
    return value, sum(peak["Total"] for peak in tracker.get_tracker_snapshot("peak").values())


def case_efficient_workspace(s: Sizes) -> dict:
    """The memory-efficient backward on packed fp32 documents: its peak bytes against the planner's model of
    the same calls (dq, dk, dv, our wrapper's copies, delta and the fp32 dq workspace of each call)."""
    count, longest, H, d = s.workspace_docs
    lengths = [max(1, longest * (i + 1) // count) for i in range(count)]
    T = sum(lengths)
    tensor_bytes = T * H * d * 4
    shape = {"documents": count, "longest": longest, "tokens": T, "heads": H, "head_dim": d}
    reason = skip_reason(12 * tensor_bytes, 0, device_total_bytes(s), host_ram_bytes())  # inputs, grads, slack
    if reason:
        return {**shape, "skipped": reason}
    name = "sdpa_efficient" if s.device == "cuda" else s.kernels[0]
    kernel, cu = kernels.KERNELS[name], tuple(itertools.accumulate(lengths, initial=0))
    g = torch.Generator(device=s.device).manual_seed(4)
    q, k, v, dout = (torch.randn(T, H, d, device=s.device, generator=g) for _ in range(4))
    out, lse, state = kernel.forward(q, k, v, cu)
    _, measured = peak_bytes_of(lambda: kernel.backward(dout, q, k, v, out, lse, cu, state=state), s.device)
    model_state = state if name == "sdpa_efficient" else (None, None)
    planned = gpu_allocations.planned_kernels(lambda tensor, label: None)  # the planner's models of the operators
    _, modelled = peak_bytes_of(lambda: planned[gpu_allocations.PLANNED_PREFIX + "sdpa_efficient"].backward(
        dout, q, k, v, out, lse, cu, state=model_state), s.device)
    return {**shape, "kernel": name, "measured_backward_peak_bytes": measured,
            "modelled_backward_peak_bytes": modelled, "modelled_over_measured": modelled / max(measured, 1),
            "measured_over_input_bytes": measured / tensor_bytes}


def section_kernel_cases(s: Sizes) -> dict:
    """Cases that catch known kernel defects; each records its own failure or skip, and the section fails
    (keeping every figure) when a kernel is beyond tolerance."""
    result = {}
    for name, case in (("strided_efficient", case_strided_efficient), ("many_segments", case_many_segments),
                       ("efficient_workspace", case_efficient_workspace)):
        try:
            result[name] = case(s)
        except Exception as e:  # noqa: BLE001 - one case's failure leaves the others
            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        _release()
    result["failures"] = [f"{case}/{label}" for case, runs in result.items() if isinstance(runs, dict)
                          for label, run in runs.items() if isinstance(run, dict) and run.get("within_tolerance") is False]
    result["failures"] += [case for case, runs in result.items() if isinstance(runs, dict) and "error" in runs]
    return result


# --- NCCL's first use of each collective -----------------------------------------------------------


def nccl_version() -> str | None:
    """torch.cuda.nccl.version() as text; None where torch has no NCCL (a CPU build)."""
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def section_nccl(s: Sizes) -> dict:
    """Device memory after init_process_group and after the first use of each collective kind the training
    step runs, on a one-rank communicator (NCCL on CUDA, gloo in the dry run). One rank has no peers, so no
    connection buffers: this measures NCCL's per-communicator base; peers' buffers need a multi-GPU run."""
    cuda = s.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    TIMELINE.record("before init_process_group")
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            **({"device_id": device} if cuda else {}))
    try:
        first_use = {"init_process_group": TIMELINE.record("after init_process_group")}
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
            try:
                run_collective(kind, None, device)
                if cuda:
                    torch.cuda.synchronize()
                first_use[kind] = TIMELINE.record(f"after first {kind}")
            except Exception as e:  # noqa: BLE001 - e.g. gloo has no send to itself
                first_use[kind] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        dist.destroy_process_group()
    return {"backend": "nccl" if cuda else "gloo", "world_size": 1, "nccl_version": nccl_version(),
            "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"), "first_use": first_use}


# --- one step, measured ---------------------------------------------------------------------


def config(s: Sizes, seq_length: int, stack: dict, **extra):
    """The configuration of one case, with the flash implementation active now (what its step runs, so
    what the planner models)."""
    values = dict(**s.model, bf16=s.dtype == torch.bfloat16, mock_data=True, device=s.device,
                  seq_length=seq_length, flash_attention_impl=flash_impl.active_flash_impl(), **stack, **extra)
    return planning_config(config_from_values(values), seq_length)


def synthetic_batch(cfg, pstate: ParallelState) -> Batch:
    """Random tokens of this rank's slice, one document per sample."""
    B, S, cp = cfg.data.micro_batch_size, cfg.data.seq_length, pstate.cp_size
    tokens = torch.randint(0, cfg.model_config().vocab_size, (B, S // cp))
    positions = (torch.arange(S // cp) + pstate.cp_rank * (S // cp)).expand(B, S // cp).contiguous()
    return Batch(tokens, tokens.roll(-1, dims=1), positions, tuple(range(0, B * S + 1, S)))


def measure_step(cfg, world_size: int, s: Sizes) -> dict:
    """Build, materialize and run `s.steps` real training steps on rank 0 of a fake world of `world_size`; the
    last one is measured."""
    with fake_process_group(world_size):  # nothing for one rank
        return _measure_step(cfg, world_size, s)


def _measure_step(cfg, world_size: int, s: Sizes) -> dict:
    devices = Devices(torch.device(s.device), torch.device("cpu"))
    pstate = ParallelState(parallel_dims(cfg, world_size), device_type=s.device)
    model, offload = build_sharded_model(cfg, cfg.run_spec(pstate.dims.world_size), pstate, devices)
    optimizer = build_run_optimizer(model, cfg, devices, fused=s.device == "cuda")
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
    return {"allocated_peak_bytes": analysis.peak.total, "reserved_peak_bytes": None, "num_alloc_retries": None,
            **_host_bytes(offload), "step_seconds": time.perf_counter() - start}


def _measure_cuda(model, optimizer, batch, pstate, devices, cfg, offload) -> dict:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with step_autocast(cfg.train.bf16, pstate, "cuda"):
        train_step(model, optimizer, [batch], pstate, devices.accelerator, cfg.optim.clip_grad)
    torch.cuda.synchronize()
    return {**allocator_counters(), **_host_bytes(offload), **caching_host_allocator_bytes(),
            "step_seconds": time.perf_counter() - start}


def allocator_counters() -> dict:
    """Peaks since the last reset, and the allocator's retries: a cudaMalloc that failed, freed the cache and
    tried again (memory_stats' num_alloc_retries; fragmentation shows there before it shows as an OOM)."""
    stats = torch.cuda.memory_stats()
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return {"allocated_peak_bytes": allocated, "reserved_peak_bytes": reserved,
            "reserved_minus_allocated_at_peak_bytes": reserved - allocated,
            "num_alloc_retries": stats.get("num_alloc_retries"), "num_ooms": stats.get("num_ooms")}


HOST_STATS_KEYS = ("allocated_bytes.current", "allocated_bytes.peak", "active_bytes.current", "allocations.current")
"""torch.cuda.host_memory_stats() keys of torch 2.11 (torch/cuda/memory.py, host_memory_stats' docstring):
the pinned blocks the caching host allocator owns, active + cached, at their power-of-two rounded size."""


def caching_host_allocator_bytes() -> dict:
    """torch's own pinned pool, for comparison with the arenas (which do not use it)."""
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return {"caching_host_allocator_bytes": host.get("allocated_bytes.current"),
            "caching_host_allocator": {key: host.get(key) for key in HOST_STATS_KEYS}}


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
    """Planner against a real step of the same configuration on rank 0 of a fake world of `world_size` (skipped,
    with the reason, if it cannot fit). The fake group moves no data: the time is compute and allocation only."""
    plan = predicted(cfg, world_size, s)  # the planner brings its own fake world
    modelled = plan["gpu_peak_bytes"] - plan["nccl_bytes"]  # NCCL allocates outside torch's allocator
    reason = skip_reason(modelled, plan["host_bytes_per_gpu"], device_total_bytes(s), host_ram_bytes())
    if reason:
        return {"seq_length": cfg.data.seq_length, "predicted": plan, "skipped": reason}
    real = measure_step(cfg, world_size, s)
    cp = cfg.parallel.context_parallel_size  # each data-parallel rank runs whole samples, each cp rank 1/cp
    seconds = real["compute_only_step_seconds"] = real.pop("step_seconds")
    timing = {"compute_only_tokens_per_s": cfg.data.seq_length * cfg.data.micro_batch_size / cp / seconds}
    if cp == 1:  # MFU where the rank's work is the model's (Ulysses' all-to-alls move nothing here)
        timing["compute_only_mfu"] = (model_flops_per_step(cfg) / seconds / PEAK_BF16_FLOPS
                                      if s.device == "cuda" else None)
    return {"seq_length": cfg.data.seq_length, "predicted": plan, "measured": real,
            "predicted_over_measured": modelled / real["allocated_peak_bytes"],
            "host_predicted_over_measured": plan["host_bytes_per_gpu"] / max(real["offload_host_bytes"], 1),
            **timing}


def _release() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def section_single_gpu(s: Sizes) -> dict:
    """One GPU's step as rank 0 of an 8-way data-parallel world: FSDP's bf16 policy, as a multi-GPU run."""
    result = {}
    for length in s.lengths:
        result[str(length)] = compare(config(s, length, FULL_STACK), WORLD_SIZE, s)
        _release()
    return result


CP_IMPLS = ("untied_ulysses", "ulysses")


def section_cp_rank(s: Sizes) -> dict:
    result = {}
    for impl in CP_IMPLS:
        cfg = config(s, s.cp_length, FULL_STACK, context_parallel_size=WORLD_SIZE, cp_impl=impl)
        result[impl] = compare(cfg, WORLD_SIZE, s)
        _release()
    return result


def section_ratios(s: Sizes, results: dict) -> dict:
    seconds, skipped = {}, {}
    for name, stack in STACKS.items():
        cfg = config(s, s.ratio_length, stack)
        plan = predicted(cfg, WORLD_SIZE, s)
        reason = skip_reason(plan["gpu_peak_bytes"] - plan["nccl_bytes"], plan["host_bytes_per_gpu"],
                             device_total_bytes(s), host_ram_bytes())
        if reason:
            skipped[name] = reason
            continue
        seconds[name] = measure_step(cfg, WORLD_SIZE, s)["step_seconds"]
        _release()
    base = seconds.get("none")
    ratios = {name: t / base for name, t in seconds.items()} if base else {}
    cp = results.get("cp_rank", {})
    measured = [cp["result"][i].get("measured") for i in CP_IMPLS] if cp.get("ok") else []
    if measured and all(measured):  # the fake group moves nothing: a ratio of compute and allocation
        untied, ulysses = (m["compute_only_step_seconds"] for m in measured)
        ratios["untied_over_ulysses_cp_rank_compute_only"] = untied / ulysses
    return {"seq_length": s.ratio_length, "step_seconds": seconds, "ratio_to_no_stack": ratios, "skipped": skipped}


# --- contracts: the kernel selection, offload's streams, the allocator ----------------------------

BITWISE_BASE = dict(recompute_granularity="full", keep_attention_output=True)
BITWISE_STACKS = {  # offload + early prefetch + kept attention, against the same blocks without offload
    "k1": dict(recompute_granularity="full", offload_mode="early", keep_attention_output=True),
    "k2": dict(recompute_granularity="full", offload_mode="early", keep_attention_output=True,
               offload_every_k_layers=2),
}


def step_loss_and_grads(cfg, s: Sizes) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward of `cfg` on one device, from seed 0, on a fixed batch: the loss and every
    gradient, on the CPU."""
    torch.manual_seed(0)
    devices = Devices(torch.device(s.device), torch.device("cpu"))
    pstate = ParallelState(parallel_dims(cfg, 1), device_type=s.device)
    model, _ = build_sharded_model(cfg, cfg.run_spec(pstate.dims.world_size), pstate, devices)
    torch.manual_seed(1)
    batch = synthetic_batch(cfg, pstate)
    from megatron_lc.training.step import forward_backward

    with step_autocast(cfg.train.bf16, pstate, s.device):
        result = forward_backward(model, [batch], pstate, devices.accelerator)
    grads = [p.grad.full_tensor().cpu() if hasattr(p.grad, "full_tensor") else p.grad.cpu()
             for p in model.parameters()]
    return result.loss.detach().cpu(), grads


@contextlib.contextmanager
def deterministic_algorithms():
    """torch's deterministic algorithms on, restored after: the flash backwards (torch's, and flash-attn's through
    `kernels.flash_attn_backward`) then accumulate dq in a fixed order instead of by fp32 atomics. warn_only: an
    operator with no deterministic version warns and runs; the baseline's own spread covers what it varies."""
    before, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def differences(a: tuple[torch.Tensor, list[torch.Tensor]], b: tuple[torch.Tensor, list[torch.Tensor]]) -> list[float]:
    """Max |a - b| of the loss and of each gradient (NaN where either is not finite)."""
    return [float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
            for x, y in zip((a[0], *a[1]), (b[0], *b[1]), strict=True)]


def case_offload_bitwise(s: Sizes) -> dict:
    """Offload with the early prefetch and kept attention outputs, every input kept (k = 1) and every second
    (k = 2), against the same checkpointed blocks without offload, under torch's deterministic algorithms. Two
    runs without offload give the baseline's spread per tensor (loss and each gradient): offload must match
    bitwise where the baseline is bitwise reproducible, and stay within twice its spread where it is not (an
    operator with no deterministic version), so kernel nondeterminism never reads as a stream race. On CUDA the
    caller runs it under TORCH_CUDA_SANITIZER=1 (a stream race raises there)."""
    base = config(s, s.bitwise_length, BITWISE_BASE)
    out, failures = {}, []
    with deterministic_algorithms():
        want = step_loss_and_grads(base, s)
        spread = differences(want, step_loss_and_grads(base, s))
        out["baseline"] = {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                           "bitwise_reproducible": all(d == 0 for d in spread), "max_spread": max(spread)}
        for name, stack in BITWISE_STACKS.items():
            got = step_loss_and_grads(config(s, s.bitwise_length, stack), s)
            diff = differences(want, got)
            within = all(d <= 2 * limit for d, limit in zip(diff, spread))  # NaN compares False: a failure
            out[name] = {"bitwise_equal": all(d == 0 for d in diff), "within_baseline_spread": within,
                         "max_difference": max(diff), "loss": float(got[0])}
            if not within:
                failures.append(f"offload_{name}")
    out["sanitizer"] = os.environ.get("TORCH_CUDA_SANITIZER") == "1"
    out["failures"] = failures
    return out


def _text(stream) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else stream or ""


def sanitized_offload_bitwise(s: Sizes, out: Path, timeout_s: float) -> dict:
    """`case_offload_bitwise` in a subprocess under TORCH_CUDA_SANITIZER=1 (read when torch starts), with cuBLAS
    on its deterministic workspace setting; a subprocess past `timeout_s` is this case's failure, recorded."""
    if s.device != "cuda":
        return {**case_offload_bitwise(s), "sanitizer_note": "CUDA only: the CPU rehearsal runs unsanitized"}
    sub = out / "sanitized"
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **os.environ, "TORCH_CUDA_SANITIZER": "1"}
    try:
        proc = subprocess.run([sys.executable, __file__, "--sections", "offload_bitwise", "--out", str(sub)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        return {"timeout_s": timeout_s, "stderr_tail": _text(e.stderr)[-2000:],
                "failures": [f"sanitized subprocess: no result within {timeout_s:.0f} s"]}
    result = json.loads((sub / "gpu_checks.json").read_text()).get("offload_bitwise", {}) if \
        (sub / "gpu_checks.json").exists() else {}
    return {**result.get("result", {}), "returncode": proc.returncode, "stderr_tail": proc.stderr[-2000:],
            "failures": result.get("result", {}).get("failures", ["sanitized subprocess"]) if proc.returncode == 0
            else ["sanitized subprocess"]}


def allocator_snapshot(s: Sizes) -> dict:
    """The caching allocator's segments after a step: expandable segments on, as the trainer sets them."""
    if s.device != "cuda":
        return {"skipped": "CUDA only"}
    torch.zeros(1 << 20, device="cuda")
    segments = torch.cuda.memory._snapshot()["segments"]
    expandable = [seg.get("is_expandable") for seg in segments]
    return {"segments": len(segments), "expandable": sum(bool(e) for e in expandable),
            "failures": [] if segments and all(expandable) else ["expandable_segments"]}


def flash_probe(s: Sizes) -> dict:
    """What `--flash-attention-impl auto` activates and its start-up probe's verdict; torch's own flash kernels
    are restored after, so that the sections after this one run (and the planner models) the default."""
    device = torch.device(s.device)
    impl = flash_impl.activate_flash_impl("auto", device)
    try:
        kernel = kernels.KERNELS["sdpa_flash" if s.device == "cuda" else "cpu_flash"]
        probe = flash_impl.probe_flash_kernel(kernel, device, torch.bfloat16)
        running = kernel_selection.running_kernel(s.device, "auto", torch.bfloat16)
    finally:
        flash_impl.activate_flash_impl("default", device)
    return {"flash_impl": impl, "running_kernel": running, "probe": probe or "ok",
            "failures": ["flash_probe"] if probe else []}


def _case(name: str, fn) -> dict:
    """One contract case's result, or its exception recorded as its failure (the other cases keep theirs)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one case's failure leaves the others
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                "failures": [f"{name}: {type(e).__name__}"]}


def section_contracts(s: Sizes, out: Path) -> dict:
    """What runs attention (the start-up probe of --flash-attention-impl auto), offload's streams under the
    sanitizer, bitwise, and the allocator's segments; each case's failure is recorded beside the others' results.
    The sanitized subprocess gets what is left of the section's budget."""
    start = time.perf_counter()
    flash = _case("flash_probe", lambda: flash_probe(s))
    remaining = SECTION_BUDGET_S - (time.perf_counter() - start) - 30  # the snapshot and the write after it
    offload = _case("offload_bitwise", lambda: sanitized_offload_bitwise(s, out, max(remaining, 60)))
    snapshot = _case("allocator", lambda: allocator_snapshot(s))
    failures = [f for r in (flash, offload, snapshot) for f in r.get("failures", [])]
    return {**{k: v for k, v in flash.items() if k != "failures"}, "offload_bitwise": offload,
            "allocator": snapshot, "failures": failures}


# --- driver ---------------------------------------------------------------------------------


def run_section(name: str, fn, results: dict, out: Path) -> None:
    """Run one section, recording its result or its failure, and rewrite the JSON. A section whose result
    lists `failures` is recorded as failed with its figures kept."""
    LOG.info("section %s: start", name)
    start = time.perf_counter()
    try:
        result = fn()
        failures = result.get("failures") if isinstance(result, dict) else None
        results[name] = {"ok": not failures, "result": result}
        if failures:
            results[name]["error"] = f"failures: {', '.join(failures)}"
    except Exception as e:  # noqa: BLE001 - each section records its own failure
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        LOG.error("section %s failed: %s", name, results[name]["traceback"])
    seconds = results[name]["seconds"] = round(time.perf_counter() - start, 2)
    results[name]["over_budget"] = seconds > SECTION_BUDGET_S  # the sizing to correct, not a defect of the code
    LOG.info("section %s: %s in %.1f s%s", name, "ok" if results[name]["ok"] else "FAILED", seconds,
             f" (over its {SECTION_BUDGET_S} s budget)" if results[name]["over_budget"] else "")
    (out / "gpu_checks.json").write_text(json.dumps(results, indent=1, default=str))


def host_memory_stats_keys(s: Sizes) -> list[str] | None:
    """The keys torch.cuda.host_memory_stats() has on this torch (after one pinned allocation)."""
    if s.device != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    torch.empty(1, pin_memory=True)
    return sorted(torch.cuda.host_memory_stats())


def environment(s: Sizes, dry_run: bool) -> dict:
    device = torch.device(s.device)
    probe = torch.zeros(2, 2, device=device)
    TIMELINE.record("after CUDA init")
    addmm_fp32_(probe, *(torch.ones(2, 2, device=device, dtype=torch.bfloat16) for _ in range(2)))
    return {"dry_run": dry_run, "torch": torch.__version__, "device": s.device,
            "gpu": torch.cuda.get_device_name(0) if s.device == "cuda" else None,
            "gpu_count": torch.cuda.device_count() if s.device == "cuda" else 0,
            "gpu_total_bytes": device_total_bytes(s), "host_ram_bytes": host_ram_bytes(),
            "nccl_version": nccl_version(), "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "host_memory_stats_keys": host_memory_stats_keys(s),
            "flash_attn": kernels.flash_attn_available(), "flash_attn_problem": kernels.FLASH_ATTN_PROBLEM or None,
            "fp32_output_gemm": fp32_out_gemm_available(device)}


SECTIONS = ("nccl", "kernels", "kernel_cases", "contracts", "single_gpu", "cp_rank", "ratios", "model_steps")


def compute_seconds(s: Sizes) -> dict[str, float]:
    """The GPU compute of each section that runs training steps, on one H100 by the time model
    (`planning/timing.py`: published kernel rates), leaving out what the fake group would communicate: a floor
    under the section's time, to which the planner's traces, model builds and start-up add (the contracts'
    stream sanitizer too). Each is kept within half of SECTION_BUDGET_S."""
    def step(cfg, world_size: int) -> float:
        seconds = predict_step_time(cfg, world_size, RATES["dgx-h100"]).seconds
        return sum(t for cause, t in seconds.items() if cause != "exposed communication")

    cp = [config(s, s.cp_length, FULL_STACK, context_parallel_size=WORLD_SIZE, cp_impl=i) for i in CP_IMPLS]
    return {"single_gpu": s.steps * sum(step(config(s, n, FULL_STACK), WORLD_SIZE) for n in s.lengths),
            "cp_rank": s.steps * sum(step(cfg, WORLD_SIZE) for cfg in cp),
            "ratios": s.steps * sum(step(config(s, s.ratio_length, stack), WORLD_SIZE) for stack in STACKS.values()),
            "contracts": (2 + len(BITWISE_STACKS)) * step(config(s, s.bitwise_length, BITWISE_BASE), 1),
            "model_steps": model_step_checks.compute_seconds(sys.modules[__name__], s, step)}


def section_commands(out: Path, dry_run: bool = False) -> list[str]:
    """One command per section, each run alone into its own directory, with its estimated time on one H100."""
    script = os.path.relpath(__file__)
    compute = compute_seconds(sizes(dry_run=False))
    return [f"python {shlex.quote(script)}{' --dry-run' if dry_run else ''} --sections {name} "
            f"--out {shlex.quote(str(out / name))}  # ~{SECTION_ESTIMATES_S[name]} s on one H100 (estimate"
            + (f"; {compute[name]:.0f} s of it GPU compute by the time model)" if name in compute else ")")
            for name in SECTIONS]


def main(argv: list[str] | None = None) -> dict:
    global TIMELINE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every section on CPU at tiny sizes")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="output directory (default: $OUT)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset to run")
    parser.add_argument("--list", action="store_true", help="print the command of each section and exit")
    args = parser.parse_args(argv)
    names = args.sections.split(",")
    unknown = [n for n in names if n not in (*SECTIONS, "offload_bitwise")]
    if unknown:
        parser.error(f"--sections {args.sections}: unknown {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
    out = Path(args.out)
    if args.list:
        print("\n".join(section_commands(out, args.dry_run)))
        return {}
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.FileHandler(out / "gpu_checks.log", mode="w"), logging.StreamHandler()])
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run for the CPU rehearsal")
    LOG.info("each section alone (%d s budget each on one H100):\n%s", SECTION_BUDGET_S,
             "\n".join(section_commands(out, args.dry_run)))
    s = sizes(args.dry_run)
    torch.manual_seed(0)
    TIMELINE = MemoryTimeline(s.device)
    results: dict = {"environment": environment(s, args.dry_run), "memory_timeline": TIMELINE.events}
    sections = {"nccl": lambda: section_nccl(s), "kernels": lambda: section_kernels(s),
                "kernel_cases": lambda: section_kernel_cases(s), "single_gpu": lambda: section_single_gpu(s),
                "cp_rank": lambda: section_cp_rank(s), "ratios": lambda: section_ratios(s, results),
                "contracts": lambda: section_contracts(s, out), "offload_bitwise": lambda: case_offload_bitwise(s),
                "model_steps": lambda: model_step_checks.section_model_steps(sys.modules[__name__], s)}
    real_page_lock = offload_module.page_lock
    offload_module.page_lock = recording_page_lock(real_page_lock, TIMELINE)  # every arena registration
    try:
        for name in names:
            run_section(name, sections[name], results, out)
    finally:
        offload_module.page_lock = real_page_lock
    return results


if __name__ == "__main__":
    main()
