"""Activation checkpointing of one transformer block, optionally offloading its input.

``checkpoint_block`` is reentrant-style: one autograd node per block, which runs the
block under no_grad in forward and keeps only its input (on the accelerator, or on the
host through an ``OffloadScheduler``). Its backward brings the input back, recomputes
the block with autograd on, and calls ``torch.autograd.backward`` on it; only then, past
the block's memory peak, does it ask the scheduler to start bringing back the previous
layer's input (the copy then overlaps the hand-off to that layer and costs no memory at
this block's peak; a prefetch at the start of the backward would keep one more block
input through it, which is what the scheduler's ``prefetch_early`` chooses, so that the copy
runs during this backward): parameter gradients accumulate into ``.grad`` exactly
as with reentrant checkpointing, which FSDP2's hooks rely on.

The backward starts from the recomputed output's gradient edge, not from the output
tensor, so the output itself is dropped before the backward runs (Megatron-LM frees
pipeline outputs for the same reason): a block ends in the residual add, whose backward
keeps none of its tensors, so the output's storage is freed. At 650K local tokens of
Llama-8B that is 5.3 GB less through every layer's backward. Were the last op one that
saves its output, autograd would keep it alive and nothing would change.

A block given as its residual branches (``y = x + f1(x)``, ``z = y + f2(y)``, ...)
is recomputed branch by branch, and its backward runs one branch at a time, adding each
branch's input gradient to the gradient arriving from above in place, where autograd
would add them out of place (it must, while the arriving gradient is referenced). When
the caller vouches that the output's gradient is the block's alone
(``owns_output_grad``: the output has one consumer, whose backward hands over a gradient
nobody else holds), that gradient's own buffer is the accumulator: one `[tokens, hidden]`
gradient travels down the whole network instead of two per block.

Sparse offload (an ``OffloadScheduler`` with ``every_k = k > 1``) keeps only the first input of
each segment of k offloaded layers. Each block records, in forward, how to run itself again
(``replay``: its forward under no_grad, with ``replay_params`` making its parameters usable
outside its own forward: FSDP2 gathers them). The backward of a block j that kept nothing
fetches its segment's kept input x_s (the host copy stays) and runs blocks s, ..., j-1 forward
under no_grad to rebuild x_j, dropping each intermediate input as soon as the next exists; then
it recomputes and backpropagates block j exactly as a block that kept its input. At most one
block input is resident at a time, as with k = 1, and no autograd graph is kept for the replayed
blocks. Schedule and cost, for a segment of r layers s..s+r-1 (the backward runs last first):
layer s+i replays i blocks, so the segment costs r(r-1)/2 block forwards more than k = 1, i.e.
(k-1)/2 extra block forwards per layer for full segments (0.5 for k = 2, 1.5 for k = 4), and its
kept input is copied back r times (once per layer, as many host-to-accelerator copies as k = 1
makes, from one host slot instead of r). With FSDP2, a replayed block's parameters are
gathered for its replay and sharded again after, except block j-1's: its own backward comes next
and FSDP would gather them now anyway, so r(r-1)/2 - (r-1) extra all-gathers per segment (none for
k = 2). The replay is bit-identical to the forward (same ops, same inputs, no randomness), so
losses and gradients equal those of k = 1 exactly.

Kept attention (``kept``, ``--keep-attention-output``): the caller passes the block's ``KeptAttention``
store, the one its attention op is handed too. Each forward opens a ``KeptRecord`` of its own, held by its
autograd node, and runs the block with the store keeping into it: the attention op keeps its output and
log-sum-exp there (offloaded with the block input when the layer offloads). The recompute runs with the
store replaying that record, so the attention op takes them back instead of running its forward kernel
(`memory/kept_attention.py`). The store is in a mode only inside these calls: a sparse segment's replays find
it off and compute attention as the forward did; with ``--replay-kept-attention`` each replayed block's store
peeks at its own record without consuming it, so the input of block l+1 is rebuilt from block l's input and
kept attention output by the projections, norms and MLP alone, and attention runs once forward and once
backward per block.

RNG state is not saved or restored: LLaMA blocks have no dropout or other randomness,
so the recompute is deterministic. A block that draws random numbers would recompute
with different ones.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch

from .kept_attention import KeptAttention, KeptRecord
from .offload import OffloadScheduler


def _autocast_states(device: torch.device) -> list[tuple[str, bool, torch.dtype, bool]]:
    """Autocast settings of the tensor's device type (and cpu), to replay in backward."""
    device_types = {device.type, "cpu"}
    return [
        (
            dt,
            torch.is_autocast_enabled(dt),
            torch.get_autocast_dtype(dt),
            torch.is_autocast_cache_enabled(),
        )
        for dt in sorted(device_types)
        if torch.amp.is_autocast_available(dt)
    ]


