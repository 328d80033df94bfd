"""Auto-fit: the fastest parallel layout and memory stack that fit a machine at a given sequence length.

The model, the length, the precision and the machine are given; auto-fit chooses the layout (cp degree, the
rest data-parallel; all-to-all, ring, or all-to-all in a node and a ring across; kept as given when any layout
flag is) and the memory stack (recompute granularity, CPU offload, its prefetch and how sparse it is, kept
attention outputs, tiled MLP and loss with their tile counts, Untied Ulysses and its heads per stage), and
answers with the command for `python -m megatron_lc.train`.

**Cost**: each candidate's predicted time per token on the machine (`planning/timing.py`, the one time model
of the planner): per token, because layouts with data-parallel replicas train several sequences per step.
Candidates closer than the tolerance (default 1%) are not told apart.

**Candidates**: per layout (`search_layouts`), recompute none < selective < full < full + offload (early <
prefetch < on demand); MLP and loss tiles off < 2 < ... < the default count, halving from it; Ulysses, or
Untied Ulysses at each valid heads per stage, each also with the lean backward exchanges where they change
anything (`--untied-backward lean`, `--ring-kv-grads in_place`: a kind of its own, slower, holding less);
with offload every k-th block input kept, k = 1 < 2 < 4; with full recompute, attention outputs kept or not.
Each list runs from the least memory saving to the most.

**Search** (`_Search`): estimates are fake-tensor traces (seconds each), so few are made, under two stated
assumptions: within a layout and attention kind, memory does not grow when a choice moves towards saving
more (host bytes depend only on offloading, k and kept attention); with the stack fixed, a smaller cp holds
more per GPU (applied only past the NCCL bytes a smaller group saves). Candidates are visited fastest first,
each decided by its probe (see `_Search`); the search stops at the first candidate no faster than the answer
by more than the tolerance, so every faster one was traced or ruled out, and the answer was traced. Then
pipelined Untied stages and the kept attention of the answer's first blocks are tried on the answer. At most
`max_traces` estimates; when the cap stops the search, the answer is the fastest known to fit, marked `capped`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_lc.config import TrainConfig
from megatron_lc.context_layout import DOCUMENT_LAYOUTS
from megatron_lc.data.packing import PackingSpec
from megatron_lc.planning.estimate import GIB, Estimate, Machine, estimate
from megatron_lc.planning.estimate_pool import EstimatePool
from megatron_lc.planning.layouts import Layout, layout_of
from megatron_lc.planning.search_space import (
    MODES,
    OFFLOAD_ORDER,
    Candidate,
    SearchSpace,
    search_space,
)
from megatron_lc.planning.timing import (
    StepTime,
    TimeModel,
    block_input_bytes_per_gpu,
    kept_attention_bytes_per_gpu,
)


# --- the search -----------------------------------------------------------------------------


DEFAULT_MAX_TRACES = 100
"""Estimates one search may make: Llama3-8B on one node takes 23-29, Llama 3.1 70B on 8 to 64 GPUs 53-60 (its
layouts and the optimizer on the host double the stacks), so the cap stops only searches far from an answer."""
KEPT_ATTENTION_TRIES = 3
"""Variants of the answer with the attention of its first blocks kept that are traced at most (fastest first)."""
TOLERANCE = 0.01
"""Predicted steps closer than this fraction are not told apart: the answer is within it of the fastest."""


@dataclass
class Traced:
    """One estimate the search made."""

    candidate: Candidate
    """The stack traced."""
    estimate: Estimate
    """Its memory on the machine."""
    cost: StepTime
    """Its predicted step time."""
    layout: Layout | None = None
    """Its parallel layout (None: the configured one)."""


@dataclass
class LayoutVerdict:
    """Why a layout's stacks were or were not chosen."""

    layout: Layout
    reason: str


