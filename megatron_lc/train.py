"""Entry point: `python -m megatron_lc.train [flags]`, also under torchrun, srun and mpirun.

`python -m megatron_lc.train --help` lists every flag (Megatron-LM names).
"""

import sys

import torch.distributed as dist

from megatron_lc.config import parse_config
from megatron_lc.training.trainer import train


def main(argv=None) -> None:
    cfg = parse_config(argv)
    try:
        train(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
