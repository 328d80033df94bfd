"""A run stopped by its scheduler saves, says "resume me" (exit 3), and the next run continues exactly:
deadlines from --exit-duration-in-mins and Slurm's SLURM_JOB_END_TIME, saves by time, signals mid-step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_lc.arguments import parse_config
from megatron_lc.errors import ConfigError
from megatron_lc.scheduler import current_job
from megatron_lc.training import checkpointing
from megatron_lc.training.stopping import STOPPED_FILE, Decision, StepAbandoned, StepTiming, StopRequest, deadlines
from megatron_lc.training.trainer import train
from tests.helpers import free_port

BASE = ["--mock-data", "--seq-length", "32", "--lr", "3e-3", "--adam-eps", "1e-4", "--device", "cpu"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CPU = torch.device("cpu")


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _request(clock: Clock, timing: StepTiming, *, end_in: float | None = None, minutes: float | None = None,
             save_minutes: float | None = None, signals: bool = False) -> StopRequest:
    env = {"SLURM_JOB_ID": "4242"} | ({"SLURM_JOB_END_TIME": str(int(clock.now + end_in))} if end_in else {})
    return StopRequest(signals, deadlines(minutes, clock.now, current_job(env)), save_minutes, timing, CPU,
                       clock=clock)


# --- the decision at a step boundary ----------------------------------------------------------------


def test_a_step_that_could_not_finish_and_save_before_slurms_end_time_is_not_started():
    clock = Clock()
    timing = StepTiming(step_times=[30.0, 10.0, 12.0], save_times=[5.0])  # the first step (warm-up) left out
    stop = _request(clock, timing, end_in=100)
    assert stop.decide(may_save=True).stop is None
    clock.now += 100 - 26  # 26 s left: (12 + 5) x 1.2 + 5 to leave = 25.4 fits
    assert stop.decide(may_save=True).stop is None
    clock.now += 1  # 25 s left: it does not
    decision = stop.decide(may_save=True)
    assert decision.save and decision.stop == ("the next step (12 s) and its save (5 s), x1.2, and 5 s to leave would "
                                               "pass the time limit of Slurm job 4242 (SLURM_JOB_END_TIME) in 25 s")


def test_a_deadline_judged_on_another_rank_is_named_on_this_one(monkeypatch):
    """The ranks read their clocks a moment apart: when another rank finds the next step too late first, this
    rank's reason still names the deadline (the same on every rank)."""
    from megatron_lc.training import stopping

    def another_rank_is_late(flags, op):
        flags[1] = 1

    monkeypatch.setattr(stopping.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(stopping.dist, "all_reduce", another_rank_is_late)
    clock = Clock()
    decision = _request(clock, StepTiming(step_times=[30.0, 10.0], save_times=[5.0]), end_in=100).decide(
        may_save=True)
    assert decision.for_time and decision.save
    assert decision.stop == ("the next step would pass the time limit of Slurm job 4242 (SLURM_JOB_END_TIME) "
                             "(judged on another rank)")


def test_the_earlier_of_exit_duration_and_the_job_end_is_the_deadline():
    clock = Clock()
    timing = StepTiming(step_times=[1.0], save_times=[1.0])
    assert "--exit-duration-in-mins 1" in _request(clock, timing, end_in=3600, minutes=1).deadline.name
    assert "SLURM_JOB_END_TIME" in _request(clock, timing, end_in=30, minutes=1).deadline.name
    stop = _request(clock, timing, minutes=1)
    clock.now += 60
    assert stop.decide(may_save=True).stop == "--exit-duration-in-mins 1 reached"


def test_before_the_first_step_the_resumed_checkpoints_times_judge_and_a_fresh_run_starts():
    clock = Clock()
    recorded = StepTiming.resumed({"step_s": 50.0, "save_s": 10.0})
    assert _request(clock, recorded, end_in=60).decide(may_save=False).stop.startswith("the next step (50 s)")
    assert _request(clock, recorded, end_in=100).decide(may_save=False).stop is None  # (50 + 10) x 1.2 + 5 = 77
    assert _request(clock, StepTiming(), end_in=1).decide(may_save=False).stop is None  # nothing to judge by


def test_a_deadline_without_a_known_save_time_saves_once_to_measure_it():
    clock = Clock()
    timing = StepTiming(step_times=[1.0])
    stop = _request(clock, timing, end_in=3600)
    assert stop.decide(may_save=True) == Decision(None, save=True)
    assert not stop.decide(may_save=False).save  # no --save: nothing to measure
    timing.save_times.append(2.0)
    assert not stop.decide(may_save=True).save


def test_saves_by_time_every_interval_since_the_last_save():
    clock = Clock()
    stop = _request(clock, StepTiming(step_times=[1.0]), save_minutes=10)
    assert not stop.decide(may_save=True).save
    clock.now += 600
    assert stop.decide(may_save=True).save
    stop.saved()
    clock.now += 599
    assert not stop.decide(may_save=True).save


def test_save_interval_minutes_without_save_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--save-interval-minutes 5 saves checkpoints: give --save DIR"):
        train(parse_config(BASE + ["--save-interval-minutes", "5", "--log-dir", str(tmp_path)]))


# --- whole runs ---------------------------------------------------------------------------------------


def _losses(history) -> dict[int, tuple[float, float]]:
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in history}


