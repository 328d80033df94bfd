"""The stage buffers of Untied Ulysses (`attention/untied_ulysses.py`): one buffer per role, reused across the
stages of a call and across layers and steps."""

from __future__ import annotations

import math

import torch


class StageWorkspace:
    """Stage buffers by role, reused across the stages of one forward or backward.

    The backend's only state. Each role holds one buffer, grown to the largest shape it
    is asked for and handed out as a view of that shape; the op uses a role for one
    thing at a time and never returns or saves a view of it. The op releases them when
    it returns: between attention calls (the recompute and the MLP of a block) that
    memory serves the rest of the block, and the allocator hands the same blocks back at
    the next call. Everything is also dropped when the op meets an input of another
    shape, dtype, device or tensor kind (e.g. fake tensors, inference mode).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._signature: tuple | None = None

    def begin(self, x: torch.Tensor) -> None:
        """Start one forward or backward of the op on input x."""
        kind = (type(x), id(getattr(x, "fake_mode", None)), x.is_inference())
        signature = (tuple(x.shape), x.dtype, x.device, kind)
        if signature != self._signature:
            self._buffers.clear()
            self._signature = signature

    def get(self, role: str, shape: tuple[int, ...], like: torch.Tensor,
            dtype: torch.dtype | None = None) -> torch.Tensor:
        """Role `role`'s buffer as a tensor of `shape` (contents undefined), on `like`'s device, in
        `dtype` (default `like`'s)."""
        numel, dtype = math.prod(shape), dtype or like.dtype
        buf = self._buffers.get(role)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            del buf
            self._buffers.pop(role, None)  # free the smaller buffer before its replacement exists
            buf = self._buffers[role] = torch.empty(numel, dtype=dtype, device=like.device)
        return buf[:numel].view(shape)

    def release(self) -> None:
        """Free every buffer (e.g. before evaluating at another length)."""
        self._buffers.clear()
        self._signature = None

    def buffers(self) -> dict[str, torch.Tensor]:
        """The current buffer of each role (for inspection)."""
        return dict(self._buffers)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
