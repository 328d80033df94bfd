"""Local causal attention kernels: forward with log-sum-exp, and its backward.

Every context-parallel backend ends in the same pair of calls on local heads over the
full sequence:

    out, lse, state = kernel.forward(q, k, v, cu_seqlens)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, cu_seqlens, state=state)

Ring attention also asks for attention between different token sets: with
`cu_seqlens_k=` given, segment i of q attends to segment i of k, and `causal=False`
lets every query see every key of its segment (a key block that lies wholly before
the query block). Causal attention takes one segmentation for both: q and k are the
same tokens.

Layout (as flash-attn's varlen API): q [T, H, d], k and v [T, Hkv, d] with H a multiple
of Hkv (grouped-query attention), out [T, H, d], lse [H, T] in fp32. T is the total
number of tokens of the packed batch; `cu_seqlens` is a tuple of Python ints, the
boundaries of the causal segments (documents, and samples of a micro-batch):
(0, ..., T). Attention never crosses a boundary and no T x T mask is ever built.
The backward needs nothing from its forward but (q, k, v, out, lse) and `state`: ring
attention calls it with the out and lse merged over every key block.
`state` is a tuple of the tensors the forward returned that its backward needs (the rng
state of the flash kernels), () for the others.

Implementations, chosen by `kernel_selection.select_kernel`:
- `flash_attn`: flash-attn's varlen kernels (CUDA, flash-attn >= 2.7 importable; fp16/bf16).
- `sdpa_flash`: torch's own flash kernels, variable-length (CUDA; fp16/bf16).
- `sdpa_efficient`: torch's memory-efficient kernels, variable-length (CUDA; fp32 too), in
  calls whose backward workspace stays within about twice the tokens (`varlen.kernel_calls`).
- `cpu_flash`: torch's CPU flash kernel, one call per segment.
- `reference`: blockwise online softmax in plain PyTorch, O(T) memory; tests the others.

The CUDA kernels take one call per 65,535 segments (a launch takes no more), their outputs
written into one out / lse / dq / dk / dv. Inputs may be strided views (Untied Ulysses'
receive buffer, ring attention's buffers): each operator is handed them in the layout it
really reads, copied only where they are not.

The private aten operators used by the torch kernels are wrapped here and only here
(`TORCH_OPS`), as is the private flash-attn interface.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Callable, NamedTuple

import torch

from megatron_lc.attention.varlen import (
    CuSeqlens,
    KernelCall,
    backward_calls,
    checked_kernel_calls,
    device_cu_seqlens,
    forward_calls,
    max_seqlen,
    segment_pairs,
    segments,
    state_per_call,
    varlen_args,
)
from megatron_lc.memory.kept_attention import KeptAttention, KeptTensor

FLASH_ATTN_MIN_VERSION = (2, 7)
"""The private `_flash_attn_varlen_*` signatures used below are those of flash-attn 2.7 and later."""


def _version_tuple(version: str) -> tuple[int, ...]:
    """'2.7.4.post1' -> (2, 7, 4)."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _import_flash_attn():
    """flash-attn's interface module and why it cannot be used ('' when it can)."""
    try:  # optional: flash-attn is only on CUDA machines that installed the `gpu` extra
        import flash_attn
        import flash_attn.flash_attn_interface as interface
    except ModuleNotFoundError:  # pragma: no cover - depends on the machine
        return None, "flash-attn is not installed (pip install 'megatron_lc[gpu]')"
    except Exception as e:  # a build for another torch or CUDA: undefined symbols, a failing extension
        problem = f"flash-attn is installed but cannot be imported ({first_line(e)})"
        warnings.warn(problem + "; 'auto' uses torch's kernels instead", stacklevel=2)
        return None, problem
    version = getattr(flash_attn, "__version__", "0")
    if _version_tuple(version) < FLASH_ATTN_MIN_VERSION:
        wanted = ".".join(map(str, FLASH_ATTN_MIN_VERSION))
        problem = (f"flash-attn {version} is installed but megatron_lc needs flash-attn>={wanted} "
                   f"(pip install 'flash-attn>={wanted}')")
        warnings.warn(problem + "; 'auto' uses torch's kernels instead", stacklevel=2)
        return None, problem
    return interface, ""


