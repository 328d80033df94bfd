"""Which kernel runs: `--attention-kernel NAME` on a device, for inputs of a dtype, with FA3/FA4 behind torch's
flash operators or not (`attention/flash_impl.py`)."""

from __future__ import annotations

from typing import Mapping

import torch

from megatron_lc.attention.flash_impl import FLASH_IMPLS, active_flash_impl
from megatron_lc.attention.kernels import (
    CUDA_KERNELS,
    FLASH_ATTN_PROBLEM,
    FLASH_DTYPES,
    KERNELS,
    Kernel,
    flash_attn_available,
)


def _by_dtype(low: Kernel, full: Kernel) -> Kernel:
    """`low` for fp16/bf16 inputs, `full` otherwise: what `auto` runs on CUDA (flash never sees fp32)."""

    def forward(q, k, v, cu_seqlens, scale=None, **segmentation):
        return (low if q.dtype in FLASH_DTYPES else full).forward(q, k, v, cu_seqlens, scale, **segmentation)

    def backward(dout, q, k, v, out, lse, cu_seqlens, scale=None, state=(), **segmentation):
        return (low if q.dtype in FLASH_DTYPES else full).backward(dout, q, k, v, out, lse, cu_seqlens, scale, state,
                                                                   **segmentation)

    return Kernel(f"{low.name}|{full.name}", forward, backward)


def select_kernel(device: torch.device, name: str = "auto", table: Mapping[str, Kernel] | None = None) -> Kernel:
    """The kernel for `device`, or the one named, from `table` (default `KERNELS`; the planner passes one with
    its stand-ins).

    `auto` on CUDA: torch's flash kernel when FA3/FA4 is behind it (`activate_flash_impl`), else
    flash-attn (else torch's flash kernel) for fp16/bf16 inputs and torch's
    memory-efficient kernel for fp32, decided per call from the inputs' dtype (autocast
    decides it at run time); on other devices, torch's CPU flash kernel.
    """
    table = KERNELS if table is None else table
    if name == "auto":
        if device.type != "cuda":
            return table[resolve_kernel_name(device.type, name, torch.float32, flash_attn_available())]
        low, full = (table[resolve_kernel_name("cuda", name, dtype, flash_attn_available(), active_flash_impl())]
                     for dtype in (torch.bfloat16, torch.float32))
        return _by_dtype(low, full)
    if name not in table:
        raise ValueError(f"attention kernel {name!r}: expected one of auto, {', '.join(table)}")
    if name == "flash_attn" and not flash_attn_available():
        raise ImportError(f"attention kernel 'flash_attn' was asked for but {FLASH_ATTN_PROBLEM}; "
                          "or use 'auto' to fall back to torch's kernels")
    if name in CUDA_KERNELS and device.type != "cuda":
        raise ValueError(f"attention kernel {name!r} needs a CUDA device, got {device}")
    return table[name]


def resolve_kernel_name(device_type: str, name: str, dtype: torch.dtype, flash_attn_installed: bool,
                        flash_impl: str = "default") -> str:
    """The kernel `select_kernel(name)` runs for inputs of `dtype` (what the planner models); with FA3 or FA4
    behind torch's flash operators (`flash_impl`), `auto` runs those."""
    if name != "auto":
        return name
    if device_type != "cuda":
        return "cpu_flash"
    if dtype not in FLASH_DTYPES:
        return "sdpa_efficient"
    if flash_impl != "default":
        return "sdpa_flash"
    return "flash_attn" if flash_attn_installed else "sdpa_flash"


def running_kernel(device_type: str, name: str, dtype: torch.dtype) -> str:
    """What `--attention-kernel NAME` runs in this process, in words: the kernel, and FA3/FA4 when activated
    behind torch's flash operators (what rank 0 prints and metrics.jsonl records)."""
    impl = active_flash_impl()
    kernel = resolve_kernel_name(device_type, name, dtype, flash_attn_available(), impl)
    return f"{kernel} ({FLASH_IMPLS[impl][0]})" if impl != "default" and kernel == "sdpa_flash" else kernel
