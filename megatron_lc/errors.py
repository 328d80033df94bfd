"""The error types every room raises for a setting that cannot work, the exit statuses, and how a process leaves;
a leaf module (imports nothing of the package).

An entry point reports a `ConfigError` as one line from rank 0 and exit status 2 (`entry.py`,
`command_line.run_tool`); any other exception is a defect and keeps its traceback.
"""

import os
import sys
from typing import NoReturn

EXIT_OK, EXIT_FAILURE, EXIT_CONFIG_ERROR, EXIT_RESUME = 0, 1, 2, 3
"""How a run ends. EXIT_RESUME: it stopped before its end to be started again with the same command (a signal,
a deadline: `training/stopping.py`); --exit-interval, asked for, ends with EXIT_OK."""


class ConfigError(ValueError):
    """A setting that cannot work, named with its flag: one line from rank 0, exit status 2."""


class UsageError(ConfigError):
    """A command line argparse refuses (unknown flag, missing value, bad choice)."""


def leave_now(code: int) -> NoReturn:
    """Flush stdout and stderr and end the process with `code` at once, skipping the interpreter's teardown:
    `entry.exit_process` says why an entry point ends so; a signal handler inside a step does because other ranks
    may be inside a collective this one will not join."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe must not turn the status into another
            pass
    os._exit(code)