_flash_attn_interface, FLASH_ATTN_PROBLEM = _import_flash_attn()


class Kernel(NamedTuple):
    """A forward/backward pair with the contract of this module."""

    name: str
    forward: Callable
    backward: Callable


def _softmax_scale(head_dim: int, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(head_dim)


def _acc_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32 math and lse, or fp64 when the inputs are fp64 (used by gradient checks)."""
    return torch.promote_types(q.dtype, torch.float32)


def kept_outputs(tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> list[KeptTensor]:
    """What one `attention(kept=)` call puts on the host, by this module's contract whatever the documents: out
    [tokens, heads, d] in the inputs' dtype and lse [heads, tokens] in fp32 (fp64 for fp64 inputs); the kernel's
    state stays on the accelerator."""
    return [KeptTensor((tokens, heads, head_dim), dtype),
            KeptTensor((heads, tokens), torch.promote_types(dtype, torch.float32))]


def _expand_kv(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat kv heads so head h of q pairs with kv head h // (H / Hkv)."""
    groups = num_heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_kv_grad(g: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Sum the gradients of repeated kv heads back onto their kv head."""
    groups = g.shape[1] // num_kv_heads
    if groups == 1:
        return g
    return g.unflatten(1, (num_kv_heads, groups)).sum(dim=2)


# --- reference: blockwise online softmax ------------------------------------------------


def _reference_segment_forward(q, k, v, scale, block, causal=True):
    """One segment, q [L, H, d] and k/v [Lk, H, d] in fp32; returns out [L, H, d], lse [H, L]."""
    L, H, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(H, L, dtype=q.dtype, device=q.device)
    for i0 in range(0, L, block):
        i1 = min(i0 + block, L)
        qi = q[i0:i1].transpose(0, 1)  # [H, bq, d]
        m = torch.full((H, i1 - i0), -math.inf, dtype=q.dtype, device=q.device)
        den = torch.zeros(H, i1 - i0, dtype=q.dtype, device=q.device)
        acc = torch.zeros(H, i1 - i0, d, dtype=q.dtype, device=q.device)
        keys = i1 if causal else k.shape[0]
        for j0 in range(0, keys, block):
            j1 = min(j0 + block, keys)
            s = qi @ k[j0:j1].permute(1, 2, 0) * scale  # [H, bq, bk]
            s = _mask_causal(s, i0, j0) if causal else s
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new.unsqueeze(-1))
            corr = torch.exp(m - m_new)
            den = den * corr + p.sum(dim=-1)
            acc = acc * corr.unsqueeze(-1) + p @ v[j0:j1].transpose(0, 1)
            m = m_new
        out[i0:i1] = (acc / den.unsqueeze(-1)).transpose(0, 1)
        lse[:, i0:i1] = m + torch.log(den)
    return out, lse


def _mask_causal(s: torch.Tensor, i0: int, j0: int) -> torch.Tensor:
    """Set scores of keys after their query to -inf (blocks at offsets i0, j0)."""
    bq, bk = s.shape[-2:]
    if j0 + bk - 1 <= i0:
        return s  # the whole block is at or below the diagonal
    qi = torch.arange(i0, i0 + bq, device=s.device).unsqueeze(1)
    kj = torch.arange(j0, j0 + bk, device=s.device).unsqueeze(0)
    return s.masked_fill(kj > qi, -math.inf)


def _reference_segment_backward(dout, q, k, v, out, lse, scale, block, causal=True):
    """Gradients of one segment (fp32, expanded kv heads)."""
    L = q.shape[0]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (dout * out).sum(dim=-1).transpose(0, 1)  # [H, L]
    for i0 in range(0, L, block):
        i1 = min(i0 + block, L)
        qi, doi = q[i0:i1].transpose(0, 1), dout[i0:i1].transpose(0, 1)  # [H, bq, d]
        keys = i1 if causal else k.shape[0]
        for j0 in range(0, keys, block):
            j1 = min(j0 + block, keys)
            kj, vj = k[j0:j1].transpose(0, 1), v[j0:j1].transpose(0, 1)  # [H, bk, d]
            s = qi @ kj.transpose(1, 2) * scale
            s = _mask_causal(s, i0, j0) if causal else s
            p = torch.exp(s - lse[:, i0:i1].unsqueeze(-1))
            dv[j0:j1] += (p.transpose(1, 2) @ doi).transpose(0, 1)
            ds = p * (doi @ vj.transpose(1, 2) - delta[:, i0:i1].unsqueeze(-1))
            dq[i0:i1] += (ds @ kj).transpose(0, 1) * scale
            dk[j0:j1] += (ds.transpose(1, 2) @ qi).transpose(0, 1) * scale
    return dq, dk, dv


def reference_forward(q, k, v, cu_seqlens, scale=None, block: int = 128, *, cu_seqlens_k=None, causal=True):
    """Blockwise online-softmax attention in plain PyTorch (fp32 math)."""
    scale = _softmax_scale(q.shape[-1], scale)
    H = q.shape[1]
    acc = _acc_dtype(q)
    qf, kf, vf = q.to(acc), _expand_kv(k, H).to(acc), _expand_kv(v, H).to(acc)
    out = torch.zeros_like(qf)
    lse = torch.full((H, q.shape[0]), -math.inf, dtype=acc, device=q.device)
    for a, b, c, d in segment_pairs(cu_seqlens, cu_seqlens_k, causal):
        out[a:b], lse[:, a:b] = _reference_segment_forward(qf[a:b], kf[c:d], vf[c:d], scale, block, causal)
    return out.to(q.dtype), lse, ()


def reference_backward(dout, q, k, v, out, lse, cu_seqlens, scale=None, state=(), block: int = 128, *,
                       cu_seqlens_k=None, causal=True):
    """Backward of `reference_forward` from (dout, q, k, v, out, lse) alone."""
    scale = _softmax_scale(q.shape[-1], scale)
    H, Hkv = q.shape[1], k.shape[1]
    acc = _acc_dtype(q)
    qf, kf, vf = q.to(acc), _expand_kv(k, H).to(acc), _expand_kv(v, H).to(acc)
    dof, of = dout.to(acc), out.to(acc)
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    for a, b, c, d in segment_pairs(cu_seqlens, cu_seqlens_k, causal):
        dq[a:b], dk[c:d], dv[c:d] = _reference_segment_backward(
            dof[a:b], qf[a:b], kf[c:d], vf[c:d], of[a:b], lse[:, a:b], scale, block, causal
        )
    return dq.to(q.dtype), _reduce_kv_grad(dk, Hkv).to(k.dtype), _reduce_kv_grad(dv, Hkv).to(v.dtype)


# --- torch's own kernels: the private aten operators, wrapped here and only here -----------
#
# Schemas (torch 2.11 and 2.13; only the arguments named below are passed):
#   _flash_attention_forward(q, k, v, cum_seq_q?, cum_seq_k?, max_q, max_k, dropout_p, is_causal,
#       return_debug_mask, *, scale) -> (out, logsumexp, rng_state, unused, debug_attn_mask)
#   _flash_attention_backward(dout, q, k, v, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
#       dropout_p, is_causal, rng_state, unused, *, scale) -> (dq, dk, dv)
#   _efficient_attention_forward(q, k, v, bias?, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q?,
#       max_seqlen_k?, dropout_p, custom_mask_type, compute_log_sumexp, *, scale)
#       -> (out, logsumexp, philox_seed, philox_offset, max_seqlen_batch_q, max_seqlen_batch_k)
#   _efficient_attention_backward(dout, q, k, v, bias?, out, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q,
#       max_seqlen_k, logsumexp, dropout_p, philox_seed, philox_offset, custom_mask_type,
#       bias_requires_grad, *, scale) -> (dq, dk, dv, dbias)
# With cum_seq given, the flash operators run flash-attention 2's variable-length kernels on
# [total, heads, d] and take fewer kv heads than q heads (grouped-query attention: the backward
# sums dk/dv per kv head itself); logsumexp is [heads, total] fp32. The memory-efficient operators
# take [1, total, heads, d] with equal head counts and return logsumexp [segments, heads,
# round32(longest)].
#
# What the kernels read, beyond the schema (torch 2.11's flash_api.cpp, attention_backward.cu and
# mem_eff_attention/kernel_backward.h):
# - every q, k, v, out, dout has a contiguous last dimension (checked by the host code; the other
#   strides are passed to the kernels);
# - the flash backward reads logsumexp as a dense [heads, total] array, unchecked;
# - the memory-efficient backward reads `out` with rows heads * d apart whatever its strides
#   (`o_strideM()`), unchecked; its host code copies only a strided grad_out;
# - CUDA grids hold at most 65,535 blocks in y and z, where the segments go (see `varlen.kernel_calls`).
# The wrappers below hand every operator its inputs in that form, copying only what is not.

TORCH_OPS = {
    "flash_forward": torch.ops.aten._flash_attention_forward.default,
    "flash_backward": torch.ops.aten._flash_attention_backward.default,
    "efficient_forward": torch.ops.aten._efficient_attention_forward.default,
    "efficient_backward": torch.ops.aten._efficient_attention_backward.default,
    "cpu_flash_forward": torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    "cpu_flash_backward": torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}
"""The private operators by role; tests swap an entry for a recording stand-in."""

FLASH_DTYPES = (torch.float16, torch.bfloat16)
NO_MASK, CAUSAL_FROM_TOP_LEFT = 0, 1
"""`custom_mask_type` of the memory-efficient kernels: none; causal, each segment from its first token."""

EFFICIENT_TILE_ROWS = 128
"""Query rows of the memory-efficient backward's dq tiles (`kBlockSizeI`, the largest of torch's sm80
kernels): its fp32 dq workspace holds, for every segment and head of a call, the call's longest segment
rounded up to whole tiles (`workspace_elements_gq` in `kernel_backward.h`)."""
EFFICIENT_ROWS_PER_TOKEN = 2
EFFICIENT_MIN_ROWS = 8192
"""Each memory-efficient call takes consecutive segments while segments x (longest, in whole tiles) stays
within twice the micro-batch's tokens, or 8,192 rows for small micro-batches. One call over 200 documents
of which one is 16K tokens long would hold 200 x 16K rows for 64K tokens (54 GB in fp32 at 32 heads of
128), and 64K one-token documents a 128-row tile each (68 GB)."""

def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous copy when its last dimension is strided (every kernel loads a head's d values
    as one vector; other strides it takes as they are, so views of a receive buffer are not copied)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_flash_dtype(q: torch.Tensor, kernel: str) -> None:
    """Flash kernels take fp16/bf16 only: refuse fp32 with the flags that fix it."""
    if q.dtype not in FLASH_DTYPES:
        raise TypeError(f"attention kernel {kernel!r} takes fp16/bf16 inputs, got {q.dtype}: add --bf16, or "
                        "use --attention-kernel auto (fp32 runs torch's memory-efficient kernel)")


def sdpa_flash_forward(q, k, v, cu_seqlens, scale=None, *, cu_seqlens_k=None, causal=True):
    """torch's flash kernel, variable-length: one call per 65,535 segments, kv heads as they are."""
    _check_flash_dtype(q, "sdpa_flash")
    calls = checked_kernel_calls(cu_seqlens, cu_seqlens_k, causal)
    scale = _softmax_scale(q.shape[-1], scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))

    def run_call(call):
        cu_q, cu_k, max_q, max_k = varlen_args(call, q.device)
        out, lse, rng_state, unused, _ = TORCH_OPS["flash_forward"](
            q[call.q], k[call.k], v[call.k], cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
        return out, lse, (rng_state, unused)

    return forward_calls(q, calls, run_call)


def sdpa_flash_backward(dout, q, k, v, out, lse, cu_seqlens, scale=None, state=(), *, cu_seqlens_k=None,
                        causal=True):
    """Backward of `sdpa_flash_forward`, given the rng tensors its forward returned (`state`)."""
    _check_flash_dtype(q, "sdpa_flash")
    calls = checked_kernel_calls(cu_seqlens, cu_seqlens_k, causal)
    scale = _softmax_scale(q.shape[-1], scale)
    dout, q, k, v, out = (_last_dim_contiguous(t) for t in (dout, q, k, v, out))

    def run_call(call, rng):
        cu_q, cu_k, max_q, max_k = varlen_args(call, q.device)
        return TORCH_OPS["flash_backward"](
            dout[call.q], q[call.q], k[call.k], v[call.k], out[call.q], lse[:, call.q].contiguous(), cu_q, cu_k,
            max_q, max_k, 0.0, causal, *rng, scale=scale)

    return backward_calls(q, k, v, calls, state_per_call(state, calls, 2), run_call)


def _lse_index(cu_seqlens: CuSeqlens, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment, position in it) of every token, built on `device` from the boundaries alone: where
    each token's lse lives in the memory-efficient layout."""
    cu = device_cu_seqlens(cu_seqlens, device)
    tokens = torch.arange(cu_seqlens[-1], dtype=torch.int32, device=device)
    segment = torch.searchsorted(cu[1:], tokens, right=True)  # empty segments own no token
    return segment, (tokens - cu[segment]).long()


def _lse_to_heads_tokens(native: torch.Tensor, cu_seqlens: CuSeqlens) -> torch.Tensor:
    """Memory-efficient lse [segments, H, padded] -> [H, T] (the module's layout), one gather."""
    segment, position = _lse_index(cu_seqlens, native.device)
    return native.transpose(0, 1)[:, segment, position]


def _lse_to_native(lse: torch.Tensor, cu_seqlens: CuSeqlens) -> torch.Tensor:
    """[H, T] -> the memory-efficient layout [segments, H, round32(longest)], one scatter; padded with +inf
    as its forward pads (rows past a segment's end then weigh nothing)."""
    padded = -(-max_seqlen(cu_seqlens) // 32) * 32
    native = lse.new_full((len(cu_seqlens) - 1, lse.shape[0], padded), math.inf)
    segment, position = _lse_index(cu_seqlens, lse.device)
    native.transpose(0, 1)[:, segment, position] = lse
    return native


def _efficient_mask(causal: bool) -> int:
    return CAUSAL_FROM_TOP_LEFT if causal else NO_MASK


def _efficient_calls(cu_seqlens, cu_seqlens_k, causal: bool) -> tuple[KernelCall, ...]:
    """The memory-efficient kernels' calls: at most 65,535 segments, and a bounded backward workspace."""
    max_rows = max(EFFICIENT_ROWS_PER_TOKEN * cu_seqlens[-1], EFFICIENT_MIN_ROWS)
    return checked_kernel_calls(cu_seqlens, cu_seqlens_k, causal, max_rows, EFFICIENT_TILE_ROWS)


def sdpa_efficient_forward(q, k, v, cu_seqlens, scale=None, *, cu_seqlens_k=None, causal=True, ops=TORCH_OPS):
    """torch's memory-efficient kernel (fp32 too), variable-length; kv heads expanded (it has no GQA). `ops`:
    the operators by role (the planner passes allocation models of them)."""
    H = q.shape[1]
    calls = _efficient_calls(cu_seqlens, cu_seqlens_k, causal)
    scale = _softmax_scale(q.shape[-1], scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))

    def run_call(call):
        cu_q, cu_k, max_q, max_k = varlen_args(call, q.device)
        out, native_lse, seed, offset, _, _ = ops["efficient_forward"](
            q[call.q].unsqueeze(0), _expand_kv(k[call.k], H).unsqueeze(0), _expand_kv(v[call.k], H).unsqueeze(0),
            None, cu_q, cu_k, max_q, max_k, 0.0, _efficient_mask(causal), True, scale=scale)
        return out.squeeze(0), _lse_to_heads_tokens(native_lse, call.cu_q), (seed, offset)

    return forward_calls(q, calls, run_call)


def sdpa_efficient_backward(dout, q, k, v, out, lse, cu_seqlens, scale=None, state=(), *, cu_seqlens_k=None,
                            causal=True, ops=TORCH_OPS):
    """Backward of `sdpa_efficient_forward`: its lse layout rebuilt from `lse` (which may be merged over key
    blocks), the philox tensors its forward returned."""
    H, Hkv = q.shape[1], k.shape[1]
    calls = _efficient_calls(cu_seqlens, cu_seqlens_k, causal)
    scale = _softmax_scale(q.shape[-1], scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))

    def run_call(call, philox):
        cu_q, cu_k, max_q, max_k = varlen_args(call, q.device)
        # The kernel reads out (and grad_out) rows H * d apart: a strided view would be misread.
        rows_out, rows_dout = out[call.q].contiguous(), dout[call.q].contiguous()
        dq, dk, dv, _ = ops["efficient_backward"](
            rows_dout.unsqueeze(0), q[call.q].unsqueeze(0), _expand_kv(k[call.k], H).unsqueeze(0),
            _expand_kv(v[call.k], H).unsqueeze(0), None, rows_out.unsqueeze(0), cu_q, cu_k, max_q, max_k,
            _lse_to_native(lse[:, call.q], call.cu_q), 0.0, *philox, _efficient_mask(causal), False, scale=scale)
        return dq.squeeze(0), _reduce_kv_grad(dk.squeeze(0), Hkv), _reduce_kv_grad(dv.squeeze(0), Hkv)

    return backward_calls(q, k, v, calls, state_per_call(state, calls, 2), run_call)


