"""One training step: forward/backward over micro-batches with exact global loss normalisation.

The loss of a step is the sum of token losses over every valid (not ignored) token of
the global batch divided by their global count. Each rank knows its local sum; the count
is summed over batch x cp ranks before backward. FSDP averages gradients over the ranks,
so each rank's backward is scaled by that number to produce the gradient of the global
mean exactly, whatever the split of valid tokens between ranks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_lc.parallel_state import ParallelState
from megatron_lc.training.optim import HostAdamW, clip_grad_norm

IGNORE_INDEX = -100


@dataclass
class StepResult:
    loss: torch.Tensor
    """Mean loss over the step's valid tokens (every rank, every micro-batch)."""
    num_valid_tokens: torch.Tensor
    """Global count of valid tokens."""
    grad_norm: torch.Tensor | None = None
    """Global gradient norm before clipping (None from `forward_backward`)."""


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


def forward_backward(model, micro_batches: Sequence, pstate: ParallelState, device: torch.device) -> StepResult:
    """Accumulate gradients of the global mean loss over `micro_batches` (objects with
    input_ids, labels, position_ids [B, S_local] and cu_seqlens)."""
    local_valid = sum((mb.labels != IGNORE_INDEX).sum() for mb in micro_batches)
    # Counted in int64: a float32 count is inexact past 2**24 tokens, a step's worth at a million tokens a sample.
    num_valid = _sum_over(torch.as_tensor(local_valid, dtype=torch.int64, device=device), pstate.loss_group)
    scale = pstate.grad_averaging_size / num_valid.clamp(min=1)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for mb in micro_batches:
        token_loss_sum, _ = model(mb.input_ids.to(device), mb.position_ids.to(device), mb.labels.to(device),
                                  tuple(mb.cu_seqlens))
        (token_loss_sum * scale).backward()
        loss_sum += token_loss_sum.detach()
    loss = _sum_over(loss_sum, pstate.loss_group) / num_valid.clamp(min=1)
    return StepResult(loss, num_valid)


def step_autocast(bf16: bool, pstate: ParallelState, device_type: str):
    """The autocast a step runs under: with --bf16 in one process, bf16 compute over fp32 parameters
    (a sharded run gets bf16 compute from FSDP's mixed-precision policy instead)."""
    if bf16 and not pstate.distributed:
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(model, optimizer, micro_batches: Sequence, pstate: ParallelState, device: torch.device,
               clip_grad: float | None = 1.0, may_step: Callable[[StepResult], bool] | None = None) -> StepResult:
    """forward_backward, clip by the global norm, optimizer step (unless `may_step` says no), zero grads."""
    result = forward_backward(model, micro_batches, pstate, device)
    if isinstance(optimizer, HostAdamW):  # the gradients are on the host already
        result.grad_norm = optimizer.clip_grad_norm(clip_grad, device)
    else:
        result.grad_norm = clip_grad_norm(model.parameters(), clip_grad)
    if may_step is None or may_step(result):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return result
