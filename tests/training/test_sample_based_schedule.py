"""Megatron-LM's sample-based schedule, warmup start and weight-decay schedule, through the trainer."""

import math

import pytest

from megatron_lc.errors import ConfigError
from megatron_lc.arguments import parse_config
from megatron_lc.training.trainer import build_run, train, train_one_step
from tests.helpers import train_flags

BASE = train_flags("--lr", "1.0", "--min-lr", "0.1", "--clip-grad", "0", tiny_model=True)


def megatron_lr(n: int, init: float, peak: float, low: float, warmup: int, decay: int, style: str) -> float:
    """Megatron-LM's OptimizerParamScheduler.get_lr after `n` samples."""
    if warmup > 0 and n <= warmup:
        return init + (peak - init) * n / warmup
    if n > decay:
        return low
    ratio = (n - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return low + coeff * (peak - low)


def megatron_wd(n: int, start: float, end: float, steps: int, style: str) -> float:
    """Megatron-LM's OptimizerParamScheduler.get_wd after `n` samples."""
    if n > steps:
        return end
    ratio = n / steps
    coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return start + coeff * (end - start)


def test_train_samples_runs_samples_over_global_batch_steps_with_the_rate_counted_in_samples(tmp_path):
    flags = BASE + ["--train-samples", "23", "--global-batch-size", "2", "--lr-warmup-samples", "4",
                    "--lr-decay-samples", "20", "--lr-decay-style", "linear", "--lr-warmup-init", "0.2",
                    "--log-dir", str(tmp_path)]
    history = train(parse_config(flags))
    assert [m["step"] for m in history] == list(range(1, 12))  # 23 // 2
    # Warmup reaches --lr at its last step (the step starting at sample 2 runs at Megatron's rate after 4
    # samples); after warmup, the step starting after n samples runs at Megatron's rate of n.
    expected = [megatron_lr(min((s + 1) * 2, 4) if s * 2 < 4 else s * 2, 0.2, 1.0, 0.1, 4, 20, "linear")
                for s in range(11)]
    assert [m["lr"] for m in history] == pytest.approx(expected, rel=1e-12)
    assert history[0]["lr"] == pytest.approx(0.2 + 0.8 * 2 / 4)


def test_warmup_starts_from_lr_warmup_init_in_iteration_runs_too(tmp_path):
    history = train(parse_config(BASE + ["--train-iters", "3", "--lr-warmup-iters", "4", "--lr-decay-iters", "10", "--lr-warmup-init", "0.6",
                                         "--log-dir", str(tmp_path)]))
    assert [m["lr"] for m in history] == pytest.approx([0.7, 0.8, 0.9])


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_goes_from_start_to_end_as_megatron_schedules_it(style):
    run = build_run(parse_config(BASE + ["--train-samples", "12", "--global-batch-size", "2", "--start-weight-decay",
                                         "0.0", "--end-weight-decay", "0.5", "--weight-decay-incr-style", style]))
    for step in range(1, 4):
        train_one_step(run, step)
        wd = run.optimizer.param_groups[0]["weight_decay"]
        assert wd == pytest.approx(megatron_wd((step - 1) * 2, 0.0, 0.5, 12, style), rel=1e-12)
    assert run.schedule.weight_decay(6) == 0.5 and run.schedule.weight_decay(3) > 0  # end, and on the way


def test_constant_weight_decay_is_weight_decay_every_step():
    run = build_run(parse_config(BASE + ["--train-iters", "2", "--weight-decay", "0.03"]))
    train_one_step(run, 1)
    assert run.optimizer.param_groups[0]["weight_decay"] == 0.03 and run.schedule.weight_decay(1) == 0.03


@pytest.mark.parametrize("flags, message", [
    (["--train-samples", "8", "--train-iters", "4"], "--train-samples 8 and --train-iters 4: give one"),
    (["--train-samples", "8", "--lr-warmup-iters", "2"], "--lr-warmup-iters 2 with --train-samples"),
    (["--train-samples", "8", "--lr-decay-iters", "2"], "--lr-decay-iters 2 with --train-samples"),
    (["--lr-decay-samples", "8"], "--lr-decay-samples 8 counts samples: it needs --train-samples"),
    (["--lr-warmup-samples", "8"], "--lr-warmup-samples 8 counts samples"),
    (["--train-samples", "1", "--global-batch-size", "2"], "--train-samples 1 is less than one global batch"),
    (["--train-samples", "8", "--lr-warmup-samples", "9"], "--lr-warmup-samples 9 is longer than --lr-decay-samples 8"),
    (["--start-weight-decay", "0.1"], "need --weight-decay-incr-style linear or cosine"),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0"], "give both"),
    (["--lr-warmup-init", "-1"], "--lr-warmup-init -1.0 must be >= 0"),
])
def test_contradicting_sample_and_weight_decay_flags_are_one_line_before_any_work(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(BASE + flags).validate(world_size=1)
