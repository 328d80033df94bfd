"""The error types every room raises for a setting that cannot work; a leaf module (imports nothing).

An entry point reports a `ConfigError` as one line from rank 0 and exit status 2 (`entry.py`,
`command_line.run_tool`); any other exception is a defect and keeps its traceback.
"""

EXIT_OK, EXIT_FAILURE, EXIT_CONFIG_ERROR, EXIT_RESUME = 0, 1, 2, 3
"""How a run ends. EXIT_RESUME: it stopped before its end to be started again with the same command (a signal,
a deadline: `training/stopping.py`); --exit-interval, asked for, ends with EXIT_OK."""


class ConfigError(ValueError):
    """A setting that cannot work, named with its flag: one line from rank 0, exit status 2."""


class UsageError(ConfigError):
    """A command line argparse refuses (unknown flag, missing value, bad choice)."""