@dataclass
class AutoFitResult:
    """The fastest stack that fits (None when none does) and how it was found."""

    choice: Candidate | None
    """The answer."""
    estimate: Estimate | None
    """The answer's memory."""
    cost: StepTime | None
    """The answer's predicted step time."""
    traced: list[Traced] = field(default_factory=list)
    """Every estimate made, in order."""
    candidates: int = 0
    """Size of the search space (all layouts)."""
    capped: bool = False
    """The trace cap stopped the search: the answer is the fastest known to fit, maybe not the fastest."""
    time_model: TimeModel = field(default_factory=TimeModel)
    """The rates the step times were predicted at."""
    layout: Layout | None = None
    """The answer's layout."""
    layout_searched: bool = False
    """The layout was chosen by the search (else kept as configured)."""
    verdicts: list[LayoutVerdict] = field(default_factory=list)
    """Per layout: why it was not chosen (or that it was)."""
    tolerance: float = TOLERANCE

    @property
    def runner_up(self) -> Traced | None:
        """The fastest traced stack that fits besides the answer."""
        others = [t for t in self.traced if t.estimate.fits
                  and (t.candidate, t.layout) != (self.choice, self.layout)]
        return min(others, key=lambda t: t.cost.step_s / t.cost.tokens, default=None)


class _Knowledge:
    """What the traces so far imply about the points of one layout, under the monotonicity assumption."""

    def __init__(self, space: SearchSpace, offload_modes: set[int]):
        self.space, self.offload_modes = space, offload_modes
        self.family = [level.kind for level in space.attention]  # pipelined, lean: kinds of their own
        self.gpu_fits: list[tuple[int, ...]] = []
        self.gpu_fails: list[tuple[int, ...]] = []
        self.offload_host_fits: dict[tuple[int, int], bool] = {}
        """By (k level, kept-attention level): whether the host holds the offloaded tensors (the same for every
        offloading mode)."""
        self.estimates: dict[tuple[int, ...], Estimate] = {}

    def record(self, point: tuple[int, ...], e: Estimate) -> None:
        self.estimates[point] = e
        at_least = getattr(e, "at_least", False)  # bytes of fewer layers: only what is over a budget is known
        if not (at_least and e.fits_gpu):
            (self.gpu_fits if e.fits_gpu else self.gpu_fails).append(point)
        if point[0] in self.offload_modes and not (at_least and e.fits_host):
            self.offload_host_fits[(point[4], point[5])] = e.fits_host

    def host_fits(self, k_level: int, keep_level: int) -> bool | None:
        """Whether offloading at these levels fits the host: known from any that fit with k at most as sparse
        and attention kept at least as much, or any that did not with k at least as sparse and attention kept
        at most as much (host bytes fall as either level rises)."""
        known = self.offload_host_fits.items()
        if any(fits for (k, j), fits in known if k <= k_level and j <= keep_level):
            return True
        if any(not fits for (k, j), fits in known if k >= k_level and j >= keep_level):
            return False
        return None

    def le(self, a: tuple[int, ...], b: tuple[int, ...]) -> bool:
        """`a` saves no more memory than `b` in any choice (same attention family: Ulysses or Untied); k is
        compared only between two offloading points (GPU memory does not depend on it)."""
        dims = [0, 1, 2, 3, 5] + ([4] if a[0] in self.offload_modes and b[0] in self.offload_modes else [])
        return self.family[a[3]] == self.family[b[3]] and all(a[i] <= b[i] for i in dims)

    def status(self, point: tuple[int, ...]) -> bool | None:
        """True: fits; False: does not; None: unknown without a trace."""
        point = self.space.canonical(point)
        if point in self.estimates:
            return self.estimates[point].fits
        host = True if point[0] not in self.offload_modes else self.host_fits(point[4], point[5])
        if host is False or any(self.le(point, q) for q in self.gpu_fails):
            return False
        if host and any(self.le(q, point) for q in self.gpu_fits):
            return True
        return None


Option = tuple[int, tuple[int, ...]]
"""(layout index, canonical point of that layout's space)."""


