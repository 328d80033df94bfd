"""The learning-rate schedule, as Megatron-LM's `--lr-decay-style` defines it.

The rate is a pure function of the step and a few settings, so a resumed run computes
exactly the rate the uninterrupted one would have, and a checkpoint records the settings
(not a rate) so a change on resume is seen, refused or applied, never mixed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup to `lr`, then decay to `min_lr` by `decay_iters` in the chosen style."""

    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    decay_style: str = "cosine"
    wsd_decay_iters: int = 0
    wsd_decay_style: str = "linear"

    def __call__(self, step: int) -> float:
        """Rate of 0-based step `step` (the first optimizer step is step 0)."""
        if self.warmup_iters and step < self.warmup_iters:
            return self.lr * (step + 1) / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        if step >= self.decay_iters:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.lr * math.sqrt(max(self.warmup_iters, 1)) / math.sqrt(max(step, 1)))
        return self.min_lr + self._coefficient(step) * (self.lr - self.min_lr)

    def _coefficient(self, step: int) -> float:
        """1 at the end of warmup, 0 at `decay_iters`."""
        if self.decay_style == "WSD":
            anneal_start = self.decay_iters - self.wsd_decay_iters
            if step <= anneal_start:
                return 1.0
            return _decay(self.wsd_decay_style, (step - anneal_start) / self.wsd_decay_iters)
        return _decay(self.decay_style, (step - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _decay(style: str, ratio: float) -> float:
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    raise ValueError(f"unknown decay style {style!r}")


def schedule_from_config(cfg) -> LRSchedule:
    """The schedule of a TrainConfig; ValueError naming the flag when its settings contradict."""
    o = cfg.optim
    decay_iters = o.lr_decay_iters if o.lr_decay_iters is not None else cfg.train.train_iters
    warmup = round(o.lr_warmup_fraction * decay_iters) if o.lr_warmup_fraction is not None else o.lr_warmup_iters
    if warmup < 0 or decay_iters < 1:
        raise ValueError(f"--lr-warmup-iters {warmup} and --lr-decay-iters {decay_iters}: need warmup >= 0, decay >= 1")
    if o.lr_decay_style not in ("constant", "inverse-square-root") and warmup > decay_iters:
        raise ValueError(f"--lr-warmup-iters {warmup} is longer than --lr-decay-iters {decay_iters}")
    wsd = o.lr_wsd_decay_iters or 0
    if o.lr_decay_style == "WSD" and not 0 < wsd <= decay_iters - warmup:
        raise ValueError(f"--lr-decay-style WSD needs --lr-wsd-decay-iters in 1..{decay_iters - warmup} "
                         f"(the final decay), got {o.lr_wsd_decay_iters}")
    return LRSchedule(o.lr, o.min_lr, warmup, decay_iters, o.lr_decay_style, wsd, o.lr_wsd_decay_style)