# --- torch's CPU flash kernel, one call per segment -----------------------------------------


def _to_bhld(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).unsqueeze(0)  # [L, H, d] -> [1, H, L, d]


def _from_bhld(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(0).transpose(0, 1)  # [1, H, L, d] -> [L, H, d]


def cpu_flash_forward(q, k, v, cu_seqlens, scale=None, *, cu_seqlens_k=None, causal=True):
    """torch's CPU flash kernel per segment (it has no variable-length entry point)."""
    scale = _softmax_scale(q.shape[-1], scale)
    H = q.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((H, q.shape[0]), -math.inf, dtype=_acc_dtype(q), device=q.device)
    for a, b, c, d in segment_pairs(cu_seqlens, cu_seqlens_k, causal):
        o, l = TORCH_OPS["cpu_flash_forward"](_to_bhld(q[a:b]), _to_bhld(_expand_kv(k[c:d], H)),
                                              _to_bhld(_expand_kv(v[c:d], H)), 0.0, causal, scale=scale)
        out[a:b] = _from_bhld(o)
        lse[:, a:b] = l.squeeze(0)
    return out, lse, ()


def cpu_flash_backward(dout, q, k, v, out, lse, cu_seqlens, scale=None, state=(), *, cu_seqlens_k=None,
                       causal=True):
    """Backward of `cpu_flash_forward`, segment by segment."""
    scale = _softmax_scale(q.shape[-1], scale)
    H, Hkv = q.shape[1], k.shape[1]
    dq = torch.zeros_like(q)
    dk = torch.zeros(k.shape[0], H, k.shape[2], dtype=k.dtype, device=k.device)
    dv = torch.zeros_like(dk)
    for a, b, c, d in segment_pairs(cu_seqlens, cu_seqlens_k, causal):
        args = [_to_bhld(t) for t in (dout[a:b], q[a:b], _expand_kv(k[c:d], H), _expand_kv(v[c:d], H), out[a:b])]
        seg_lse = lse[:, a:b].unsqueeze(0).to(q.dtype if q.dtype == torch.float64 else torch.float32)
        gq, gk, gv = TORCH_OPS["cpu_flash_backward"](*args, seg_lse.contiguous(), 0.0, causal, scale=scale)
        dq[a:b], dk[c:d], dv[c:d] = _from_bhld(gq), _from_bhld(gk), _from_bhld(gv)
    return dq, _reduce_kv_grad(dk, Hkv), _reduce_kv_grad(dv, Hkv)


# --- flash-attn varlen --------------------------------------------------------------------


def flash_attn_forward(q, k, v, cu_seqlens, scale=None, *, cu_seqlens_k=None, causal=True):
    """flash-attn's variable-length forward (GQA native), one call per 65,535 segments; keeps each call's
    rng state for the backward."""
    _check_flash_dtype(q, "flash_attn")
    calls = checked_kernel_calls(cu_seqlens, cu_seqlens_k, causal)
    scale = _softmax_scale(q.shape[-1], scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))

    def run_call(call):
        cu_q, cu_k, max_q, max_k = varlen_args(call, q.device)
        out, lse, _, rng_state = _flash_attn_interface._flash_attn_varlen_forward(
            q[call.q], k[call.k], v[call.k], cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale,
            causal=causal)
        return out, lse, (rng_state,)

    return forward_calls(q, calls, run_call)


