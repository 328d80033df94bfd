"""The longest sequence that fits, and the stack table: the longest with each memory layer added in turn.

Memory grows monotonically with the sequence length and is piecewise linear in it (tile and stage
counts change in steps), so the search predicts the limit on lines through the estimates it has and
traces in rounds of two, which an `EstimatePool` runs at once on two cores: first two far-apart lengths
(the first line), then a pair just either side of each predicted limit while the prediction rests on
far-apart points, then the pair (L, L + one multiple) at the interpolated limit, which ends the search
when L fits and L + one multiple does not. When interpolation lands on the same side twice it bisects.
Every length it answers with was estimated: the answer fits, and the next allowed length does not;
`tests/planning/test_planner_parts.py` checks that this is the limit a scan of every length finds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_lc.attention.registry import CP_IMPLS
from megatron_lc.config import TrainConfig
from megatron_lc.planning.estimate import Estimate, Machine, estimate
from megatron_lc.planning.estimate_pool import EstimatePool

TOKEN_GRANULE = 1024
"""Lengths searched are multiples of this (and of what the configuration requires)."""
START_LENGTH = 32768
FIRST_SPAN = 8
"""The first round traces START_LENGTH and this many times it: the first line."""
MAX_LENGTH = 1 << 31
SPREAD = 0.01
"""A prediction from far-apart points is traced this fraction either side, so the next line is short."""
TIGHT = 0.05
"""A bracket narrower than this fraction of its lower end is interpolated to a closing pair."""
ROUNDS_LEFT_GUESS = 3
"""Rounds a search usually has left before any length fails (for the ETA of the progress lines)."""


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
    """Length where the first of GPU and host use reaches its budget, each on its own line through two estimates
    (None if both are flat). Each memory on its own line: their maximum is not a line where one overtakes the
    other (a host-bound limit predicted from GPU-bound short lengths overshoots by the host's steeper growth)."""
    span = b.seq_length - a.seq_length
    limits = [a.seq_length + (1 - ua) * span / (ub - ua) for ua, ub in zip(a.usages, b.usages) if ub > ua]
    return min(limits, default=None)


def find_max_seq_length(cfg: TrainConfig, machine: Machine, start: int = START_LENGTH,
                        evaluate: Callable[[TrainConfig, Machine, int], Estimate] | EstimatePool = estimate,
                        on_estimate: Callable[[Estimate], None] | None = None) -> SearchResult:
    """The longest multiple of `length_multiple(cfg)` whose estimate fits `machine` (traced in rounds by
    `evaluate`: an `EstimatePool` runs each round's two at once)."""
    step = length_multiple(cfg)
    pool = evaluate if isinstance(evaluate, EstimatePool) else EstimatePool(evaluate)
    known: dict[int, Estimate] = {}

    def run(lengths: list[int]) -> None:
        new = sorted({min(max(step, n), MAX_LENGTH // step * step) for n in lengths} - known.keys())
        for e in pool.many([(cfg, machine, n) for n in new]):
            known[e.seq_length] = e
            if on_estimate:
                on_estimate(e)

    first = _round(start, step)
    pool.expected_left = 2 + 2 * ROUNDS_LEFT_GUESS
    run([first, _round(first * FIRST_SPAN, step)])
    same_side, last_side = 0, None
    while True:
        lo, hi = _bracket(known)
        if hi is None and (lo.seq_length >= MAX_LENGTH // step * step):
            break
        if hi is not None and (hi.seq_length - (lo.seq_length if lo else 0) <= step):
            break
        proposals = _proposals(known, lo, hi, step, bisect=same_side >= 2)
        tight = hi is not None and hi.seq_length - lo.seq_length <= TIGHT * lo.seq_length if lo else False
        rounds = 1 if tight else (2 if hi is not None else ROUNDS_LEFT_GUESS)
        pool.expected_left = len(proposals) + 2 * (rounds - 1)
        run(proposals)
        new_lo, new_hi = _bracket(known)
        if hi is None or lo is None:  # still bracketing: interpolation has not started
            same_side, last_side = 0, None
            continue
        moved = (new_lo is not lo, new_hi is not hi)
        side = None if all(moved) else moved[0]  # which end moved; both: neither side
        same_side = same_side + 1 if side is not None and side == last_side else 0
        last_side = side
    pool.expected_left = 0
    lo, _ = _bracket(known)
    evaluated = sorted(known.values(), key=lambda e: e.seq_length)
    return SearchResult(lo.seq_length if lo else 0, lo, evaluated)


def _bracket(known: dict[int, Estimate]) -> tuple[Estimate | None, Estimate | None]:
    """(the longest estimate that fits, the shortest longer one that does not), each None when there is none."""
    lo = max((e for e in known.values() if e.fits), key=lambda e: e.seq_length, default=None)
    above = [e for e in known.values() if not e.fits and (lo is None or e.seq_length > lo.seq_length)]
    return lo, min(above, key=lambda e: e.seq_length, default=None)


def _proposals(known: dict[int, Estimate], lo: Estimate | None, hi: Estimate | None, step: int,
               bisect: bool) -> list[int]:
    """The next round's two lengths."""
    if lo is None:  # nothing fits yet: halve twice at once
        return [_round(hi.seq_length // 2, step), _round(hi.seq_length // 4, step)]
    if hi is None:  # everything fits: past the limit predicted from the two longest, or four times further
        fitting = sorted((e for e in known.values() if e.fits), key=lambda e: e.seq_length)
        predicted = _predict(fitting[-2], fitting[-1]) if len(fitting) >= 2 else None
        guess = predicted if predicted and predicted > lo.seq_length else 4 * lo.seq_length
        guess = min(guess, 64 * lo.seq_length)
        return [max(_round(guess * (1 - SPREAD), step), lo.seq_length + step),
                max(_round(guess * (1 + SPREAD), step), lo.seq_length + 2 * step)]
    low, high = lo.seq_length + step, hi.seq_length - step  # the lengths not known yet
    predicted = None if bisect else _predict(lo, hi)
    guess = predicted if predicted is not None else (lo.seq_length + hi.seq_length) / 2
    at = min(max(_round(guess, step), low), high)
    if bisect or hi.seq_length - lo.seq_length <= TIGHT * lo.seq_length:
        return [at, min(at + step, high)] if at < high else [at]
    return [min(max(_round(guess * (1 - SPREAD), step), low), high),
            min(max(_round(guess * (1 + SPREAD), step), low), high)]


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
    c = cfg.run_spec(num_gpus).model
    for cp in range(num_gpus, 1, -1):
        kv_ok = c.num_query_groups % cp == 0 or cp % c.num_query_groups == 0
        if num_gpus % cp == 0 and c.num_attention_heads % cp == 0 and kv_ok:
            return cp
    return 1


def stack_layers(cfg: TrainConfig, num_gpus: int) -> list[StackLayer]:
    """FSDP -> Ulysses -> checkpointing -> offload -> tiling -> Untied Ulysses -> offload fetched on demand -> the
    lean backward (Untied Ulysses', and the ring's in-place accumulators where there is a ring)."""
    def with_(base: TrainConfig, **changes) -> TrainConfig:
        parallel = dataclasses.replace(base.parallel, **{k: v for k, v in changes.items()
                                                         if hasattr(base.parallel, k)})
        memory = dataclasses.replace(base.memory, **{k: v for k, v in changes.items() if hasattr(base.memory, k)})
        return dataclasses.replace(base, parallel=parallel, memory=memory)

    p = cfg.parallel
    fsdp = with_(cfg, context_parallel_size=1, cp_impl="ulysses", cp_comm_type="a2a", untied_backward="fast",
                 ring_kv_grads="overlapped",
                 hierarchical_context_parallel_sizes=[], recompute_granularity="none", recompute_method=None,
                 recompute_num_layers=None, offload_mode="none", offload_keep_last=None, offload_every_k_layers=1,
                 keep_attention_output=False, replay_kept_attention=False, tiled_mlp=False, tiled_mlp_tiles=None,
                 tiled_loss=False, tiled_loss_tiles=None)
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
    lean = {"untied_backward": "lean"} if layers[-1].config.run_spec(num_gpus).parallelize.cp.untied else {}
    if ulysses.run_spec(num_gpus).dims.cp_ring > 1:
        lean["ring_kv_grads"] = "in_place"
    if lean:
        layers.append(StackLayer("+ lean backward", with_(layers[-1].config, **lean)))
    return layers


def ablate(cfg: TrainConfig, machine: Machine, on_estimate: Callable[[Estimate], None] | None = None,
           evaluate: Callable[[TrainConfig, Machine, int], Estimate] | EstimatePool = estimate
           ) -> list[tuple[StackLayer, SearchResult]]:
    """The longest context with each layer of the stack added in turn."""
    rows = []
    start = START_LENGTH
    for layer in stack_layers(cfg, machine.num_gpus):
        result = find_max_seq_length(layer.config, machine, start=start, evaluate=evaluate, on_estimate=on_estimate)
        rows.append((layer, result))
        start = max(START_LENGTH, result.max_seq_length)  # each layer reaches at least as far as the previous
    return rows
