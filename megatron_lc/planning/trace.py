"""One training step of our own code, traced with fake tensors on a fake world, for rank 0.

The step is the real one: the model is built on meta, `parallelize_llama` applies
context parallelism, the memory stack and FSDP2, `materialize` allocates the sharded
weights, the optimizer state exists (as from step 2 on), and `train_step` runs
forward/backward over the micro-batches, clips and steps AdamW. Tensors are fake
(shapes and dtypes, no data), so the big matmuls cost nothing; the accelerator is a
fake `cpu` and the offload host a fake `meta`, so the tracker tells GPU bytes from host
bytes. For a CUDA target the attention kernels are the stand-ins of `gpu_allocations.py`.

The same `run_tracked_step` drives the real CPU runs that validate the planner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_lc.config import TrainConfig
from megatron_lc.data.loader import Batch
from megatron_lc.devices import Devices
from megatron_lc.memory.tiling import every_rank
from megatron_lc.models.llama.parallelize import materialize
from megatron_lc.parallel_state import ParallelDims, ParallelState
from megatron_lc.planning.fake_world import fake_process_group, representative_ranks, representative_tile_bounds
from megatron_lc.planning.gpu_allocations import (
    BufferNamer,
    cuda_rms_norm,
    planned_kernel_name,
    planned_kernels,
)
from megatron_lc.planning.tracker import TimelineAnalysis, make_tracker
from megatron_lc.training.build import build_parallel_model, build_run_optimizer, build_sharded_model
from megatron_lc.training.optim import HostAdamW
from megatron_lc.training.step import step_autocast, train_step

PLANNER_DEVICES = Devices(accelerator=torch.device("cpu"), host=torch.device("meta"))


@dataclass
class StepTrace:
    """The timeline of one traced step and what it was traced with."""

    analysis: TimelineAnalysis
    num_layers: int
    micro_batches: int
    offload_host_peak: int
    """The offload scheduler's own count of host bytes (cross-checks the tracked host peak)."""