def test_a_run_stops_before_slurms_end_time_saved_and_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 12))  # start-up and some steps (5 s to leave)
    ckpt = tmp_path / "ckpt"
    flags = BASE + ["--train-iters", "100000", "--save", str(ckpt)]
    first = train(parse_config(flags + ["--log-dir", str(tmp_path / "a")]))
    assert first.stopped and "SLURM_JOB_END_TIME" in first.stopped and 1 < len(first) < 100000
    stopped_at = first[-1]["step"]
    assert time.time() < int(os.environ["SLURM_JOB_END_TIME"])  # saved and stopped before the limit
    meta = checkpointing.read_meta(checkpointing.latest_checkpoint(ckpt))
    assert meta["step"] == stopped_at and meta["timing"]["step_s"] > 0 and meta["timing"]["save_s"] > 0
    assert json.loads((ckpt / STOPPED_FILE).read_text())["step"] == stopped_at
    assert checkpointing.checkpoint_dir(ckpt, 1).exists()  # the save after step 1 measured the save time

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued, with a new time limit
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 3600))
    resumed = train(parse_config(flags + ["--load", str(ckpt), "--exit-interval", str(stopped_at + 3),
                                          "--log-dir", str(tmp_path / "b")]))
    assert [m["step"] for m in resumed] == [stopped_at + 1, stopped_at + 2, stopped_at + 3]
    assert resumed.stopped is None and not (ckpt / STOPPED_FILE).exists()

    monkeypatch.delenv("SLURM_JOB_END_TIME")
    reference = train(parse_config(BASE + ["--train-iters", "100000", "--exit-interval", str(stopped_at + 3),
                                           "--log-dir", str(tmp_path / "ref")]))
    expected = _losses(reference)
    for step, (loss, norm) in (_losses(first) | _losses(resumed)).items():
        assert loss == pytest.approx(expected[step][0], rel=1e-5) and norm == pytest.approx(expected[step][1], rel=1e-4)


