"""The GPU check's model steps of what the host and the step itself hold (`run_gpu_checks.py --sections
model_steps`): each case takes the check's own helpers (`checks`: the run_gpu_checks module) and returns its
figures, with `failures` naming what failed.

- host_optimizer: two steps of two micro-batches with --optimizer-cpu-offload against the resident AdamW on the
  same tokens (loss, gradient norm, every parameter after; bitwise where the baseline is deterministic, else within
  a relative 1e-4), and its host bytes: what the planner predicts per GPU, what the optimizer and the offload
  arenas page-locked themselves (exact registrations), and torch's caching host allocator before and after (the
  optimizer must not use it). On a GPU it fails when a host buffer the GPU copies to is not page-locked
  (`is_pinned`) or the planner's host bytes over those the buffers' storages span are outside [1.0, 1.05].
- replay_kept_attention: --replay-kept-attention with sparse offload (k = 2) against the same checkpointed blocks
  without offload: loss and every gradient, bitwise under torch's deterministic algorithms where two baseline runs
  agree bitwise; and, started as the trainer starts (`reserve_host_arenas`), the host arenas two steps still make:
  none, or the shapes the attention backend declares for its kept output and lse are not the kernels' own (fails).
- ring: rank 0 of an 8-way ring context-parallel world (--cp-comm-type p2p) over torch's fake process group, full
  stack, against the planner (the fake group moves nothing: times are compute only).
- packed_documents: one step of whole documents packed into a sample (each attending to itself, positions from 0),
  loss and gradients finite, against the planner's peak.
- fa3_head_dim_128: FA3 behind torch's flash kernel where installed, packed causal and ring's unmasked calls at
  the check's head dim (128 on the GPU) against the reference; skipped with the reason elsewhere.
"""

from __future__ import annotations

import math
import time

import torch

from megatron_lc.devices import Devices
from megatron_lc.parallel_state import ParallelState
from megatron_lc.planning.trace import parallel_dims
from megatron_lc.training.build import build_run_optimizer, build_sharded_model, reserve_host_arenas
from megatron_lc.training.optim import HostAdamW
from megatron_lc.training.step import step_autocast, train_step

HOST_OPTIMIZER = dict(recompute_granularity="full", offload_mode="prefetch", global_batch_size=2, micro_batch_size=1,
                      clip_grad=0.05, weight_decay=0.1)
REPLAY_BASE = dict(recompute_granularity="full", keep_attention_output=True)
REPLAY = dict(recompute_granularity="full", offload_mode="early", keep_attention_output=True,
              offload_every_k_layers=2, replay_kept_attention=True)
PACKED_DOCUMENTS = 8
"""Documents packed into each sample of the packed_documents case."""


def _host_pinned_allocator_bytes() -> int | None:
    host = torch.cuda.host_memory_stats() if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats") \
        else {}
    return host.get("allocated_bytes.current")


