"""Sequence tiling: the SwiGLU MLP and the output projection + cross-entropy, tile by tile.

Both are custom autograd Functions that never hold a full-width intermediate:

- ``tiled_swiglu_mlp`` keeps only its input and weights; backward recomputes each tile
  and accumulates the weight gradients in one buffer per weight, returned once.
- ``tiled_linear_cross_entropy`` never builds the ``N x V`` logits; each row tile's
  logits exist in fp32 only while that tile is processed.

Tile counts come from configuration (see ``chunks.plan_chunks``), never from data, so
every rank runs the same number of tiles. Tiles split the rows as evenly as possible
(sizes differ by at most one); a count larger than the row count leaves empty tiles,
which are skipped.

Precision: matmuls run in the input dtype (or the autocast dtype when autocast is on);
with 16-bit weights and more than one tile, weight gradients are accumulated across
tiles in fp32 by GEMMs that write fp32 (``addmm_fp32_``: no 16-bit product of a tile is
ever rounded and added) and cast once at the end; the loss head's weight gradient stays
fp32 until backward has scaled it. So the result does not depend on the tile count
beyond the rounding of the last cast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

_LOW_PRECISION = (torch.float16, torch.bfloat16)


TileBounds = Callable[[int, int], Iterator[tuple[int, int]]]
"""A tile policy: (rows, num_tiles) -> the (start, end) row ranges a tile loop runs over. `tile_bounds` runs
every tile; the planner passes one that runs representative tiles (`planning.fake_world.representative_tile_bounds`)."""


def tile_bounds(rows: int, num_tiles: int) -> Iterator[tuple[int, int]]:
    """Yield ``(start, end)`` of each non-empty tile; sizes differ by at most one row."""
    for i in range(num_tiles):
        start, end = i * rows // num_tiles, (i + 1) * rows // num_tiles
        if end > start:
            yield start, end


RankLoop = Callable[[int], Iterable[int]]
"""A rank-loop policy: cp -> the ranks a loop of per-rank GEMMs into one preallocated buffer runs over.
`every_rank` runs all; the planner passes one that runs two (`planning.fake_world.representative_ranks`)."""


def every_rank(cp: int) -> range:
    return range(cp)


def _check_num_tiles(num_tiles: object) -> int:
    """Raise unless ``num_tiles`` is a positive int (it must come from config)."""
    if isinstance(num_tiles, bool) or not isinstance(num_tiles, int):
        raise TypeError(f"num_tiles must be an int from the config, got {num_tiles!r}")
    if num_tiles < 1:
        raise ValueError(f"num_tiles must be >= 1, got {num_tiles}")
    return num_tiles


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on ``x`` run in: the autocast dtype if autocast is on, else x's."""
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _autocast_off(x: torch.Tensor):
    """Disable autocast inside a Function so forward and backward run identical math."""
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _empty_rows(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised contiguous buffer shaped like ``like`` (row slices are then contiguous)."""
    return torch.empty(like.shape, dtype=dtype, device=like.device)


def _new_accumulator(weight: torch.Tensor, dtype: torch.dtype, many_tiles: bool) -> torch.Tensor:
    """Zeroed weight-gradient buffer: fp32 when 16-bit grads are summed over several tiles."""
    acc_dtype = torch.float32 if (many_tiles and dtype in _LOW_PRECISION) else dtype
    return torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)


_FP32_OUT_GEMM: dict[tuple[type, str], bool] = {}
"""(tensor type, device type) -> whether `torch.addmm(..., out_dtype=fp32, out=acc)` runs there (what the
hardware and torch answer, remembered; nothing sets it)."""


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fp32_out_gemm: bool | None = None) -> None:
    """``acc += a @ b`` accumulated in ``acc``'s dtype (fp32 for 16-bit a, b), rounded nowhere else.

    With 16-bit operands and an fp32 accumulator this is one GEMM writing fp32 output
    (``addmm`` with ``out_dtype``: CUDA, and fake tensors on any device); where that is
    unavailable (CPU, or a torch whose CUDA kernel wants ``acc`` in the operands' dtype)
    the operands are upcast to fp32 copies, block by block. Either way no 16-bit product
    is rounded before it is added. `fp32_out_gemm` names the path (the planner states its target's, whatever
    tensors it traces with); None: the device's, tried once.
    """
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    key = (type(acc), acc.device.type)
    if _FP32_OUT_GEMM.get(key, True) if fp32_out_gemm is None else fp32_out_gemm:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _FP32_OUT_GEMM[key] = True
            return
        except (NotImplementedError, RuntimeError, TypeError):  # refused before any work is launched
            _FP32_OUT_GEMM[key] = False
    _upcast_addmm_(acc, a, b)


def _upcast_addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, elements: int = 1 << 22) -> None:
    """``acc += a @ b`` from fp32 copies of blocks of a and b, each at most `elements` (16 MiB in fp32)."""
    (M, K), N = a.shape, b.shape[1]
    k_step = max(1, min(K, elements // max(N, 1)))
    m_step = max(1, min(M, elements // k_step))
    for m0 in range(0, M, m_step):
        for k0 in range(0, K, k_step):
            acc[m0:m0 + m_step].addmm_(a[m0:m0 + m_step, k0:k0 + k_step].to(acc.dtype),
                                       b[k0:k0 + k_step].to(acc.dtype))


def fp32_out_gemm_available(device: torch.device) -> bool | None:
    """Whether the fp32-output GEMM ran on `device` (None: not tried yet)."""
    return _FP32_OUT_GEMM.get((torch.Tensor, device.type))


def _accumulate_at_b(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fp32_out_gemm: bool | None) -> None:
    """``acc += a.T @ b``, in place, accumulated in ``acc``'s dtype (no tile-sized 16-bit product)."""
    addmm_fp32_(acc, a.t(), b, fp32_out_gemm)


# ----------------------------------------------------------------------------- MLP


def _swiglu_tile_forward(xt, w_gate, w_up, w_down) -> torch.Tensor:
    """``silu(xt Wg^T) * (xt Wu^T)`` projected by ``Wd``; in-place to hold two tile buffers."""
    gate = F.linear(xt, w_gate)
    F.silu(gate, inplace=True)
    gate.mul_(F.linear(xt, w_up))
    return F.linear(gate, w_down)


def _swiglu_tile_backward(xt, dy, w_gate, w_up, w_down, grads, grad_x_tile, fp32_out_gemm) -> None:
    """Recompute one tile and add its gradients.

    ``grads`` holds the accumulators (or None) for (w_gate, w_up, w_down); ``grad_x_tile``
    is the slice of the input gradient to fill (or None). At most four tile x ffn
    buffers are alive at once.
    """
    acc_gate, acc_up, acc_down = grads
    gate = F.linear(xt, w_gate)
    up = F.linear(xt, w_up)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    # silu'(g) = sig * (1 + g - g * sig) = sig * (1 + g - silu), written over gate.
    dsilu = gate.sub_(silu).add_(1).mul_(sig)
    del sig
    if acc_down is not None:
        _accumulate_at_b(acc_down, dy, silu * up, fp32_out_gemm)
    d_act = dy @ w_down
    d_up = silu.mul_(d_act)
    d_gate = d_act.mul_(up).mul_(dsilu)
    del up, dsilu
    if acc_gate is not None:
        _accumulate_at_b(acc_gate, d_gate, xt, fp32_out_gemm)
    if acc_up is not None:
        _accumulate_at_b(acc_up, d_up, xt, fp32_out_gemm)
    if grad_x_tile is not None:
        torch.mm(d_gate, w_gate, out=grad_x_tile)
        grad_x_tile.addmm_(d_up, w_up)


class _TiledSwiGLU(torch.autograd.Function):
    """SwiGLU MLP over row tiles; saves only the input and the weights."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, num_tiles, bounds, fp32_out_gemm):
        dtype = _compute_dtype(x)
        with _autocast_off(x):
            rows = x.reshape(-1, x.shape[-1])
            wg, wu, wd = (w.to(dtype) for w in (w_gate, w_up, w_down))
            out = rows.new_empty((rows.shape[0], wd.shape[0]), dtype=dtype)
            for start, end in bounds(rows.shape[0], num_tiles):
                out[start:end] = _swiglu_tile_forward(rows[start:end].to(dtype), wg, wu, wd)
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        ctx.num_tiles, ctx.dtype, ctx.bounds, ctx.fp32_out_gemm = num_tiles, dtype, bounds, fp32_out_gemm
        return out.view(*x.shape[:-1], wd.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, w_gate, w_up, w_down = ctx.saved_tensors
        dtype, num_tiles = ctx.dtype, ctx.num_tiles
        need_x, *need_w = ctx.needs_input_grad[:4]
        with _autocast_off(x):
            rows = x.reshape(-1, x.shape[-1])
            dy_rows = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
            weights = [w.to(dtype) for w in (w_gate, w_up, w_down)]
            bounds = list(ctx.bounds(rows.shape[0], num_tiles))
            grads = [
                _new_accumulator(w, dtype, len(bounds) > 1) if need else None
                for w, need in zip(weights, need_w)
            ]
            grad_x = _empty_rows(rows, dtype) if need_x else None
            for start, end in bounds:
                gx_tile = grad_x[start:end] if need_x else None
                _swiglu_tile_backward(
                    rows[start:end].to(dtype), dy_rows[start:end], *weights, grads, gx_tile, ctx.fp32_out_gemm
                )
        originals = (w_gate, w_up, w_down)
        grad_ws = [None if g is None else g.to(w.dtype) for g, w in zip(grads, originals)]
        grad_x = None if grad_x is None else grad_x.view(x.shape).to(x.dtype)
        return (grad_x, *grad_ws, None, None, None)


def _check_mlp_shapes(x, w_gate, w_up, w_down) -> None:
    """Raise a clear error unless the shapes form a SwiGLU MLP."""
    if x.dim() < 2:
        raise ValueError(f"x must be [..., S, hidden], got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    for name, w in (("w_gate", w_gate), ("w_up", w_up)):
        if w.dim() != 2 or w.shape[1] != hidden:
            raise ValueError(f"{name} must be [ffn, {hidden}], got {tuple(w.shape)}")
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up {tuple(w_up.shape)} must match w_gate {tuple(w_gate.shape)}")
    if w_down.dim() != 2 or w_down.shape[1] != w_gate.shape[0]:
        raise ValueError(f"w_down must be [out, {w_gate.shape[0]}], got {tuple(w_down.shape)}")


def tiled_swiglu_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    num_tiles: int,
    bounds: TileBounds = tile_bounds,
    fp32_out_gemm: bool | None = None,
) -> torch.Tensor:
    """``F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)`` over tiles.

    ``x`` is ``[..., S, hidden]``; its leading dims are flattened with the sequence and
    the rows are cut into ``num_tiles`` tiles. Forward keeps nothing but ``x`` and the
    weights; backward recomputes tile by tile and returns one gradient per weight. `bounds` is the tile policy,
    `fp32_out_gemm` how 16-bit tiles' weight gradients are summed in fp32 (`addmm_fp32_`).
    """
    _check_num_tiles(num_tiles)
    _check_mlp_shapes(x, w_gate, w_up, w_down)
    return _TiledSwiGLU.apply(x, w_gate, w_up, w_down, num_tiles, bounds, fp32_out_gemm)


# ----------------------------------------------------------------------- loss


def _logits_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logits are upcast to fp32 for the log-sum-exp (fp64 inputs stay fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _tile_loss_and_grad_logits(logits, labels, ignore_index, need_grad):
    """Sum of the tile's token losses; turns ``logits`` (fp32, owned) into d loss/d logits.

    Works in place on the one ``rows x V`` fp32 buffer: max-shift, exp, normalise to the
    softmax, subtract one at each label; ignored rows are zeroed. Returns
    ``(loss_sum, grad_logits or None)``.
    """
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(1)
    target = logits.gather(1, safe_labels).squeeze(1)
    row_max = logits.amax(dim=1, keepdim=True)
    sum_exp = logits.sub_(row_max).exp_().sum(dim=1, keepdim=True)
    log_sum_exp = (row_max + sum_exp.log()).squeeze(1)
    loss = torch.where(valid, log_sum_exp - target, torch.zeros_like(target)).sum()
    if not need_grad:
        return loss, None
    grad = logits.div_(sum_exp)
    grad.scatter_add_(1, safe_labels, -valid.unsqueeze(1).to(grad.dtype))
    return loss, grad.mul_(valid.unsqueeze(1))


def _ce_tile(h_tile, weight, labels, ignore_index, grad_h_tile, grad_w, fp32_out_gemm):
    """Loss sum of one row tile; writes its hidden gradient and adds its weight gradient.

    ``grad_h_tile`` / ``grad_w`` are None when that gradient is not needed.
    """
    need_grad = grad_h_tile is not None or grad_w is not None
    logits = F.linear(h_tile, weight).to(_logits_dtype(h_tile.dtype))
    loss, grad_logits = _tile_loss_and_grad_logits(logits, labels, ignore_index, need_grad)
    del logits  # grad_logits aliases it; the cast below may free the fp32 buffer early
    if grad_logits is None:
        return loss
    grad_logits = grad_logits.to(h_tile.dtype)
    if grad_h_tile is not None:
        torch.mm(grad_logits, weight, out=grad_h_tile)
    if grad_w is not None:
        _accumulate_at_b(grad_w, grad_logits, h_tile, fp32_out_gemm)
    return loss


class _TiledLinearCrossEntropy(torch.autograd.Function):
    """Fused output projection + cross-entropy over row tiles.

    Gradients are computed in forward, tile by tile, and only scaled in backward.
    Why not recompute them in backward: at large N both variants peak at the same
    moment with the same buffers alive (hidden [N, h], grad_hidden [N, h], the weight
    gradient [V, h] and one fp32 logits tile), so recomputing buys no memory. It costs
    a second logits matmul (4 matmuls of N x V x h instead of 3) and must save
    ``hidden`` and the weight for backward. Precomputing saves neither: between
    forward and backward it holds grad_hidden in place of hidden (same size) plus the
    weight gradient, and backward is an in-place scalar multiply.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, num_tiles, ignore_index, tile_policy, fp32_out_gemm):
        dtype = _compute_dtype(hidden)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        bounds = list(tile_policy(hidden.shape[0], num_tiles))
        with _autocast_off(hidden):
            w = weight.to(dtype)
            grad_h = _empty_rows(hidden, dtype) if need_h else None
            grad_w = _new_accumulator(w, dtype, len(bounds) > 1) if need_w else None
            loss = torch.zeros((), dtype=_logits_dtype(dtype), device=hidden.device)
            for start, end in bounds:
                grad_h_tile = grad_h[start:end] if need_h else None
                loss += _ce_tile(
                    hidden[start:end].to(dtype),
                    w,
                    labels[start:end],
                    ignore_index,
                    grad_h_tile,
                    grad_w,
                    fp32_out_gemm,
                )
        num_valid = (labels != ignore_index).sum()
        ctx.mark_non_differentiable(num_valid)
        ctx.grad_hidden = None if grad_h is None else grad_h.to(hidden.dtype)
        ctx.grad_weight = grad_w  # kept in its accumulation dtype: scaled, then cast once, in backward
        ctx.weight_dtype = weight.dtype
        return loss, num_valid

    @staticmethod
    def backward(ctx, grad_loss, _grad_num_valid):
        grad_h, grad_w = ctx.grad_hidden, ctx.grad_weight
        if grad_h is None and grad_w is None:
            raise RuntimeError(
                "tiled_linear_cross_entropy: backward ran twice; its precomputed "
                "gradients are consumed by the first backward (retain_graph is unsupported)"
            )
        # The buffers belong to this node alone, so scale them in place (no second copy).
        ctx.grad_hidden = ctx.grad_weight = None
        if grad_h is not None:
            grad_h.mul_(grad_loss)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None