def flash_attn_backward(dout, q, k, v, out, lse, cu_seqlens, scale=None, state=(), *,
                        cu_seqlens_k=None, causal=True):
    """Backward of `flash_attn_forward`: each call writes its rows of dq, dk, dv in place; deterministic (dq
    accumulated in a fixed order) when torch's deterministic algorithms are on, as torch's flash backward."""
    _check_flash_dtype(q, "flash_attn")
    calls = checked_kernel_calls(cu_seqlens, cu_seqlens_k, causal)
    scale = _softmax_scale(q.shape[-1], scale)
    dout, q, k, v, out = (_last_dim_contiguous(t) for t in (dout, q, k, v, out))
    states = state_per_call(state or (None,) * len(calls), calls, 1)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))  # the calls cover every row
    for call, (rng_state,) in zip(calls, states):
        cu_q, cu_k, max_q, max_k = varlen_args(call, q.device)
        _flash_attn_interface._flash_attn_varlen_backward(
            dout[call.q], q[call.q], k[call.k], v[call.k], out[call.q], lse[:, call.q].contiguous(),
            dq[call.q], dk[call.k], dv[call.k], cu_q, cu_k, max_q, max_k,
            dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1,
            softcap=0.0, alibi_slopes=None, rng_state=rng_state,
            deterministic=torch.are_deterministic_algorithms_enabled(),  # else dq by fp32 atomics, in any order
        )
    return dq, dk, dv