def _replay_autocast(states, stack: contextlib.ExitStack) -> None:
    """Enter the recorded autocast settings on ``stack``."""
    for device_type, enabled, dtype, cache in states:
        stack.enter_context(
            torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache)
        )


class _CheckpointBlock(torch.autograd.Function):
    """One block, recomputed in backward; saves only the block input (maybe on the host)."""

    @staticmethod
    def forward(ctx, fn, x, offload, layer_idx, replay_params, kept, _grad_anchor):
        ctx.fn = fn
        _keep_input(ctx, x, offload, layer_idx, _replay(fn, replay_params), kept)
        with torch.no_grad(), _keeping(ctx):
            y = fn(x)
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"checkpoint_block: fn must return a Tensor, got {type(y).__name__}")
        return y

    @staticmethod
    def backward(ctx, grad_y):
        with _released_on_error(ctx):
            return _CheckpointBlock._backward(ctx, grad_y)

    @staticmethod
    def _backward(ctx, grad_y):
        x = _restore_input(ctx)
        _prefetch_previous(ctx, early=True)
        x = x.detach().requires_grad_(True)
        with torch.enable_grad(), contextlib.ExitStack() as stack, _replaying(ctx):
            _replay_autocast(ctx.autocast, stack)
            y = ctx.fn(x)
        if y.requires_grad:
            edge = torch.autograd.graph.get_gradient_edge(y)
            del y  # freed here unless the graph saved it
            torch.autograd.backward(edge, grad_y)
        grad_x = x.grad if ctx.needs_input_grad[1] else None
        _prefetch_previous(ctx, early=False)
        return None, grad_x, None, None, None, None, None


class _CheckpointResidualBlock(torch.autograd.Function):
    """A block of residual branches, recomputed in backward; saves only the block input (maybe on the host)."""

    @staticmethod
    def forward(ctx, branches, x, offload, layer_idx, owns_output_grad, replay_params, kept, _grad_anchor):
        ctx.branches, ctx.owns_output_grad = branches, owns_output_grad
        _keep_input(ctx, x, offload, layer_idx, _replay(lambda t: _residual_chain(branches, t), replay_params), kept)
        with torch.no_grad(), _keeping(ctx):
            return _residual_chain(branches, x)

    @staticmethod
    def backward(ctx, grad_out):
        with _released_on_error(ctx):
            return _CheckpointResidualBlock._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x = _restore_input(ctx)
        _prefetch_previous(ctx, early=True)
        leaves, edges = [], []
        with torch.enable_grad(), contextlib.ExitStack() as stack, _replaying(ctx):
            _replay_autocast(ctx.autocast, stack)
            for i, branch in enumerate(ctx.branches):
                leaf = x.detach().requires_grad_(True)
                out = branch(leaf)
                if i + 1 < len(ctx.branches):
                    with torch.no_grad():
                        x = leaf + out  # the next branch's input; the block's output itself is never needed
                leaves.append(leaf)
                edges.append(torch.autograd.graph.get_gradient_edge(out) if out.requires_grad else None)
                del out  # kept only if the branch's graph saved it
        del x, leaf  # each branch input lives in `leaves` only, until its gradient is taken
        grad, owned = grad_out, ctx.owns_output_grad
        while leaves:  # last branch first; each branch input is released once its gradient is taken
            leaf, edge = leaves.pop(), edges.pop()
            if edge is not None:
                torch.autograd.backward(edge, grad)
            summed = _add_branch_grad(grad, leaf.grad, owned)
            owned = owned or summed is not grad  # a new buffer, or the branch's gradient, is this backward's own
            grad = summed
            del leaf, edge
        _prefetch_previous(ctx, early=False)
        return None, grad if ctx.needs_input_grad[1] else None, None, None, None, None, None, None


def _residual_chain(branches, x: torch.Tensor) -> torch.Tensor:
    for branch in branches:
        x = x + branch(x)
    return x


def _add_branch_grad(grad: torch.Tensor, branch_grad: torch.Tensor | None, grad_is_ours: bool) -> torch.Tensor:
    """grad + branch_grad, into a buffer that is ours: grad itself when it is (and is a dense buffer, not
    e.g. the expanded ones of `loss.sum()`), else the branch's gradient; out of place if they share memory."""
    if branch_grad is None:
        return grad
    if _storage_id(branch_grad) == _storage_id(grad) or grad.shape != branch_grad.shape:
        return grad + branch_grad
    dtype = torch.promote_types(grad.dtype, branch_grad.dtype)
    if grad_is_ours and grad.is_contiguous() and grad.dtype == dtype:
        return grad.add_(branch_grad)
    if branch_grad.is_contiguous() and branch_grad.dtype == dtype:
        return branch_grad.add_(grad)
    return grad + branch_grad