def micro_batches_to_trace(cfg: TrainConfig, dp: int) -> int:
    """Micro-batches per step, capped at 2: from the second on, each holds the same memory."""
    d = cfg.data
    if d.global_batch_size is None:
        return 1
    return min(2, d.global_batch_size // (d.micro_batch_size * dp))


def synthetic_micro_batch(cfg: TrainConfig, cp: int, device: torch.device) -> Batch:
    """One micro-batch of this rank's shape (one document per sample), on the host `device`."""
    B, S = cfg.data.micro_batch_size, cfg.data.seq_length
    tokens = torch.zeros(B, S // cp, dtype=torch.int64, device=device)
    positions = torch.zeros(B, S // cp, dtype=torch.int64, device=device)
    return Batch(tokens, tokens.clone(), positions, tuple(range(0, B * S + 1, S)))


def initialize_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state as a first step would (zero gradients, one step), then drop the gradients."""
    initialize_gradients(model, optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def initialize_gradients(model: torch.nn.Module, optimizer) -> None:
    """Zero gradients of every trained parameter, where the optimizer takes them."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
            if isinstance(optimizer, HostAdamW):  # as a backward hands it a final gradient
                optimizer.take_gradient(p)


def run_tracked_step(tracker, model, optimizer, micro_batches, pstate: ParallelState, devices: Devices,
                     clip_grad: float, bf16: bool = False) -> TimelineAnalysis:
    """One `train_step` under `tracker` (and the trainer's autocast); returns the analysed timeline."""
    with tracker, step_autocast(bf16, pstate, devices.accelerator.type):
        train_step(model, optimizer, micro_batches, pstate, devices.accelerator, clip_grad)
    return tracker.analyse()


def measure_real_step(cfg: TrainConfig, pstate: ParallelState, batch: Batch,
                      devices: Devices) -> tuple[TimelineAnalysis, int]:
    """One real training step of `cfg` on this rank, tracked as `trace_step` tracks a fake one.

    Returns the analysed timeline and the host peak: the offload scheduler's, plus the host optimizer's bytes
    (--optimizer-cpu-offload; 0 without either). Where host and accelerator are one device (CPU runs), both are
    tracked too; a probe of their bytes moves them from the accelerator's side to the host's.
    """
    model, offload = build_sharded_model(cfg, cfg.run_spec(pstate.dims.world_size), pstate, devices)
    optimizer = build_run_optimizer(model, cfg, devices, fused=False)
    initialize_optimizer_state(model, optimizer)
    host_optimizer = optimizer.host_bytes() if isinstance(optimizer, HostAdamW) else 0
    scratch = host_step_scratch(model, optimizer) if host_optimizer else 0
    probe = None
    if (offload or host_optimizer) and devices.host == devices.accelerator:
        probe = lambda: (offload.host_bytes_reserved if offload else 0) + host_optimizer  # noqa: E731
    tracker = make_tracker(model, optimizer, probe, extra=(batch.input_ids, batch.labels, batch.position_ids))
    analysis = run_tracked_step(tracker, model, optimizer, [batch], pstate, devices, cfg.optim.clip_grad,
                                cfg.train.bf16)
    if host_optimizer and devices.host == devices.accelerator:  # the host step's scratch is not the accelerator's
        phases = {k: v for k, v in analysis.phase_peaks.items() if k != "optimizer"}
        analysis = dataclasses.replace(analysis, peak=max(phases.values(), key=lambda p: p.total))
    return analysis, (offload.host_bytes_peak if offload else 0) + host_optimizer + scratch


def host_step_scratch(model: torch.nn.Module, optimizer: HostAdamW) -> int:
    """Bytes the host optimizer's step allocates beyond what it holds (foreach AdamW's temporaries), measured by
    MemTracker on one step of zero gradients (state and weights put back)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    saved = [{k: v.clone() for k, v in s.items()} for s in optimizer.inner.state.values()]
    weights = [m.clone() for m in optimizer.masters]
    initialize_gradients(model, optimizer)
    tracker = MemTracker()
    tracker.track_external(optimizer.inner, *optimizer.masters, *optimizer.gradient_buffers())
    with tracker:
        before = sum(d["Total"] for d in tracker.get_tracker_snapshot("current").values())
        optimizer.inner.step()
        peak = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    for state, kept in zip(optimizer.inner.state.values(), saved):
        state.update(kept)
    for master, kept in zip(optimizer.masters, weights):
        master.copy_(kept)
    optimizer.zero_grad(set_to_none=True)
    return peak - before


def parallel_dims(cfg: TrainConfig, world_size: int) -> ParallelDims:
    """The run's parallel degrees."""
    return cfg.parallel_dims(world_size)


def trace_step(cfg: TrainConfig, world_size: int, num_layers: int, device: str = "cuda",
               flash_attn_installed: bool = False, flash_impl: str = "default", exact: bool = False) -> StepTrace:
    """Trace one step of `cfg` with `num_layers` blocks on rank 0 of `world_size`, planning for `device`
    (with flash-attn installed there or not, and `flash_impl` behind torch's flash operators: they decide what
    `auto` runs); per-rank loops over two ranks (`representative_ranks`), or, `exact`, over every rank."""
    namer = BufferNamer()
    compute_dtype = torch.bfloat16 if cfg.train.bf16 else torch.float32  # what attention sees (--bf16: autocast)
    kernel = planned_kernel_name(cfg.parallel.attention_kernel, device, compute_dtype, flash_attn_installed,
                                 flash_impl)
    spec = cfg.run_spec(world_size)
    opts = spec.parallelize
    opts = dataclasses.replace(opts, cp=dataclasses.replace(opts.cp, kernel=kernel), kernels=planned_kernels(namer),
                               tile_bounds=representative_tile_bounds, fp32_out_gemm=device == "cuda",
                               rank_loop=every_rank if exact else representative_ranks,
                               rms_norm=cuda_rms_norm if device == "cuda" else F.rms_norm)
    model_config = dataclasses.replace(spec.model, num_layers=num_layers)
    with fake_process_group(world_size):
        pstate = ParallelState(spec.dims, device_type="cpu")
        model, offload = build_parallel_model(model_config, opts, pstate, PLANNER_DEVICES)
        with FakeTensorMode(allow_non_fake_inputs=True):
            materialize(model, PLANNER_DEVICES, cfg.train.seed)
            optimizer = build_run_optimizer(model, cfg, PLANNER_DEVICES, fused=device == "cuda")
            initialize_optimizer_state(model, optimizer)
            count = micro_batches_to_trace(cfg, pstate.dp_size)
            batches = [synthetic_micro_batch(cfg, pstate.cp_size, PLANNER_DEVICES.host) for _ in range(count)]
            tracker = make_tracker(model, optimizer)
            namer.tracker = tracker
            analysis = run_tracked_step(tracker, model, optimizer, batches, pstate, PLANNER_DEVICES,
                                        cfg.optim.clip_grad, cfg.train.bf16)
    return StepTrace(analysis, num_layers, count, offload.host_bytes_peak if offload else 0)
