"""The `local` attention backend: no context parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from megatron_lc.attention.kernels import Kernel, attention
from megatron_lc.attention.rotary import apply_rotary


@dataclass
class LocalAttention:
    """No context parallelism: every rank holds the whole sequence."""

    head_dim: int
    kernel: Kernel

    def __call__(self, x, wq, wk, wv, cos, sin, cu_seqlens):
        B, S, _ = x.shape
        d = self.head_dim
        q = apply_rotary(F.linear(x, wq).unflatten(-1, (-1, d)), cos, sin)
        k = apply_rotary(F.linear(x, wk).unflatten(-1, (-1, d)), cos, sin)
        v = F.linear(x, wv).unflatten(-1, (-1, d))
        return attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens, self.kernel).reshape(B, S, -1)