def _storage_id(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (also for fake tensors, whose data pointers must not be read)."""
    return t.untyped_storage()._cdata


class _Segment:
    """Sparse offload: one segment's kept input and, in layer order, how to run each of its layers again."""

    def __init__(self, first: int, handle) -> None:
        self.first, self.handle = first, handle
        self.replays: list[tuple[Callable[[torch.Tensor, bool], torch.Tensor],
                                 tuple[KeptAttention, KeptRecord] | None]] = []
        """Per layer: how to run it again, and the kept attention store and record its replay reads (None: it
        computes its attention)."""


_OPEN_SEGMENTS: "weakref.WeakKeyDictionary[OffloadScheduler, _Segment]" = weakref.WeakKeyDictionary()
"""The segment each scheduler's forward is in (the layers after its first record themselves into it)."""


def _replay(fn: Callable[[torch.Tensor], torch.Tensor], replay_params) -> Callable[[torch.Tensor, bool], torch.Tensor]:
    """``fn`` run again outside its forward: ``replay(x, keep)``, its parameters made usable by
    ``replay_params(keep)`` (a context manager; ``keep``: leave them gathered, its backward is next)."""
    def replay(x: torch.Tensor, keep: bool) -> torch.Tensor:
        with replay_params(keep) if replay_params is not None else contextlib.nullcontext():
            return fn(x)
    return replay


def _keep_input(ctx, x: torch.Tensor, offload: OffloadScheduler | None, layer_idx: int, replay,
                kept: KeptAttention | None = None) -> None:
    """Keep the block input for backward (on the host when offloaded; with sparse offload only at a
    segment's first layer), the autocast state to replay, and with the block's `kept` store a record of
    this forward's attention results (``ctx.kept_record``; on the host when the layer offloads).

    Offloading starts before the block runs, so the copy overlaps this block's compute."""
    ctx.offload, ctx.layer_idx, ctx.segment = offload, layer_idx, None
    ctx.autocast = _autocast_states(x.device)
    ctx.offloaded = offload is not None and offload.should_offload(layer_idx)
    ctx.kept = kept
    ctx.kept_record = KeptRecord(offload if ctx.offloaded else None) if kept is not None else None
    if ctx.offloaded and offload.every_k > 1:
        if offload.keeps_input(layer_idx):
            ctx.handle = offload.offload(layer_idx, x)
            _OPEN_SEGMENTS[offload] = _Segment(layer_idx, ctx.handle)
        segment = _OPEN_SEGMENTS.get(offload)
        if segment is None or segment.first + len(segment.replays) != layer_idx:
            raise RuntimeError(f"checkpoint_block: sparse offload needs the layers of a segment in order; layer "
                               f"{layer_idx} ran without layer {offload.segment_start(layer_idx)} before it")
        reads_kept = ctx.kept is not None and offload.replay_kept_attention
        segment.replays.append((replay, (ctx.kept, ctx.kept_record) if reads_kept else None))
        ctx.segment = segment
        if layer_idx + 1 == offload.segment_end(layer_idx):
            del _OPEN_SEGMENTS[offload]  # complete: only its layers' backward holds it now
    elif ctx.offloaded:
        ctx.handle = offload.offload(layer_idx, x)
    else:
        ctx.save_for_backward(x)


def _keeping(ctx) -> contextlib.AbstractContextManager:
    """The block's forward: its attention op keeps into this forward's record (nothing without a store)."""
    return ctx.kept.keeping(ctx.kept_record) if ctx.kept is not None else contextlib.nullcontext()


def _replaying(ctx) -> contextlib.AbstractContextManager:
    """The block's recompute: its attention op takes back what this forward kept (nothing without a store)."""
    return ctx.kept.replaying(ctx.kept_record) if ctx.kept is not None else contextlib.nullcontext()


def _restore_input(ctx) -> torch.Tensor:
    """The block input back on the accelerator (recomputed from its segment's kept one under sparse offload)."""
    if ctx.segment is not None:
        return _recompute_input(ctx)
    if not ctx.offloaded:
        (x,) = ctx.saved_tensors
    elif ctx.handle is None:
        raise _consumed(ctx.layer_idx)
    else:
        x, ctx.handle = ctx.offload.fetch(ctx.handle), None
    return x


def _consumed(layer_idx: int) -> RuntimeError:
    return RuntimeError(f"checkpoint_block: layer {layer_idx}'s offloaded input was consumed by an "
                        "earlier backward (retain_graph is unsupported with offload)")


def _recompute_input(ctx) -> torch.Tensor:
    """Sparse offload: the segment's kept input, fetched (released at the segment's own first layer), run
    forward through the segment's layers before this one, under no_grad; one input alive at a time."""
    segment, own = ctx.segment, ctx.layer_idx == ctx.segment.first
    if segment.handle.host_buffer is None:
        raise _consumed(segment.first)
    x = ctx.offload.fetch(segment.handle, keep=not own)
    if own:
        ctx.segment = None
        return x
    replays = segment.replays[:ctx.layer_idx - segment.first]
    with torch.no_grad(), contextlib.ExitStack() as stack:
        _replay_autocast(ctx.autocast, stack)
        for i, (replay, kept) in enumerate(replays):
            with kept[0].peeking(kept[1]) if kept is not None else contextlib.nullcontext():
                x = replay(x, i == len(replays) - 1)  # the previous input is dropped here
    return x


@contextlib.contextmanager
def _released_on_error(ctx):
    """A block backward that raises leaves no copy in flight: the scheduler waits for its side stream, then lets
    every offloaded tensor go (the step is abandoned; the next one offloads afresh). Without this, a prefetched
    input dropped unfetched could go back to the allocator while its copy still writes into it."""
    try:
        yield
    except BaseException:
        if ctx.offload is not None:
            try:
                ctx.offload.release_all()
            except Exception:  # noqa: BLE001 - a sticky CUDA error raises again here; the first one is the news
                pass
        raise


def _prefetch_previous(ctx, early: bool) -> None:
    """Start bringing back the previous layer's input (a no-op without offload or prefetch), at the start of
    this backward (`early`) or its end, as the scheduler's `prefetch_early` says."""
    if ctx.offload is not None and ctx.layer_idx > 0 and ctx.offload.prefetch_early == early:
        ctx.offload.prefetch(ctx.layer_idx - 1)


def checkpoint_block(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    offload: OffloadScheduler | None = None,
    layer_idx: int = 0,
    replay_params: Callable[[bool], contextlib.AbstractContextManager] | None = None,
    kept: KeptAttention | None = None,
) -> torch.Tensor:
    """Run ``fn(x)`` keeping only ``x`` for backward, where the block is recomputed.

    ``fn`` is the block's forward and closes over the module's parameters (they are
    not explicit inputs); their gradients accumulate into ``.grad`` during backward.
    With ``offload`` given and ``offload.should_offload(layer_idx)``, ``x`` is kept on
    the host instead of the accelerator. Autocast state is replayed in the recompute;
    RNG state is not (see the module docstring). With grad disabled, ``fn(x)`` runs
    plainly. ``replay_params(keep)``: a context in which ``fn``'s parameters can be used outside
    its own forward (sparse offload replays it in a later block's backward); None: they always can.
    ``kept``: the store ``fn`` hands its attention op; each forward keeps what the op computes into it, so
    the recompute does not run the op's forward kernel again (see the module docstring).
    """
    if not torch.is_grad_enabled():
        return fn(x)
    # A leaf that requires grad makes the output require grad even when x does not
    # (e.g. the first block on a frozen embedding), so parameter grads are not lost.
    grad_anchor = torch.empty(0, device=x.device, requires_grad=True)
    return _CheckpointBlock.apply(fn, x, offload, layer_idx, replay_params, kept, grad_anchor)


def checkpoint_residual_block(
    branches: tuple[Callable[[torch.Tensor], torch.Tensor], ...],
    x: torch.Tensor,
    *,
    offload: OffloadScheduler | None = None,
    layer_idx: int = 0,
    owns_output_grad: bool = False,
    replay_params: Callable[[bool], contextlib.AbstractContextManager] | None = None,
    kept: KeptAttention | None = None,
) -> torch.Tensor:
    """``checkpoint_block`` of the block ``x -> x + b1(x) -> ... `` given as its residual branches.

    The same function and gradients as ``checkpoint_block(lambda t: chain(t), x)``; its
    backward adds each branch's input gradient in place (see the module docstring).
    ``owns_output_grad``: the output's gradient reaches this block alone (the output has a
    single consumer), so its buffer may be accumulated into. ``replay_params``, ``kept``: as for
    ``checkpoint_block``.
    """
    if not branches:
        raise ValueError("checkpoint_residual_block needs at least one branch")
    if not torch.is_grad_enabled():
        return _residual_chain(branches, x)
    grad_anchor = torch.empty(0, device=x.device, requires_grad=True)
    return _CheckpointResidualBlock.apply(tuple(branches), x, offload, layer_idx, owns_output_grad, replay_params,
                                         kept, grad_anchor)
