"""A run given the planner's estimate of itself (--memory-plan) logs each step's peak beside the prediction, judges
its deadline by the predicted step before it has measured one, and refuses a plan made for other flags."""

from __future__ import annotations

import json
import time

import pytest

from megatron_lc.arguments import parse_config
from megatron_lc.errors import ConfigError
from megatron_lc.planning import cli as planner_cli
from megatron_lc.training.memory_plan import read_memory_plan
from megatron_lc.training.stopping import StepTiming
from megatron_lc.training.trainer import train

RUN = ["--mock-data", "--seq-length", "32", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
       "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "128", "--recompute-granularity",
       "full", "--tiled-loss"]
"""The flags a plan depends on; training adds its own (learning rate, device, logging) which it does not."""
TRAIN = ["--lr", "3e-3", "--device", "cpu", "--train-iters", "2"]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """The planner's JSON for RUN on one GPU, as a user writes it: estimate_memory.py <flags> --json > FILE."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert planner_cli.main([*RUN, "--num-gpus", "1", "--json"]) == 0
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(out.getvalue())
    return path


def test_a_run_logs_each_steps_peak_beside_the_planned_one(plan_file, tmp_path, capsys):
    plan = json.loads(plan_file.read_text())
    history = train(parse_config([*RUN, *TRAIN, "--memory-plan", str(plan_file), "--log-dir", str(tmp_path)]))
    out = capsys.readouterr().out
    assert [m["planned_peak_gib"] for m in history] == [plan["gpu_peak_gib"]] * 2
    assert f"memory plan {plan_file}" in out and f"planned {plan['gpu_peak_gib']:.2f}" in out
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(m["planned_peak_gib"] == plan["gpu_peak_gib"] for m in logged if "loss" in m)


@pytest.mark.parametrize("change, named", [(["--seq-length", "64"], "--seq-length 32, this run has 64"),
                                           (["--tiled-mlp"], "--tiled-mlp False, this run has True"),
                                           (["--recompute-granularity", "none"], "--recompute-granularity full")])
def test_a_plan_made_for_other_flags_is_refused_naming_the_flag(plan_file, change, named):
    cfg = parse_config([*RUN, *TRAIN, *change])
    with pytest.raises(ConfigError, match="was made for") as e:
        read_memory_plan(str(plan_file), cfg, 1)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_a_plan_for_another_world_size_is_refused(plan_file):
    with pytest.raises(ConfigError, match="made for world size 1, this run has 2"):
        read_memory_plan(str(plan_file), parse_config([*RUN, *TRAIN]), 2)


def test_a_file_that_is_not_one_estimate_is_refused_in_one_line(tmp_path):
    cfg = parse_config([*RUN, *TRAIN])
    broken = tmp_path / "broken.json"
    broken.write_text('{"gpu_peak_gib": 1.0,\n "run": }')
    with pytest.raises(ConfigError, match=r"broken.json: not JSON \(line 2"):
        read_memory_plan(str(broken), cfg, 1)
    search = tmp_path / "autofit.json"
    search.write_text(json.dumps({"seq_length": 32, "gpu_peak_gib": 1.0, "auto_fit": {}}))
    with pytest.raises(ConfigError, match="not the JSON of one estimate"):
        read_memory_plan(str(search), cfg, 1)
    with pytest.raises(ConfigError, match="missing.json: cannot read it"):
        read_memory_plan(str(tmp_path / "missing.json"), cfg, 1)


def test_the_deadline_reads_the_measured_then_the_recorded_then_the_planned_step():
    timing = StepTiming(planned_step_s=500.0)
    assert timing.step_s() == 500.0
    timing.recorded_step_s = 300.0
    assert timing.step_s() == 300.0
    timing.step_times.append(40.0)
    assert timing.step_s() == 40.0


def test_a_fresh_run_whose_planned_step_cannot_fit_the_jobs_time_is_refused(plan_file, tmp_path, monkeypatch):
    """No incarnation of this job could finish a step: requeueing it (exit 3) would loop; it is refused (exit 2)."""
    plan = json.loads(plan_file.read_text())
    plan["time"]["step_s"] = 7200.0  # an hours-long step, as the planner predicts for millions of tokens
    long_step = tmp_path / "plan.json"
    long_step.write_text(json.dumps(plan))
    monkeypatch.setenv("SLURM_JOB_ID", "91")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 3600))
    with pytest.raises(ConfigError, match=r"before step 1: the next step \(7200 s\).*a requeue could not make progress"):
        train(parse_config([*RUN, *TRAIN, "--memory-plan", str(long_step), "--save", str(tmp_path / "ckpt"),
                            "--log-dir", str(tmp_path / "log")]))
    assert not (tmp_path / "ckpt" / "stopped_to_resume.json").exists()
