"""Attention backends by name: `local` (no CP), `ulysses`, `untied_ulysses`, each with
ring attention under it when the context-parallel layout has a ring."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from megatron_lc.attention.context_parallel import CP_IMPLS
from megatron_lc.attention.kernel_selection import select_kernel
from megatron_lc.attention.kernels import Kernel
from megatron_lc.attention.local import LocalAttention
from megatron_lc.attention.ring import RingAttention
from megatron_lc.attention.ulysses import UlyssesAttention, check_ulysses_shapes
from megatron_lc.attention.untied_plan import check_untied_shapes
from megatron_lc.attention.untied_ulysses import UntiedUlyssesAttention
from megatron_lc.memory.tiling import RankLoop, TileBounds, every_rank, tile_bounds
from megatron_lc.parallel_state import ParallelState



def build_attention_backend(name: str, head_dim: int, device: torch.device, pstate: ParallelState, *,
                            kernel: str = "auto", heads_per_stage: int | None = None,
                            overlap: bool = False, untied_backward: str = "fast", ring_kv_grads: str = "overlapped",
                            documents: str = "sequence",
                            num_heads: int, num_kv_heads: int, seq_length: int | None = None,
                            kernels: Mapping[str, Kernel] | None = None, tile_bounds: TileBounds = tile_bounds,
                            fp32_out_gemm: bool | None = None, rank_loop: RankLoop = every_rank):
    """The backend `name` on `device`, checked against the head counts and the cp layout.

    `name` is the all-to-all level (`--cp-impl`); with a ring (`--cp-comm-type p2p` or
    `a2a+p2p`) its local kernel is ring attention over `pstate.ring_group`, which needs
    the `seq_length` it cuts into chunks, by `documents` (`--cp-document-layout`). `heads_per_stage` (Untied Ulysses only)
    defaults to the all-to-all degree: one head per rank per stage; `overlap` pipelines its stages and
    `untied_backward` what its backward holds; `ring_kv_grads` how the ring's dK/dV accumulators travel.
    `kernels` is the table `kernel` is looked up in (default: the real kernels; the planner passes its
    stand-ins), `tile_bounds` the tile policy of Untied Ulysses' row-chunk loops and of the ring's in-place
    rotation, `rank_loop` that of its per-rank projection loops and of the ring's steps, and `fp32_out_gemm` how
    it sums 16-bit products in fp32 (`tiling.addmm_fp32_`; None: the device's way).
    """
    local_kernel = select_kernel(device, kernel, kernels)
    if name == "local" or pstate.cp_size == 1:
        return LocalAttention(head_dim, local_kernel)
    if name not in CP_IMPLS:
        raise ValueError(f"--cp-impl {name!r}: expected one of {', '.join(CP_IMPLS)}")
    layout = dataclasses.replace(pstate.context_layout, documents=documents)
    if layout.ring_size > 1:
        if seq_length is None:
            raise ValueError("ring attention needs the sequence length it cuts into chunks")
        local_kernel = RingAttention(local_kernel, pstate.ring_group, layout, seq_length, kv_grads=ring_kv_grads,
                                     tile_bounds=tile_bounds, rank_loop=rank_loop).as_kernel()
    if layout.a2a_size == 1:
        return LocalAttention(head_dim, local_kernel)  # the ring alone: every head on every rank
    return _all_to_all_backend(name, head_dim, local_kernel, pstate, heads_per_stage, overlap, untied_backward, num_heads,
                               num_kv_heads, tile_bounds, fp32_out_gemm, rank_loop)


def _all_to_all_backend(name: str, head_dim: int, kernel: Kernel, pstate: ParallelState,
                        heads_per_stage: int | None, overlap: bool, untied_backward: str, num_heads: int, num_kv_heads: int,
                        bounds: TileBounds, fp32_out_gemm: bool | None, rank_loop: RankLoop):
    a2a = pstate.context_layout.a2a_size
    check_ulysses_shapes(num_heads, num_kv_heads, a2a)
    if name == "ulysses":
        return UlyssesAttention(head_dim, kernel, pstate.a2a_group, a2a)
    plan = check_untied_shapes(num_heads, num_kv_heads, a2a, a2a if heads_per_stage is None else heads_per_stage)
    return UntiedUlyssesAttention(head_dim, kernel, pstate.a2a_group, plan, overlap=overlap, backward_memory=untied_backward,
                                  tile_bounds=bounds, fp32_out_gemm=fp32_out_gemm, rank_loop=rank_loop)
