"""The one way a run's model and optimizer are built, for the trainer, evaluate and the planner: meta-device
model -> context parallelism, memory stack, FSDP (`parallelize_llama`) -> real (sharded) weights; the
run's AdamW from its flags. The planner builds the same model and materializes it under fake tensors."""

from __future__ import annotations

import logging
import os

import torch

from megatron_lc.config import RunSpec, TrainConfig
from megatron_lc.devices import Devices
from megatron_lc.memory.kept_attention import ATTENTION_KIND
from megatron_lc.memory.offload import OffloadScheduler, arena_bytes
from megatron_lc.models.llama import Transformer, build_model
from megatron_lc.models.llama.model import LlamaConfig
from megatron_lc.models.llama.parallelize import ParallelizeOptions, materialize, parallelize_llama
from megatron_lc.parallel_state import ParallelState, host_threads_per_process, local_processes
from megatron_lc.training.optim import HostAdamW, build_optimizer
from megatron_lc.training.preflight import check_host_before_step_one

LOG = logging.getLogger(__name__)


def build_parallel_model(model_config: LlamaConfig, opts: ParallelizeOptions, pstate: ParallelState,
                         devices: Devices) -> tuple[Transformer, OffloadScheduler | None]:
    """A run's model on the meta device, parallelized as `opts` say, and its offload scheduler."""
    model = build_model(model_config, device="meta", dtype=torch.float32)  # fp32 master weights, also with --bf16
    return model, parallelize_llama(model, pstate, opts, devices)


def build_sharded_model(cfg: TrainConfig, spec: RunSpec, pstate: ParallelState,
                        devices: Devices) -> tuple[Transformer, OffloadScheduler | None]:
    """The run's model (`spec`) on this rank with its (sharded) initial weights, and its offload scheduler."""
    model, offload = build_parallel_model(spec.model, spec.parallelize, pstate, devices)
    materialize(model, devices, seed=cfg.train.seed, fsdp_cpu_offload=spec.parallelize.fsdp.cpu_offload)
    return model, offload


def reserve_host_arenas(cfg: TrainConfig, spec: RunSpec, model: Transformer, offload: OffloadScheduler | None,
                        distributed: bool) -> None:
    """Weigh what this rank's offload arenas (block inputs, kept attention outputs) and host optimizer will hold
    against the node (every rank together), then make and page-lock the arenas: all before step 1, so that no
    step page-locks anything (minutes for a terabyte, logged). `distributed`: the run is sharded (bf16 block
    inputs under --bf16; in one process autocast leaves them fp32)."""
    arenas = {}
    if offload is not None:
        compute_dtype = torch.bfloat16 if cfg.train.bf16 else torch.float32
        block = (cfg.data.micro_batch_size, cfg.data.seq_length // spec.dims.cp, spec.model.hidden_size)
        arenas = spec.parallelize.memory.host_arenas(model, offload, block, compute_dtype if distributed
                                                     else torch.float32, compute_dtype)
    kept = {key: slots for key, slots in arenas.items() if key[2] == ATTENTION_KIND}
    check_host_before_step_one(cfg, model, arena_bytes(arenas) - arena_bytes(kept), arena_bytes(kept))
    if offload is not None:
        offload.reserve(arenas)


def build_run_optimizer(model: torch.nn.Module, cfg: TrainConfig, devices: Devices,
                        fused: bool | None = None) -> torch.optim.AdamW | HostAdamW:
    """The run's AdamW (--lr, --weight-decay, --adam-beta1/2, --adam-eps); fused on CUDA unless `fused` says; with
    --optimizer-cpu-offload its state and step on the host (page-locked when the accelerator is CUDA; there the step
    runs `host_threads_per_process` threads)."""
    o = cfg.optim
    host = devices.host if o.optimizer_cpu_offload else None
    if host is not None and devices.is_cuda:  # the host step's threads (torchrun leaves each process one)
        threads = host_threads_per_process()
        torch.set_num_threads(threads)
        LOG.info("host optimizer: its step runs %d threads a process (%d cores here, %d processes on this node)",
                 threads, os.cpu_count() or 1, local_processes())
    return build_optimizer(model, lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
                           eps=o.adam_eps, fused=fused, host=host, page_locked=devices.is_cuda)
