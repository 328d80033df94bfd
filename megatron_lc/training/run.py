"""What a training run is made of, built once by `trainer.build_run` and read by the loop, resume and saving."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_lc.config import TrainConfig
from megatron_lc.data.loader import MicroBatchLoader, WorkerLoader
from megatron_lc.data.samples import SampleSource
from megatron_lc.devices import Devices
from megatron_lc.parallel_state import LaunchInfo, ParallelState
from megatron_lc.training.memory_plan import MemoryPlan
from megatron_lc.training.save_lock import SaveLock
from megatron_lc.training.schedule import LRSchedule
from megatron_lc.training.stopping import StepTiming


@dataclass
class Run:
    """Everything a training run is made of."""

    cfg: TrainConfig
    launch: LaunchInfo
    devices: Devices
    pstate: ParallelState
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    offload: object | None
    loader: MicroBatchLoader | WorkerLoader
    valid_source: SampleSource | None
    eod_token: int | None
    accumulation: int
    save_lock: SaveLock | None = None
    test_source: SampleSource | None = None
    eval_loaders: tuple[tuple[SampleSource, MicroBatchLoader | WorkerLoader], ...] = ()
    """The loader of each evaluated source (validation, test), made with the run: workers fork once, early."""

    def eval_loader(self, source: SampleSource) -> MicroBatchLoader | WorkerLoader:
        """The loader reading `source`, repositioned by each evaluation."""
        return next(loader for known, loader in self.eval_loaders if known is source)

    memory_plan: MemoryPlan | None = None
    """The planner's estimate of this run (--memory-plan)."""
    timing: StepTiming = field(default_factory=StepTiming)
    """Measured step and save times (and the resumed checkpoint's), for the deadline."""
    source_meta: dict = field(default_factory=dict)
    """The loaded checkpoint's meta about its source model (`hf_generation.SOURCE_META_KEYS`), saved again with
    every checkpoint of this run."""

    @property
    def is_logging_rank(self) -> bool:
        return self.launch.rank == 0


def print_rank_0(run: Run, text: str) -> None:
    """One line from the logging rank (rank 0), as Megatron-LM's print_rank_0."""
    if run.is_logging_rank:
        print(text, flush=True)


def global_batch_size(cfg: TrainConfig, dp_size: int) -> int:
    """Samples per optimizer step over all data-parallel ranks (--global-batch-size, default micro x dp)."""
    return cfg.data.global_batch_size or cfg.data.micro_batch_size * dp_size
