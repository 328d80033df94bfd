"""The planner's prediction for a run, read by the run it was made for (--memory-plan FILE).

`tools/estimate_memory.py <the run's flags> --json > plan.json` writes one estimate: the GPU peak (allocated),
the reserve the planner adds for the allocator and the CUDA context, the host bytes per node and the predicted
step time, and, under "run", the flags the estimate depends on (`planned_run`). A run given that file refuses
it in one line when its own flags differ (a plan of another run would compare the measured peak with the
wrong number), then logs each step's measured peak beside the plan's and, before any step has been measured,
judges its deadline by the plan's step time.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from megatron_lc.config import TrainConfig
from megatron_lc.errors import ConfigError
from megatron_lc.flags import flag_name

PLANNED_SECTIONS = ("model", "parallel", "fsdp", "memory")
"""Sections every flag of which can change a step's memory or time (those the config has)."""
PLANNED_FIELDS = {"data": ("seq_length", "micro_batch_size", "global_batch_size"),
                  "train": ("bf16", "fp16"), "optim": ("optimizer_cpu_offload",)}
"""The flags of other sections that can."""
IGNORED_FIELDS = {"model": ("checkpoint_model", "init_method_std"), "parallel": ("distributed_timeout_minutes",)}
"""Flags of those sections that change neither (and a field filled in from a checkpoint at load time)."""


def planned_run(cfg: TrainConfig, world_size: int) -> dict:
    """The flags an estimate of `cfg` depends on, by flag name, and the world size."""
    found: dict = {"world size": world_size}
    for section in (*PLANNED_SECTIONS, *PLANNED_FIELDS):
        args = getattr(cfg, section, None)
        if args is None:
            continue
        names = PLANNED_FIELDS.get(section)
        for f in dataclasses.fields(args):
            if (names is None or f.name in names) and f.name not in IGNORED_FIELDS.get(section, ()):
                value = getattr(args, f.name)
                found[flag_name(f)] = list(value) if isinstance(value, tuple) else value
    return found


@dataclass(frozen=True)
class MemoryPlan:
    """One estimate of the planner's, for this run."""

    path: str
    machine: str
    gpu_peak_gib: float
    """Allocated bytes at the step's peak on the busiest GPU."""
    reserve_gib: float
    """What the planner adds for the allocator's rounding and caching, the CUDA context and NCCL."""
    gpu_memory_gib: float
    host_per_node_gib: float
    step_s: float | None
    """Predicted step time at the plan's machine rates (None: the plan has no time)."""

    def describe(self) -> str:
        step = f", step {self.step_s:,.0f} s" if self.step_s is not None else ""
        return (f"memory plan {self.path} ({self.machine}): GPU peak {self.gpu_peak_gib:.2f} GiB + "
                f"{self.reserve_gib:.2f} reserve of {self.gpu_memory_gib:g} GiB, host {self.host_per_node_gib:,.1f} "
                f"GiB per node{step} (predicted)")


def read_memory_plan(path: str, cfg: TrainConfig, world_size: int) -> MemoryPlan:
    """The plan in `path` (estimate_memory.py --json of this run's flags); refused in one line when it is not one
    estimate's, or when it was made for other flags."""
    where = f"--memory-plan {path}"
    try:
        plan = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON (line {e.lineno}: {e.msg}); write it with estimate_memory.py "
                          "... --json > FILE") from None
    if not isinstance(plan, dict) or "run" not in plan or plan.get("gpu_peak_gib") is None:
        raise ConfigError(f"{where}: not the JSON of one estimate (estimate_memory.py with this run's flags and "
                          "--json, without --auto-fit, --find-max-seq-length or --ablate)")
    ours = planned_run(cfg, world_size)
    differ = [(k, plan["run"].get(k, "(not planned)"), v) for k, v in ours.items() if plan["run"].get(k) != v]
    differ += [(k, v, "(not a flag here)") for k, v in plan["run"].items() if k not in ours]
    if differ:
        flag, planned, here = differ[0]
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise ConfigError(f"{where} was made for {flag} {planned}, this run has {here}{more}: run "
                          "estimate_memory.py again with this run's flags and --json")
    step = plan.get("time", {}).get("step_s")
    return MemoryPlan(path, str(plan.get("machine", "?")), float(plan["gpu_peak_gib"]),
                      float(plan.get("reserve_gib") or 0.0), float(plan.get("gpu_memory_gib") or 0.0),
                      float(plan.get("host_peak_gib") or 0.0), float(step) if step is not None else None)
