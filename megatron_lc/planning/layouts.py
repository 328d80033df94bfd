"""Auto-fit's parallel layouts: how a number of GPUs splits into context-parallel and data-parallel
degrees, and which context-parallel communication each uses."""


from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_lc.config import TrainConfig
from megatron_lc.errors import ConfigError


LAYOUT_FLAGS = ("--context-parallel-size", "--cp-comm-type", "--hierarchical-context-parallel-sizes")
"""The flags of the parallel layout: given any, auto-fit keeps the layout; else it searches it."""


@dataclass(frozen=True)
class Layout:
    """One way to lay the GPUs out: the context-parallel group (its degree and how it communicates), the rest
    data-parallel."""

    cp: int
    comm_type: str
    """a2a (Ulysses and Untied Ulysses), p2p (ring attention) or a2a+p2p (all-to-all in a node, a ring across)."""
    hierarchical: tuple[int, ...] = ()

    @property
    def chain(self) -> str:
        """Layouts of one chain differ in cp only: with the same stack, a smaller cp holds more per GPU."""
        return "none" if self.cp == 1 else self.comm_type

    def flags(self) -> list[str]:
        out = ["--context-parallel-size", str(self.cp)]
        if self.cp > 1 and self.comm_type != "a2a":
            out += ["--cp-comm-type", self.comm_type]
        if self.hierarchical:
            out += ["--hierarchical-context-parallel-sizes", *map(str, self.hierarchical)]
        return out

    def apply(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` laid out this way, its all-to-all implementation reset to Ulysses (a candidate sets its own)."""
        parallel = dataclasses.replace(cfg.parallel, context_parallel_size=self.cp,
                                       cp_comm_type=self.comm_type if self.cp > 1 else "a2a",
                                       hierarchical_context_parallel_sizes=list(self.hierarchical),
                                       cp_impl="ulysses", untied_heads_per_stage=None, untied_overlap_stages=False,
                                       untied_backward="fast", ring_kv_grads="overlapped")
        return dataclasses.replace(cfg, parallel=parallel)

    def describe(self, num_gpus: int) -> str:
        how = {"a2a": "all-to-all", "p2p": "ring", "a2a+p2p": "all-to-all x ring"}[self.comm_type]
        dp = num_gpus // self.cp
        return "no context parallelism" + (f", dp {dp}" if dp > 1 else "") if self.cp == 1 else \
            f"cp {self.cp} {how}" + (f" {'x'.join(map(str, self.hierarchical))}" if self.hierarchical else "") + \
            (f", dp {dp}" if dp > 1 else "")


def layout_of(cfg: TrainConfig) -> Layout:
    p = cfg.parallel
    return Layout(p.context_parallel_size, p.cp_comm_type if p.context_parallel_size > 1 else "a2a",
                  tuple(p.hierarchical_context_parallel_sizes))


def search_layouts(cfg: TrainConfig, num_gpus: int, gpus_per_node: int) -> list[Layout]:
    """Every layout of `num_gpus` GPUs that `cfg` validates with, whatever its memory flags (auto-fit replaces
    them): cp over the divisors of the GPU count (the rest data-parallel, within --global-batch-size when given),
    all-to-all where the heads allow it (across nodes: all-to-all over a share of a node, a ring across), and the
    ring. Refused in one line when none does."""
    from megatron_lc.memory.stack import MemoryArgs
    from megatron_lc.planning.estimate import planning_config

    neutral = dataclasses.replace(cfg, memory=MemoryArgs())
    found, errors = [], []
    for cp in sorted((d for d in range(1, num_gpus + 1) if num_gpus % d == 0), reverse=True):
        options = [Layout(cp, "a2a")] if cp == 1 else [Layout(cp, "p2p")]
        if 1 < cp <= gpus_per_node:
            options.insert(0, Layout(cp, "a2a"))
        elif cp > gpus_per_node:  # the widest all-to-all inside one node the heads allow, a ring across
            inners = [i for i in range(gpus_per_node, 1, -1) if gpus_per_node % i == 0 and cp % i == 0]
            options[:0] = [Layout(cp, "a2a+p2p", (i, cp // i)) for i in inners]
        for layout in options:
            if layout.comm_type == "a2a+p2p" and any(x.cp == cp and x.comm_type == "a2a+p2p" for x in found):
                continue  # a wider inner all-to-all validated already
            try:
                planning_config(layout.apply(neutral)).validate(num_gpus)
            except ValueError as e:
                errors.append(str(e))
                continue  # heads that do not divide, a global batch the replicas do not divide
            found.append(layout)
    if not found and len(set(errors)) == 1:  # every layout refused for one reason: the configuration's own
        raise ConfigError(errors[0])
    if not found:
        raise ConfigError(f"--auto-fit: no parallel layout of {num_gpus} GPUs validates with this configuration "
                          "(check --global-batch-size and the head counts)")
    return found
