"""The run is the user's: one writer per --save, nothing deleted unasked, resume that moves forward,
saves that fail in one line, every evaluation logged."""

import errno
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from megatron_lc.errors import ConfigError
from megatron_lc.arguments import build_parser, parse_config
from megatron_lc.training.preflight import preflight
from megatron_lc.training import checkpointing, save_lock
from megatron_lc.training.trainer import train
from tests.helpers import train_flags, write_random_dataset

BASE = train_flags("--seq-length", "32")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _steps(log_dir: Path) -> list[int]:
    path = log_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# --- 1. one writer per --save ----------------------------------------------------------


def test_second_run_on_the_same_save_is_refused_and_the_first_keeps_its_checkpoints(tmp_path):
    first = subprocess.Popen([sys.executable, "-m", "megatron_lc.train", *BASE, "--train-iters", "100000",
                              "--save", "ckpt", "--save-interval", "1", "--exit-signal-handler", "--log-dir", "a"],
                             env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not checkpointing.latest_checkpoint(tmp_path / "ckpt"):
            assert first.poll() is None and time.monotonic() < deadline, "the first run ended before saving"
            time.sleep(0.2)
        second = subprocess.run([sys.executable, "-m", "megatron_lc.train", *BASE, "--train-iters", "2",
                                 "--save", "ckpt", "--log-dir", "b"], env=ENV, cwd=tmp_path, capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"error: --save ckpt is in use by the run of pid {first.pid} on host {socket.gethostname()}, started "
            + json.loads((tmp_path / "ckpt" / save_lock.LOCK).read_text())["started"]
            + f" (ckpt/{save_lock.LOCK}): wait for it to finish or give another --save"]
        assert not (tmp_path / "b").exists()
    finally:
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == 3, stderr[-3000:]  # saved and stopped to be resumed
    saved = sorted((tmp_path / "ckpt").glob("iter_*"))
    assert saved and all(checkpointing.read_meta(p)["train_config"]["logging"]["log_dir"] == "a" for p in saved)
    assert [int(p.name[5:]) for p in saved] == list(range(1, len(saved) + 1))  # every step kept, none replaced
    assert not (tmp_path / "ckpt" / save_lock.LOCK).exists()  # released at exit
    assert not list((tmp_path / "ckpt").glob(".tmp_iter_*"))


def test_a_live_holder_is_refused_in_process_too(tmp_path):
    (tmp_path / "ckpt").mkdir()
    holder = save_lock.Holder.this_process()
    (tmp_path / "ckpt" / save_lock.LOCK).write_text(json.dumps(asdict(holder)))
    with pytest.raises(ConfigError, match=f"in use by the run of pid {os.getpid()} on host"):
        train(parse_config(BASE + ["--train-iters", "1", "--save", str(tmp_path / "ckpt"),
                                   "--log-dir", str(tmp_path / "log")]))
    assert (tmp_path / "ckpt" / save_lock.LOCK).exists()  # someone else's lock is never removed


def test_stale_lock_and_temporaries_of_a_dead_run_are_taken_over_and_said(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    dead = save_lock.Holder(socket.gethostname(), _dead_pid(), None, "earlier")
    (ckpt / save_lock.LOCK).write_text(json.dumps(asdict(dead)))
    for name in (".tmp_iter_0000004.other-run", ".tmp_iter_0000002"):  # per-run and old-style temporaries
        (ckpt / name).mkdir()
        (ckpt / name / "__0_0.distcp").write_bytes(b"x" * 100)
    history = train(parse_config(BASE + ["--train-iters", "1", "--save", str(ckpt), "--log-dir", str(tmp_path / "l")]))
    out = capsys.readouterr().out
    assert [m["step"] for m in history] == [1]
    assert f"taking over the lock of pid {dead.pid} on host {dead.host}, started earlier: that process is gone" in out
    assert "removed .tmp_iter_0000004.other-run, the unfinished checkpoint of a run that is gone" in out
    assert "removed .tmp_iter_0000002" in out
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000001", checkpointing.LATEST]


def test_a_reused_pid_does_not_keep_a_lock_alive(tmp_path):
    me = save_lock.Holder.this_process()
    if me.start_ticks is None:
        pytest.skip("no /proc: start times unknown")
    reused = save_lock.Holder(me.host, me.pid, me.start_ticks + 1, "earlier")
    (tmp_path / save_lock.LOCK).write_text(json.dumps(asdict(reused)))
    lock = save_lock.acquire_save_lock(tmp_path, say=lambda _: None)
    assert json.loads((tmp_path / save_lock.LOCK).read_text())["start_ticks"] == me.start_ticks
    lock.release()
    assert not (tmp_path / save_lock.LOCK).exists()


# --- 2. nothing deleted unasked ---------------------------------------------------------


def test_every_checkpoint_is_kept_by_default_and_help_says_how_to_keep_n(tmp_path):
    ckpt = tmp_path / "ckpt"
    train(parse_config(BASE + ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "1",
                               "--log-dir", str(tmp_path / "log")]))
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001", "iter_0000002", "iter_0000003"]
    help_text = " ".join(build_parser().format_help().split())
    assert "0 keeps every checkpoint in --save (as Megatron-LM); N > 0 keeps the newest N" in help_text


# --- 3. resume moves forward --------------------------------------------------------------


def test_load_of_a_copied_checkpoint_directory_moves_forward_and_save_into_one_is_refused(tmp_path):
    run = tmp_path / "run"
    train(parse_config(BASE + ["--train-iters", "3", "--save", str(run), "--save-interval", "1",
                               "--log-dir", str(tmp_path / "a")]))
    copy = tmp_path / "copy"
    shutil.copytree(checkpointing.checkpoint_dir(run, 1), copy)
    with pytest.raises(ConfigError, match=f"--save {copy}: is the checkpoint {copy} .*save into its parent"):
        preflight(parse_config(BASE + ["--save", str(copy)]))
    with pytest.raises(ConfigError, match=f"is inside the checkpoint {copy}"):
        preflight(parse_config(BASE + ["--save", str(copy / "more")]))
    # Saved into it by an earlier version: the nested, later checkpoint is the one to resume.
    shutil.copytree(checkpointing.checkpoint_dir(run, 3), checkpointing.checkpoint_dir(copy, 3))
    assert checkpointing.latest_checkpoint(copy) == checkpointing.checkpoint_dir(copy, 3)
    resumed = train(parse_config(BASE + ["--train-iters", "4", "--load", str(copy), "--override-opt_param-scheduler",
                                         "--log-dir", str(tmp_path / "b")]))
    assert [m["step"] for m in resumed] == [4]


# --- 4. saves that cannot be written ------------------------------------------------------


def test_a_save_that_cannot_fit_is_refused_in_one_line_before_writing(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    train(parse_config(BASE + ["--train-iters", "2", "--save", str(ckpt), "--log-dir", str(tmp_path / "a")]))
    real = shutil.disk_usage
    monkeypatch.setattr(checkpointing.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=999) if Path(p) == ckpt else real(p))
    with pytest.raises(checkpointing.SaveError) as e:
        train(parse_config(BASE + ["--train-iters", "3", "--load", str(ckpt), "--save", str(ckpt),
                                   "--override-opt_param-scheduler", "--log-dir", str(tmp_path / "b")]))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"--save {ckpt}: a checkpoint needs about ") and str(e.value).endswith(
        ", 999 bytes free")
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", checkpointing.LATEST]