def auto_fit(cfg: TrainConfig, machine: Machine, time_model: TimeModel | None = None,
             max_traces: int = DEFAULT_MAX_TRACES,
             evaluate: Callable[[TrainConfig, Machine, int], Estimate] | EstimatePool = estimate,
             on_estimate: Callable[[Candidate, Estimate, Layout], None] | None = None,
             space: SearchSpace | None = None, layouts: list[Layout] | None = None,
             tolerance: float = TOLERANCE, partial_keep: bool = True) -> AutoFitResult:
    """The fastest candidate that fits `machine` (within `tolerance` of the fastest by `time_model`, default the
    machine's published rates): over `layouts` (default: the configured one only) and each layout's memory
    stacks (`space`, default `search_space`; a given space is for the configured layout only); with `partial_keep`,
    an answer that offloads without keeping attention outputs keeps those of as many first blocks as the host
    holds, where that is faster and fits (`_Search.kept_attention`).

    The optimizer stays on the GPU where any stack fits so; only where none does is the same search made with
    the optimizer on the host (--optimizer-cpu-offload: its step and copies cost time, the GPU holds 4 bytes per
    parameter of 16), within the traces left, under the same host budget."""
    resident = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, optimizer_cpu_offload=False))
    first = _auto_fit(resident if space is None else cfg, machine, time_model, max_traces, evaluate, on_estimate,
                      space, layouts, tolerance, partial_keep)
    left = max_traces - len(first.traced)
    if first.choice is not None or space is not None or left <= 0 or first.capped:
        return first
    on_host = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, optimizer_cpu_offload=True))
    second = _auto_fit(on_host, machine, time_model, left, evaluate, on_estimate, None, layouts, tolerance,
                       partial_keep)
    second.traced[:0] = first.traced
    second.candidates += first.candidates
    return second


def _auto_fit(cfg: TrainConfig, machine: Machine, time_model: TimeModel | None, max_traces: int,
              evaluate, on_estimate, space: SearchSpace | None, layouts: list[Layout] | None, tolerance: float,
              partial_keep: bool) -> AutoFitResult:
    """`auto_fit` with the optimizer where `cfg` puts it."""
    time_model = time_model or TimeModel.for_machine(machine, cfg)
    searched = layouts is not None
    layouts = layouts or [layout_of(cfg)]
    spaces = [space or search_space(layout.apply(cfg), machine.num_gpus) for layout in layouts]
    pool = evaluate if isinstance(evaluate, EstimatePool) else EstimatePool(evaluate)
    search = _Search(cfg, machine, time_model, max_traces, pool, on_estimate, layouts, spaces, tolerance)
    stopping, pool.stop_when_over = pool.stop_when_over, True  # what does not fit needs no exact bytes
    try:
        best = search.pipelined(search.run())
    finally:
        pool.stop_when_over = stopping
    result = search.result
    result.layout_searched = searched
    if best is not None:
        layout, point = best
        result.choice, result.estimate = spaces[layout].candidate(point), search.known[layout].estimates[point]
        result.cost, result.layout = search.cost(best), layouts[layout]
        if partial_keep:
            search.kept_attention(result, layout)
    result.verdicts = search.verdicts(best)
    return result


def fastest_document_layout(time_model: TimeModel, cfg: TrainConfig, num_gpus: int) -> StepTime:
    """The predicted step of `cfg`; for packed documents on a ring, at the fastest --cp-document-layout (its
    `packed["document_layout"]`). Every layout gives each rank S/cp tokens, so one trace holds for all: only the
    time model tells them apart."""
    if not PackingSpec.of(cfg.packing).whole_documents or cfg.context_layout().ring_size == 1:
        return time_model.predict(cfg, num_gpus)  # without a ring every document layout is the same
    return min((time_model.predict(dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, cp_document_layout=layout)), num_gpus) for layout in DOCUMENT_LAYOUTS),
        key=lambda t: t.step_s)


def document_layout_flags(cost: StepTime | None) -> list[str]:
    """The --cp-document-layout the answer was predicted at (none for unpacked data or without a ring)."""
    if cost is None or cost.packed is None or cost.packed["ring"] == 1:
        return []
    return ["--cp-document-layout", cost.packed["document_layout"]]


