"""What the batch scheduler says about this job: its id, its incarnation, its end time, its nodes.

Read from Slurm's environment (the variables `sbatch`, `salloc` and `srun` set); a process
outside a Slurm job has no job (`Job.outside()`), and nothing here asks the scheduler
anything except `job_state`, which runs `squeue` when it exists.

- `SLURM_JOB_ID`: the job; `SLURM_RESTART_COUNT` its incarnation (0 before its first requeue;
  Slurm runs one incarnation of a job at a time, so an earlier incarnation is gone).
- `SLURM_JOB_END_TIME` (Slurm >= 23.02): the Unix time at which the job is killed for its time
  limit; the training loop stops before it (`training/stopping.py`).
- `SLURM_STEP_NODELIST` / `SLURM_JOB_NODELIST`: the hosts, in order; the first runs rank 0
  of an `srun` step (block and cyclic distributions both place task 0 on the first node).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping

LIVE_STATES = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "CONFIGURING", "SIGNALING",
                         "STAGE_OUT", "RESIZING"})
"""Slurm job states in which the job's processes may still run (and write). Any other state (PENDING,
REQUEUED, COMPLETED, CANCELLED, FAILED, TIMEOUT, PREEMPTED, NODE_FAIL, OUT_OF_MEMORY, ...) or no record at
all means none of its processes is left."""


@dataclass(frozen=True)
class Job:
    """The scheduler job this process belongs to."""

    job_id: str | None
    restart_count: int = 0
    end_time: float | None = None
    """Unix time of the job's time limit (None: none known)."""
    nodes: tuple[str, ...] = ()

    @classmethod
    def outside(cls) -> Job:
        return cls(None)

    def describe(self) -> str:
        if self.job_id is None:
            return "no scheduler job"
        return f"Slurm job {self.job_id}" + (f" (requeued {self.restart_count}x)" if self.restart_count else "")


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = env.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else default


def current_job(env: Mapping[str, str] = os.environ) -> Job:
    """This process's Slurm job, from its environment."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return Job.outside()
    end = _int(env, "SLURM_JOB_END_TIME", None)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return Job(job_id, _int(env, "SLURM_RESTART_COUNT", 0) or 0, float(end) if end else None,
               tuple(expand_nodelist(nodelist)))


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list in order: `gpu[01-03,07],login5` -> gpu01 gpu02 gpu03 gpu07 login5."""
    hosts = []
    for prefix, ranges, suffix in re.findall(r"([^,\[\]]+)(?:\[([^\]]*)\])?([^,\[\]]*)", text):
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            for number in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{number:0{len(first)}d}{suffix}")
    return [h for h in hosts if h]


Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def job_state(job_id: str, run: Runner = _run) -> str | None:
    """The job's state as `squeue` reports it ("" when the scheduler no longer knows the job); None when
    it cannot be asked (no squeue here, or squeue failed for another reason)."""
    if run is _run and shutil.which("squeue") is None:
        return None
    try:
        out = run(["squeue", "--noheader", "--jobs", job_id, "--format", "%T"])
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return "" if "invalid job id" in (out.stderr or "").lower() else None  # purged after MinJobAge
    states = out.stdout.split()
    return states[0] if states else ""


def job_alive(job_id: str, run: Runner = _run) -> bool | None:
    """Whether any process of the job may still run; None when the scheduler cannot be asked."""
    state = job_state(job_id, run)
    return None if state is None else state in LIVE_STATES
