"""A CPU rehearsal of a 2-node Slurm job whose time limit is shorter than the run: its first incarnation was
SIGKILLed on another node and left its lock; the requeued job takes the lock over, is preempted (SIGTERM mid-step
on one task), saves and exits 3; requeued again with a short time limit, it stops before the limit, saved, exits 3;
the last incarnation finishes. Every step's loss equals an uninterrupted run's, with no person in between."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_lc.training import checkpointing, save_lock
from megatron_lc.training.stopping import STOPPED_FILE
from tests.helpers import free_port

FLAGS = ["--mock-data", "--seq-length", "32", "--lr", "3e-3", "--adam-eps", "1e-4", "--device", "cpu",
         "--train-iters", "100000", "--save", "ckpt", "--load", "ckpt", "--exit-signal-handler"]
JOB = "5000"


def _srun_env(rank: int, port: int, restart: int, end_time: float | None) -> dict:
    """What `srun` gives task `rank` of a 2-node, 1-task-per-node step of job JOB (incarnation `restart`)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_", "OMPI_"))}
    env.update(OMP_NUM_THREADS="1", MASTER_PORT=str(port), SLURM_JOB_ID=JOB, SLURM_RESTART_COUNT=str(restart),
               SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID=str(rank), SLURM_LOCALID="0",
               SLURM_NODEID=str(rank), SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="localhost,nodeb",
               SLURM_STEP_NODELIST="localhost,nodeb")
    if end_time is not None:
        env["SLURM_JOB_END_TIME"] = str(int(end_time))
    return env


def _srun(tmp_path: Path, log: str, restart: int, end_time: float | None, extra=()) -> list[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "megatron_lc.train", *FLAGS, "--log-dir", log, *extra],
                             env=_srun_env(rank, port, restart, end_time), cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for rank in range(2)]


def _finish(tasks: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    outputs = [t.communicate(timeout=300) for t in tasks]
    return [(t.returncode, *out) for t, out in zip(tasks, outputs)]


def _metrics(log_dir: Path) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _lock_left_by_a_killed_task(ckpt: Path) -> int:
    """Incarnation 0's rank 0, on node `nodeb`, took the lock and was SIGKILLed (an OOM kill, a node failure)."""
    script = ("import socket, time\n"
              "socket.gethostname = lambda: 'nodeb'\n"
              "from megatron_lc.training.save_lock import acquire_save_lock\n"
              f"acquire_save_lock({str(ckpt)!r}, say=lambda _: None)\n"
              "print('locked', flush=True)\n"
              "time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", script], env=_srun_env(0, 0, 0, None), stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "locked"
    child.send_signal(signal.SIGKILL)
    child.wait()
    return child.pid


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
def test_a_two_node_slurm_job_shorter_than_its_run_saves_requeues_and_resumes_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    killed = _lock_left_by_a_killed_task(ckpt)

    # Incarnation 1: takes the dead incarnation's lock over; preempted: SIGTERM reaches one task mid-step.
    began = time.monotonic()
    tasks = _srun(tmp_path, "log1", restart=1, end_time=time.time() + 3600)
    while len(_metrics(tmp_path / "log1")) < 3:
        assert all(t.poll() is None for t in tasks) and time.monotonic() - began < 180, "no third step"
        time.sleep(0.05)
    start_up = time.monotonic() - began
    tasks[1].send_signal(signal.SIGTERM)
    (status0, out0, err0), (status1, _, err1) = _finish(tasks)
    assert (status0, status1) == (3, 3), err0[-2000:] + err1[-2000:]
    assert (f"taking over the lock of pid {killed} on host nodeb in Slurm job {JOB}, started" in out0
            and "it is an earlier incarnation of this job, which was requeued" in out0)
    first = json.loads((ckpt / STOPPED_FILE).read_text())
    assert first["reason"] == f"stopping after step {first['step']}: signal on another rank"
    assert checkpointing.read_meta(checkpointing.latest_checkpoint(ckpt))["step"] == first["step"]
    assert not (ckpt / save_lock.LOCK).exists()  # released at exit

    # Incarnation 2: a time limit shorter than the rest of the run; it stops before the limit, saved.
    end = time.time() + 2 * start_up + 10
    (status0, out0, err0), (status1, _, err1) = _finish(_srun(tmp_path, "log2", restart=2, end_time=end))
    assert (status0, status1) == (3, 3), err0[-2000:] + err1[-2000:]
    second = json.loads((ckpt / STOPPED_FILE).read_text())
    assert second["step"] > first["step"] and "SLURM_JOB_END_TIME" in second["reason"]
    saved = checkpointing.latest_checkpoint(ckpt)
    assert checkpointing.read_meta(saved)["step"] == second["step"]
    assert (saved / checkpointing.META).stat().st_mtime < end  # saved before Slurm would have killed the job

    # Incarnation 3 finishes (here: two more steps).
    until = ["--exit-interval", str(second["step"] + 2)]
    (status0, _, err0), (status1, _, err1) = _finish(_srun(tmp_path, "log3", 3, time.time() + 3600, until))
    assert (status0, status1) == (0, 0), err0[-2000:] + err1[-2000:]

    reference = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
         "-m", "megatron_lc.train", *FLAGS[:FLAGS.index("--save")], "--log-dir", "ref", *until],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-2000:]
    expected = {m["step"]: m["loss"] for m in _metrics(tmp_path / "ref")}
    got = {m["step"]: m["loss"] for log in ("log1", "log2", "log3") for m in _metrics(tmp_path / log)}
    assert sorted(got) == list(range(1, second["step"] + 3))  # every step once: none lost, none repeated
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
