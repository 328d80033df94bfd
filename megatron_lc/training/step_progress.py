"""Progress within a step: at millions of tokens one step takes hours, so the logging rank says, at most every
`every_s` seconds, how many blocks the forward and the backward of the current micro-batch have passed and when
the step should end.

Blocks are counted by module hooks (`register_forward_pre_hook`, `register_forward_hook`) and, for the
backward, by a hook on each block's input tensor, which fires once that block's backward is done. A block's
forward run again inside the backward (recomputation, --recompute-granularity) is not counted twice: it runs
while autograd executes a graph. The step's ETA is the previous step's time (or, before the first, the time the
resumed checkpoint recorded) less the time spent; none is given without either.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from megatron_lc.training.logging import format_duration

PROGRESS_EVERY_S = 60.0
"""Seconds between lines within a step (a step shorter than this prints none)."""


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a recomputed forward runs inside one)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class StepProgress:
    """Counts blocks through one step of `blocks` and says where it is, through `say`."""

    def __init__(self, blocks: list[nn.Module], say: Callable[[str], None], every_s: float = PROGRESS_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.blocks, self.say, self.every_s, self.clock = blocks, say, every_s, clock
        self.step, self.total_steps, self.micro_batches, self.expected_s = 0, 0, 1, None
        self.micro_batch = self.forward_done = self.backward_done = 0
        self.began = self.last_said = 0.0
        self._handles = []
        for i, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(self._before_forward(i)))
            self._handles.append(block.register_forward_hook(self._after_forward(i)))

    def begin(self, step: int, total_steps: int, micro_batches: int, expected_s: float | None) -> None:
        self.step, self.total_steps, self.micro_batches, self.expected_s = step, total_steps, micro_batches, expected_s
        self.micro_batch = self.forward_done = self.backward_done = 0
        self.began = self.last_said = self.clock()

    def _before_forward(self, i: int):
        def hook(module, args):
            if _in_backward():
                return
            if i == 0:
                self.micro_batch += 1
                self.forward_done = self.backward_done = 0
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
                x.register_hook(self._backward_passed(i))
        return hook

    def _after_forward(self, i: int):
        def hook(module, args, output):
            if not _in_backward():
                self.forward_done = i + 1
                self._maybe_say()
        return hook

    def _backward_passed(self, i: int):
        def hook(grad):
            self.backward_done = len(self.blocks) - i
            self._maybe_say()
        return hook

    def line(self, now: float) -> str:
        n, elapsed = len(self.blocks), now - self.began
        where = (f"backward {self.backward_done}/{n} blocks" if self.backward_done
                 else f"forward {self.forward_done}/{n} blocks")
        eta = ("" if self.expected_s is None
               else f", ETA {format_duration(max(self.expected_s - elapsed, 0.0))}")
        return (f"step {self.step:>5}/{self.total_steps} in progress | micro-batch {self.micro_batch}/"
                f"{self.micro_batches} | {where} | {format_duration(elapsed)} into the step{eta}")

    def _maybe_say(self) -> None:
        now = self.clock()
        if now - self.last_said >= self.every_s:
            self.last_said = now
            self.say(self.line(now))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