KERNELS: dict[str, Kernel] = {
    "reference": Kernel("reference", reference_forward, reference_backward),
    "cpu_flash": Kernel("cpu_flash", cpu_flash_forward, cpu_flash_backward),
    "sdpa_flash": Kernel("sdpa_flash", sdpa_flash_forward, sdpa_flash_backward),
    "sdpa_efficient": Kernel("sdpa_efficient", sdpa_efficient_forward, sdpa_efficient_backward),
    "flash_attn": Kernel("flash_attn", flash_attn_forward, flash_attn_backward),
}
CUDA_KERNELS = ("flash_attn", "sdpa_flash", "sdpa_efficient")


def flash_attn_available() -> bool:
    return _flash_attn_interface is not None


class _Attention(torch.autograd.Function):
    """Autograd around a kernel pair; saves q, k, v, out and lse only.

    Given the kept attention store of a checkpointed block (`memory/kept_attention.py`), the block's forward
    keeps out and lse (and the kernel's state) in it, and the block's recompute takes them back instead of
    calling the kernel's forward again; outside those the store is off and the kernel runs."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, kernel, scale, kept):
        if kept is not None and kept.replay:
            (out, lse, *state), _ = kept.take()
        else:
            out, lse, state = kernel.forward(q, k, v, cu_seqlens, scale)
            if kept is not None and kept.keep:  # out and lse to the host with the block input; the rng state stays
                kept.put((out, lse, *state), (True, True, *(False for _ in state)))
        ctx.save_for_backward(q, k, v, out, lse, *state)
        ctx.cu_seqlens, ctx.kernel, ctx.scale = cu_seqlens, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *state = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout.contiguous(), q, k, v, out, lse, ctx.cu_seqlens, ctx.scale,
                                         tuple(state))
        return dq, dk, dv, None, None, None, None


def attention(q, k, v, cu_seqlens: CuSeqlens, kernel: Kernel, scale: float | None = None,
              kept: KeptAttention | None = None) -> torch.Tensor:
    """Differentiable causal attention over packed segments: q [T, H, d] -> out [T, H, d]. `kept`: the calling
    block's kept attention store (`memory/kept_attention.py`; None: computed, nothing kept)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    return _Attention.apply(q, k, v, tuple(cu_seqlens), kernel, scale, kept)


def naive_attention(q, k, v, cu_seqlens: CuSeqlens, scale: float | None = None):
    """Materialised-softmax attention (O(T^2) memory): the ground truth in tests only."""
    scale = _softmax_scale(q.shape[-1], scale)
    H = q.shape[1]
    k, v = _expand_kv(k, H), _expand_kv(v, H)
    outs, lses = [], []
    for a, b in segments(cu_seqlens):
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale
        mask = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, -math.inf)
        lses.append(torch.logsumexp(s, dim=-1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v[a:b]))
    return torch.cat(outs), torch.cat(lses, dim=1)