def _storage_span_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes the host storages behind `tensors` span, each storage once (views of one allocation counted together;
    a locked allocation's page-alignment slack, two pages, left out): what the buffers occupy, not their count."""
    spans: dict[int, tuple[int, int]] = {}
    for t in tensors:
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        key = t.untyped_storage().data_ptr()
        low, high = spans.get(key, (start, end))
        spans[key] = (min(low, start), max(high, end))
    return sum(high - low for low, high in spans.values())


def _two_steps(checks, cfg, s, on_host: bool) -> dict:
    """Two steps of two micro-batches from seed 0; the figures and the built optimizer's host bytes."""
    torch.manual_seed(0)
    devices = Devices(torch.device(s.device), torch.device("cpu"))
    pstate = ParallelState(parallel_dims(cfg, 1), device_type=s.device)
    before = _host_pinned_allocator_bytes()
    model, offload = build_sharded_model(cfg, cfg.run_spec(1), pstate, devices)
    optimizer = build_run_optimizer(model, cfg, devices, fused=False)  # foreach on both sides: one arithmetic
    torch.manual_seed(1)
    batches = [checks.synthetic_batch(cfg, pstate) for _ in range(2)]
    losses, norms = [], []
    for _ in range(2):
        with step_autocast(cfg.train.bf16, pstate, s.device):
            result = train_step(model, optimizer, batches, pstate, devices.accelerator, cfg.optim.clip_grad)
        losses.append(result.loss.detach().float().cpu())
        norms.append(result.grad_norm.detach().float().cpu())
    out = {"losses": losses, "norms": norms, "params": [p.detach().float().cpu() for p in model.parameters()]}
    if on_host and isinstance(optimizer, HostAdamW):
        locked = [*optimizer.host_buffers(), *(offload.host_buffers() if offload else [])]
        moments = [t for held in optimizer.inner.state.values() for t in held.values() if torch.is_tensor(t)]
        out["host"] = {"unpinned_host_buffers": sum(not t.is_pinned() for t in locked) if s.device == "cuda" else None,
                       "allocated_host_bytes": _storage_span_bytes([*locked, *moments]),"optimizer_page_locked_bytes": optimizer.page_locked_bytes(),
                       "optimizer_host_bytes": optimizer.host_bytes(),
                       "offload_page_locked_bytes": offload.page_locked_bytes if offload else 0,
                       "offload_host_bytes": offload.host_bytes_reserved if offload else 0,
                       "caching_host_allocator_growth_bytes": None if before is None
                       else _host_pinned_allocator_bytes() - before}
    return out


def case_host_optimizer(checks, s) -> dict:
    cfg_on_host = checks.config(s, s.bitwise_length, HOST_OPTIMIZER, optimizer_cpu_offload=True)
    cfg_resident = checks.config(s, s.bitwise_length, HOST_OPTIMIZER)
    threads = torch.get_num_threads()
    try:
        with checks.deterministic_algorithms():
            want = _two_steps(checks, cfg_resident, s, on_host=False)
            got = _two_steps(checks, cfg_on_host, s, on_host=True)
    finally:
        torch.set_num_threads(threads)  # the host optimizer sets its step's threads on a GPU
    pairs = list(zip([*want["losses"], *want["norms"], *want["params"]], [*got["losses"], *got["norms"], *got["params"]]))
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in pairs)
    close = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in pairs)
    host = got["host"]
    one_micro_batch = checks.config(s, s.bitwise_length, {**HOST_OPTIMIZER, "global_batch_size": 1},
                                    optimizer_cpu_offload=True)  # the planner traces one (host bytes: the same)
    planned = checks.predicted(one_micro_batch, 1, s)["host_bytes_per_gpu"]
    measured = host["allocated_host_bytes"]  # the buffers' storages, not the optimizer's own count
    failures = [] if close else ["host_optimizer: differs from the resident optimizer"]
    if s.device == "cuda" and host["caching_host_allocator_growth_bytes"]:
        failures.append("host_optimizer: torch's caching host allocator grew (pin_memory=True somewhere)")
    if s.device == "cuda" and host["unpinned_host_buffers"]:
        failures.append(f"host_optimizer: {host['unpinned_host_buffers']} host buffers the GPU copies to are not "
                        "page-locked (is_pinned)")
    if s.device == "cuda" and not 1.0 <= planned / max(measured, 1) <= 1.05:
        failures.append(f"host_optimizer: the planner's host bytes ({planned:,}) over those allocated "
                        f"({measured:,}) are {planned / max(measured, 1):.4f}, outside [1.0, 1.05]")
    return {"bitwise_equal": diff == 0, "max_difference": diff, "losses": [float(x) for x in got["losses"]],
            **host, "planned_host_bytes_per_gpu": planned, "measured_host_bytes": measured,
            "planned_over_measured_host": planned / max(measured, 1), "failures": failures}


def _arenas_made_in_two_steps(checks, cfg, s) -> dict:
    """Start-up as the trainer's (the host arenas reserved and page-locked before step 1), then two steps: the
    arenas the steps still made (none: every kept tensor's shape was declared right), and the reservation's time."""
    torch.manual_seed(0)
    devices = Devices(torch.device(s.device), torch.device("cpu"))
    pstate = ParallelState(parallel_dims(cfg, 1), device_type=s.device)
    model, offload = build_sharded_model(cfg, cfg.run_spec(1), pstate, devices)
    began = time.monotonic()
    reserve_host_arenas(cfg, cfg.run_spec(1), model, offload, pstate.distributed)
    seconds, reserved = time.monotonic() - began, offload.arena_slots()
    optimizer = build_run_optimizer(model, cfg, devices)
    batch = checks.synthetic_batch(cfg, pstate)
    for _ in range(2):
        with step_autocast(cfg.train.bf16, pstate, s.device):
            train_step(model, optimizer, [batch], pstate, devices.accelerator, cfg.optim.clip_grad)
    made = [f"{kind} {list(shape)} {dtype}" for (shape, dtype, kind), n in offload.arena_slots().items()
            if reserved.get((shape, dtype, kind)) != n]
    out = {"reserved_host_bytes": offload.host_bytes_reserved, "reserve_seconds": seconds, "arenas_made_in_steps": made}
    offload.close()
    return out


def case_replay_kept_attention(checks, s) -> dict:
    replaying = checks.config(s, s.bitwise_length, REPLAY)
    with checks.deterministic_algorithms():
        base = checks.config(s, s.bitwise_length, REPLAY_BASE)
        want = checks.step_loss_and_grads(base, s)
        spread = checks.differences(want, checks.step_loss_and_grads(base, s))
        got = checks.step_loss_and_grads(replaying, s)
    diff = checks.differences(want, got)
    within = all(d <= 2 * limit for d, limit in zip(diff, spread))
    arenas = _arenas_made_in_two_steps(checks, replaying, s)
    failures = [] if within else ["replay_kept_attention: beyond the baseline's spread"]
    if arenas["arenas_made_in_steps"]:
        failures.append(f"replay_kept_attention: arenas made inside the steps: {arenas['arenas_made_in_steps']}")
    return {"baseline_bitwise_reproducible": all(d == 0 for d in spread), "bitwise_equal": all(d == 0 for d in diff),
            "within_baseline_spread": within, "max_difference": max(diff), "loss": float(got[0]), **arenas,
            "failures": failures}


