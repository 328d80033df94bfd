"""Where the planner remembers what it worked out, and its answers to whole command lines.

Two levels, one directory (`default_cache_dir`): estimates (`planning.estimate_pool.EstimateCache`), and
the printed answer of each planner command line (`answered`). A warm call of `tools/estimate_memory.py`
(the same flags, the same code, the same files) prints its stored answer before anything imports torch: a
fraction of a second where importing the planner alone takes seconds. Everything here is the standard
library only, so that path stays light.

Both levels are keyed by a digest of this package's sources and torch's installed version
(`code_fingerprint`): a change of code never answers from an old trace. An answer is keyed by the command
line too, and by the size and modification time of every file the command line names (a data prefix's
`.bin`/`.idx`), so it is never served for changed data.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "MEGATRON_LC_PLAN_CACHE"
"""A directory for the planner's cache in place of the default (`off`: no cache on disk)."""
PROGRESS_INDENT = "  "
"""Progress lines on stderr start with this; they are not part of an answer (not replayed from the cache)."""


def default_cache_dir() -> Path | None:
    """$MEGATRON_LC_PLAN_CACHE, else $XDG_CACHE_HOME/megatron_lc/plans (~/.cache by default); None for `off`."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return None if given == "off" else Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "megatron_lc" / "plans"


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A digest of every source file of this package and of torch's installed version: what a plan depends on."""
    root = Path(__file__).resolve().parent
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    digest = hashlib.sha256(torch_version.encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def files_named(argv: list[str]) -> list[tuple[str, int, int]]:
    """(path, size, mtime) of every existing file an argument names, itself or as a data prefix."""
    found = []
    for arg in argv:
        value = arg.split("=", 1)[-1]
        for path in (value, f"{value}.bin", f"{value}.idx", f"{value}_loss_mask.bin", f"{value}_loss_mask.idx"):
            try:
                st = os.stat(path)
            except (OSError, ValueError):
                continue
            if os.path.isfile(path):
                found.append((path, st.st_size, st.st_mtime_ns))
    return found


def _answer_dir(argv: list[str]) -> Path | None:
    """The answers' directory for this command line; None when nothing is remembered (`--planner-cache off`,
    $MEGATRON_LC_PLAN_CACHE=off) or when the command does more than print (`--plot` writes a file, `--help`)."""
    light = argparse.ArgumentParser(add_help=False)
    light.add_argument("--planner-cache", default=None)
    light.add_argument("--plot", default=None)
    light.add_argument("-h", "--help", action="store_true")
    known, _ = light.parse_known_args(argv)
    if known.plot or known.help:
        return None
    base = default_cache_dir() if known.planner_cache is None else (
        None if known.planner_cache == "off" else Path(known.planner_cache))
    return None if base is None else base / "answers"


def answer_key(argv: list[str]) -> str:
    what = json.dumps([argv, code_fingerprint(), files_named(argv)])
    return hashlib.sha256(what.encode()).hexdigest()


class _Tee(io.TextIOBase):
    """Writes through to `stream` and keeps a copy."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()


def answered(argv: list[str], run: Callable[[list[str]], int]) -> int:
    """`run(argv)`'s exit status, its stdout and its stderr (less progress lines) printed from the answers'
    cache when this command line was answered before with the same code and files; else `run` runs and a
    status of 0 or 1 (an answer, fitting or not) is remembered. Statuses 2 (bad input) and others are not."""
    directory = _answer_dir(argv)
    path = None if directory is None else directory / f"{answer_key(argv)}.json"
    if path is not None:
        try:
            stored = json.loads(path.read_text())
            sys.stdout.write(stored["stdout"])
            sys.stderr.write(stored["stderr"])
            return int(stored["status"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # absent or unreadable: answered again
    out, err = _Tee(sys.stdout), _Tee(sys.stderr)
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        status = run(argv)
    finally:
        sys.stdout, sys.stderr = saved
    if path is not None and status in (0, 1):
        kept = "".join(line for line in err.copy.getvalue().splitlines(keepends=True)
                       if not line.startswith(PROGRESS_INDENT))
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"stdout": out.copy.getvalue(), "stderr": kept, "status": status}))
            os.replace(partial, path)  # whole or absent, with several planners at once
        except OSError:  # a read-only or full disk costs the cache, not the answer
            partial.unlink(missing_ok=True)
    return status
