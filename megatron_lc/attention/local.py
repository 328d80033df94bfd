"""The `local` attention backend: no context parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_lc.attention.kernels import Kernel, attention, kept_outputs
from megatron_lc.memory.kept_attention import KeptTensor
from megatron_lc.attention.rotary import apply_rotary


def project_qkv(x, wq, wk, wv, cos, sin, head_dim: int):
    """q, k (rotated) and v [B, S, heads, d] of the tokens in x [B, S, hidden]."""
    q = apply_rotary(F.linear(x, wq).unflatten(-1, (-1, head_dim)), cos, sin)
    k = apply_rotary(F.linear(x, wk).unflatten(-1, (-1, head_dim)), cos, sin)
    return q, k, F.linear(x, wv).unflatten(-1, (-1, head_dim))


@dataclass
class LocalAttention:
    """No context parallelism: every rank holds the whole sequence."""

    head_dim: int
    kernel: Kernel

    def kept_tensors(self, batch: int, tokens: int, num_heads: int, dtype: torch.dtype) -> list[KeptTensor]:
        """What a keeping block puts on the host for `batch` samples of `tokens` local tokens: every head of the
        local tokens (a ring's kernel attends the ring rank's tokens)."""
        return kept_outputs(batch * tokens, num_heads, self.head_dim, dtype)

    def __call__(self, x, wq, wk, wv, cos, sin, cu_seqlens, kept=None):
        B, S, _ = x.shape
        q, k, v = project_qkv(x, wq, wk, wv, cos, sin, self.head_dim)
        return attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens, self.kernel,
                         kept=kept).reshape(B, S, -1)
