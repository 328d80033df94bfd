"""Local causal attention kernels: forward with log-sum-exp, and its backward.

Every context-parallel backend ends in the same pair of calls on local heads over the
full sequence:

    out, lse = attention_forward(q, k, v, cu_seqlens)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, cu_seqlens)

Layout (as flash-attn's varlen API): q [T, H, d], k and v [T, Hkv, d] with H a multiple
of Hkv (grouped-query attention), out [T, H, d], lse [H, T] in fp32. T is the total
number of tokens of the packed batch; `cu_seqlens` is a tuple of Python ints, the
boundaries of the causal segments (documents, and samples of a micro-batch):
(0, ..., T). Attention never crosses a boundary and no T x T mask is ever built.

Implementations, chosen by `select_kernel`:
- `flash_attn`: flash-attn's varlen kernels (CUDA, when importable).
- `sdpa_flash`: torch's own CUDA flash kernels, one call per segment.
- `cpu_flash`: torch's CPU flash kernel, one call per segment.
- `reference`: blockwise online softmax in plain PyTorch, O(T) memory; tests the others.

The private aten operators used by the torch kernels are wrapped here and only here.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch

CuSeqlens = Sequence[int]

try:  # optional: flash-attn is only on CUDA machines that installed the `gpu` extra
    import flash_attn.flash_attn_interface as _flash_attn_interface
except ImportError:  # pragma: no cover - depends on the machine
    _flash_attn_interface = None


class Kernel(NamedTuple):
    """A forward/backward pair with the contract of this module."""

    name: str
    forward: Callable
    backward: Callable


def segments(cu_seqlens: CuSeqlens) -> list[tuple[int, int]]:
    """(start, end) of each non-empty segment."""
    return [(a, b) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a]


def check_cu_seqlens(cu_seqlens: CuSeqlens, num_tokens: int) -> None:
    """cu_seqlens must start at 0, end at the token count and never decrease."""
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to {num_tokens}, got {tuple(cu_seqlens)[:8]}...")
    if any(b < a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")


def _softmax_scale(head_dim: int, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(head_dim)


def _acc_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32 math and lse, or fp64 when the inputs are fp64 (used by gradient checks)."""
    return torch.promote_types(q.dtype, torch.float32)


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


def _reference_segment_forward(q, k, v, scale, block):
    """One causal segment, q/k/v [L, H, d] in fp32; returns out [L, H, d], lse [H, L]."""
    L, H, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(H, L, dtype=q.dtype, device=q.device)
    for i0 in range(0, L, block):
        i1 = min(i0 + block, L)
        qi = q[i0:i1].transpose(0, 1)  # [H, bq, d]
        m = torch.full((H, i1 - i0), -math.inf, dtype=q.dtype, device=q.device)
        den = torch.zeros(H, i1 - i0, dtype=q.dtype, device=q.device)
        acc = torch.zeros(H, i1 - i0, d, dtype=q.dtype, device=q.device)
        for j0 in range(0, i1, block):
            j1 = min(j0 + block, i1)
            s = qi @ k[j0:j1].permute(1, 2, 0) * scale  # [H, bq, bk]
            s = _mask_causal(s, i0, j0)
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


def _reference_segment_backward(dout, q, k, v, out, lse, scale, block):
    """Gradients of one causal segment (fp32, expanded kv heads)."""
    L = q.shape[0]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (dout * out).sum(dim=-1).transpose(0, 1)  # [H, L]
    for i0 in range(0, L, block):
        i1 = min(i0 + block, L)
        qi, doi = q[i0:i1].transpose(0, 1), dout[i0:i1].transpose(0, 1)  # [H, bq, d]
        for j0 in range(0, i1, block):
            j1 = min(j0 + block, i1)
            kj, vj = k[j0:j1].transpose(0, 1), v[j0:j1].transpose(0, 1)  # [H, bk, d]
            s = _mask_causal(qi @ kj.transpose(1, 2) * scale, i0, j0)
            p = torch.exp(s - lse[:, i0:i1].unsqueeze(-1))
            dv[j0:j1] += (p.transpose(1, 2) @ doi).transpose(0, 1)
            ds = p * (doi @ vj.transpose(1, 2) - delta[:, i0:i1].unsqueeze(-1))
            dq[i0:i1] += (ds @ kj).transpose(0, 1) * scale
            dk[j0:j1] += (ds.transpose(1, 2) @ qi).transpose(0, 1) * scale
    return dq, dk, dv


