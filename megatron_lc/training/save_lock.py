"""One writer per checkpoint directory: an exclusive lock on `--save`.

`DIR/.save.lock` names its holder: host, pid, the process's start time, and its scheduler
job (Slurm job id and incarnation, `scheduler.py`). It is created with O_EXCL before the
first checkpoint write and removed when the run ends; a run killed outright (SIGKILL, a
cgroup OOM kill, an NCCL abort) leaves it behind. A lock is stale, and taken over with a
line that says so, when its holder is certainly gone:

1. its host is this host and its process is gone (no such pid, or a pid reused by a later
   process);
2. it names this job, in an earlier incarnation (a requeued job: Slurm runs one incarnation
   of a job at a time, so the earlier one's processes are gone, whatever host they ran on);
3. it names another job that the scheduler says is no longer running (`squeue` reports it
   finished, requeued or pending, or no longer knows it).

Anything else is respected: a live process on this host, this job's own incarnation on
another host, another job still running, or a job the scheduler cannot be asked about (no
`squeue` here). Two live jobs on one --save therefore still cannot both write. Once a run
holds the lock, every temporary checkpoint directory in DIR belongs to a run that is gone,
so it is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_lc.errors import ConfigError
from megatron_lc.processes import process_alive, process_start_ticks
from megatron_lc.scheduler import Job, Runner, current_job, job_alive

LOCK = ".save.lock"
TMP_PREFIX = ".tmp_iter_"


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    start_ticks: int | None
    started: str
    job_id: str | None = None
    """The scheduler job (Slurm's SLURM_JOB_ID); None outside one."""
    restart_count: int = 0
    """The job's incarnation (SLURM_RESTART_COUNT)."""

    @property
    def run_id(self) -> str:
        """Names this run's temporary directories (unique across hosts and pid reuse)."""
        return f"{self.host}-{self.pid}-{self.start_ticks or 0}"

    def describe(self) -> str:
        job = "" if self.job_id is None else f" in {Job(self.job_id, self.restart_count).describe()}"
        return f"pid {self.pid} on host {self.host}{job}, started {self.started}"

    @classmethod
    def this_process(cls, job: Job | None = None) -> Holder:
        job = job or current_job()
        return cls(socket.gethostname(), os.getpid(), process_start_ticks(os.getpid()),
                   time.strftime("%Y-%m-%d %H:%M:%S"), job.job_id, job.restart_count)


def _read_holder(path: Path) -> Holder | None:
    """The lock's holder; None when the file vanished or is unreadable (a writer killed mid-write)."""
    try:
        return Holder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


class SaveLock:
    """The lock on one --save directory, held by this process until `release()`."""

    def __init__(self, root: Path, holder: Holder):
        self.root, self.holder = root, holder

    @property
    def run_id(self) -> str:
        return self.holder.run_id

    def release(self) -> None:
        path = self.root / LOCK
        if _read_holder(path) == self.holder:  # never remove a lock another run took over
            path.unlink(missing_ok=True)


def _create(path: Path, holder: Holder) -> bool:
    """Create the lock file holding `holder`; False when it exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(holder)))
        f.flush()
        os.fsync(f.fileno())
    return True


def stale_reason(holder: Holder | None, me: Holder, ask_scheduler: Runner | None = None) -> str | None:
    """Why `holder` is certainly gone (the rules in the module docstring), or None when it may be alive."""
    if holder is None:
        return "the lock is unreadable (its writer was killed while writing it)"
    if holder.host == me.host:
        return None if process_alive(holder.pid, holder.start_ticks) else "that process is gone"
    if holder.job_id is None:
        return None
    if holder.job_id == me.job_id:
        if holder.restart_count < me.restart_count:
            return "it is an earlier incarnation of this job, which was requeued"
        return None
    alive = job_alive(holder.job_id) if ask_scheduler is None else job_alive(holder.job_id, ask_scheduler)
    return f"the scheduler says job {holder.job_id} is no longer running" if alive is False else None


def _take_over(path: Path, stale: Holder | None) -> None:
    """Move a stale lock aside; if another run replaced it meanwhile, put that one back."""
    aside = path.with_name(f"{LOCK}.stale.{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another run moved it first: the next attempt sees what it left
    if _read_holder(aside) != stale:
        try:
            os.link(aside, path)  # restore without overwriting a lock created since
        except FileExistsError:
            pass
    aside.unlink(missing_ok=True)


def acquire_save_lock(root: str | Path, say=print, ask_scheduler: Runner | None = None) -> SaveLock:
    """Take the lock on `root` (created if needed) or raise ConfigError naming its holder.

    `ask_scheduler` runs a scheduler command (tests pass a stand-in; default: `squeue` when installed)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path, me = root / LOCK, Holder.this_process()
    for _ in range(5):
        if _create(path, me):
            remove_stale_temporaries(root, say)
            return SaveLock(root, me)
        holder = _read_holder(path)
        reason = stale_reason(holder, me, ask_scheduler)
        if reason is None:
            where = ("" if holder.host == me.host
                     else f"; if that run is gone, delete {path} (a lock from another host is taken over only "
                          "when the scheduler says its job has ended)")
            raise ConfigError(f"--save {root} is in use by the run of {holder.describe()} ({path}): wait for it "
                              f"to finish or give another --save{where}")
        say(f"--save {root}: taking over the lock of "
            f"{holder.describe() if holder else 'an unreadable holder'}: {reason}")
        _take_over(path, holder)
    raise ConfigError(f"--save {root}: could not take {path}: other runs keep taking it")


def remove_stale_temporaries(root: Path, say=print) -> None:
    """Temporary checkpoints in `root` while this run holds the lock are those of runs that are gone."""
    for tmp in sorted(root.glob(f"{TMP_PREFIX}*")):
        shutil.rmtree(tmp, ignore_errors=True)
        say(f"--save {root}: removed {tmp.name}, the unfinished checkpoint of a run that is gone")
