"""Parallel dimensions, the device mesh and its named views, and process launch.

One `ParallelState` is built per run and passed explicitly to whoever needs a group:
there are no module-level process groups. The world is laid out as a mesh
[dp_replicate, dp_shard, cp_ring, cp_a2a] (cp = cp_ring x cp_a2a, see `context_layout`):

- `cp_mesh`: the context-parallel group (ranks holding slices of the same sequences);
  `a2a_mesh` its all-to-all groups (contiguous ranks), `ring_mesh` its rings.
- `fsdp_mesh`: dp_shard x cp flattened (parameters are sharded over context ranks too),
  with dp_replicate as an outer replicate dimension when > 1 (HSDP).
- `batch_mesh`: dp_replicate x dp_shard flattened: ranks that read different samples.
- `loss_mesh`: every rank: the valid-token count is summed over batch x cp.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_lc.context_layout import ContextLayout
from megatron_lc.errors import ConfigError
from megatron_lc.scheduler import current_job


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism; their product is the world size."""

    world_size: int
    """Number of processes."""
    cp: int = 1
    """Context-parallel degree: each sequence is split into `cp` slices."""
    dp_replicate: int = 1
    """Replicas of the sharded model (HSDP's outer dimension)."""
    dp_shard: int = -1
    """FSDP data-parallel shards; -1 takes the rest of the world."""
    cp_ring: int = 1
    """Ring degree of context parallelism: cp / cp_ring contiguous ranks form each all-to-all group."""

    def __post_init__(self) -> None:
        for name in ("world_size", "cp", "dp_replicate", "cp_ring"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cp % self.cp_ring:
            raise ValueError(f"context-parallel size {self.cp} is not divisible by its ring degree {self.cp_ring}")
        rest, remainder = divmod(self.world_size, self.cp * self.dp_replicate)
        if remainder:
            raise ValueError(f"world size {self.world_size} is not divisible by context-parallel size {self.cp} "
                             f"x data-parallel replicate {self.dp_replicate}")
        if self.dp_shard == -1:
            object.__setattr__(self, "dp_shard", rest)
        if self.dp_replicate * self.dp_shard * self.cp != self.world_size:
            raise ValueError(f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x cp {self.cp} "
                             f"!= world size {self.world_size}")

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks reading different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def context_layout(self) -> ContextLayout:
        return ContextLayout(a2a_size=self.cp // self.cp_ring, ring_size=self.cp_ring)


def _flatten(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """Flatten a (sub)mesh into one named dimension; the one use of DeviceMesh's private `_flatten`."""
    return mesh._flatten(name)


class ParallelState:
    """The mesh and the questions Megatron users ask of it (ranks, sizes, groups)."""

    def __init__(self, dims: ParallelDims, device_type: str = "cpu"):
        self.dims = dims
        self.world_mesh: DeviceMesh | None = None
        if dims.world_size == 1:
            return  # one process: no groups, no collectives
        layout = dims.context_layout
        self.world_mesh = init_device_mesh(
            device_type, (dims.dp_replicate, dims.dp_shard, layout.ring_size, layout.a2a_size),
            mesh_dim_names=("dp_replicate", "dp_shard", "cp_ring", "cp_a2a"),
        )
        m = self.world_mesh
        self.cp_mesh = _flatten(m["cp_ring", "cp_a2a"], "cp")
        self.a2a_mesh, self.ring_mesh = m["cp_a2a"], m["cp_ring"]
        self.batch_mesh = _flatten(m["dp_replicate", "dp_shard"], "dp")
        self.loss_mesh = _flatten(m["dp_replicate", "dp_shard", "cp_ring", "cp_a2a"], "dp_cp")
        shard_cp = _flatten(m["dp_shard", "cp_ring", "cp_a2a"], "dp_shard_cp")
        self.fsdp_mesh = m["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else shard_cp

    @property
    def distributed(self) -> bool:
        return self.world_mesh is not None

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def cp_rank(self) -> int:
        return self.cp_mesh.get_local_rank() if self.distributed else 0

    @property
    def cp_group(self):
        return self.cp_mesh.get_group() if self.distributed else None

    @property
    def context_layout(self) -> ContextLayout:
        return self.dims.context_layout

    @property
    def a2a_group(self):
        """The all-to-all group of this rank's context-parallel ranks (the whole cp group without a ring)."""
        return self.a2a_mesh.get_group() if self.distributed else None

    @property
    def ring_group(self):
        """The ring this rank belongs to (ranks at the same place in each all-to-all group)."""
        return self.ring_mesh.get_group() if self.distributed else None

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        return self.batch_mesh.get_local_rank() if self.distributed else 0

    @property
    def dp_group(self):
        return self.batch_mesh.get_group() if self.distributed else None

    @property
    def loss_group(self):
        """Group over which valid-token counts and loss sums are summed (batch x cp)."""
        return self.loss_mesh.get_group() if self.distributed else None

    @property
    def grad_averaging_size(self) -> int:
        """Ranks FSDP averages gradients over (every rank holds a different part of the batch)."""
        return self.dims.world_size

    def __repr__(self) -> str:
        d = self.dims
        return (f"ParallelState(world={d.world_size}, dp_replicate={d.dp_replicate}, dp_shard={d.dp_shard}, "
                f"cp={d.cp}, cp_ring={d.cp_ring})")


# --- warm-up --------------------------------------------------------------------------------

GRADIENT_ALL_REDUCE_ELEMENTS = 1 << 20
"""Elements of the warm-up all-reduce on HSDP's replicate group. NCCL picks its algorithm by message
size and (NCCL >= 2.22) connects each algorithm on first use, so the one group that all-reduces
large messages (gradients) is warmed with a large one too (4 MiB in fp32); the others all-reduce
scalars in the step and are warmed with scalars."""


def collective_plan(dims: ParallelDims) -> list[tuple[str, str]]:
    """(collective, group name) pairs one training step runs, for `warm_up_collectives`.

    world: stop requests and checkpoint saving; loss: token counts and loss sums; fsdp:
    FSDP2's all-gather and reduce-scatter and the gradient norm's all-reduce; fsdp_replicate:
    HSDP's gradient all-reduce; a2a: Ulysses' all-to-all; ring: ring attention's send/recv.
    The dp and cp groups carry no collective (only their ranks and sizes are used).
    """
    if dims.world_size == 1:
        return []
    plan = [("all_reduce", "world"), ("all_reduce", "loss"),
            ("all_gather", "fsdp"), ("reduce_scatter", "fsdp"), ("all_reduce", "fsdp")]
    if dims.dp_replicate > 1:
        plan.append(("all_reduce", "fsdp_replicate"))
    layout = dims.context_layout
    if dims.cp > 1 and layout.a2a_size > 1:
        plan.append(("all_to_all", "a2a"))
    if layout.ring_size > 1:
        plan.append(("send_recv", "ring"))
    return plan


def _plan_groups(pstate: ParallelState) -> dict:
    """The process group behind each name of `collective_plan` (None: the default group)."""
    groups = {"world": None, "loss": pstate.loss_group, "fsdp": pstate.fsdp_mesh.get_group("dp_shard_cp"),
              "a2a": pstate.a2a_group, "ring": pstate.ring_group}
    if pstate.dims.dp_replicate > 1:
        groups["fsdp_replicate"] = pstate.fsdp_mesh.get_group("dp_replicate")
    return groups


def run_collective(kind: str, group, device: torch.device, elements: int = 1) -> None:
    """One `kind` of `collective_plan` on `group` (None: the default group), `elements` per rank."""
    group = group or dist.group.WORLD  # a real group: get_global_rank takes no None
    n = dist.get_world_size(group)
    x = torch.ones(n * elements, device=device)
    if kind == "all_reduce":
        dist.all_reduce(x, group=group)
    elif kind == "all_gather":
        dist.all_gather_into_tensor(torch.empty(n * x.numel(), device=device), x, group=group)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(torch.empty(elements, device=device), x, group=group)
    elif kind == "all_to_all":
        dist.all_to_all_single(torch.empty_like(x), x, group=group)
    elif kind == "send_recv":  # as ring attention: send to the next rank, receive from the previous
        rank = dist.get_rank(group)
        ops = [dist.P2POp(dist.isend, x, dist.get_global_rank(group, (rank + 1) % n), group),
               dist.P2POp(dist.irecv, torch.empty_like(x), dist.get_global_rank(group, (rank - 1) % n), group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    else:
        raise ValueError(f"unknown collective {kind!r}")


def warm_up_collectives(pstate: ParallelState, device: torch.device) -> None:
    """Run each collective of the step once on each group it uses, with tiny tensors.

    NCCL >= 2.22 makes its connections (and their buffers, outside PyTorch's allocator) on a
    communicator's first use of each kind. Done before step 1, they take memory from an empty card;
    done inside step 1, after PyTorch's cache has grown, they can fail for want of it.
    """
    groups = _plan_groups(pstate) if pstate.distributed else {}
    for kind, name in collective_plan(pstate.dims):
        large = kind == "all_reduce" and name == "fsdp_replicate"
        run_collective(kind, groups[name], device, GRADIENT_ALL_REDUCE_ELEMENTS if large else 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- launch -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits, read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str


def _launch(env: Mapping[str, str], name: str, rank: str, size: str, local: str | None) -> LaunchInfo:
    return LaunchInfo(int(env[rank]), int(env[size]), int(env.get(local, 0)) if local else 0, name)


def detect_launch(env: Mapping[str, str] = os.environ) -> LaunchInfo:
    """Rank, world size and local rank from torchrun, mpirun (Open MPI, MPICH/Hydra) or srun.

    The order matters where launchers nest or overlap:
    - torchrun first: `srun torchrun ...` and mpirun inside a Slurm job leave Slurm's variables of the
      launching task (torchrun's, or the MPI daemon's) in every worker's environment;
    - Open MPI's and Hydra's own variables next (Hydra's MPI_LOCALRANKID marks an mpirun process; `srun
      --mpi=pmi2` sets PMI_RANK/PMI_SIZE but no local rank, which Slurm's SLURM_LOCALID gives);
    - an `srun` step (SLURM_STEP_NUM_TASKS, set by srun and not in a batch script or salloc shell), with or
      without pmi2/pmix;
    - PMI_RANK/PMI_SIZE alone (another PMI launcher): local rank 0.
    A batch script or salloc shell has Slurm's job variables but no step: one process (see `require_launcher`).
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return _launch(env, "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        return _launch(env, "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
    if "PMI_RANK" in env and "PMI_SIZE" in env and "MPI_LOCALRANKID" in env:
        return _launch(env, "mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return _launch(env, "slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return _launch(env, "mpich", "PMI_RANK", "PMI_SIZE", None)
    return LaunchInfo(0, 1, 0, "single")


LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")
"""Processes on this node, as torchrun, Open MPI, MPICH and srun say it."""


def slurm_tasks_on_node(tasks_per_node: str, node: int) -> int | None:
    """Tasks on node `node` of Slurm's SLURM_TASKS_PER_NODE, a list of counts, each repeated by `(xN)`:
    "8(x2)", "4,2", "2(x3),1" (None: not of that form, or no such node)."""
    counts = []
    for part in tasks_per_node.split(","):
        count, _, repeat = part.partition("(x")
        if not count.isdigit() or (repeat and not (repeat.endswith(")") and repeat[:-1].isdigit())):
            return None
        counts += [int(count)] * (int(repeat[:-1]) if repeat else 1)
    return counts[node] if 0 <= node < len(counts) and counts[node] > 0 else None


def local_processes(env: Mapping[str, str] = os.environ) -> int:
    """This node's processes of the run, from the launcher's environment (1 when none says). srun without
    --ntasks-per-node sets no count of its own for the node: Slurm's SLURM_TASKS_PER_NODE, always set, says it."""
    named = next((int(env[v]) for v in LOCAL_SIZE_VARIABLES if env.get(v, "").isdigit() and int(env[v]) > 0), None)
    if named is not None:
        return named
    node = env.get("SLURM_NODEID", "0")
    on_node = slurm_tasks_on_node(env.get("SLURM_TASKS_PER_NODE", ""), int(node)) if node.isdigit() else None
    return on_node or 1


def host_threads_per_process(env: Mapping[str, str] = os.environ, usable_cores: int | None = None,
                             node_cores: int | None = None) -> int:
    """Threads this process's host compute (the host optimizer's step) should run: the node's cores shared by its
    processes, within the cores this process may run on (its affinity: srun --cpus-per-task and mpirun bind it)
    and Slurm's SLURM_CPUS_PER_TASK. Not OMP_NUM_THREADS: torchrun sets it to 1 for several processes a node."""
    usable = len(os.sched_getaffinity(0)) if usable_cores is None else usable_cores
    node = (os.cpu_count() or 1) if node_cores is None else node_cores
    threads = min(usable, node // local_processes(env))
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and int(per_task) > 0:
        threads = min(threads, int(per_task))
    return max(1, threads)


def require_launcher(env: Mapping[str, str] = os.environ) -> LaunchInfo:
    """`detect_launch`, refusing one process started without a launcher inside a Slurm allocation of several
    tasks (a batch script or salloc shell running python directly), which would otherwise train alone."""
    launch = detect_launch(env)
    tasks = env.get("SLURM_NTASKS", "1")
    if launch.launcher == "single" and tasks.isdigit() and int(tasks) > 1:
        raise ConfigError(f"started without a launcher inside Slurm job {env.get('SLURM_JOB_ID', '?')} of {tasks} "
                          "tasks (SLURM_NTASKS): launch with srun (one task per GPU), or torchrun or mpirun")
    return launch


def _rendezvous_address(launch: LaunchInfo, env: Mapping[str, str]) -> str:
    """tcp:// address of rank 0: MASTER_ADDR/PORT, else rank 0's host shared through MPI, or for srun the first
    host of the step's node list (never the host srun was typed on: after salloc that is a login node)."""
    port = env.get("MASTER_PORT", "29500")
    if "MASTER_ADDR" in env:
        return f"tcp://{env['MASTER_ADDR']}:{port}"
    if launch.launcher in ("openmpi", "mpich"):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise RuntimeError("launched by mpirun without MASTER_ADDR: set MASTER_ADDR/MASTER_PORT or install "
                               "mpi4py (pip install 'megatron_lc[mpi]') to share rank 0's address") from e
        host = MPI.COMM_WORLD.bcast(socket.gethostname() if launch.rank == 0 else None, root=0)
        return f"tcp://{host}:{port}"
    nodes = current_job(env).nodes
    if launch.launcher == "slurm" and nodes:
        return f"tcp://{nodes[0]}:{port}"
    raise RuntimeError(f"cannot find rank 0's address for launcher {launch.launcher}: set MASTER_ADDR and MASTER_PORT")


def process_group_options(accelerator: torch.device | None, backend: str | None = None) -> dict:
    """Backend (and bound device) for the accelerator the run uses, whatever else the machine has.

    NCCL for CUDA, bound to this rank's device (`device_id`), so the communicator is made on
    the right GPU at once; gloo for CPU, including `--device cpu` on a machine with GPUs.
    """
    on_cuda = accelerator is not None and accelerator.type == "cuda"
    options = {"backend": backend or ("nccl" if on_cuda else "gloo")}
    if on_cuda and options["backend"] == "nccl":
        options["device_id"] = accelerator
    return options


def init_distributed(accelerator: torch.device | None = None, backend: str | None = None,
                     env: Mapping[str, str] = os.environ, timeout_minutes: float | None = None) -> LaunchInfo:
    """Initialise the default process group from the launcher's environment (no-op for one process).

    Call it after `torch.cuda.set_device(accelerator)`: the backend follows the accelerator.
    `timeout_minutes` (--distributed-timeout-minutes) is the process group's timeout; None: torch's default.
    """
    launch = detect_launch(env)
    if launch.world_size == 1 or dist.is_initialized():
        return launch
    options = process_group_options(accelerator, backend)
    if timeout_minutes is not None:
        options["timeout"] = datetime.timedelta(minutes=timeout_minutes)
    dist.init_process_group(init_method=_rendezvous_address(launch, env), rank=launch.rank,
                            world_size=launch.world_size, **options)
    return launch
