"""The one way a run's model is built, for the trainer, evaluate and the planner: meta-device model ->
context parallelism, memory stack, FSDP (`parallelize_llama`) -> real (sharded) weights."""

from __future__ import annotations

import torch

from megatron_lc.config import TrainConfig
from megatron_lc.devices import Devices
from megatron_lc.memory.offload import OffloadScheduler
from megatron_lc.models.llama import Transformer, build_model
from megatron_lc.models.llama.model import LlamaConfig
from megatron_lc.models.llama.parallelize import materialize, parallelize_llama
from megatron_lc.parallel_state import ParallelState


def build_sharded_model(cfg: TrainConfig, model_config: LlamaConfig, pstate: ParallelState,
                        devices: Devices) -> tuple[Transformer, OffloadScheduler | None]:
    """The run's model on this rank (fp32 master weights, also with --bf16) and its offload scheduler."""
    model = build_model(model_config, device="meta", dtype=torch.float32)
    offload = parallelize_llama(model, pstate, cfg.parallelize_options(), devices)
    materialize(model, devices, seed=cfg.train.seed, fsdp_cpu_offload=cfg.parallel.fsdp_cpu_offload)
    return model, offload
