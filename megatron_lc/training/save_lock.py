"""One writer per checkpoint directory: an exclusive lock on `--save`.

`DIR/.save.lock` names its holder (host, pid, the process's start time). It is created
with O_EXCL before the first checkpoint write and removed when the run ends. A lock
whose process is gone on its host (no such pid, or a pid reused by a later process) is
stale and taken over; a lock held from another host cannot be checked from here and
is respected. Once a run holds the lock, every temporary checkpoint directory in DIR
belongs to a run that is gone, so it is removed.
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

LOCK = ".save.lock"
TMP_PREFIX = ".tmp_iter_"


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    start_ticks: int | None
    started: str

    @property
    def run_id(self) -> str:
        """Names this run's temporary directories (unique across hosts and pid reuse)."""
        return f"{self.host}-{self.pid}-{self.start_ticks or 0}"

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"

    @classmethod
    def this_process(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), process_start_ticks(os.getpid()),
                   time.strftime("%Y-%m-%d %H:%M:%S"))


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


def _is_stale(holder: Holder | None) -> bool:
    if holder is None:
        return True
    return holder.host == socket.gethostname() and not process_alive(holder.pid, holder.start_ticks)


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


def acquire_save_lock(root: str | Path, say=print) -> SaveLock:
    """Take the lock on `root` (created if needed) or raise ConfigError naming its holder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path, me = root / LOCK, Holder.this_process()
    for _ in range(5):
        if _create(path, me):
            remove_stale_temporaries(root, say)
            return SaveLock(root, me)
        holder = _read_holder(path)
        if not _is_stale(holder):
            where = ("" if holder.host == me.host
                     else f"; if that run is gone, delete {path} (a lock from another host cannot be checked here)")
            raise ConfigError(f"--save {root} is in use by the run of {holder.describe()} ({path}): wait for it "
                              f"to finish or give another --save{where}")
        say(f"--save {root}: taking over the lock of "
            f"{holder.describe() if holder else 'an unreadable holder'}: that process is gone")
        _take_over(path, holder)
    raise ConfigError(f"--save {root}: could not take {path}: other runs keep taking it")


def remove_stale_temporaries(root: Path, say=print) -> None:
    """Temporary checkpoints in `root` while this run holds the lock are those of runs that are gone."""
    for tmp in sorted(root.glob(f"{TMP_PREFIX}*")):
        shutil.rmtree(tmp, ignore_errors=True)
        say(f"--save {root}: removed {tmp.name}, the unfinished checkpoint of a run that is gone")