def _check_loss_shapes(hidden, weight, labels) -> None:
    """Raise a clear error unless hidden [N, h], weight [V, h], labels [N] int64."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, h], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, {hidden.shape[1]}], got {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if labels.dtype != torch.int64:
        raise TypeError(f"labels must be int64, got {labels.dtype}")


def tiled_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_tiles: int,
    ignore_index: int = -100,
    bounds: TileBounds = tile_bounds,
    fp32_out_gemm: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies of ``hidden @ weight.T`` against ``labels``, tiled.

    Returns ``(loss_sum, num_valid)``: an fp32 scalar and an int64 scalar (rows whose
    label is ``ignore_index`` count in neither). The mean over the global batch is the
    caller's: all-reduce both, then divide. `bounds` and `fp32_out_gemm` as in ``tiled_swiglu_mlp``.
    """
    _check_num_tiles(num_tiles)
    _check_loss_shapes(hidden, weight, labels)
    return _TiledLinearCrossEntropy.apply(hidden, weight, labels, num_tiles, ignore_index, bounds, fp32_out_gemm)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Untiled reference of ``tiled_linear_cross_entropy`` with plain autograd.

    Builds the full ``N x V`` logits (upcast to fp32); same return contract.
    """
    _check_loss_shapes(hidden, weight, labels)
    logits = F.linear(hidden, weight).to(_logits_dtype(hidden.dtype))
    loss_sum = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return loss_sum, (labels != ignore_index).sum()
