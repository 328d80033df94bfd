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

import os
import socket
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_lc.context_layout import ContextLayout


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


# --- launch -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits, read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str


_LAUNCHERS = (  # (name, rank, world size, local rank) variables of each launcher
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def detect_launch(env: Mapping[str, str] = os.environ) -> LaunchInfo:
    """Rank, world size and local rank from torchrun, mpirun (Open MPI, MPICH) or srun."""
    for name, rank, size, local in _LAUNCHERS:
        if rank in env and size in env:
            return LaunchInfo(int(env[rank]), int(env[size]), int(env.get(local, 0)), name)
    return LaunchInfo(0, 1, 0, "single")


def _rendezvous_address(launch: LaunchInfo, env: Mapping[str, str]) -> str:
    """tcp:// address of rank 0: MASTER_ADDR/PORT, else rank 0's host shared through MPI or Slurm."""
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
    if launch.launcher == "slurm" and "SLURM_LAUNCH_NODE_IPADDR" in env:
        return f"tcp://{env['SLURM_LAUNCH_NODE_IPADDR']}:{port}"
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
                     env: Mapping[str, str] = os.environ) -> LaunchInfo:
    """Initialise the default process group from the launcher's environment (no-op for one process).

    Call it after `torch.cuda.set_device(accelerator)`: the backend follows the accelerator.
    """
    launch = detect_launch(env)
    if launch.world_size == 1 or dist.is_initialized():
        return launch
    dist.init_process_group(init_method=_rendezvous_address(launch, env), rank=launch.rank,
                            world_size=launch.world_size, **process_group_options(accelerator, backend))
    return launch