def reference_forward(q, k, v, cu_seqlens, scale=None, block: int = 128):
    """Blockwise online-softmax attention in plain PyTorch (fp32 math)."""
    scale = _softmax_scale(q.shape[-1], scale)
    H = q.shape[1]
    acc = _acc_dtype(q)
    qf, kf, vf = q.to(acc), _expand_kv(k, H).to(acc), _expand_kv(v, H).to(acc)
    out = torch.zeros_like(qf)
    lse = torch.zeros(H, q.shape[0], dtype=acc, device=q.device)
    for a, b in segments(cu_seqlens):
        out[a:b], lse[:, a:b] = _reference_segment_forward(qf[a:b], kf[a:b], vf[a:b], scale, block)
    return out.to(q.dtype), lse


def reference_backward(dout, q, k, v, out, lse, cu_seqlens, scale=None, block: int = 128):
    """Backward of `reference_forward` from (dout, q, k, v, out, lse) alone."""
    scale = _softmax_scale(q.shape[-1], scale)
    H, Hkv = q.shape[1], k.shape[1]
    acc = _acc_dtype(q)
    qf, kf, vf = q.to(acc), _expand_kv(k, H).to(acc), _expand_kv(v, H).to(acc)
    dof, of = dout.to(acc), out.to(acc)
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    for a, b in segments(cu_seqlens):
        dq[a:b], dk[a:b], dv[a:b] = _reference_segment_backward(
            dof[a:b], qf[a:b], kf[a:b], vf[a:b], of[a:b], lse[:, a:b], scale, block
        )
    return dq.to(q.dtype), _reduce_kv_grad(dk, Hkv).to(k.dtype), _reduce_kv_grad(dv, Hkv).to(v.dtype)


# --- torch's own flash kernels (CPU and CUDA), one call per segment -------------------


def _to_bhld(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).unsqueeze(0)  # [L, H, d] -> [1, H, L, d]


def _from_bhld(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(0).transpose(0, 1)  # [1, H, L, d] -> [L, H, d]


def _per_segment_forward(segment_fn):
    def forward(q, k, v, cu_seqlens, scale=None):
        scale = _softmax_scale(q.shape[-1], scale)
        H = q.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty(H, q.shape[0], dtype=_acc_dtype(q), device=q.device)
        for a, b in segments(cu_seqlens):
            o, l = segment_fn(_to_bhld(q[a:b]), _to_bhld(_expand_kv(k[a:b], H)), _to_bhld(_expand_kv(v[a:b], H)), scale)
            out[a:b] = _from_bhld(o)
            lse[:, a:b] = l.squeeze(0)
        return out, lse

    return forward


def _per_segment_backward(segment_fn):
    def backward(dout, q, k, v, out, lse, cu_seqlens, scale=None):
        scale = _softmax_scale(q.shape[-1], scale)
        H, Hkv = q.shape[1], k.shape[1]
        dq = torch.zeros_like(q)
        dk = torch.zeros(k.shape[0], H, k.shape[2], dtype=k.dtype, device=k.device)
        dv = torch.zeros_like(dk)
        for a, b in segments(cu_seqlens):
            args = [_to_bhld(t) for t in (dout[a:b], q[a:b], _expand_kv(k[a:b], H), _expand_kv(v[a:b], H), out[a:b])]
            seg_lse = lse[:, a:b].unsqueeze(0).to(q.dtype if q.dtype == torch.float64 else torch.float32)
            gq, gk, gv = segment_fn(*args, seg_lse.contiguous(), scale)
            dq[a:b], dk[a:b], dv[a:b] = _from_bhld(gq), _from_bhld(gk), _from_bhld(gv)
        return dq, _reduce_kv_grad(dk, Hkv), _reduce_kv_grad(dv, Hkv)

    return backward


def _cpu_flash_segment_forward(q, k, v, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)


def _cpu_flash_segment_backward(dout, q, k, v, out, lse, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, True, scale=scale
    )


def _cuda_flash_segment_forward(q, k, v, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    return out, lse


def _cuda_flash_segment_backward(dout, q, k, v, out, lse, scale):
    L = q.shape[2]
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, empty, empty, L, L, 0.0, True, zero, zero, scale=scale
    )


# --- flash-attn varlen --------------------------------------------------------------------


def _cu_tensor(cu_seqlens, device):
    return torch.tensor(list(cu_seqlens), dtype=torch.int32, device=device)


def _max_seqlen(cu_seqlens) -> int:
    return max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))