class _FullDisk(io.RawIOBase):
    """A file whose writes fail with ENOSPC once `room` bytes are written."""

    def __init__(self, raw, room: list[int]):
        self.raw, self.room = raw, room

    def writable(self):
        return True

    def write(self, b):
        n = len(memoryview(b))
        if n > self.room[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room[0] -= n
        return self.raw.write(b)

    def tell(self):
        return self.raw.tell()

    def seek(self, *a):
        return self.raw.seek(*a)

    def fileno(self):
        return self.raw.fileno()

    def flush(self):
        self.raw.flush()

    def __exit__(self, *a):
        self.raw.close()


def test_a_write_error_mid_save_is_one_line_and_leaves_no_temporary(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    flags = BASE + ["--load", str(ckpt), "--save", str(ckpt), "--override-opt_param-scheduler"]
    train(parse_config(BASE + ["--train-iters", "2", "--save", str(ckpt), "--log-dir", str(tmp_path / "a")]))
    room = [20_000]  # the disk fills inside the first shard
    monkeypatch.setattr(checkpointing, "open", lambda path, mode: _FullDisk(open(path, mode), room), raising=False)
    with pytest.raises(checkpointing.SaveError) as e:
        train(parse_config(flags + ["--train-iters", "3", "--log-dir", str(tmp_path / "b")]))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"--save {ckpt}: writing {ckpt}/.tmp_iter_0000003.")
    assert "__0_0.distcp failed: No space left on device (ENOSPC); its temporary directory was removed" in message
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", checkpointing.LATEST]
    monkeypatch.undo()  # space again: the same save now succeeds and the run goes on from step 2
    resumed = train(parse_config(flags + ["--train-iters", "3", "--log-dir", str(tmp_path / "c")]))
    assert [m["step"] for m in resumed] == [3] and checkpointing.latest_checkpoint(ckpt).name == "iter_0000003"


def test_the_save_probe_writes_data(tmp_path, monkeypatch):
    from megatron_lc import command_line

    written = []
    real_open = open
    monkeypatch.setattr(command_line, "open", lambda p, m: written.append(p) or real_open(p, m), raising=False)
    command_line.check_writable(str(tmp_path), "--save")
    assert written and not list(tmp_path.iterdir())  # one probe, written (4 KiB, synced) and removed


# --- 5. every evaluation logged ---------------------------------------------------------


def _dataset(prefix: Path) -> str:
    return write_random_dataset(prefix, documents=60, lengths=(10, 60), vocab=512)


def test_every_evaluation_is_logged_at_its_step_whatever_the_log_interval(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = _dataset(tmp_path / "data")
    train(parse_config(["--data-path", data, "--split", "80,20,0", "--seq-length", "32", "--device", "cpu",
                        "--train-iters", "10", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "5",
                        "--log-dir", str(tmp_path / "log"), "--tensorboard-dir", str(tmp_path / "tb"),
                        "--log-validation-ppl-to-tensorboard"]))
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 6, 8, 10]
    assert all(r["val_ppl"] == pytest.approx(np.exp(r["val_loss"])) for r in records if "val_loss" in r)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("validation at step")]
    assert [int(line.split()[3]) for line in lines] == [2, 4, 6, 8, 10]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for tag in ("lm loss validation", "lm loss validation ppl"):
        assert [s.step for s in events.Scalars(tag)] == [2, 4, 6, 8, 10]


