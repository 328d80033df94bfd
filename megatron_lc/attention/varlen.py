"""A packed micro-batch's segments and the variable-length kernel calls they are split into.

`cu_seqlens` is a tuple of Python ints, the boundaries of the causal segments (documents, and samples
of a micro-batch): (0, ..., T). The CUDA kernels (`attention/kernels.py`) take one call per run of
consecutive segments (`kernel_calls`), their outputs written into one out / lse / dq / dk / dv.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import torch

CuSeqlens = Sequence[int]


def segments(cu_seqlens: CuSeqlens) -> list[tuple[int, int]]:
    """(start, end) of each non-empty segment."""
    return [(a, b) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a]


def segment_pairs(cu_q: CuSeqlens, cu_k: CuSeqlens | None, causal: bool) -> list[tuple[int, int, int, int]]:
    """(q start, q end, k start, k end) of each segment with queries and keys.

    `cu_k` None: keys are the queries' own tokens. Causal attention between different
    token sets is refused: where its diagonal lies would be a guess.
    """
    if cu_k is None:
        return [(a, b, a, b) for a, b in segments(cu_q)]
    if causal:
        raise ValueError("causal attention takes one cu_seqlens for q and k; pass causal=False with cu_seqlens_k")
    if len(cu_k) != len(cu_q):
        raise ValueError(f"cu_seqlens_k has {len(cu_k) - 1} segments, cu_seqlens {len(cu_q) - 1}")
    return [(a, b, c, d) for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]) if b > a and d > c]


def check_cu_seqlens(cu_seqlens: CuSeqlens, num_tokens: int) -> None:
    """cu_seqlens must start at 0, end at the token count and never decrease."""
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to {num_tokens}, got {tuple(cu_seqlens)[:8]}...")
    if any(b < a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")


MAX_SEGMENTS_PER_CALL = 65_535
"""Segments one variable-length call may take: flash-attention 2 launches one block row per segment
in gridDim.y, the memory-efficient kernels in gridDim.z, and CUDA caps both at 65,535 (flash-attn
issue #1786); more fail to launch."""

_DEVICE_CU_SEQLENS: dict[tuple[torch.device, tuple], torch.Tensor] = {}
_KEPT_CU_SEQLENS = 64
"""Boundary tensors kept: a micro-batch's own, and each chunk pair's of ring attention."""


def device_cu_seqlens(cu_seqlens: CuSeqlens, device: torch.device) -> torch.Tensor:
    """cu_seqlens as an int32 tensor on `device`, built once per micro-batch.

    Every layer and every Untied stage of a micro-batch asks for the same boundaries
    (ring attention: the same few per chunk pair), so the tensors built last on each
    device are kept and handed out again. On CUDA they are copied from page-locked
    memory without blocking the host. Tensors made under a fake mode (the planner) are
    not kept: they belong to that mode.
    """
    key = (device, tuple(cu_seqlens))
    cached = _DEVICE_CU_SEQLENS.pop(key, None)
    if cached is not None:
        _DEVICE_CU_SEQLENS[key] = cached  # most recently used last: the oldest unused one goes first
        return cached
    if device.type == "cuda":
        tensor = torch.tensor(key[1], dtype=torch.int32).pin_memory().to(device, non_blocking=True)
    else:
        tensor = torch.tensor(key[1], dtype=torch.int32, device=device)
    if type(tensor) is torch.Tensor:
        if len(_DEVICE_CU_SEQLENS) >= _KEPT_CU_SEQLENS:
            _DEVICE_CU_SEQLENS.pop(next(iter(_DEVICE_CU_SEQLENS)))
        _DEVICE_CU_SEQLENS[key] = tensor
    return tensor


def max_seqlen(cu_seqlens: CuSeqlens) -> int:
    """The longest segment."""
    return max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))


class KernelCall(NamedTuple):
    """One variable-length call over consecutive segments: its rows of q and of k/v, and its
    boundaries counted from its first row (`cu_k` None: the keys are the queries' tokens)."""

    q: slice
    k: slice
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...] | None