def flash_attn_forward(q, k, v, cu_seqlens, scale=None):  # pragma: no cover - needs CUDA
    cu, m = _cu_tensor(cu_seqlens, q.device), _max_seqlen(cu_seqlens)
    out, lse, *_ = _flash_attn_interface._flash_attn_varlen_forward(
        q, k, v, cu, cu, m, m, dropout_p=0.0, softmax_scale=_softmax_scale(q.shape[-1], scale), causal=True
    )
    return out, lse


def flash_attn_backward(dout, q, k, v, out, lse, cu_seqlens, scale=None):  # pragma: no cover - needs CUDA
    cu, m = _cu_tensor(cu_seqlens, q.device), _max_seqlen(cu_seqlens)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_interface._flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, cu, cu, m, m,
        dropout_p=0.0, softmax_scale=_softmax_scale(q.shape[-1], scale), causal=True,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
    )
    return dq, dk, dv


KERNELS: dict[str, Kernel] = {
    "reference": Kernel("reference", reference_forward, reference_backward),
    "cpu_flash": Kernel(
        "cpu_flash", _per_segment_forward(_cpu_flash_segment_forward), _per_segment_backward(_cpu_flash_segment_backward)
    ),
    "sdpa_flash": Kernel(
        "sdpa_flash", _per_segment_forward(_cuda_flash_segment_forward), _per_segment_backward(_cuda_flash_segment_backward)
    ),
    "flash_attn": Kernel("flash_attn", flash_attn_forward, flash_attn_backward),
}


def flash_attn_available() -> bool:
    return _flash_attn_interface is not None


def select_kernel(device: torch.device, name: str = "auto") -> Kernel:
    """The kernel for `device`: flash-attn, else torch's flash kernels; or the one named."""
    if name == "auto":
        if device.type == "cuda":
            name = "flash_attn" if flash_attn_available() else "sdpa_flash"
        else:
            name = "cpu_flash"
    if name not in KERNELS:
        raise ValueError(f"attention kernel {name!r}: expected one of auto, {', '.join(KERNELS)}")
    if name == "flash_attn" and not flash_attn_available():
        raise ImportError("attention kernel 'flash_attn' was asked for but flash-attn is not installed "
                          "(pip install 'megatron_lc[gpu]'), or use 'auto' to fall back to torch's kernels")
    if name in ("flash_attn", "sdpa_flash") and device.type != "cuda":
        raise ValueError(f"attention kernel {name!r} needs a CUDA device, got {device}")
    return KERNELS[name]


class _Attention(torch.autograd.Function):
    """Autograd around a kernel pair; saves q, k, v, out and lse only."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, kernel, scale):
        out, lse = kernel.forward(q, k, v, cu_seqlens, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cu_seqlens, ctx.kernel, ctx.scale = cu_seqlens, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout.contiguous(), q, k, v, out, lse, ctx.cu_seqlens, ctx.scale)
        return dq, dk, dv, None, None, None


def attention(q, k, v, cu_seqlens: CuSeqlens, kernel: Kernel, scale: float | None = None) -> torch.Tensor:
    """Differentiable causal attention over packed segments: q [T, H, d] -> out [T, H, d]."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    return _Attention.apply(q, k, v, tuple(cu_seqlens), kernel, scale)


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