# --- 5. a lock left behind on another host ---------------------------------------------------------


def _killed_lock_holder(ckpt: Path, host: str, job_id: str, restart_count: int) -> int:
    """A process that took the lock on `ckpt` as rank 0 of Slurm job `job_id` on `host`, then was SIGKILLed."""
    script = ("import socket, sys, time\n"
              f"socket.gethostname = lambda: {host!r}\n"
              "from megatron_lc.training.save_lock import acquire_save_lock\n"
              f"acquire_save_lock({str(ckpt)!r}, say=lambda _: None)\n"
              "print('locked', flush=True)\n"
              "time.sleep(600)\n")
    env = {**ENV, "SLURM_JOB_ID": job_id, "SLURM_RESTART_COUNT": str(restart_count)}
    child = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "locked"
    child.send_signal(signal.SIGKILL)
    child.wait()
    return child.pid


def _squeue(stdout: str = "", returncode: int = 0, stderr: str = ""):
    asked = []

    def run(command):
        asked.append(command)
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)
    run.asked = asked
    return run


def test_the_requeued_job_takes_over_the_lock_its_killed_incarnation_left_on_another_host(tmp_path, monkeypatch):
    pid = _killed_lock_holder(tmp_path, "node-b", "900", 0)
    assert json.loads((tmp_path / save_lock.LOCK).read_text())["job_id"] == "900"
    monkeypatch.setenv("SLURM_JOB_ID", "900")
    with pytest.raises(ConfigError, match=f"in use by the run of pid {pid} on host node-b in Slurm job 900"):
        save_lock.acquire_save_lock(tmp_path, say=lambda _: None)  # the same incarnation elsewhere may be alive
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    said = []
    lock = save_lock.acquire_save_lock(tmp_path, say=said.append, ask_scheduler=_squeue("RUNNING"))
    assert len(said) == 1 and said[0].startswith(f"--save {tmp_path}: taking over the lock of pid {pid} on host "
                                                 "node-b in Slurm job 900, started ")
    assert said[0].endswith(": it is an earlier incarnation of this job, which was requeued")
    assert lock.holder.job_id == "900" and lock.holder.restart_count == 1
    lock.release()


@pytest.mark.parametrize("answer, taken", [
    (_squeue(""), True),  # the scheduler no longer lists it
    (_squeue("COMPLETED\n"), True),
    (_squeue("PENDING\n"), True),  # requeued and waiting: none of its processes runs
    (_squeue(returncode=1, stderr="slurm_load_jobs error: Invalid job id specified"), True),  # purged
    (_squeue("RUNNING\n"), False),
    (_squeue("SUSPENDED\n"), False),
    (_squeue(returncode=1, stderr="slurm_load_jobs error: Unable to contact slurm controller"), False),
])
def test_another_jobs_lock_from_another_host_is_taken_over_only_when_the_scheduler_says_it_ended(
        tmp_path, monkeypatch, answer, taken):
    pid = _killed_lock_holder(tmp_path, "node-c", "901", 0)
    monkeypatch.setenv("SLURM_JOB_ID", "902")
    if taken:
        lock = save_lock.acquire_save_lock(tmp_path, say=lambda _: None, ask_scheduler=answer)
        assert lock.holder.job_id == "902"
    else:
        with pytest.raises(ConfigError, match=f"pid {pid} on host node-c in Slurm job 901.*delete"):
            save_lock.acquire_save_lock(tmp_path, say=lambda _: None, ask_scheduler=answer)
    assert answer.asked[-1] == ["squeue", "--noheader", "--jobs", "901", "--format", "%T"]


def test_without_squeue_a_lock_from_another_host_is_respected(tmp_path, monkeypatch):
    _killed_lock_holder(tmp_path, "node-d", "903", 0)
    monkeypatch.setenv("SLURM_JOB_ID", "904")
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    with pytest.raises(ConfigError, match="a lock from another host is taken over only when the scheduler says"):
        save_lock.acquire_save_lock(tmp_path, say=lambda _: None)