class _Search:
    """The state of one auto-fit search: knowledge, traces, costs.

    Options (a layout and a stack) are visited in order of predicted time per token. An option whose fit is
    unknown is decided by its *probe*, the same stack with tiles and Untied stages at their most memory-saving
    levels (they cost little time): when the probe does not fit, neither does any stack that saves no more in
    its layout (nor, by more than the NCCL bytes a smaller group saves, in a layout of the same chain with a
    smaller cp: with every other choice fixed each GPU holds more); when it fits and is within the tolerance of
    the option's time, it is the answer; else the option itself is traced. The search stops at the first
    option no faster than the answer so far by more than the tolerance. Each round traces the probes of the
    next options whose fit is unknown, as many as the estimate pool's workers, at once."""

    def __init__(self, cfg: TrainConfig, machine: Machine, time_model: TimeModel, max_traces: int,
                 pool: EstimatePool, on_estimate: Callable[[Candidate, Estimate, Layout], None] | None,
                 layouts: list[Layout], spaces: list[SearchSpace], tolerance: float):
        self.cfg, self.machine, self.time_model, self.max_traces = cfg, machine, time_model, max_traces
        self.pool, self.on_estimate, self.tolerance = pool, on_estimate, tolerance
        self.layouts, self.spaces = layouts, spaces
        self.configs = [layout.apply(cfg) for layout in layouts]
        self.known = [_Knowledge(sp, {i for i, (_, off) in enumerate(sp.modes) if off != "none"}) for sp in spaces]
        self.result = AutoFitResult(None, None, None, candidates=sum(len(sp.points()) for sp in spaces),
                                    time_model=time_model, tolerance=tolerance)
        self.costs: dict[Option, StepTime] = {}
        # Memos of pure functions of an option (per token, probe) and of what the traces so far imply (status,
        # forgotten at each round): a search asks them of tens of thousands of options between its rounds.
        self._per_token: dict[Option, float] = {}
        self._probes: dict[Option, tuple[int, ...]] = {}
        self._statuses: dict[Option, bool | None] = {}
        self.column_fails: list[tuple[int, tuple, int, bool]] = []
        """(layout, column, margin bytes, by the GPU) of probes that did not fit: see `_column`."""

    # costs

    def cost(self, option: Option) -> StepTime:
        layout, point = option[0], self.spaces[option[0]].canonical(option[1])
        if (layout, point) not in self.costs:
            cfg = self.spaces[layout].candidate(point).apply(self.configs[layout])
            self.costs[(layout, point)] = fastest_document_layout(self.time_model, cfg, self.machine.num_gpus)
        return self.costs[(layout, point)]

    def per_token(self, option: Option) -> float:
        if option not in self._per_token:
            c = self.cost(option)
            self._per_token[option] = c.step_s / c.tokens
        return self._per_token[option]

    # knowledge

    def _column(self, option: Option) -> tuple:
        """What a probe's failure carries to smaller cp: the mode, k, kept attention and attention kind."""
        space, point = self.spaces[option[0]], option[1]
        level = space.attention[point[3]]
        full = space.modes[point[0]][0] == "full"
        return (space.modes[point[0]], space.offload_every[point[4]] if space.offloads(point) else 1,
                space.keep_attention[point[5]] or not full, (level.impl, level.lean))  # attention kept short of full

    def status(self, option: Option) -> bool | None:
        if option not in self._statuses:
            self._statuses[option] = self._status(option)
        return self._statuses[option]

    def _status(self, option: Option) -> bool | None:
        layout, point = option[0], self.spaces[option[0]].canonical(option[1])
        known = self.known[layout].status(point)
        if known is not None:
            return known
        if self._host_fails_at_this_cp((layout, point)):
            return False
        mine, column = self.layouts[layout], self._column((layout, self.probe((layout, point))))
        for other, failed, margin, by_gpu in self.column_fails:
            theirs = self.layouts[other]
            if theirs.cp > mine.cp and (theirs.chain == mine.chain or mine.cp == 1) and margin > 0 \
                    and _holds_at_least(column, failed, by_gpu, any_kind=mine.cp == 1):
                return False
        return None

    def _host_fails_at_this_cp(self, option: Option) -> bool:
        """An offloading stack that overflowed the host in another layout of the same cp overflows it here too:
        what each rank offloads and keeps on the host is its `S/cp` share, whichever way the cp group exchanges
        (all-to-all, ring or both), and the model states on the host are sharded over the same world."""
        layout, point = option
        space, mine = self.spaces[layout], self.layouts[layout]
        if point[0] not in self.known[layout].offload_modes:
            return False
        k, keep = space.offload_every[point[4]], space.keep_attention[point[5]]
        for i, theirs in enumerate(self.layouts):
            other = self.spaces[i]
            if i == layout or theirs.cp != mine.cp or k not in other.offload_every or keep not in other.keep_attention:
                continue
            if self.known[i].host_fits(other.offload_every.index(k), other.keep_attention.index(keep)) is False:
                return True
        return False

    def probe(self, option: Option) -> tuple[int, ...]:
        """The option with its tiles and Untied stages at their most memory-saving levels."""
        if option not in self._probes:
            space, (mode, _, _, attention, k, keep) = self.spaces[option[0]], option[1]
            kind = space.attention[attention].kind
            same_kind = [i for i, level in enumerate(space.attention) if level.kind == kind]
            self._probes[option] = space.canonical((mode, len(space.mlp_tiles) - 1, len(space.loss_tiles) - 1,
                                                    same_kind[-1], k, keep))
        return self._probes[option]

    def trace(self, options: list[Option]) -> None:
        """Estimate `options` in one round (at most the cap's remainder)."""
        options = list(dict.fromkeys((o[0], self.spaces[o[0]].canonical(o[1])) for o in options))
        options = [o for o in options if o[1] not in self.known[o[0]].estimates]
        room = self.max_traces - len(self.result.traced)
        if len(options) > room:
            self.result.capped = True
            options = options[:max(room, 0)]
        jobs = [(self.spaces[lay].candidate(p).apply(self.configs[lay]), self.machine, self.cfg.data.seq_length)
                for lay, p in options]
        for (layout, point), e in zip(options, self.pool.many(jobs)):
            self._statuses.clear()  # what the traces imply has changed
            self.known[layout].record(point, e)
            candidate = self.spaces[layout].candidate(point)
            self.result.traced.append(Traced(candidate, e, self.cost((layout, point)), self.layouts[layout]))
            if point == self.probe((layout, point)) and not e.fits:
                by_gpu = not e.fits_gpu
                margin = (e.gpu_peak_bytes - e.gpu_budget_bytes - e.nccl_bytes) if by_gpu else 1
                self.column_fails.append((layout, self._column((layout, point)), margin, by_gpu))
            if self.on_estimate:
                self.on_estimate(candidate, e, self.layouts[layout])

    # the search

    def options(self) -> list[Option]:
        """Every option the search visits (pipelined stages are tried on the answer, not searched), fastest
        per token first, a larger cp first among equals."""
        everything = [(i, p) for i, sp in enumerate(self.spaces) for p in sp.points() if not sp.attention[p[3]].overlap]
        return sorted(everything, key=lambda o: (self.per_token(o), -self.layouts[o[0]].cp, o))

    def _column_point(self, layout: int, column: tuple) -> tuple[int, ...] | None:
        """The probe of `column` (mode, k, kept attention, attention kind) in `layout`, if it has one."""
        space = self.spaces[layout]
        mode, k, keep, kind = column
        kinds = [i for i, level in enumerate(space.attention) if (level.impl, level.lean) == kind and not level.overlap]
        if mode not in space.modes or not kinds or (k not in space.offload_every and mode[1] != "none"):
            return None
        k_level = space.offload_every.index(k) if mode[1] != "none" else 0
        keep_level = space.keep_attention.index(keep) if keep in space.keep_attention else 0
        return space.canonical((space.modes.index(mode), len(space.mlp_tiles) - 1, len(space.loss_tiles) - 1,
                                kinds[-1], k_level, keep_level))

    def target(self, probe: Option) -> Option:
        """What to trace to decide `probe`: the same column in the layout of its chain with the largest cp, while
        that is unknown (its failure rules out the column at every smaller cp), else the probe itself."""
        mine = self.layouts[probe[0]]
        column = self._column(probe)
        for i, theirs in enumerate(self.layouts):
            if theirs.chain == mine.chain and theirs.cp > mine.cp:
                point = self._column_point(i, column)
                if point is not None and self.status((i, point)) is None:
                    return i, point
        return probe

    def strongest(self) -> list[Option]:
        """Per chain, in its layout with the largest cp, each attention kind's most memory-saving stack: when one
        does not fit the GPU, nothing of its kind in the chain does."""
        out, seen = [], set()
        for i, layout in sorted(enumerate(self.layouts), key=lambda x: -x[1].cp):
            if layout.chain in seen:
                continue
            seen.add(layout.chain)
            space = self.spaces[i]
            kinds = {a.kind: level for level, a in enumerate(space.attention) if not a.overlap}
            for level in kinds.values():
                out.append((i, space.canonical((len(space.modes) - 1, len(space.mlp_tiles) - 1,
                                                len(space.loss_tiles) - 1, level, len(space.offload_every) - 1,
                                                len(space.keep_attention) - 1))))
        return out

    def run(self) -> Option | None:
        order, best = self.options(), None
        if self.status(order[0]) is None:  # the fastest of all first: it fits when no technique is needed
            self.trace([(order[0][0], self.probe(order[0])), order[0]][-self.pool.workers:])
        if self.status(order[0]) is not True:
            self.trace(self.strongest())
        i = 0
        while i < len(order):
            option = order[i]
            if best is not None and self.per_token(option) * (1 + self.tolerance) >= self.per_token(best):
                break
            status = self.status(option)
            if status is False or self._beaten_by_fast_twin(option):
                i += 1
                continue
            if status is True:  # known to fit: confirmed by a trace of its own
                self.trace([option])
                e = self.known[option[0]].estimates.get(option[1])
                if e is None:
                    break  # capped
                if e.fits:
                    break
                i += 1  # the assumption did not hold here: the trace decides
                continue
            probe = (option[0], self.probe(option))
            probe_status = self.status(probe)
            if probe_status is None:
                self.pool.expected_left = self._left(order, i, best)
                first = self.target(probe)
                self.trace([first] + self._speculative(order, i + 1, self.pool.workers - 1, first))
                if first[1] not in self.known[first[0]].estimates:
                    break  # capped
                continue  # the same option, with what the round taught
            if probe_status:  # known to fit (maybe only inferred): it and the option are traced before either counts
                self.trace([probe, option])
                e = self.known[probe[0]].estimates.get(probe[1])
                if e is None or self.status(option) is None:
                    break  # capped
                if e.fits:
                    best = probe if best is None or self.per_token(probe) < self.per_token(best) else best
                    if self.per_token(probe) <= self.per_token(option) * (1 + self.tolerance):
                        break
                continue  # the same option, decided by its own trace now
            i += 1
        return self._fastest_traced_fit()

    def _beaten_by_fast_twin(self, option: Option) -> bool:
        """Whether `option` is lean and its fast twin (the same stack with the fast backward) is known to fit and is
        no slower: the lean option is then never the answer."""
        space, point = self.spaces[option[0]], option[1]
        level = space.attention[point[3]]
        if not level.lean:
            return False
        twin = (option[0], space.canonical((*point[:3], space.attention.index(
            level._replace(untied_backward="fast", ring_kv_grads="overlapped")), *point[4:])))
        return self.per_token(twin) <= self.per_token(option) and self.status(twin) is True

    def _fastest_traced_fit(self) -> Option | None:
        """The answer: the fastest option traced that fits (what the search stopped at, or, capped, the best known)."""
        fits = [(layout, point) for layout, k in enumerate(self.known) for point, e in k.estimates.items() if e.fits
                and not self.spaces[layout].attention[point[3]].overlap]
        return min(fits, key=lambda o: (self.per_token(o), -self.layouts[o[0]].cp, o), default=None)

    def _left(self, order: list[Option], start: int, best: Option | None) -> int:
        """At most the traces still to make: two per column of unknown fit faster than the answer so far (counted
        until they reach the cap's remainder)."""
        probes, room = set(), self.max_traces - len(self.result.traced)
        for option in order[start:]:
            if best is not None and self.per_token(option) * (1 + self.tolerance) >= self.per_token(best):
                break
            if 2 * len(probes) + 1 >= room:
                break
            if self.status(option) is None and not self._beaten_by_fast_twin(option):
                probes.add((option[0], self.probe(option)))
        return min(2 * len(probes) + 1, room)

    def _speculative(self, order: list[Option], start: int, count: int, first: Option) -> list[Option]:
        """What decides the next `count` options of unknown fit after `start` (traced in the same round)."""
        out: list[Option] = []
        for option in order[start:]:
            if len(out) >= count:
                break
            if self.status(option) is None and not self._beaten_by_fast_twin(option):
                probe = (option[0], self.probe(option))
                if self.status(probe) is None:
                    target = self.target(probe)
                    if target != first and target not in out:
                        out.append(target)
        return out

    def pipelined(self, best: Option | None) -> Option | None:
        """The answer's memory stack with pipelined Untied stages (`--untied-overlap-stages`): at an Untied
        answer's stage width or the widest narrower one (any width for a Ulysses answer) that fits and is
        predicted faster; else `best`. Pipelining costs stage buffers and saves exposed exchange time only,
        so it is tried on the answer rather than searched as a family of its own: a pipelined stage wider
        than the answer's holds more than the synchronous one that did not fit."""
        if best is None:
            return None
        layout, point = best
        space = self.spaces[layout]
        answer = space.attention[point[3]]
        if answer.impl not in ("ulysses", "untied_ulysses") or answer.overlap:
            return best
        u = answer.heads_per_stage or self.configs[layout].run_spec(self.machine.num_gpus).model.num_attention_heads
        for level, other in enumerate(space.attention):
            option = (layout, space.canonical((*point[:3], level, *point[4:])))
            if other.impl == "untied_ulysses" and other.overlap and other.lean == answer.lean \
                    and other.heads_per_stage <= u and self.per_token(option) < self.per_token(best) \
                    and self.status(option) is not False:
                self.trace([option])
                e = self.known[layout].estimates.get(option[1])
                if e is not None and e.fits:
                    return option
        return best

    def kept_attention(self, result: AutoFitResult, layout: int) -> None:
        """The answer with the attention outputs of as many of its first blocks kept as the host has room for
        (`--keep-attention-output-layers`, fewer than all), at its k or every input kept (k = 1), with its offload
        mode or one that brings the kept tensors back later (less at the GPU's peak), when it offloads: each kept block saves its attention forward in the recompute, k = 1 the sparse
        replays. The host bytes of each variant follow from the answer's (one slot per kept input, one per
        block keeping its attention); the variants predicted faster are traced fastest first, the first that fits
        taken (at most KEPT_ATTENTION_TRIES)."""
        choice, e = result.choice, result.estimate
        if choice.recompute != "full" or choice.offload == "none":
            return
        cfg, num_gpus = self.configs[layout], self.machine.num_gpus
        spec = cfg.run_spec(num_gpus)
        c = spec.model
        on_node = self.machine.gpus_on_node
        per_block = kept_attention_bytes_per_gpu(cfg, spec) * on_node
        per_input = block_input_bytes_per_gpu(cfg, spec) * on_node

        def host_of(candidate: Candidate) -> float:
            stack = candidate.apply(cfg).run_spec(num_gpus).parallelize.memory
            offloaded = stack.offloaded_layers(c.num_layers)
            return (stack.host_slots(c.num_layers) * per_input
                    + min(stack.kept_attention_layers(c.num_layers), offloaded) * per_block)

        base = e.host_bytes_per_node - host_of(choice)  # what the answer's host holds besides inputs and outputs
        room = 0.99 * e.host_budget_bytes - base  # its reserve grows a little with what is page-locked
        offloaded = choice.apply(cfg).run_spec(num_gpus).parallelize.memory.offloaded_layers(c.num_layers)
        faster = []
        modes = [m for m in OFFLOAD_ORDER if OFFLOAD_ORDER.index(m) >= OFFLOAD_ORDER.index(choice.offload)]
        for k, mode in itertools.product(sorted({1, choice.offload_every}), modes):
            inputs = host_of(dataclasses.replace(choice, offload_every=k, keep_attention=False))
            n = int((room - inputs) // per_block)
            if not 1 <= n < offloaded:
                continue  # every block keeping is a candidate of the search itself, already decided
            candidate = dataclasses.replace(choice, offload=mode, offload_every=k, keep_attention=True,
                                            keep_attention_layers=n)
            cost = fastest_document_layout(self.time_model, candidate.apply(cfg), self.machine.num_gpus)
            if cost.step_s / cost.tokens < result.cost.step_s / result.cost.tokens:
                faster.append((cost.step_s / cost.tokens, candidate, cost))
        # Fastest first; a mode that brings kept tensors back later holds less at the GPU's peak.
        for _, candidate, cost in sorted(faster, key=lambda f: f[0])[:KEPT_ATTENTION_TRIES]:
            if len(result.traced) >= self.max_traces:
                result.capped = True
                return
            estimate = self.pool(candidate.apply(cfg), self.machine, cfg.data.seq_length)
            result.traced.append(Traced(candidate, estimate, cost, self.layouts[layout]))
            if self.on_estimate:
                self.on_estimate(candidate, estimate, self.layouts[layout])
            if estimate.fits:
                result.choice, result.estimate, result.cost = candidate, estimate, cost
                return

    def _floor(self, layout: int) -> float:
        """The fastest per token of the layout's searched stacks (pipelined stages are tried on the answer only)."""
        space = self.spaces[layout]
        return min(self.per_token((layout, p)) for p in space.points() if not space.attention[p[3]].overlap)

    def verdicts(self, best: Option | None) -> list[LayoutVerdict]:
        """Per layout, why its stacks were not chosen (from the traces and the search's order)."""
        out = []
        limit = self.per_token(best) if best is not None else None
        for i, layout in enumerate(self.layouts):
            if best is not None and i == best[0]:
                out.append(LayoutVerdict(layout, "chosen"))
                continue
            traces = list(self.known[i].estimates.values())
            fitting = [(self.per_token((i, p)), p) for p, e in self.known[i].estimates.items() if e.fits]
            if fitting:
                t, p = min(fitting)
                reason = f"fits with {' '.join(self.spaces[i].candidate(p).flags()) or 'no memory flags'}, " \
                         f"predicted {100 * (t / limit - 1):+.1f}% per token" if limit else "fits"
            elif traces:
                closest = min(traces, key=lambda e: e.usage)
                what = "GPU" if not closest.fits_gpu else "host"
                reason = (f"no stack faster than the answer fits: the closest traced needs {what} "
                          + ("at least " if getattr(closest, "at_least", False) else "")
                          + (f"{closest.gpu_peak_bytes / GIB:.1f} GiB of {closest.gpu_budget_bytes / GIB:.1f}"
                             if what == "GPU" else
                             f"{closest.host_bytes_per_node / GIB:.0f} GiB of {closest.host_budget_bytes / GIB:.0f}"))
            elif limit is not None and (floor := self._floor(i)) * (1 + self.tolerance) >= limit:
                reason = (f"not traced: even its fastest stack ({100 * (floor / limit - 1):+.1f}% per token) is within "
                          f"the {100 * self.tolerance:g}% tolerance of the answer or slower")
            else:
                reason = ("its stacks faster than the answer were ruled out by the traces of a larger cp (each GPU "
                          "holds more with fewer in the group)")
            out.append(LayoutVerdict(layout, reason))
        return out


def _holds_at_least(column: tuple, failed: tuple, by_gpu: bool, any_kind: bool) -> bool:
    """Whether `column` (mode, k, attention held, attention kind) holds at least what the `failed` one did, and so
    fails too: by the GPU, a mode no stronger and attention held if it was (modes short of full recompute hold it
    anyway); by the host, offloading with k no sparser and attention kept if it was (host bytes do not depend on the
    rest)."""
    mode, k, keep, kind = column
    their_mode, their_k, their_keep, their_kind = failed
    if by_gpu:
        same_kind = any_kind or kind == their_kind
        return same_kind and MODES.index(mode) <= MODES.index(their_mode) and keep >= their_keep
    return mode[1] != "none" and k <= their_k and keep >= their_keep

