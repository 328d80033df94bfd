"""Process launch from torchrun's, Open MPI's, MPICH's and Slurm's environments."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lc.devices import cuda_index
from megatron_lc.errors import ConfigError
from megatron_lc.parallel_state import (ParallelDims, _rendezvous_address, detect_launch, host_threads_per_process,
                                        require_launcher)
from megatron_lc.scheduler import expand_nodelist

HERE = Path(__file__).parent


SRUN = {"SLURM_JOB_ID": "81", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1"}
"""An `srun` task's environment (rank 9 of 16, the second task on the second node)."""


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}, ("torchrun", 3, 8, 3)),
    ({"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "GROUP_RANK": "1", **SRUN,
      "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"},
     ("torchrun", 11, 16, 3)),  # srun torchrun on 2 nodes: torchrun's, not its launching task's
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "5"},
     ("openmpi", 5, 16, 5)),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "5", **SRUN,
      "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}, ("openmpi", 5, 16, 5)),  # mpirun inside a Slurm job
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, ("mpich", 1, 2, 1)),
    ({"PMI_RANK": "9", "PMI_SIZE": "16", "MPI_LOCALRANKID": "1", **SRUN, "SLURM_STEP_NUM_TASKS": "2",
      "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}, ("mpich", 9, 16, 1)),  # Hydra's proxies are srun tasks
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, ("mpich", 1, 2, 0)),
    (SRUN, ("slurm", 9, 16, 1)),
    ({**SRUN, "PMI_RANK": "9", "PMI_SIZE": "16"}, ("slurm", 9, 16, 1)),  # srun --mpi=pmi2: not local rank 0
    ({**SRUN, "PMIX_RANK": "9"}, ("slurm", 9, 16, 1)),  # srun --mpi=pmix
    ({**SRUN, "SLURM_NTASKS": "32"}, ("slurm", 9, 16, 1)),  # a step of 16 tasks in a job of 32
    ({}, ("single", 0, 1, 0)),
    ({"SLURM_JOB_ID": "81", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, ("single", 0, 1, 0)),  # a 1-task batch
])
def test_launcher_environment_is_read(env, expected):
    info = require_launcher(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == expected


@pytest.mark.parametrize("env", [
    {"SLURM_JOB_ID": "81", "SLURM_NTASKS": "16", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"},  # the batch script
    {"SLURM_JOB_ID": "81", "SLURM_NTASKS": "16", "SLURM_JOB_NODELIST": "gpu[07-08]"},  # a salloc shell
])
def test_a_run_without_a_launcher_inside_a_multi_task_allocation_is_refused(env):
    with pytest.raises(ConfigError) as e:
        require_launcher(env)
    assert str(e.value) == ("started without a launcher inside Slurm job 81 of 16 tasks (SLURM_NTASKS): launch with "
                            "srun (one task per GPU), or torchrun or mpirun")


def test_the_entry_point_refuses_it_in_one_line_before_any_process_group(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "PMI_"))}
    env.update(SLURM_JOB_ID="81", SLURM_NTASKS="16", SLURM_PROCID="0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "megatron_lc.train", "--mock-data", "--seq-length", "32",
                          "--device", "cpu", "--train-iters", "1"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: started without a launcher inside Slurm job 81 of 16 tasks (SLURM_NTASKS): launch with srun (one "
        "task per GPU), or torchrun or mpirun"]


def test_srun_rank_zeros_address_is_the_first_node_of_the_step_not_the_host_srun_ran_on():
    """After salloc on a login node, srun runs there: SLURM_LAUNCH_NODE_IPADDR is the login node's."""
    launch = detect_launch(SRUN)
    assert _rendezvous_address(launch, {**SRUN, "MASTER_PORT": "6000"}) == "tcp://gpu07:6000"
    assert _rendezvous_address(launch, {**SRUN, "MASTER_ADDR": "head"}) == "tcp://head:29500"


@pytest.mark.parametrize("text, hosts", [
    ("gpu[07-09,12],login5", ["gpu07", "gpu08", "gpu09", "gpu12", "login5"]),
    ("node1", ["node1"]),
    ("a[1-2]-ib,b[009-010]", ["a1-ib", "a2-ib", "b009", "b010"]),
])
def test_slurm_node_lists_are_expanded_in_order(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("local_rank, visible, index", [(3, 8, 3), (3, 1, 0), (0, 1, 0)])
def test_a_task_that_sees_one_gpu_uses_it(local_rank, visible, index):
    assert cuda_index(local_rank, visible) == index


def test_a_local_rank_past_the_visible_gpus_is_refused():
    with pytest.raises(ConfigError, match="local rank 3 sees 2 GPUs"):
        cuda_index(3, 2)


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


@pytest.mark.parametrize("env, usable, threads", [
    ({"LOCAL_WORLD_SIZE": "8", "OMP_NUM_THREADS": "1"}, 112, 14),  # torchrun: every core visible, 1 OMP thread set
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 56, 14),  # mpirun bound to a socket: its 4 processes share it
    ({**SRUN, "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "14"}, 14, 14),  # srun --cpus-per-task binds
    ({**SRUN, "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "6"}, 112, 6),  # --cpu-bind=none: the ask
    ({"LOCAL_WORLD_SIZE": "16"}, 8, 7),  # fewer usable cores than the share: the share of the node
    ({}, 112, 112),  # one process alone
    ({"LOCAL_WORLD_SIZE": "200"}, 112, 1),  # more processes than cores: one each
])
def test_host_threads_are_the_nodes_cores_shared_by_its_processes_within_the_bound_ones(env, usable, threads):
    """The host optimizer's step threads (--optimizer-cpu-offload on a GPU): torchrun, mpirun and srun alike."""
    assert host_threads_per_process(env, usable_cores=usable, node_cores=112) == threads


@pytest.mark.parametrize("env, threads", [
    ({**SRUN, "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "1"}, 14),  # srun -n 16 -N 2, no --ntasks-per-node
    ({**SRUN, "SLURM_TASKS_PER_NODE": "4,2", "SLURM_NODEID": "0"}, 28),  # uneven nodes: each its own count
    ({**SRUN, "SLURM_TASKS_PER_NODE": "4,2", "SLURM_NODEID": "1"}, 56),
    ({**SRUN, "SLURM_TASKS_PER_NODE": "2(x3),8", "SLURM_NODEID": "3"}, 14),
    ({**SRUN, "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "4"}, 28),  # named
    ({**SRUN, "SLURM_TASKS_PER_NODE": "unreadable", "SLURM_NODEID": "0"}, 112),  # nothing says: one process
])
def test_srun_without_ntasks_per_node_shares_the_node_by_slurms_tasks_per_node(env, threads):
    """srun sets SLURM_NTASKS_PER_NODE only when asked with --ntasks-per-node; SLURM_TASKS_PER_NODE is always set."""
    assert host_threads_per_process(env, usable_cores=112, node_cores=112) == threads


def test_calibration_measures_the_host_step_at_the_trainers_thread_count(monkeypatch, tmp_path):
    """The planner's measured host step runs the threads a process of the run gets (the one rule)."""
    from megatron_lc.planning import calibration
    seen = {}

    def measure(threads, shapes, host_threads, processes):
        seen["host_threads"] = host_threads
        return dict.fromkeys(calibration.MEASURED, 1.0)

    monkeypatch.setattr(calibration, "_measure_local", measure)
    monkeypatch.setattr(calibration.os, "sched_getaffinity", lambda pid: set(range(3)), raising=False)
    monkeypatch.setattr(calibration.os, "cpu_count", lambda: 64)
    calibration.calibrate_local(cache=tmp_path / "rates.json", processes=8, refresh=True)
    assert seen["host_threads"] == 3  # 64 // 8 = 8, but this process may run on 3 cores
