"""Which process wrote a file, and whether it is still running.

A writer is named by its host, pid and the process's start time in clock ticks since boot
(`/proc/PID/stat` field 22): a pid reused by a later process has another start time, so a
file left by a killed process is never taken for the work of a live one. Only a writer on
this host can be checked; one from another host is always taken as alive here (the checkpoint lock
also asks the scheduler about the writer's job: `training/save_lock.py`).

Used by the checkpoint lock (`training/save_lock.py`) and by the dataset builder's
temporary files (`data/indexed_dataset.py`).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after the command name, which may hold spaces


def process_alive(pid: int, start_ticks: int | None) -> bool:
    """Whether `pid` is the same process that started at `start_ticks` (a reused pid has another start
    time; with no start time known, any process of that pid counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    current = process_start_ticks(pid)
    return start_ticks is None or current is None or current == start_ticks


def host_name() -> str:
    """This host's name."""
    return socket.gethostname()


# A writer tag must survive being split back from a file name: no dots, no path separators.
_TAG_HOST = re.compile(r"[^A-Za-z0-9_]")
_TAG = re.compile(r"^(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-(?P<ticks>\d+)$")


@dataclass(frozen=True)
class Writer:
    """A process that writes files: host, pid and start ticks (0 when unknown)."""

    host: str
    pid: int
    start_ticks: int

    @classmethod
    def this_process(cls) -> "Writer":
        pid = os.getpid()
        return cls(host_name(), pid, process_start_ticks(pid) or 0)

    @property
    def tag(self) -> str:
        """`HOST-PID-TICKS`, the host with every character but letters, digits and `_` as `_`."""
        return f"{_TAG_HOST.sub('_', self.host)}-{self.pid}-{self.start_ticks}"

    @classmethod
    def from_tag(cls, tag: str) -> "Writer | None":
        """The writer a `tag` names (its host as the tag spells it); None for anything else."""
        match = _TAG.match(tag)
        if match is None:
            return None
        return cls(match["host"], int(match["pid"]), int(match["ticks"]))

    def is_dead_here(self) -> bool:
        """Whether this writer is on this host and its process is gone (or its pid now another's)."""
        if self.host != _TAG_HOST.sub("_", host_name()):
            return False
        return not process_alive(self.pid, self.start_ticks or None)
