"""How every entry point that runs the model starts (training, evaluation, the passkey test): after its checks
and before the model is built, in this order, the CUDA allocator's settings (before CUDA initialises), the
device, the flash implementation (before any attention and any process group), the process group, the mesh,
and the step's collectives warmed up (NCCL's connections before PyTorch's cache fills the card)."""

from __future__ import annotations

import os

import torch

from megatron_lc.config import TrainConfig
from megatron_lc.devices import Devices, resolve_devices, set_cuda_allocator_settings
from megatron_lc.parallel_state import LaunchInfo, ParallelDims, ParallelState, init_distributed, warm_up_collectives
from megatron_lc.training.preflight import activate_flash


def nccl_version() -> str:
    version = torch.cuda.nccl.version()  # (major, minor, patch[, suffix]); an int in old torch
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def nccl_settings_line(warm_up_bytes: int) -> str:
    """What NCCL ran with: its version, NVLS (NVLink SHARP buffers, which the memory plan leaves out and
    NCCL turns on by default on NVSwitch systems), and the device memory the warm-up collectives took."""
    nvls = os.environ.get("NCCL_NVLS_ENABLE")
    nvls_text = (f"NCCL_NVLS_ENABLE={nvls}" if nvls is not None
                 else "NCCL_NVLS_ENABLE unset (NCCL's default: on where NVSwitch has it)")
    return (f"NCCL {nccl_version()} | {nvls_text} | warm-up collectives took {warm_up_bytes / 2**30:.2f} GiB "
            "of device memory")


def warmed_up_collectives(pstate: ParallelState, devices: Devices, rank: int, say_nccl_settings: bool = True) -> None:
    """Warm up the step's collectives; on CUDA rank 0 prints NCCL's settings and the device memory the warm-up
    took (the driver's free bytes), unless `say_nccl_settings` is off (an entry point whose stdout is JSON)."""
    free_before = torch.cuda.mem_get_info(devices.accelerator)[0] if devices.is_cuda else 0
    warm_up_collectives(pstate, devices.accelerator)
    if devices.is_cuda and rank == 0 and say_nccl_settings:
        print(nccl_settings_line(free_before - torch.cuda.mem_get_info(devices.accelerator)[0]), flush=True)


def start_processes(cfg: TrainConfig, dims: ParallelDims, launch: LaunchInfo, say_nccl_settings: bool = True
                    ) -> tuple[Devices, ParallelState]:
    """This process's devices and its place in the run's mesh (`dims`, the run spec's), started as the module
    docstring says."""
    set_cuda_allocator_settings()  # torch reads it when CUDA initialises
    devices = resolve_devices(cfg.train.device, launch.local_rank)
    if devices.is_cuda:
        torch.cuda.set_device(devices.accelerator)
        activate_flash(cfg, devices.accelerator)  # before any attention and any process group
    init_distributed(devices.accelerator, timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    pstate = ParallelState(dims, devices.accelerator.type)
    warmed_up_collectives(pstate, devices, launch.rank, say_nccl_settings)
    return devices, pstate
