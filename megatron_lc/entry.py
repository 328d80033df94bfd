"""How every entry point ends: 0 when done, 3 when stopped to be resumed, 2 on a configuration error, 1 on a
failure.

A finished distributed run must report success. With gloo, the interpreter's teardown
after `destroy_process_group()` can still meet the process group's worker threads and
abort (`terminate called without an active exception`, SIGABRT) although all work is
done. Once the group is destroyed and output is flushed nothing is left to clean up, so
the process leaves with `os._exit`. A configuration error is one line from rank 0, with
no traceback, exit status 2 (every rank reaches the same conclusion from the same flags).
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from typing import Callable, NoReturn

import torch.distributed as dist

from megatron_lc.errors import EXIT_CONFIG_ERROR, EXIT_FAILURE, EXIT_OK, ConfigError, leave_now
from megatron_lc.parallel_state import detect_launch



def exit_process(code: int) -> NoReturn:
    """Flush what was written and leave now (see the module docstring for why not `sys.exit`)."""
    if code == EXIT_OK:  # on a failure another rank may never reach finalize: do not wait for it
        _finalize_mpi()
    logging.shutdown()
    leave_now(code)


def _finalize_mpi() -> None:
    """mpirun counts a rank that leaves without MPI_Finalize as failed; mpi4py's own finalize runs at
    interpreter exit, which `os._exit` skips, so finalize here when mpi4py was used."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def finish_distributed() -> None:
    """Tear the process group down after a finished run (every rank reaches this)."""
    if dist.is_initialized():
        dist.destroy_process_group()


REPORTING_GRACE_S = 5.0
"""How long ranks that stay silent about a configuration error wait before they exit."""


def report_config_error(error: ConfigError) -> bool:
    """One line from rank 0; other nodes' first ranks speak too, as a check of files (data, --save) can
    fail on one node alone and that node would otherwise leave without a word. True if this rank spoke."""
    launch = detect_launch()
    if launch.rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    elif launch.local_rank == 0:
        print(f"[rank {launch.rank}] error: {error}", file=sys.stderr, flush=True)
    return launch.rank == 0 or launch.local_rank == 0


def run_entry_point(main: Callable[[], object]) -> NoReturn:
    """Run `main()` and exit with its outcome's status (an int it returns, else 0); never returns."""
    status = EXIT_OK
    try:
        returned = main()
        if isinstance(returned, int) and not isinstance(returned, bool):
            status = returned
    except SystemExit as e:  # argparse's usage errors and --help come before any process group
        if not dist.is_initialized():
            raise
        exit_process(EXIT_OK if e.code is None else e.code if isinstance(e.code, int) else EXIT_FAILURE)
    except ConfigError as e:
        if not report_config_error(e) and detect_launch().world_size > 1:
            time.sleep(REPORTING_GRACE_S)  # the launcher stops the others when one exits: let the reporting rank speak
        exit_process(EXIT_CONFIG_ERROR)
    except BaseException:  # noqa: BLE001 - any other failure: its traceback, then a failing status
        traceback.print_exc()
        exit_process(EXIT_FAILURE)  # no teardown: other ranks may still wait in a collective
    finish_distributed()
    exit_process(status)