def test_a_resumed_run_whose_recorded_step_cannot_fit_the_jobs_time_is_refused(tmp_path, monkeypatch):
    """Every incarnation of the job gets the same time: a requeue (exit 3) would loop without progress."""
    ckpt = tmp_path / "ckpt"
    train(parse_config(BASE + ["--train-iters", "10", "--exit-interval", "2", "--save", str(ckpt),
                               "--log-dir", str(tmp_path / "a")]))
    meta_path = checkpointing.checkpoint_dir(ckpt, 2) / checkpointing.META
    meta = json.loads(meta_path.read_text())
    meta["timing"] = {"step_s": 7200.0, "save_s": 60.0}  # as an hours-long step would have recorded
    meta_path.write_text(json.dumps(meta))
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 3600))
    with pytest.raises(ConfigError, match=r"before step 3: the next step \(7200 s\).*could not make progress"):
        train(parse_config(BASE + ["--train-iters", "10", "--save", str(ckpt), "--load", str(ckpt),
                                   "--log-dir", str(tmp_path / "b")]))
    assert not (ckpt / STOPPED_FILE).exists()
    assert checkpointing.latest_checkpoint(ckpt) == checkpointing.checkpoint_dir(ckpt, 2)


def test_save_interval_minutes_saves_by_time(tmp_path):
    ckpt = tmp_path / "ckpt"
    train(parse_config(BASE + ["--train-iters", "3", "--save", str(ckpt), "--save-interval-minutes", "1e-9",
                               "--log-dir", str(tmp_path / "a")]))
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001", "iter_0000002", "iter_0000003"]
    train(parse_config(BASE + ["--train-iters", "3", "--save", str(tmp_path / "c2"), "--save-interval-minutes", "60",
                               "--log-dir", str(tmp_path / "b")]))
    assert sorted(p.name for p in (tmp_path / "c2").glob("iter_*")) == ["iter_0000003"]  # the end only


# --- a torchrun group of two gloo ranks, signalled mid-step -----------------------------------------------

TRAIN_ITERS = "2000"
"""The scenarios' planned steps: more than any runs before its signal (the learning-rate schedule reads it)."""
UNINTERRUPTED_STEPS = 8
"""Steps of the uninterrupted run the scenarios compare with: past where a resume stops (a signal after step 3
resumes to step 5)."""


def _torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
            "-m", "megatron_lc.train", *args]


def _metrics(log_dir: Path) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _worker_pids(launcher_pid: int) -> list[int]:
    return [int(pid) for pid in Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()]


