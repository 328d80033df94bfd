"""Entry point: `python -m megatron_lc.train [flags]`, also under torchrun, srun and mpirun.

`python -m megatron_lc.train --help` lists every flag (Megatron-LM names). Exit status:
0 when the run finished (or stopped at --exit-interval, as asked), 3 when it saved and
stopped to be resumed (a signal, a deadline: run the same command again), 2 on a configuration error (one line from
rank 0), 1 on any other failure.
"""

import sys

from megatron_lc.arguments import parse_config
from megatron_lc.entry import run_entry_point
from megatron_lc.errors import EXIT_OK, EXIT_RESUME
from megatron_lc.training.trainer import train


def _status(argv) -> int:
    return EXIT_RESUME if train(parse_config(argv)).stopped else EXIT_OK


def main(argv=None) -> None:
    run_entry_point(lambda: _status(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
