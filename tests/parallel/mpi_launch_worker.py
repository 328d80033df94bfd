"""Started by mpirun in tests: initialise from Open MPI's environment, run one collective, report."""

import json
import sys

import torch
import torch.distributed as dist

from megatron_lc.entry import exit_process
from megatron_lc.parallel_state import ParallelDims, ParallelState, init_distributed


def main(out_prefix: str) -> None:
    torch.set_num_threads(1)
    launch = init_distributed(backend="gloo")
    pstate = ParallelState(ParallelDims(launch.world_size, cp=launch.world_size))
    value = torch.tensor([float(launch.rank + 1)])
    dist.all_reduce(value, group=pstate.cp_group)
    with open(f"{out_prefix}.{launch.rank}.json", "w") as f:
        json.dump({"launcher": launch.launcher, "rank": launch.rank, "world_size": launch.world_size,
                   "local_rank": launch.local_rank, "cp_rank": pstate.cp_rank, "sum": value.item()}, f)
    dist.destroy_process_group()
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1])
