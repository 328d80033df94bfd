"""Attention backends by name: `local` (no CP), `ulysses`, `untied_ulysses`."""

from __future__ import annotations

import torch

from megatron_lc.attention.kernels import select_kernel
from megatron_lc.attention.local import LocalAttention
from megatron_lc.attention.ulysses import UlyssesAttention, check_ulysses_shapes
from megatron_lc.attention.untied_ulysses import (
    UntiedUlyssesAttention,
    check_untied_shapes,
)
from megatron_lc.parallel_state import ParallelState

CP_IMPLS = ("ulysses", "untied_ulysses")


def build_attention_backend(name: str, head_dim: int, device: torch.device, pstate: ParallelState, *,
                            kernel: str = "auto", heads_per_stage: int | None = None,
                            num_heads: int, num_kv_heads: int):
    """The backend `name` on `device`, checked against the head counts and cp degree.

    `heads_per_stage` (Untied Ulysses only) defaults to the cp degree: one head per rank per stage.
    """
    local_kernel = select_kernel(device, kernel)
    if name == "local":
        return LocalAttention(head_dim, local_kernel)
    if name not in CP_IMPLS:
        raise ValueError(f"--cp-impl {name!r}: expected one of {', '.join(CP_IMPLS)}")
    check_ulysses_shapes(num_heads, num_kv_heads, pstate.cp_size)
    if name == "ulysses":
        return UlyssesAttention(head_dim, local_kernel, pstate.cp_group, pstate.cp_size)
    stage_heads = pstate.cp_size if heads_per_stage is None else heads_per_stage
    plan = check_untied_shapes(num_heads, num_kv_heads, pstate.cp_size, stage_heads)
    return UntiedUlyssesAttention(head_dim, local_kernel, pstate.cp_group, plan)
