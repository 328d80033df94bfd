"""Process launch from torchrun's, Open MPI's, MPICH's and Slurm's environments."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lc.parallel_state import ParallelDims, detect_launch

HERE = Path(__file__).parent


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}, ("torchrun", 3, 8, 3)),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "5"},
     ("openmpi", 5, 16, 5)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, ("mpich", 1, 2, 0)),
    ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}, ("slurm", 9, 16, 1)),
    ({}, ("single", 0, 1, 0)),
])
def test_launcher_environment_is_read(env, expected):
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == expected


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, cp=4), "not divisible by context-parallel size 4"),
    (dict(world_size=8, cp=2, dp_replicate=2, dp_shard=3), "!= world size 8"),
    (dict(world_size=4, cp=0), "cp must be >= 1"),
])
def test_impossible_parallel_dims_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_dp_shard_takes_the_rest_of_the_world():
    dims = ParallelDims(world_size=16, cp=4, dp_replicate=2)
    assert (dims.dp_shard, dims.dp) == (2, 4)


def _mpirun() -> str | None:
    candidate = Path(sys.executable).parent / "mpirun"
    return str(candidate) if candidate.exists() else shutil.which("mpirun")


@pytest.mark.skipif(_mpirun() is None, reason="mpirun not installed (pip install 'megatron_lc[mpi]')")
def test_mpirun_two_ranks_initialise_through_mpi4py(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "RANK", "WORLD_SIZE")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", MASTER_PORT="0")
    from tests.helpers import free_port

    env["MASTER_PORT"] = str(free_port())
    cmd = [_mpirun(), "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable,
           str(HERE / "mpi_launch_worker.py"), str(tmp_path / "out")]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    assert [r["launcher"] for r in reports] == ["openmpi", "openmpi"]
    assert sorted(r["cp_rank"] for r in reports) == [0, 1]
    assert all(r["sum"] == 3.0 and r["world_size"] == 2 for r in reports)


def test_backend_follows_the_accelerator_not_the_machine():
    """--device cpu on a GPU machine is gloo; CUDA is NCCL bound to this rank's device."""
    import torch

    from megatron_lc.parallel_state import process_group_options

    assert process_group_options(torch.device("cpu")) == {"backend": "gloo"}
    cuda = torch.device("cuda", 3)
    assert process_group_options(cuda) == {"backend": "nccl", "device_id": cuda}
    assert process_group_options(cuda, backend="gloo") == {"backend": "gloo"}
