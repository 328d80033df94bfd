"""Rotary position embeddings in the rotate-half convention of `transformers`, with Llama 3 scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent rotary scaling (rope_type 'llama3' in transformers)."""

    factor: float = 8.0
    """Divisor of the low frequencies."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_position_embeddings / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """Context length the base model was trained at."""


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None, device=None) -> torch.Tensor:
    """Inverse frequencies [d/2], with Llama 3 scaling applied when given."""
    d = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    if scaling is None:
        return inv_freq.float()
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    # Between the two wavelengths, interpolate smoothly between scaled and unscaled.
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(medium, smoothed, scaled).float()


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and sin tables [..., d] for the given positions (rotate-half layout)."""
    freqs = position_ids.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, H, d] by position; cos/sin are [..., T, d]. The result keeps x's dtype
    (under autocast the projections are bf16 while the tables are fp32), as in `transformers`."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)
