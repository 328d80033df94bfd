"""The longest sequence that fits, and the stack table: the longest with each memory layer added in turn.

Memory grows monotonically with the sequence length, and nearly linearly, so the search
brackets the limit by doubling (jumping straight to the linear prediction when it is
further), then narrows the bracket by interpolation, falling back to bisection whenever
interpolation stalls on one side. Every length it answers with was estimated: the
answer fits, and the next allowed length does not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_lc.attention.registry import CP_IMPLS
from megatron_lc.config import TrainConfig
from megatron_lc.planning.estimate import Estimate, Machine, estimate

TOKEN_GRANULE = 1024
"""Lengths searched are multiples of this (and of what the configuration requires)."""
START_LENGTH = 32768
MAX_LENGTH = 1 << 31


@dataclass
class SearchResult:
    """The longest length that fits (0 if none does) and every estimate made on the way."""

    max_seq_length: int
    best: Estimate | None
    evaluated: list[Estimate] = field(default_factory=list)

    @property
    def bound_by(self) -> str | None:
        """What stops the next length: "GPU" (its memory), "host" (the node's, GPU fitting) or None (not known)."""
        longer = [e for e in self.evaluated if e.seq_length > self.max_seq_length and not e.fits]
        if not longer:
            return None
        first = min(longer, key=lambda e: e.seq_length)
        return "GPU" if not first.fits_gpu else "host"


def length_multiple(cfg: TrainConfig) -> int:
    """What every searched length is a multiple of: the cp degree and the token granule."""
    cp = cfg.parallel.context_parallel_size
    return cp * TOKEN_GRANULE // math.gcd(cp, TOKEN_GRANULE)


def _round(length: float, step: int) -> int:
    return max(step, int(length) // step * step)


def _predict(a: Estimate, b: Estimate) -> float | None:
    """Length where usage reaches 1 on the line through two estimates (None if flat)."""
    slope = (b.usage - a.usage) / (b.seq_length - a.seq_length)
    return None if slope <= 0 else a.seq_length + (1 - a.usage) / slope


def find_max_seq_length(cfg: TrainConfig, machine: Machine, start: int = START_LENGTH,
                        evaluate: Callable[[TrainConfig, Machine, int], Estimate] = estimate,
                        on_estimate: Callable[[Estimate], None] | None = None) -> SearchResult:
    """The longest multiple of `length_multiple(cfg)` whose estimate fits `machine`."""
    step = length_multiple(cfg)
    cache: dict[int, Estimate] = {}

    def at(length: int) -> Estimate:
        if length not in cache:
            cache[length] = evaluate(cfg, machine, length)
            if on_estimate:
                on_estimate(cache[length])
        return cache[length]

    lo, hi = _bracket(at, _round(start, step), step)
    lo, hi = _narrow(at, lo, hi, step)
    evaluated = sorted(cache.values(), key=lambda e: e.seq_length)
    return SearchResult(lo.seq_length if lo else 0, lo, evaluated)


def _bracket(at, length: int, step: int) -> tuple[Estimate | None, Estimate | None]:
    """(an estimate that fits or None, one that does not or None) with nothing known in between."""
    first = at(length)
    if not first.fits:
        return _bracket_down(at, first, step)
    lo = first
    while lo.seq_length < MAX_LENGTH:
        candidate = at(_round(2 * lo.seq_length, step))
        if not candidate.fits:
            return lo, candidate
        predicted = _predict(lo, candidate)
        lo = candidate
        if predicted and predicted > 2 * lo.seq_length:
            jump = at(_round(predicted * 1.02, step))  # just past the predicted limit, to close the bracket
            if not jump.fits:
                return lo, jump
            lo = jump
    return lo, None


def _bracket_down(at, hi: Estimate, step: int) -> tuple[Estimate | None, Estimate]:
    """Halve from a length that does not fit until one does (None when not even `step` fits)."""
    while hi.seq_length > step:
        smaller = at(_round(hi.seq_length // 2, step))
        if smaller.fits:
            return smaller, hi
        hi = smaller
    return None, hi


def _narrow(at, lo: Estimate | None, hi: Estimate | None, step: int) -> tuple[Estimate | None, Estimate | None]:
    """Shrink [lo, hi] to adjacent lengths by interpolation, bisecting after two moves of the same end."""
    if lo is None or hi is None:
        return lo, hi
    last_fit, same_side = None, 0
    while hi.seq_length - lo.seq_length > step:
        predicted = _predict(lo, hi)
        use_prediction = predicted is not None and same_side < 2
        guess = predicted if use_prediction else (lo.seq_length + hi.seq_length) / 2
        length = min(max(_round(guess, step), lo.seq_length + step), hi.seq_length - step)
        candidate = at(length)
        same_side = same_side + 1 if candidate.fits == last_fit else 0
        last_fit = candidate.fits
        if candidate.fits:
            lo = candidate
        else:
            hi = candidate
    return lo, hi


# --- the stack table -----------------------------------------------------------------------


@dataclass(frozen=True)
class StackLayer:
    """One row of the stack table: a name and the configuration with this layer (and those above) on."""

    name: str
    config: TrainConfig


def default_cp(cfg: TrainConfig, num_gpus: int) -> int:
    """The cp degree of the Ulysses rows: the configured one, else the largest that the GPUs and heads allow."""
    if cfg.parallel.context_parallel_size > 1:
        return cfg.parallel.context_parallel_size
    c = cfg.model_config()
    for cp in range(num_gpus, 1, -1):
        kv_ok = c.num_query_groups % cp == 0 or cp % c.num_query_groups == 0
        if num_gpus % cp == 0 and c.num_attention_heads % cp == 0 and kv_ok:
            return cp
    return 1


def stack_layers(cfg: TrainConfig, num_gpus: int) -> list[StackLayer]:
    """FSDP -> Ulysses -> checkpointing -> offload -> tiling -> Untied Ulysses -> offload fetched on demand."""
    def with_(base: TrainConfig, **changes) -> TrainConfig:
        parallel = dataclasses.replace(base.parallel, **{k: v for k, v in changes.items()
                                                         if hasattr(base.parallel, k)})
        memory = dataclasses.replace(base.memory, **{k: v for k, v in changes.items() if hasattr(base.memory, k)})
        return dataclasses.replace(base, parallel=parallel, memory=memory)

    p = cfg.parallel
    fsdp = with_(cfg, context_parallel_size=1, cp_impl="ulysses", cp_comm_type="a2a",
                 hierarchical_context_parallel_sizes=[], recompute_granularity="none", recompute_method=None,
                 recompute_num_layers=None, offload_mode="none", offload_keep_last=None, offload_every_k_layers=1,
                 keep_attention_output=False, tiled_mlp=False, tiled_mlp_tiles=None, tiled_loss=False,
                 tiled_loss_tiles=None)
    cp = default_cp(cfg, num_gpus)
    ulysses = with_(fsdp, context_parallel_size=cp, cp_comm_type=p.cp_comm_type,  # the configured layout
                    hierarchical_context_parallel_sizes=p.hierarchical_context_parallel_sizes)
    checkpointing = with_(ulysses, recompute_granularity="full")
    offload = with_(checkpointing, offload_mode="prefetch", offload_keep_last=cfg.memory.offload_keep_last)
    tiling = with_(offload, tiled_mlp=True, tiled_loss=True)
    layers = [StackLayer("FSDP", fsdp), StackLayer(f"+ Ulysses (cp={cp})", ulysses),
              StackLayer("+ activation checkpointing", checkpointing), StackLayer("+ CPU offload", offload),
              StackLayer("+ tiled MLP and loss", tiling)]
    if "untied_ulysses" in CP_IMPLS and cp > 1:
        layers.append(StackLayer("+ Untied Ulysses", with_(tiling, cp_impl="untied_ulysses")))
    layers.append(StackLayer("+ offload fetched on demand", with_(layers[-1].config, offload_mode="on_demand")))
    return layers


def ablate(cfg: TrainConfig, machine: Machine,
           on_estimate: Callable[[Estimate], None] | None = None) -> list[tuple[StackLayer, SearchResult]]:
    """The longest context with each layer of the stack added in turn."""
    rows = []
    start = START_LENGTH
    for layer in stack_layers(cfg, machine.num_gpus):
        result = find_max_seq_length(layer.config, machine, start=start, on_estimate=on_estimate)
        rows.append((layer, result))
        start = max(START_LENGTH, result.max_seq_length)  # each layer reaches at least as far as the previous
    return rows
