"""Command-line parsing shared by every entry point, with Megatron-LM's habits.

Flags are never matched by abbreviation (`--seq` is not `--seq-length`: Megatron-LM sets
`allow_abbrev=False`, and a prefix that matches today can match two flags tomorrow). A
usage error is one line naming the flag, exit status 2, not argparse's usage block (70
lines for train, printed by every rank of a job): the parser raises `UsageError`, which
each entry point reports like any other configuration error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from pathlib import Path
from typing import Callable, Sequence

from megatron_lc.errors import EXIT_CONFIG_ERROR, ConfigError, UsageError

__all__ = ["EXIT_CONFIG_ERROR", "ArgumentParser", "ConfigError", "UsageError", "check_writable",
           "report_tool_error", "run_tool"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse without abbreviations, whose errors are `UsageError`s."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def report_tool_error(prog: str, error: BaseException) -> int:
    """One line on stderr for a single-process tool; the exit status of a configuration error."""
    text = str(error).replace("\n", " ")
    print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
    return EXIT_CONFIG_ERROR


def run_tool(prog: str, main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None,
             errors: tuple[type[BaseException], ...] = ()) -> int:
    """`main(argv)`'s status, or 2 with one line when it raises a `ConfigError` or one of `errors`."""
    try:
        return main(argv)
    except (ConfigError, *errors) as error:
        return report_tool_error(prog, error)


def check_writable(directory: str, flag_name: str, create: bool = True) -> None:
    """Prove a file can be written in `directory` (before any training time), creating it if needed; with
    `create` False nothing is created: the probe goes into the directory, or where it would be created.

    The probe writes and syncs a block: an empty file can still be created on a full disk."""
    path = Path(directory)
    where = path if create else _nearest_existing(path.absolute())
    probe = where / f".write_probe_{socket.gethostname()}_{os.getpid()}"  # unique across nodes sharing it
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        elif not where.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(where))
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        with contextlib.suppress(OSError):  # the probe may never have been created
            probe.unlink()
        raise ConfigError(f"{flag_name} {directory}: not writable ({e.strerror or e})") from e
    probe.unlink(missing_ok=True)


def _nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    return next(p for p in (path, *path.parents) if p.exists())