@pytest.mark.parametrize("target", ["one worker", "torchrun"])
def test_sigterm_mid_step_saves_exits_with_the_resume_status_and_the_resume_is_exact(tmp_path, target, uninterrupted):
    """Slurm's preemption signal may reach one worker first, or torchrun, which forwards SIGTERM to every
    worker; all ranks stop together at the step boundary, save, and exit 3."""
    args = BASE + ["--train-iters", TRAIN_ITERS, "--save", "ckpt", "--exit-signal-handler"]
    proc = subprocess.Popen(_torchrun(args + ["--log-dir", "a"]), env=ENV, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(_metrics(tmp_path / "a")) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its third step"
        time.sleep(0.05)
    os.kill(_worker_pids(proc.pid)[-1] if target == "one worker" else proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0 and stderr.count("Traceback") == 1, stderr[-3000:]  # torchrun's own, none of ours
    if target == "one worker":
        assert "exitcode  : 3" in stderr and "ChildFailedError" in stderr  # torchrun's summary of the workers
    else:  # torchrun forwards SIGTERM and waits --shutdown-timeout (30 s) for the workers, which leave in time
        assert "Received 15 death signal" in stderr and "SIGKILL" not in stderr
    stopped = json.loads((tmp_path / "ckpt" / STOPPED_FILE).read_text())
    step = stopped["step"]
    assert stopped["reason"].startswith(f"stopping after step {step}: signal") and 3 <= step < int(TRAIN_ITERS)
    assert checkpointing.read_meta(checkpointing.latest_checkpoint(tmp_path / "ckpt"))["step"] == step

    _assert_the_resume_is_exact(tmp_path, args, step + 2, uninterrupted)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """`losses(until)`: the losses by step, to at least `until`, of one uninterrupted two-rank run of the
    scenarios' flags (`BASE`, `TRAIN_ITERS` steps planned). The scenarios share it: run once, to
    `UNINTERRUPTED_STEPS` steps, and again only for a scenario that resumes further."""
    run = {"steps": 0}

    def losses(until: int) -> dict[int, float]:
        if run["steps"] < until:
            log_dir, steps = tmp_path_factory.mktemp("uninterrupted"), max(until, UNINTERRUPTED_STEPS)
            flags = BASE + ["--train-iters", TRAIN_ITERS, "--log-dir", str(log_dir), "--exit-interval", str(steps)]
            reference = subprocess.run(_torchrun(flags), env=ENV, cwd=log_dir, capture_output=True, text=True,
                                       timeout=300)
            assert reference.returncode == 0, reference.stderr[-3000:]
            run.update(steps=steps, losses={m["step"]: m["loss"] for m in _metrics(log_dir)})
        return run["losses"]

    return losses


def _assert_the_resume_is_exact(tmp_path, args: list[str], until: int, uninterrupted) -> None:
    """Resumed from ckpt to step `until` (log b), the losses of run a and b are those of one uninterrupted run."""
    resumed = subprocess.run(_torchrun(args + ["--load", "ckpt", "--log-dir", "b", "--exit-interval", str(until)]),
                             env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = uninterrupted(until)
    got = {m["step"]: m["loss"] for m in _metrics(tmp_path / "a") + _metrics(tmp_path / "b")}
    assert sorted(got) == list(range(1, until + 1))  # every step once: none lost, none repeated
    for s, loss in got.items():
        assert loss == pytest.approx(expected[s], rel=1e-5), s


def test_a_deadline_passed_before_the_first_step_leaves_the_entry_point_as_a_configuration_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_lc.train", *BASE, "--train-iters", "100",
                          "--exit-duration-in-mins", "1e-9", "--save", "ckpt", "--log-dir", "a"], env=ENV, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "before step 1: --exit-duration-in-mins 1e-09 reached; no step fits" in out.stderr
    assert not (tmp_path / "ckpt" / STOPPED_FILE).exists()


def _signalled_inside_a_step(timing: StepTiming, grace_s: float, elapsed: float) -> list[str]:
    """The reasons StopRequest gave for leaving at once when SIGTERM arrived `elapsed` s into step 7."""
    now = [1000.0]
    abandoned: list[str] = []
    stop = StopRequest(True, [], None, timing, torch.device("cpu"), clock=lambda: now[0], grace_s=grace_s,
                       abandon=abandoned.append)
    try:
        stop.begin_step(7)
        now[0] += elapsed
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs in the main thread at the next bytecode
        stop.end_step()
        if not abandoned:
            assert stop.decide(may_save=True) == Decision("signal SIGTERM", True)  # finished, saved, stopped
    finally:
        stop.close()
    return abandoned


def test_a_signal_inside_a_step_too_long_for_the_grace_time_stops_the_run_at_once():
    """A step of hours cannot finish and save in the 30 s a scheduler leaves after its signal: the run leaves
    inside the step (exit 3, resuming from its last checkpoint) instead of being killed in the middle of a save;
    a step that can finish in time finishes, saves and stops at its boundary as before."""
    long_steps = StepTiming(step_times=[5.0, 3600.0], save_times=[20.0])
    (reason,) = _signalled_inside_a_step(long_steps, grace_s=30, elapsed=600)
    assert reason.startswith("signal SIGTERM during step 7: what is left of it (~3000 s) and its save (20 s)")
    assert "--exit-signal-grace-secs" in reason
    near_the_end = _signalled_inside_a_step(long_steps, grace_s=30, elapsed=3595)  # (5 + 20) x 1.2 <= 30
    assert near_the_end == []
    short_steps = StepTiming(step_times=[0.5, 1.0], save_times=[2.0])
    assert _signalled_inside_a_step(short_steps, grace_s=30, elapsed=0.2) == []
    (unmeasured,) = _signalled_inside_a_step(StepTiming(), grace_s=30, elapsed=1)
    assert "nothing has measured yet" in unmeasured


def test_a_run_signalled_inside_a_long_step_leaves_at_once_with_the_resume_status(tmp_path):
    """The third step is made long (a stand-in for a step of hours); SIGTERM inside it ends the process within
    seconds, exit 3, and the file says to resume from step 2's checkpoint."""
    driver = ("import sys, time\n"
              "from megatron_lc.training import trainer\n"
              "real, calls = trainer.train_step, []\n"
              "def slow(*args, **kwargs):\n"
              "    calls.append(1)\n"
              "    if len(calls) == 3:\n"
              "        time.sleep(60)\n"
              "    return real(*args, **kwargs)\n"
              "trainer.train_step = slow\n"
              "from megatron_lc.train import main\n"
              "main(sys.argv[1:])\n")
    args = BASE + ["--train-iters", "10", "--save", "ckpt", "--save-interval", "2", "--exit-signal-handler",
                   "--exit-signal-grace-secs", "0", "--log-dir", "a"]
    proc = subprocess.Popen([sys.executable, "-c", driver, *args], env=ENV, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(_metrics(tmp_path / "a")) < 2 or not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its third step"
        time.sleep(0.05)
    time.sleep(1.0)  # inside the third step
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 3 and time.monotonic() - signalled < 20, stderr[-3000:]
    stopped = json.loads((tmp_path / "ckpt" / STOPPED_FILE).read_text())
    assert stopped["step"] == 2 and stopped["reason"].startswith("stopping inside the step: signal SIGTERM during step 3")
    assert "stopping inside the step" in stdout and len(_metrics(tmp_path / "a")) == 2


def test_a_grace_time_without_the_signal_handler_is_refused_in_one_line():
    for flags in (["--exit-signal-grace-secs", "60"], ["--exit-signal-handler", "--exit-signal-grace-secs", "-1"]):
        with pytest.raises(ConfigError, match="--exit-signal-grace-secs .* needs --exit-signal-handler"):
            parse_config(BASE + flags).validate(1)
    parse_config(BASE + ["--exit-signal-handler", "--exit-signal-grace-secs", "60"]).validate(1)


def test_a_signal_abandons_the_step_at_a_block_boundary_when_the_last_finished_step_was_never_saved():
    """Too late to finish the step, step 6 done and never saved, its save fits the grace time (or was never timed):
    the step is left at the next block boundary instead of at once; saved already, or a save too long: at once."""
    def signalled(unsaved, save_times, grace_s=30):
        left = []
        stop = StopRequest(True, [], None, StepTiming(step_times=[5.0, 3600.0], save_times=save_times),
                           torch.device("cpu"), grace_s=grace_s, abandon=left.append)
        stop.unsaved_step = unsaved
        try:
            stop.begin_step(7)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            block = torch.nn.Linear(2, 2)
            stop.watch_blocks([block])
            try:
                block(torch.zeros(2))
                return "finished", left
            except StepAbandoned as reason:
                return str(reason), left
        finally:
            stop.close()

    reason, left = signalled(unsaved=6, save_times=[20.0])
    assert reason.startswith("signal SIGTERM during step 7") and left == []
    assert signalled(unsaved=6, save_times=[])[0].startswith("signal SIGTERM during step 7")  # untimed: tried
    finished, left = signalled(unsaved=None, save_times=[20.0])  # step 6 is in a checkpoint: leave at once
    assert finished == "finished" and len(left) == 1
    finished, left = signalled(unsaved=6, save_times=[40.0])  # its save would not end before the SIGKILL
    assert finished == "finished" and len(left) == 1


def test_a_sigterm_inside_step_2_of_an_unsaved_torchrun_run_saves_step_1_and_the_resume_is_exact(tmp_path,
                                                                                                   uninterrupted):
    """torchrun, two ranks, no --save-interval: step 1 finished and unsaved, SIGTERM inside step 2, too long for
    the grace time. Both ranks leave step 2 at the same block boundary, step 1 is saved, exit 3; the run resumes
    from step 1 with an uninterrupted run's losses."""
    driver = tmp_path / "slow_steps.py"
    driver.write_text("import sys, time\n"
                      "from megatron_lc.training import trainer\n"
                      "real, calls = trainer.train_step, []\n"
                      "def slow(*args, **kwargs):\n"
                      "    calls.append(1)\n"
                      "    time.sleep({1: 3, 2: 8}.get(len(calls), 0))  # step 1 measured long, step 2 longer\n"
                      "    return real(*args, **kwargs)\n"
                      "trainer.train_step = slow\n"
                      "from megatron_lc.train import main\n"
                      "main(sys.argv[1:])\n")
    args = BASE + ["--train-iters", TRAIN_ITERS, "--save", "ckpt", "--exit-signal-handler", "--exit-signal-grace-secs",
                   "0"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    proc = subprocess.Popen([*launch, str(driver), *args, "--log-dir", "a"], env=ENV, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(_metrics(tmp_path / "a")) < 1:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its second step"
        time.sleep(0.05)
    time.sleep(0.5)  # inside step 2's sleep
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    stopped = json.loads((tmp_path / "ckpt" / STOPPED_FILE).read_text())
    assert stopped["step"] == 1, (stopped, stderr[-3000:])
    assert stopped["reason"].startswith("stopping inside step 2: signal SIGTERM during step 2")
    assert checkpointing.read_meta(checkpointing.latest_checkpoint(tmp_path / "ckpt"))["step"] == 1
    assert "SIGKILL" not in stderr and len(_metrics(tmp_path / "a")) == 1

    _assert_the_resume_is_exact(tmp_path, args, 3, uninterrupted)


def _long_step_request(unsaved: int | None, left: list) -> StopRequest:
    stop = StopRequest(True, [], None, StepTiming(step_times=[5.0, 3600.0], save_times=[20.0]), torch.device("cpu"),
                       grace_s=30, abandon=left.append)
    stop.unsaved_step = unsaved
    return stop


def _at_boundary_on_another_thread(stop: StopRequest) -> str:
    """What `at_block_boundary` did on a thread other than the main one (autograd's device thread on a GPU)."""
    outcome = []

    def boundary():
        try:
            stop.at_block_boundary()
            outcome.append("went on")
        except StepAbandoned as reason:
            outcome.append(str(reason))

    thread = threading.Thread(target=boundary)
    thread.start()
    thread.join()
    return outcome[0]


def test_a_signal_is_read_at_a_block_boundary_on_another_thread_before_the_python_handler_runs():
    """On a GPU the backward's recomputed blocks run on autograd's thread while the main thread waits in C++: the
    C-level handler's byte in the wakeup pipe is what the boundary reads. Judged there once; the Python handler,
    running when the backward returns, does not judge it again."""
    left: list[str] = []
    stop = _long_step_request(6, left)
    try:
        stop.begin_step(7)
        written = signal.set_wakeup_fd(-1)  # the pipe StopRequest made; put back at once
        signal.set_wakeup_fd(written, warn_on_full_buffer=False)
        os.write(written, bytes([signal.SIGTERM]))  # what the C-level handler writes on arrival
        reason = _at_boundary_on_another_thread(stop)
        assert reason.startswith("signal SIGTERM during step 7") and left == []
        stop._on_signal(signal.SIGTERM, None)  # the late Python handler on the main thread
        assert stop.abandoning == reason and left == []
    finally:
        stop.close()
    assert signal.set_wakeup_fd(-1) == -1  # close put back the previous wakeup fd (none)

    stop = _long_step_request(None, left)  # saved already: leave at once, once
    try:
        stop.begin_step(7)
        written = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(written, warn_on_full_buffer=False)
        os.write(written, bytes([signal.SIGTERM]))
        assert _at_boundary_on_another_thread(stop) == "went on" and len(left) == 1
        stop._on_signal(signal.SIGTERM, None)
        assert len(left) == 1
    finally:
        stop.close()


class _TwoRanks:
    """A recording stand-in for the boundary group's all-reduce: the other rank's flag is the one it had when the
    collective was started; the result is seen after `wait`, as with gloo's asynchronous work."""

    def __init__(self):
        self.other, self.started, self.waited = 0, [], 0

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.started.append(async_op)
        other, ranks = self.other, self

        class Work:
            def wait(self):
                ranks.waited += 1
                tensor.copy_(torch.maximum(tensor, torch.tensor([other], dtype=tensor.dtype)))
                return True

        if not async_op:
            Work().wait()
            return None
        return Work()


def test_the_ranks_agree_at_block_boundaries_asynchronously_one_boundary_late(monkeypatch):
    """Each boundary starts an asynchronous all-reduce and waits for the previous one's: no rank waits for the
    others at every block. Another rank flags after boundary 1: this rank leaves at boundary 3, where boundary 2's
    agreement is read; a step that finishes waits for its last agreement."""
    from megatron_lc.training import stopping
    ranks = _TwoRanks()
    monkeypatch.setattr(stopping.dist, "all_reduce", ranks.all_reduce)
    stop = StopRequest(False, [], None, StepTiming(), CPU)
    stop.boundary_group = object()
    stop.begin_step(1)
    stop.at_block_boundary()
    ranks.other = 1
    stop.at_block_boundary()
    with pytest.raises(StepAbandoned, match="a stop signal on another rank"):
        stop.at_block_boundary()
    assert ranks.started == [True, True] and ranks.waited == 2
    stop.end_step()
    ranks.other = 0
    stop.begin_step(2)
    stop.at_block_boundary()
    stop.end_step()  # the step finished: its last agreement is waited for
    assert ranks.started == [True, True, True] and ranks.waited == 3
    stop.begin_step(3)
    stop.at_block_boundary()
    stop.end_step(finished=False)  # an error inside the step: dropped, this rank fails at once
    assert ranks.waited == 3


def test_an_abandoned_step_is_saved_after_its_exception_and_traceback_are_released(tmp_path, monkeypatch):
    """The traceback of `StepAbandoned` holds the abandoned step's graph and activations: the last finished step is
    saved once it is gone."""
    from megatron_lc.training import trainer
    real, during_save = trainer.train_one_step, []

    def abandoned_at_step_2(run, step):
        if step == 2:
            raise StepAbandoned("signal SIGTERM during step 2")
        return real(run, step)

    def save_the_last_finished_step(run, step, reason, before):
        during_save.append((sys.exc_info()[0], reason))
        return f"stopping inside step {step}: {reason}"

    monkeypatch.setattr(trainer, "train_one_step", abandoned_at_step_2)
    monkeypatch.setattr(trainer, "_save_the_last_finished_step", save_the_last_finished_step)
    history = train(parse_config(BASE + ["--train-iters", "3", "--save", str(tmp_path / "ckpt"),
                                         "--exit-signal-handler", "--log-dir", str(tmp_path / "a")]))
    assert during_save == [(None, "signal SIGTERM during step 2")]
    assert history.stopped == "stopping inside step 2: signal SIGTERM during step 2" and len(history) == 1


@pytest.mark.parametrize("save", [False, True])
def test_block_boundaries_are_watched_only_when_the_run_saves(tmp_path, monkeypatch, save):
    """Without --save no finished step can be saved, so no step is abandoned at a block boundary: nothing watches
    them (with several processes each boundary would be a collective for nothing)."""
    watched = []
    monkeypatch.setattr(StopRequest, "watch_blocks", lambda self, blocks: watched.append(len(blocks)) or [])
    flags = BASE + ["--train-iters", "1", "--exit-signal-handler", "--log-dir", str(tmp_path / "a")]
    train(parse_config(flags + (["--save", str(tmp_path / "ckpt")] if save else [])))
    assert watched == ([2] if save else [])
