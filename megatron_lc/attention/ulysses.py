"""Ulysses context parallelism: sequence-sharded <-> head-sharded around local attention.

Each cp rank holds S/cp tokens of every sequence. Before attention one all-to-all
scatters heads and gathers the sequence, so each rank runs full-sequence attention on
H/cp heads (documents and causality intact); a second all-to-all brings the output back
to the rank's own tokens. With grouped-query attention and fewer kv heads than ranks,
kv heads are replicated before the exchange; autograd sums their gradients back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lc.attention.kernels import Kernel, attention, kept_outputs
from megatron_lc.attention.local import project_qkv
from megatron_lc.memory.kept_attention import KeptTensor


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Exchange x's leading-dimension chunks: chunk j goes to rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous like x: the collective writes in memory order
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_head_layout(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[B, S/cp, H, d] on every rank -> [B, S, H/cp, d] (rank r holds head chunk r)."""
    B, s, H, d = x.shape
    chunks = x.reshape(B, s, cp, H // cp, d).permute(2, 0, 1, 3, 4)  # [cp, B, s, H/cp, d]
    received = _all_to_all(chunks, group)  # chunk j: rank j's tokens, my heads
    return received.permute(1, 0, 2, 3, 4).reshape(B, cp * s, H // cp, d)


def head_to_seq_layout(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[B, S, H/cp, d] -> [B, S/cp, H, d]: the inverse of `seq_to_head_layout`."""
    B, S, h, d = x.shape
    chunks = x.reshape(B, cp, S // cp, h, d).permute(1, 0, 2, 3, 4)  # [cp, B, S/cp, h, d]
    received = _all_to_all(chunks, group)  # chunk j: my tokens, rank j's heads
    return received.permute(1, 2, 0, 3, 4).reshape(B, S // cp, cp * h, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        return seq_to_head_layout(x, group, cp)

    @staticmethod
    def backward(ctx, grad):
        return head_to_seq_layout(grad, ctx.group, ctx.cp), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        return head_to_seq_layout(x, group, cp)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_head_layout(grad, ctx.group, ctx.cp), None, None


def gather_sequence(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Differentiable [B, S/cp, H, d] -> [B, S, H/cp, d]."""
    return _SeqToHead.apply(x, group, cp)


def scatter_sequence(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Differentiable [B, S, H/cp, d] -> [B, S/cp, H, d]."""
    return _HeadToSeq.apply(x, group, cp)


def kv_replication(num_kv_heads: int, cp: int) -> int:
    """How many times each kv head is repeated so every rank receives one (1 when Hkv >= cp)."""
    return cp // num_kv_heads if num_kv_heads < cp else 1


def check_ulysses_shapes(num_heads: int, num_kv_heads: int, cp: int, seq_length: int | None = None) -> None:
    """Configuration-time check: heads and sequence must split evenly over cp ranks."""
    if num_heads % cp:
        raise ValueError(f"--num-attention-heads {num_heads} is not divisible by --context-parallel-size {cp} "
                         "(Ulysses gives each rank heads/cp heads; ring attention has no such limit: --cp-comm-type p2p, "
                         "or a2a+p2p with a smaller all-to-all degree)")
    if num_kv_heads % cp and cp % num_kv_heads:
        raise ValueError(f"--num-query-groups {num_kv_heads} and --context-parallel-size {cp}: one must divide "
                         "the other (kv heads are split, or replicated when fewer than cp)")
    if seq_length is not None and seq_length % cp:
        raise ValueError(f"--seq-length {seq_length} is not divisible by --context-parallel-size {cp}")


@dataclass
class UlyssesAttention:
    """The `ulysses` backend: local tokens in, full-sequence attention on H/cp heads, local tokens out."""

    head_dim: int
    kernel: Kernel
    group: object
    cp: int

    def kept_tensors(self, batch: int, tokens: int, num_heads: int, dtype: torch.dtype) -> list[KeptTensor]:
        """What a keeping block puts on the host for `batch` samples of `tokens` local tokens: H/cp heads of the
        gathered sequence (the group's tokens)."""
        return kept_outputs(batch * tokens * self.cp, num_heads // self.cp, self.head_dim, dtype)

    def __call__(self, x, wq, wk, wv, cos, sin, cu_seqlens, kept=None):
        B, s, _ = x.shape
        q, k, v = project_qkv(x, wq, wk, wv, cos, sin, self.head_dim)
        rep = kv_replication(k.shape[2], self.cp)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = (gather_sequence(t, self.group, self.cp) for t in (q, k, v))
        out = attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens, self.kernel, kept=kept)
        out = scatter_sequence(out.unflatten(0, (B, s * self.cp)), self.group, self.cp)
        return out.reshape(B, s, -1)