def case_ring(checks, s) -> dict:
    cfg = checks.config(s, s.cp_length, checks.FULL_STACK, context_parallel_size=checks.WORLD_SIZE,
                        cp_comm_type="p2p")
    return checks.compare(cfg, checks.WORLD_SIZE, s)


def case_packed_documents(checks, s) -> dict:
    """One step of PACKED_DOCUMENTS whole documents a sample (as --packing documents gives them), on one device."""
    cfg = checks.config(s, s.bitwise_length, checks.FULL_STACK, packing="documents")
    torch.manual_seed(0)
    devices = Devices(torch.device(s.device), torch.device("cpu"))
    pstate = ParallelState(parallel_dims(cfg, 1), device_type=s.device)
    model, _ = build_sharded_model(cfg, cfg.run_spec(1), pstate, devices)
    optimizer = build_run_optimizer(model, cfg, devices)
    batch = checks.synthetic_batch(cfg, pstate)
    S, length = cfg.data.seq_length, cfg.data.seq_length // PACKED_DOCUMENTS
    positions = (torch.arange(S) % length).expand_as(batch.position_ids).contiguous()
    cu = tuple(range(0, batch.input_ids.numel() + 1, length))
    packed = type(batch)(batch.input_ids, batch.labels, positions, cu)
    if s.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with step_autocast(cfg.train.bf16, pstate, s.device):
        result = train_step(model, optimizer, [packed], pstate, devices.accelerator, cfg.optim.clip_grad)
    loss, norm = float(result.loss), float(result.grad_norm)
    plan = checks.predicted(cfg, 1, s)
    peak = torch.cuda.max_memory_allocated() if s.device == "cuda" else None
    finite = math.isfinite(loss) and math.isfinite(norm)
    return {"documents_per_sample": PACKED_DOCUMENTS, "loss": loss, "grad_norm": norm,
            "predicted_gpu_peak_bytes": plan["gpu_peak_bytes"], "allocated_peak_bytes": peak,
            "predicted_over_measured": None if peak is None else (plan["gpu_peak_bytes"] - plan["nccl_bytes"]) / peak,
            "failures": [] if finite else ["packed_documents: loss or gradient norm not finite"]}


def case_fa3_head_dim_128(checks, s) -> dict:
    """FA3 behind torch's flash kernel, where it is installed and the card takes it: packed causal calls and ring's
    unmasked calls at head dim 128 against the reference; torch's own kernels restored after."""
    from megatron_lc.attention import flash_impl, kernels

    T, H, Hkv, d = s.kernel_shape
    if s.device != "cuda":
        return {"skipped": "CUDA only", "failures": []}
    device = torch.device(s.device)
    try:
        running = flash_impl.activate_flash_impl("fa3", device)
    except flash_impl.FlashImplRefused as refused:
        return {"skipped": f"fa3: {refused}", "failures": []}
    if running != "fa3":  # not installed, or not for this card: warned, torch's own kernels kept
        return {"skipped": f"fa3 does not run here ({running} does)", "failures": []}
    try:
        kernel = kernels.KERNELS["sdpa_flash"]
        runs = {"packed": checks.check_kernel(kernel, s.dtype, s), "unmasked": checks.check_unmasked(kernel, s.dtype, s)}
    finally:
        flash_impl.activate_flash_impl("default", device)
    return {"running": running, "head_dim": d, **runs,
            "failures": [f"fa3_{name}" for name, r in runs.items() if not r["within_tolerance"]]}


def compute_seconds(checks, s, step) -> float:
    """The cases' GPU compute on one H100 by the time model (`step(cfg, world_size)`: one step's seconds)."""
    on_host = checks.config(s, s.bitwise_length, HOST_OPTIMIZER, optimizer_cpu_offload=True)
    ring = checks.config(s, s.cp_length, checks.FULL_STACK, context_parallel_size=checks.WORLD_SIZE,
                         cp_comm_type="p2p")
    return (2 * 2 * step(on_host, 1) + 3 * step(checks.config(s, s.bitwise_length, REPLAY_BASE), 1)
            + 2 * step(checks.config(s, s.bitwise_length, REPLAY), 1)
            + s.steps * step(ring, checks.WORLD_SIZE)
            + step(checks.config(s, s.bitwise_length, checks.FULL_STACK, packing="documents"), 1))


CASES = {"host_optimizer": case_host_optimizer, "replay_kept_attention": case_replay_kept_attention,
         "ring": case_ring, "packed_documents": case_packed_documents, "fa3_head_dim_128": case_fa3_head_dim_128}


def section_model_steps(checks, s) -> dict:
    """Every case, each failure recorded beside the others' results (`checks._case`)."""
    results = {}
    for name, case in CASES.items():
        results[name] = checks._case(name, lambda case=case: case(checks, s))
        checks._release()
    results["failures"] = [f for r in results.values() for f in r.get("failures", [])]
    return results
