"""--profile: the steps Megatron-LM's flags name are profiled (torch.profiler on CPU, nsys's range on CUDA), and
flags that would profile nothing are refused in one line."""

import json

import pytest

from megatron_lc.arguments import parse_config
from megatron_lc.errors import ConfigError
from megatron_lc.training.profiling import ProfilingArgs, StepProfiler
from megatron_lc.training.trainer import train
from tests.helpers import TINY_MODEL_FLAGS, TRAIN_FLAGS


def test_pytorch_profiler_records_the_window_steps_and_writes_a_trace_and_a_table(tmp_path, capsys):
    history = train(parse_config(TRAIN_FLAGS + TINY_MODEL_FLAGS + [
        "--train-iters", "4", "--log-dir", str(tmp_path), "--profile", "--use-pytorch-profiler",
        "--profile-step-start", "1", "--profile-step-end", "3"]))
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    traces = list(tmp_path.glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#1", "ProfilerStep#2"]  # steps 2 and 3; step 1 was the warm-up
    table = (tmp_path / "profile_rank0_steps2-3.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table
    assert "rank 0: profiled steps 2-3" in capsys.readouterr().out


class RecordingCudart:
    def __init__(self, calls: list):
        self.calls = calls

    def cudaProfilerStart(self):
        self.calls.append("start")

    def cudaProfilerStop(self):
        self.calls.append("stop")


def test_nsys_range_opens_before_the_first_profiled_step_and_closes_after_the_last():
    calls = []

    class RecordingNvtx:
        def __init__(self, record_shapes):
            assert record_shapes

        def __enter__(self):
            calls.append("nvtx on")

        def __exit__(self, *exc):
            calls.append("nvtx off")

    args = ProfilingArgs(profile=True, profile_step_start=2, profile_step_end=4)
    profiler = StepProfiler(args, rank=0, first_step=1, out_dir=".", cuda=True, say=calls.append,
                            cudart=RecordingCudart(calls), nvtx=RecordingNvtx)
    for step in range(1, 7):
        profiler.before_step(step)
        calls.append(step)
        profiler.after_step(step)
    profiler.close()
    assert calls == [1, 2, "start", "nvtx on", 3, 4, "nvtx off", "stop",
                     "rank 0: nsys capture range closed after step 4", 5, 6]


def test_a_rank_not_named_and_a_resumed_run_past_the_window_profile_nothing():
    said = []
    args = ProfilingArgs(profile=True, use_pytorch_profiler=True, profile_ranks=[1])
    assert not StepProfiler(args, rank=0, first_step=1, out_dir=".", cuda=False, say=said.append).active
    late = StepProfiler(ProfilingArgs(profile=True, use_pytorch_profiler=True), rank=0, first_step=20, out_dir=".",
                        cuda=False, say=said.append)
    assert not late.active and said == ["--profile: steps 11-12 are before this run's first step 20: nothing profiled"]
    inside = StepProfiler(ProfilingArgs(profile=True, use_pytorch_profiler=True), rank=0, first_step=12,
                          out_dir=".", cuda=False)
    assert inside.active and inside.steps == (12, 12) and not inside.warmup


@pytest.mark.parametrize("flags, message", [
    (["--use-pytorch-profiler"], "--use-pytorch-profiler chooses what --profile profiles: add --profile"),
    (["--profile-ranks", "1"], "--profile-ranks chooses what --profile profiles: add --profile"),
    (["--profile-step-start", "1"], "--profile-step-start chooses what --profile profiles: add --profile"),
    (["--profile-step-end", "3"], "--profile-step-end chooses what --profile profiles: add --profile"),
    (["--profile", "--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "3"],
     "give 0 <= start < end"),
    (["--profile", "--use-pytorch-profiler", "--profile-step-start", "4", "--profile-step-end", "6"],
     "--profile-step-start 4 with --train-iters 4: no step would be profiled"),
    (["--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "2",
      "--profile-ranks", "0", "2"], "--profile-ranks 2: the run has ranks 0 to 1"),
])
def test_flags_that_would_profile_nothing_are_refused(flags, message):
    cfg = parse_config(TRAIN_FLAGS + ["--train-iters", "4"] + flags)
    with pytest.raises(ConfigError, match=message):
        cfg.validate(world_size=2)


def test_nsys_range_on_cpu_is_refused_by_the_preflight(tmp_path):
    cfg = parse_config(TRAIN_FLAGS + ["--train-iters", "4", "--profile", "--profile-step-start", "1",
                                      "--profile-step-end", "2", "--log-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="nsys's CUDA capture range; this run is on the CPU: add "
                                          "--use-pytorch-profiler"):
        train(cfg)


def test_a_window_cut_short_says_what_it_recorded(tmp_path):
    said = []
    args = ProfilingArgs(profile=True, use_pytorch_profiler=True, profile_step_start=2, profile_step_end=5)
    in_warmup = StepProfiler(args, rank=0, first_step=1, out_dir=str(tmp_path), cuda=False, say=said.append)
    for step in (1, 2):
        in_warmup.before_step(step)
        in_warmup.after_step(step)
    in_warmup.close()
    assert said == ["rank 0: the run ended before step 3: nothing profiled"]
    cut = StepProfiler(args, rank=0, first_step=1, out_dir=str(tmp_path), cuda=False, say=said.append)
    for step in (1, 2, 3):
        cut.before_step(step)
        cut.after_step(step)
    cut.close()
    assert said[-1].startswith("rank 0: profiled steps 3-3:") and (tmp_path / "profile_rank0_steps3-3.txt").exists()


def test_a_run_that_stops_before_the_window_says_nothing_was_profiled():
    said = []
    profiler = StepProfiler(ProfilingArgs(profile=True, use_pytorch_profiler=True), rank=0, first_step=1,
                            out_dir=".", cuda=False, say=said.append)
    for step in (1, 2, 3):  # --exit-interval 3, a time limit or a signal: the run ends at step 3
        profiler.before_step(step)
        profiler.after_step(step)
    profiler.close()
    assert said == ["rank 0: the run ended before step 11: nothing profiled"]
