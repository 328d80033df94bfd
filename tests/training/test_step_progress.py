"""Progress within a step: blocks through the forward, then the backward, counted once each even when the
backward recomputes the forward, with the step's ETA from the previous step's time."""

from __future__ import annotations

import pytest

from megatron_lc.arguments import parse_config
from megatron_lc.training.step_progress import StepProgress
from megatron_lc.training.trainer import build_run, train_one_step

BASE = ["--mock-data", "--seq-length", "16", "--num-layers", "3", "--hidden-size", "32", "--ffn-hidden-size", "48",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "8", "--vocab-size", "100",
        "--device", "cpu", "--lr", "3e-3", "--train-iters", "5"]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 10.0  # every look at the clock is 10 s later
        return self.now


@pytest.mark.parametrize("recompute", [[], ["--recompute-granularity", "full"]])
def test_every_block_is_counted_once_forward_then_backward(recompute):
    run = build_run(parse_config(BASE + recompute + ["--global-batch-size", "2"]))
    lines = []
    progress = StepProgress(list(run.model.layers), lines.append, every_s=0.0, clock=Clock())
    progress.begin(2, 5, run.accumulation, expected_s=3600.0)
    train_one_step(run, 2)
    progress.close()
    assert run.accumulation == 2
    where = [line.split(" | ")[1:3] for line in lines]
    one = [f"forward {i}/3 blocks" for i in (1, 2, 3)] + [f"backward {i}/3 blocks" for i in (1, 2, 3)]
    assert where == [["micro-batch 1/2", w] for w in one] + [["micro-batch 2/2", w] for w in one]
    assert lines[0] == "step     2/5 in progress | micro-batch 1/2 | forward 1/3 blocks | 10s into the step, ETA 59m50s"


def test_lines_come_at_most_every_interval_and_the_hooks_go_with_close():
    run = build_run(parse_config(BASE))
    lines = []
    progress = StepProgress(list(run.model.layers), lines.append, every_s=25.0, clock=Clock())
    progress.begin(1, 5, 1, expected_s=None)  # the first step of a fresh run: no ETA
    train_one_step(run, 1)
    assert len(lines) == 2 and "ETA" not in lines[0]  # 6 blocks passed, 10 s apart: every third one said
    progress.close()
    train_one_step(run, 2)
    assert len(lines) == 2
