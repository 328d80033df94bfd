"""The learning-rate and weight-decay schedules, as Megatron-LM's `--lr-decay-style` and
`--weight-decay-incr-style` define them.

The rate and the decay are pure functions of the step and a few settings, so a resumed run
computes exactly the values the uninterrupted one would have, and a checkpoint records the
settings (not a rate) so a change on resume is seen, refused or applied, never mixed.

Iteration-based runs (`--train-iters`) count warmup and decay in optimizer steps; sample-based
runs (`--train-samples`) count them in samples, as Megatron-LM does (`samples_per_step` is the
global batch: step `s` starts after `s * samples_per_step` samples).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup from `init_lr` to `lr`, then decay to `min_lr` by `decay_iters` in the chosen style;
    weight decay from `start_wd` to `end_wd` over `wd_incr_iters`."""

    lr: float
    """Peak rate (--lr)."""
    min_lr: float
    """Rate at the end of the decay (--min-lr)."""
    warmup_iters: int
    """Warmup length: steps, or samples when `samples_per_step` is set."""
    decay_iters: int
    """Where the decay reaches `min_lr`: a step, or a sample count when `samples_per_step` is set."""
    decay_style: str = "cosine"
    """--lr-decay-style."""
    wsd_decay_iters: int = 0
    """WSD: length of the final decay (steps or samples)."""
    wsd_decay_style: str = "linear"
    """WSD: shape of the final decay."""
    init_lr: float = 0.0
    """Rate warmup starts from (--lr-warmup-init)."""
    samples_per_step: int | None = None
    """None: the lengths above count steps (--train-iters); else they count samples (--train-samples) and
    each step consumes this many (the global batch)."""
    start_wd: float | None = None
    """Weight decay at the start (None: not scheduled, the optimizer's own)."""
    end_wd: float | None = None
    """Weight decay at `wd_incr_iters` and after."""
    wd_incr_iters: int = 0
    """Length of the weight-decay increase (the whole run: steps, or samples)."""
    wd_incr_style: str = "constant"
    """--weight-decay-incr-style: constant, linear or cosine."""

    def _position(self, step: int) -> tuple[int, int]:
        """(where 0-based `step` starts, one step's length) in the schedule's unit."""
        unit = self.samples_per_step or 1
        return step * unit, unit

    def __call__(self, step: int) -> float:
        """Rate of 0-based step `step` (the first optimizer step is step 0)."""
        p, unit = self._position(step)
        if self.warmup_iters and p < self.warmup_iters:
            # Reaches `lr` at the warmup's last step: step 0 runs at init + (lr - init) / warmup, not at init.
            return self.init_lr + (self.lr - self.init_lr) * min(p + unit, self.warmup_iters) / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        if p >= self.decay_iters:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return max(self.min_lr, self.lr * math.sqrt(max(self.warmup_iters, 1)) / math.sqrt(max(p, 1)))
        return self.min_lr + self._coefficient(p) * (self.lr - self.min_lr)

    def _coefficient(self, p: int) -> float:
        """1 at the end of warmup, 0 at `decay_iters`."""
        if self.decay_style == "WSD":
            anneal_start = self.decay_iters - self.wsd_decay_iters
            if p <= anneal_start:
                return 1.0
            return _decay(self.wsd_decay_style, (p - anneal_start) / self.wsd_decay_iters)
        return _decay(self.decay_style, (p - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters))

    def weight_decay(self, step: int) -> float | None:
        """Weight decay of 0-based step `step`, as Megatron-LM's get_wd (None when not scheduled)."""
        if self.start_wd is None or self.end_wd is None:
            return None
        p, _ = self._position(step)
        if p > self.wd_incr_iters or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = p / max(1, self.wd_incr_iters)
        if self.wd_incr_style == "linear":
            coeff = ratio
        elif self.wd_incr_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        else:
            raise ValueError(f"unknown weight decay increment style {self.wd_incr_style!r}")
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict, current: LRSchedule) -> LRSchedule:
        """A checkpoint's schedule; settings it does not record (older checkpoints) are `current`'s."""
        known = {f.name for f in dataclasses.fields(cls)}
        return dataclasses.replace(current, **{k: v for k, v in saved.items() if k in known})


def _decay(style: str, ratio: float) -> float:
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    raise ValueError(f"unknown decay style {style!r}")


def schedule_from_config(cfg, world_size: int = 1) -> LRSchedule:
    """The schedule of a TrainConfig on `world_size` ranks (sample-based runs need the global batch);
    ValueError naming the flag when its settings contradict."""
    o, t = cfg.optim, cfg.train
    if t.train_samples is not None:  # Megatron-LM's sample-based schedule
        unit, names = cfg.global_batch(world_size), ("--lr-warmup-samples", "--lr-decay-samples", "--lr-wsd-decay-samples")
        decay = o.lr_decay_samples if o.lr_decay_samples is not None else t.train_samples
        warmup_given, wsd_given, total = o.lr_warmup_samples, o.lr_wsd_decay_samples, t.train_samples
    else:
        unit, names = None, ("--lr-warmup-iters", "--lr-decay-iters", "--lr-wsd-decay-iters")
        total = t.train_iters if t.train_iters is not None else 10
        decay = o.lr_decay_iters if o.lr_decay_iters is not None else total
        warmup_given, wsd_given = o.lr_warmup_iters, o.lr_wsd_decay_iters
    warmup = round(o.lr_warmup_fraction * decay) if o.lr_warmup_fraction is not None else warmup_given
    if warmup < 0 or decay < 1:
        raise ValueError(f"{names[0]} {warmup} and {names[1]} {decay}: need warmup >= 0, decay >= 1")
    if o.lr_decay_style not in ("constant", "inverse-square-root") and warmup > decay:
        raise ValueError(f"{names[0]} {warmup} is longer than {names[1]} {decay}")
    wsd = wsd_given or 0
    if o.lr_decay_style == "WSD" and not 0 < wsd <= decay - warmup:
        raise ValueError(f"--lr-decay-style WSD needs {names[2]} in 1..{decay - warmup} (the final decay), got "
                         f"{wsd_given}")
    if o.weight_decay_incr_style == "constant":
        start_wd = end_wd = o.weight_decay
    else:
        start_wd, end_wd = o.start_weight_decay, o.end_weight_decay
    return LRSchedule(o.lr, o.min_lr, warmup, decay, o.lr_decay_style, wsd, o.lr_wsd_decay_style,
                      init_lr=o.lr_warmup_init, samples_per_step=unit, start_wd=start_wd, end_wd=end_wd,
                      wd_incr_iters=total, wd_incr_style=o.weight_decay_incr_style)
