"""Activation checkpointing of one transformer block, optionally offloading its input.

``checkpoint_block`` is reentrant-style: one autograd node per block, which runs the
block under no_grad in forward and keeps only its input (on the accelerator, or on the
host through an ``OffloadScheduler``). Its backward brings the input back, asks the
scheduler to start bringing back the previous layer's input (so that copy overlaps this
layer's recompute), recomputes the block with autograd on, and calls
``torch.autograd.backward`` on it: parameter gradients accumulate into ``.grad`` exactly
as with reentrant checkpointing, which FSDP2's hooks rely on.

The backward starts from the recomputed output's gradient edge, not from the output
tensor, so the output itself is dropped before the backward runs (Megatron-LM frees
pipeline outputs for the same reason): a block ends in the residual add, whose backward
keeps none of its tensors, so the output's storage is freed. At 650K local tokens of
Llama-8B that is 5.3 GB less through every layer's backward. Were the last op one that
saves its output, autograd would keep it alive and nothing would change.

RNG state is not saved or restored: LLaMA blocks have no dropout or other randomness,
so the recompute is deterministic. A block that draws random numbers would recompute
with different ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

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
    def forward(ctx, fn, x, offload, layer_idx, _grad_anchor):
        ctx.fn, ctx.offload, ctx.layer_idx = fn, offload, layer_idx
        ctx.autocast = _autocast_states(x.device)
        # Offload before the block runs, so the copy overlaps this block's compute.
        ctx.offloaded = offload is not None and offload.should_offload(layer_idx)
        if ctx.offloaded:
            ctx.handle = offload.offload(layer_idx, x)
        else:
            ctx.save_for_backward(x)
        with torch.no_grad():
            y = fn(x)
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"checkpoint_block: fn must return a Tensor, got {type(y).__name__}")
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x = _restore_input(ctx)
        x = x.detach().requires_grad_(True)
        with torch.enable_grad(), contextlib.ExitStack() as stack:
            _replay_autocast(ctx.autocast, stack)
            y = ctx.fn(x)
        if y.requires_grad:
            edge = torch.autograd.graph.get_gradient_edge(y)
            del y  # freed here unless the graph saved it
            torch.autograd.backward(edge, grad_y)
        grad_x = x.grad if ctx.needs_input_grad[1] else None
        return None, grad_x, None, None, None


def _restore_input(ctx) -> torch.Tensor:
    """The block input back on the accelerator; starts the previous layer's prefetch."""
    if not ctx.offloaded:
        (x,) = ctx.saved_tensors
    elif ctx.handle is None:
        raise RuntimeError(
            f"checkpoint_block: layer {ctx.layer_idx}'s offloaded input was consumed by an "
            "earlier backward (retain_graph is unsupported with offload)"
        )
    else:
        x, ctx.handle = ctx.offload.fetch(ctx.handle), None
    if ctx.offload is not None and ctx.layer_idx > 0:
        ctx.offload.prefetch(ctx.layer_idx - 1)
    return x


def checkpoint_block(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    offload: OffloadScheduler | None = None,
    layer_idx: int = 0,
) -> torch.Tensor:
    """Run ``fn(x)`` keeping only ``x`` for backward, where the block is recomputed.

    ``fn`` is the block's forward and closes over the module's parameters (they are
    not explicit inputs); their gradients accumulate into ``.grad`` during backward.
    With ``offload`` given and ``offload.should_offload(layer_idx)``, ``x`` is kept on
    the host instead of the accelerator. Autocast state is replayed in the recompute;
    RNG state is not (see the module docstring). With grad disabled, ``fn(x)`` runs
    plainly.
    """
    if not torch.is_grad_enabled():
        return fn(x)
    # A leaf that requires grad makes the output require grad even when x does not
    # (e.g. the first block on a frozen embedding), so parameter grads are not lost.
    grad_anchor = torch.empty(0, device=x.device, requires_grad=True)
    return _CheckpointBlock.apply(fn, x, offload, layer_idx, grad_anchor)