@functools.lru_cache(maxsize=64)
def kernel_calls(cu_q: tuple[int, ...], cu_k: tuple[int, ...] | None, max_rows: int | None = None,
                 tile_rows: int = 1) -> tuple[KernelCall, ...]:
    """Split a micro-batch into calls of consecutive segments, exactly (segments are independent).

    Each call takes at most `MAX_SEGMENTS_PER_CALL` segments and, with `max_rows`, at most as
    many as keep segments x its longest one (rounded up to `tile_rows`) within `max_rows` (one
    segment always fits). Consecutive segments are rows next to each other, so a call reads and
    writes views of the micro-batch's tensors and nothing is gathered. Calls without tokens are
    left out.
    """
    calls, start, longest = [], 0, 0
    for i, (a, b) in enumerate(zip(cu_q[:-1], cu_q[1:])):
        count, widest = i - start + 1, max(longest, b - a)
        rows = count * -(-widest // tile_rows) * tile_rows
        too_many = count > MAX_SEGMENTS_PER_CALL or (max_rows is not None and rows > max_rows)
        if too_many and i > start:
            calls.append(_kernel_call(cu_q, cu_k, start, i))
            start, widest = i, b - a
        longest = widest
    calls.append(_kernel_call(cu_q, cu_k, start, len(cu_q) - 1))
    return tuple(c for c in calls if c.q.stop > c.q.start or c.k.stop > c.k.start)


def _kernel_call(cu_q, cu_k, first: int, end: int) -> KernelCall:
    """The call over segments [first, end)."""
    a, b = cu_q[first], cu_q[end]
    rebased_q = tuple(x - a for x in cu_q[first:end + 1])
    if cu_k is None:
        return KernelCall(slice(a, b), slice(a, b), rebased_q, None)
    c, d = cu_k[first], cu_k[end]
    return KernelCall(slice(a, b), slice(c, d), rebased_q, tuple(x - c for x in cu_k[first:end + 1]))


def checked_kernel_calls(cu_seqlens, cu_seqlens_k, causal: bool, max_rows: int | None = None, tile_rows: int = 1
           ) -> tuple[KernelCall, ...]:
    """The checked segmentation (as every kernel checks it), split into kernel calls."""
    segment_pairs(cu_seqlens, cu_seqlens_k, causal)
    cu_k = None if cu_seqlens_k is None else tuple(cu_seqlens_k)
    return kernel_calls(tuple(cu_seqlens), cu_k, max_rows, tile_rows)


def varlen_args(call: KernelCall, device: torch.device):
    """(cu_q, cu_k, max_q, max_k) device tensors and ints of one call."""
    cu_q = device_cu_seqlens(call.cu_q, device)
    if call.cu_k is None:
        m = max_seqlen(call.cu_q)
        return cu_q, cu_q, m, m
    return cu_q, device_cu_seqlens(call.cu_k, device), max_seqlen(call.cu_q), max_seqlen(call.cu_k)


def state_per_call(state: tuple, calls: Sequence[KernelCall], per_call: int) -> list[tuple]:
    """The forward's state tensors, `per_call` for each call, in call order."""
    if len(state) != per_call * len(calls):
        raise ValueError(f"state has {len(state)} tensors; the forward of these {len(calls)} kernel calls "
                         f"returns {per_call} per call")
    return [tuple(state[i * per_call:(i + 1) * per_call]) for i in range(len(calls))]


def _covers_all(calls: Sequence[KernelCall], num_tokens: int) -> bool:
    """One call over every token: its outputs are the micro-batch's, with nothing to copy."""
    return len(calls) == 1 and calls[0].q == slice(0, num_tokens)


def forward_calls(q: torch.Tensor, calls: Sequence[KernelCall], run_call: Callable):
    """(out [T, H, d], lse [H, T], state) from `run_call(call) -> (out, lse, state)` of each call: the
    outputs of several calls are written into one out and lse as each call returns."""
    T = q.shape[0]
    if _covers_all(calls, T):
        return run_call(calls[0])
    out = lse = None
    state = ()
    for call in calls:
        o, l, s = run_call(call)
        if out is None:
            out = o.new_empty((T, *o.shape[1:]))
            lse = l.new_empty((l.shape[0], T))
        out[call.q], lse[:, call.q] = o, l
        state += s
    return out, lse, state


def backward_calls(q, k, v, calls: Sequence[KernelCall], states: list[tuple], run_call: Callable):
    """(dq, dk, dv) from `run_call(call, state) -> (dq, dk, dv)` of each call, written into one dq, dk, dv."""
    if _covers_all(calls, q.shape[0]):
        return run_call(calls[0], states[0])
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]  # the calls cover every row
    for call, state in zip(calls, states):
        gq, gk, gv = run_call(call, state)
        grads[0][call.q], grads[1][call.k], grads[2][call.k] = gq, gk, gv
    return tuple(grads)
