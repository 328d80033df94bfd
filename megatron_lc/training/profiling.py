"""Profiling chosen steps, as Megatron-LM's --profile does.

Steps `--profile-step-start + 1` to `--profile-step-end` (counted as the log counts them) are profiled on
`--profile-ranks`. With `--use-pytorch-profiler`: torch.profiler, one Chrome trace per rank (open it in Perfetto
or TensorBoard's profiler plugin) and a table of operators by their own time, both in --tensorboard-dir (where
Megatron-LM writes its traces) or else the run's log directory. Without it: nsys's capture range, for a run under
`nsys profile --capture-range=cudaProfilerApi` (cudaProfilerStart/Stop around the steps, NVTX ranges per operator).
A step is everything between one training step's start and the next's (its evaluation and checkpoint included),
as Megatron-LM steps its profiler at the top of its loop; the step before the window runs under torch.profiler as
its warm-up. Megatron-LM's own torch.profiler schedule records steps start to end - 1 (its nsys range start + 1
to end): here both record start + 1 to end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megatron_lc.errors import ConfigError
from megatron_lc.flags import flag, flag_list


@dataclass
class ProfilingArgs:
    profile: bool = flag(False, "profile steps --profile-step-start + 1 to --profile-step-end on --profile-ranks: "
                         "with --use-pytorch-profiler a Chrome trace and an operator table per rank, else nsys's "
                         "capture range (run under `nsys profile --capture-range=cudaProfilerApi`)")
    use_pytorch_profiler: bool = flag(False, "with --profile: torch.profiler (traces to --tensorboard-dir, or the "
                                      "run's log directory)")
    profile_step_start: int = flag(10, "with --profile: the step after which profiling starts")
    profile_step_end: int = flag(12, "with --profile: the last step profiled")
    profile_ranks: list[int] = flag_list("with --profile: the global ranks to profile (none given: rank 0)")

    def ranks(self) -> list[int]:
        return self.profile_ranks or [0]

    def check(self, world_size: int, train_iters: int) -> None:
        """Refuses a window with no step in it and a rank outside the world (nsys's range without CUDA is the
        preflight's: `refuse_on_cpu`)."""
        if not self.profile:
            defaults = ProfilingArgs()
            given = [name for name, value, default in (
                ("--use-pytorch-profiler", self.use_pytorch_profiler, False), ("--profile-ranks", self.profile_ranks, []),
                ("--profile-step-start", self.profile_step_start, defaults.profile_step_start),
                ("--profile-step-end", self.profile_step_end, defaults.profile_step_end)) if value != default]
            if given:
                raise ConfigError(f"{given[0]} chooses what --profile profiles: add --profile")
            return
        start, end = self.profile_step_start, self.profile_step_end
        if start < 0 or end <= start:
            raise ConfigError(f"--profile-step-start {start} --profile-step-end {end}: the steps profiled are start "
                              "+ 1 to end; give 0 <= start < end")
        if start >= train_iters:
            raise ConfigError(f"--profile-step-start {start} with --train-iters {train_iters}: no step would be "
                              "profiled; lower it")
        outside = [r for r in self.ranks() if not 0 <= r < world_size]
        if outside:
            raise ConfigError(f"--profile-ranks {' '.join(map(str, outside))}: the run has ranks 0 to {world_size - 1}")

    def refuse_on_cpu(self) -> None:
        if self.profile and not self.use_pytorch_profiler:
            raise ConfigError("--profile without --use-pytorch-profiler marks nsys's CUDA capture range; this run is on "
                              "the CPU: add --use-pytorch-profiler")


class StepProfiler:
    """Starts and stops the profiler around the window's steps on a profiled rank (a no-op elsewhere).

    `cudart` is torch.cuda.cudart() and `nvtx` torch.autograd.profiler.emit_nvtx (nsys's range): passed in so
    that recording stand-ins can check the calls."""

    def __init__(self, args: ProfilingArgs, rank: int, first_step: int, out_dir: str, cuda: bool,
                 say: Callable[[str], None] = print, cudart=None, nvtx=None):
        self.args, self.rank, self.out_dir, self.cuda, self.say = args, rank, Path(out_dir), cuda, say
        self._cudart, self._nvtx_factory, self._profiler, self._nvtx = cudart, nvtx, None, None
        start, end = args.profile_step_start, args.profile_step_end
        self.warmup = start >= first_step  # the step before the window runs (a resumed run may begin inside it)
        self.steps = (max(start, first_step - 1) + 1, end)
        """The first and last step profiled."""
        self._done = first_step - 1  # the last step finished
        self.active = args.profile and rank in args.ranks()
        self._opened = False
        if self.active and first_step > end:
            say(f"--profile: steps {start + 1}-{end} are before this run's first step {first_step}: nothing profiled")
            self.active = False

    def before_step(self, step: int) -> None:
        """At the top of step `step`: the boundary between it and the step before (which it closes after the window's
        last step), and the window's opening."""
        if not self.active:
            return
        first, last = self.steps
        if self._profiler is not None:
            self._profiler.step()
        if step == last + 1:
            self.close()
        if self.args.use_pytorch_profiler and step == first - int(self.warmup):
            self._profiler, self._opened = self._torch_profiler(), True
            self._profiler.start()
        elif not self.args.use_pytorch_profiler and step == first:
            self._cuda_profiler().cudaProfilerStart()
            self._nvtx, self._opened = self._emit_nvtx()(record_shapes=True), True
            self._nvtx.__enter__()

    def after_step(self, step: int) -> None:
        self._done = step

    def close(self) -> None:
        """After the window's last step, or at the end of the run whatever happened: a window cut short still writes
        what it recorded; a run that never reached it says so."""
        if self._profiler is not None:
            self._finish_torch()
        elif self._nvtx is not None:
            self._finish_nsys()
        elif self.active and not self._opened:
            self.say(f"rank {self.rank}: the run ended before step {self.steps[0]}: nothing profiled")
            self.active = False

    def _torch_profiler(self):
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.out_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        first, last = self.steps
        window = schedule(wait=0, warmup=int(self.warmup), active=last - first + 1, repeat=1)
        return profile(activities=activities, schedule=window, record_shapes=True, with_stack=True,
                       on_trace_ready=tensorboard_trace_handler(str(self.out_dir), worker_name=f"rank{self.rank}"))

    def _finish_torch(self) -> None:
        profiler, self._profiler, self.active = self._profiler, None, False
        profiler.stop()
        first, last = self.steps[0], min(self.steps[1], self._done)
        if last < first:  # the run ended in the warm-up step
            self.say(f"rank {self.rank}: the run ended before step {first}: nothing profiled")
            return
        table = self.out_dir / f"profile_rank{self.rank}_steps{first}-{last}.txt"
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table.write_text(profiler.key_averages().table(sort_by=sort, row_limit=60) + "\n")
        self.say(f"rank {self.rank}: profiled steps {first}-{last}: Chrome trace rank{self.rank}.*.pt.trace.json and "
                 f"operator table {table.name} in {self.out_dir}")

    def _finish_nsys(self) -> None:
        nvtx, self._nvtx, self.active = self._nvtx, None, False
        nvtx.__exit__(None, None, None)
        self._cuda_profiler().cudaProfilerStop()
        self.say(f"rank {self.rank}: nsys capture range closed after step {min(self.steps[1], self._done)}")

    def _emit_nvtx(self):
        if self._nvtx_factory is None:
            import torch

            self._nvtx_factory = torch.autograd.profiler.emit_nvtx
        return self._nvtx_factory

    def _cuda_profiler(self):
        if self._cudart is None:
            import torch

            self._cudart = torch.cuda.cudart()
        return self._cudart
