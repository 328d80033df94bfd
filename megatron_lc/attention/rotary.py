"""Rotary position embeddings in the rotate-half convention of `transformers`, with the context-extension
scalings transformers computes: llama3 (frequency-dependent), linear (position interpolation), yarn
(NTK-by-parts with an attention factor on cos/sin) and dynamic NTK (the base raised by the sequence's
length over `max_position_embeddings`; transformers takes the length from the largest position it
sees, the model here from the sample length it is built for, which is the same without
`--reset-position-ids`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


ROPE_TYPES = ("llama3", "linear", "yarn", "dynamic")
"""The scalings implemented, by transformers' `rope_type` names."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling for a context longer than the base model's (transformers' `rope_scaling`)."""

    factor: float = 8.0
    """Divisor of the low frequencies (llama3), of every frequency (linear), of the interpolated ones (yarn)."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_position_embeddings / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """Context length the base model was trained at."""
    rope_type: str = "llama3"
    """llama3, linear, yarn or dynamic."""
    beta_fast: float = 32.0
    """yarn: rotations per original context above which a frequency is kept (extrapolated)."""
    beta_slow: float = 1.0
    """yarn: rotations per original context below which a frequency is divided by `factor` (interpolated)."""
    attention_factor: float | None = None
    """yarn: the factor on cos and sin; None: 0.1 ln(factor) + 1, as the YaRN paper and transformers."""

    def validate(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope scaling type {self.rope_type!r}: expected one of {', '.join(ROPE_TYPES)}")
        if self.factor <= 0 or self.original_max_position_embeddings < 1:
            raise ValueError(f"rope scaling factor {self.factor} and original positions "
                             f"{self.original_max_position_embeddings} must be positive")

    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (yarn's attention factor; 1 otherwise)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None, device=None,
                  seq_length: int | None = None, max_positions: int | None = None) -> torch.Tensor:
    """Inverse frequencies [d/2], scaled when `scaling` is given (dynamic NTK: for sequences of `seq_length`
    tokens against `max_positions`, the model's max_position_embeddings)."""
    d = head_dim
    if scaling is not None and scaling.rope_type == "dynamic":
        if seq_length is None or max_positions is None:
            raise ValueError("dynamic NTK scaling needs the sequence length and max_position_embeddings")
        length = max(seq_length, max_positions)
        theta = theta * ((scaling.factor * length / max_positions) - (scaling.factor - 1)) ** (d / (d - 2))
        scaling = None
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    if scaling is None:
        return inv_freq.float()
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).float()
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, d, theta, scaling).float()
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


def _yarn_inv_freq(inv_freq: torch.Tensor, d: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """NTK-by-parts: frequencies that turn more than beta_fast times over the original context are kept, those
    turning fewer than beta_slow times are divided by the factor, a linear ramp between (correction range
    rounded outwards, as transformers' default `truncate`)."""
    def dimension(rotations: float) -> float:  # the dimension whose wavelength makes `rotations` turns
        return d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dimension(s.beta_fast)), 0)
    high = min(math.ceil(dimension(s.beta_slow)), d - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(d // 2, dtype=torch.float64, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, factor: float = 1.0):
    """cos and sin tables [..., d] for the given positions (rotate-half layout), times `factor` (yarn's)."""
    freqs = position_ids.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    if factor != 1.0:
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, H, d] by position; cos/sin are [..., T, d]. The result keeps x's dtype
    (under autocast the projections are bf16 while the tables are fp32), as in `transformers`."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)
