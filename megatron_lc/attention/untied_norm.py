"""The block's RMSNorm folded into Untied Ulysses' projections (`attention/untied_ulysses.py`): the normed input
is never stored; its rstd is computed, and its backward applied in place, a row chunk at a time in fp32."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lc.memory.tiling import TileBounds

DX_CHUNK_ROWS = 8192
"""Rows of dx summed at a time in fp32 (8192 x 4096 x 4 bytes = 128 MiB for Llama3-8B)."""


@dataclass
class InputNorm:
    """The block's RMSNorm folded into the projections: xn = x * rstd * weight is never stored;
    every projection multiplies x by weight-scaled rows and scales its output rows by rstd."""

    weight: torch.Tensor  # [hidden]
    rstd: torch.Tensor  # [B, s] fp32

    @staticmethod
    def of(x: torch.Tensor, weight: torch.Tensor, eps: float | None, bounds: TileBounds) -> InputNorm:
        """rstd = 1 / sqrt(mean(x^2) + eps) per token, in fp32, a row chunk at a time (no fp32 copy of x)."""
        eps = torch.finfo(x.dtype).eps if eps is None else eps  # F.rms_norm's default
        rstd = torch.empty(x.shape[:2], dtype=torch.float32, device=x.device)
        for b in range(x.shape[0]):
            for start, end in bounds(x.shape[1], -(-x.shape[1] // DX_CHUNK_ROWS)):
                rstd[b, start:end] = x[b, start:end].to(torch.float32).square().mean(-1).add_(eps).rsqrt_()
        return InputNorm(weight, rstd)


def rms_norm_backward_(grad: torch.Tensor, x: torch.Tensor, norm: InputNorm, bounds: TileBounds) -> torch.Tensor:
    """RMSNorm's backward: `grad` (of xn) becomes the gradient of x, in place, a row chunk at a time in
    fp32; returns the weight's gradient (fp32). dx = rstd * (g - xh * mean(g * xh)), g = grad * w, xh = x * rstd."""
    w = norm.weight.to(torch.float32)
    dweight = torch.zeros_like(w)
    for b in range(x.shape[0]):
        for start, end in bounds(x.shape[1], -(-x.shape[1] // DX_CHUNK_ROWS)):
            rstd = norm.rstd[b, start:end].unsqueeze(-1)
            xh = x[b, start:end].to(torch.float32) * rstd
            dn = grad[b, start:end].to(torch.float32)
            dweight += (dn * xh).sum(0)
            g = dn * w
            grad[b, start:end].copy_(rstd * (g - xh * (g * xh).mean(-1, keepdim=True)))
    return dweight
