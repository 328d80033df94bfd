"""The learning-rate schedule: Megatron-LM's decay styles, warmup, and flag checks."""

import math

import pytest

from megatron_lc.errors import ConfigError
from megatron_lc.arguments import parse_config
from megatron_lc.training.schedule import LRSchedule, schedule_from_config


def _schedule(*flags):
    cfg = parse_config(["--mock-data", "--lr", "1.0", "--min-lr", "0.1", "--train-iters", "10", *flags])
    cfg.validate(1)
    return schedule_from_config(cfg)


def test_warmup_is_linear_and_reaches_the_peak_at_its_last_step():
    s = _schedule("--lr-warmup-iters", "4")
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("style, middle", [("linear", 0.55), ("cosine", 0.55), ("constant", 1.0)])
def test_decay_styles_start_at_the_peak_and_end_at_min_lr(style, middle):
    s = _schedule("--lr-decay-style", style)
    assert s(0) == 1.0 and math.isclose(s(5), middle)
    assert s(10) == (1.0 if style == "constant" else 0.1)


def test_cosine_and_linear_differ_between_their_ends():
    assert _schedule("--lr-decay-style", "cosine")(2) > _schedule("--lr-decay-style", "linear")(2)


def test_inverse_square_root_falls_as_one_over_root_step_with_a_floor():
    s = _schedule("--lr-decay-style", "inverse-square-root", "--lr-warmup-iters", "4", "--lr-decay-iters", "100000")
    assert math.isclose(s(16), 0.5) and s(90_000) == 0.1
    assert _schedule("--lr-decay-style", "inverse-square-root", "--lr-warmup-iters", "4")(16) == 0.1  # past decay


def test_wsd_holds_the_peak_then_decays_over_its_last_iterations():
    s = _schedule("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4")
    assert [s(i) for i in range(7)] == [1.0] * 7
    assert math.isclose(s(8), 0.55) and s(10) == 0.1


def test_warmup_fraction_and_decay_iters():
    s = _schedule("--lr-warmup-fraction", "0.25", "--lr-decay-iters", "8")
    assert s == LRSchedule(1.0, 0.1, 2, 8, "cosine", 0, "linear", start_wd=0.1, end_wd=0.1, wd_incr_iters=10)


@pytest.mark.parametrize("flags, message", [
    (["--min-lr", "2.0"], "--min-lr 2.0 is above --lr"),
    (["--lr-decay-style", "WSD"], "--lr-wsd-decay-iters"),
    (["--lr-warmup-iters", "20"], "longer than --lr-decay-iters"),
    (["--lr-warmup-fraction", "0.5", "--lr-warmup-iters", "2"], "--lr-warmup-fraction"),
])
def test_contradicting_schedule_flags_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        _schedule(*flags)
