"""Auto-fit: the fastest memory stack that fits a machine at a given sequence length.

The model, the length, the cp degree, the precision and the machine are given; auto-fit
chooses the memory stack (recompute granularity, CPU offload, its prefetch and how sparse it
is, tiled MLP and loss with their tile counts, Untied Ulysses and its heads per stage) and answers with
the flags for `python -m megatron_lc.train`.

**Cost**: each candidate's predicted step time on the machine (`planning/timing.py`: the
step's work over the machine's rates, overlapped by stream, the one time model of the
planner). Auto-fit answers with the fastest predicted stack that fits.

**Candidates**: recompute none < selective < full < full + offload (prefetch) < full +
offload (on demand); MLP tiles off < 2 < ... < the default count (about hidden-size
tokens per tile), halving from the default; loss tiles the same way (default: 1 GiB of
fp32 logits per tile); attention: Ulysses, or Untied Ulysses with U from the largest valid
heads per stage below the head count down to cp (with cp > 1); with offload, every k-th block
input kept, k = 1 < 2 < 4 (`--offload-every-k-layers`: host bytes about 1/k, (k-1)/2 block
forwards more per layer); with full recompute, each block's attention output and lse kept
(`--keep-attention-output`: on the host with the block input when offloading, else on the GPU;
one attention forward less per layer) or not. Each list runs from the least memory saving to the
most; the modes without full recompute keep their attention anyway, so they sit at "kept".

**Search**: an estimate is a fake-tensor trace (seconds at real sizes), so few are made.
It assumes that, within one attention family (Ulysses; Untied Ulysses at any stage width),
GPU memory does not grow when any one choice moves up its list; Untied Ulysses' own
buffers can make it hold more than Ulysses on small models, so the two families are
searched apart. Host memory depends only on whether block inputs are offloaded and on k
and on keeping attention outputs (it falls as k grows and without them), and GPU memory does not grow with k (the replays of sparse offload run
between block backwards, below their peak). Per family, fastest family first: (1) the
strongest stack is traced (without offload if the host cannot hold it): if it does not
fit, nothing in the family does; (2) for each choice, a binary search with every other
choice at its strongest finds the weakest level that can fit (weaker levels are out);
(3) the remaining candidates are visited in order of modelled cost, and the first that
fits is the family's answer. A candidate weaker in every choice than one that did not fit
is skipped untraced, one stronger than one that fit is known to fit (and is traced once
to report it); before an unknown candidate, the same candidate with its tile counts at
their strongest is traced, so one failure rules out a whole column of tile counts. A
family whose fastest candidate costs no less than the answer so far is skipped, and the
fastest candidate of all (no technique) is traced first. Every
candidate faster than the answer was traced or ruled out this way, so the answer is the
fastest that fits. At most `max_traces` estimates are made; when the cap stops the
search, the answer is the fastest candidate known to fit and is marked `capped`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_lc.attention.registry import CP_IMPLS
from megatron_lc.attention.untied_ulysses import valid_heads_per_stage
from megatron_lc.config import TrainConfig
from megatron_lc.memory.chunks import plan_chunks
from megatron_lc.memory.stack import OffloadMode
from megatron_lc.planning.estimate import GIB, Estimate, Machine, estimate
from megatron_lc.planning.timing import StepTime, TimeModel

MODES = (("none", "none"), ("selective", "none"), ("full", "none"), ("full", "early"), ("full", "prefetch"),
         ("full", "on_demand"))
"""(recompute granularity, offload) from the least memory saving to the most."""
DEFAULT_MAX_TRACES = 40
OFFLOAD_EVERY = (1, 2, 4)
"""Sparse-offload levels auto-fit tries: every block input kept, every second, every fourth."""


@dataclass(frozen=True)
class Candidate:
    """One memory stack: the choices auto-fit makes, everything else as configured."""

    recompute: str
    """--recompute-granularity: none, selective or full."""
    offload: OffloadMode
    """--offload-mode: none, early, prefetch or on_demand."""
    mlp_tiles: int | None
    """--tiled-mlp-tiles, or None for no tiled MLP."""
    loss_tiles: int | None
    """--tiled-loss-tiles, or None for no tiled loss."""
    cp_impl: str | None
    """--cp-impl (None without context parallelism: left as configured)."""
    heads_per_stage: int | None
    """--untied-heads-per-stage (Untied Ulysses only)."""
    offload_every: int = 1
    """--offload-every-k-layers (with offload only): every k-th block input kept, the rest recomputed."""
    keep_attention: bool = False
    """--keep-attention-output (full recompute only): the recompute runs no attention forward."""
    untied_overlap: bool = False
    """--untied-overlap-stages (Untied Ulysses only): its stages pipelined, one more set of stage buffers."""
    offload_keep_last: int | None = None
    """--offload-keep-last as the user gave it (with offload only; None: the default)."""

    def flags(self) -> list[str]:
        """The training flags of this stack (defaults left out)."""
        out = [] if self.recompute == "none" else ["--recompute-granularity", self.recompute]
        if self.offload != "none":
            out += ["--offload-mode", self.offload]
        if self.offload != "none" and self.offload_keep_last is not None:
            out += ["--offload-keep-last", str(self.offload_keep_last)]
        if self.offload != "none" and self.offload_every > 1:
            out += ["--offload-every-k-layers", str(self.offload_every)]
        if self.keep_attention and self.recompute == "full":
            out.append("--keep-attention-output")
        if self.mlp_tiles:
            out += ["--tiled-mlp", "--tiled-mlp-tiles", str(self.mlp_tiles)]
        if self.loss_tiles:
            out += ["--tiled-loss", "--tiled-loss-tiles", str(self.loss_tiles)]
        if self.cp_impl == "untied_ulysses":
            out += ["--cp-impl", self.cp_impl, "--untied-heads-per-stage", str(self.heads_per_stage)]
            out += ["--untied-overlap-stages"] if self.untied_overlap else []
        return out

    def apply(self, cfg: TrainConfig) -> TrainConfig:
        """`cfg` with this stack in place of its own."""
        memory = dataclasses.replace(
            cfg.memory, recompute_granularity=self.recompute, offload_mode=self.offload,
            offload_keep_last=self.offload_keep_last if self.offload != "none" else None,
            offload_every_k_layers=self.offload_every if self.offload != "none" else 1,
            keep_attention_output=self.keep_attention and self.recompute == "full", tiled_mlp=self.mlp_tiles is not None,
            tiled_mlp_tiles=self.mlp_tiles, tiled_loss=self.loss_tiles is not None, tiled_loss_tiles=self.loss_tiles)
        parallel = cfg.parallel
        if self.cp_impl is not None:
            parallel = dataclasses.replace(parallel, cp_impl=self.cp_impl, untied_heads_per_stage=self.heads_per_stage,
                                           untied_overlap_stages=self.untied_overlap and self.cp_impl == "untied_ulysses")
        return dataclasses.replace(cfg, memory=memory, parallel=parallel)


MEMORY_FLAGS = {"--recompute-granularity": 1, "--offload-mode": 1, "--offload-activations": 0,
                "--no-offload-prefetch": 0, "--offload-prefetch-early": 0,
                "--offload-every-k-layers": 1, "--offload-keep-last": 1, "--keep-attention-output": 0,
                "--tiled-mlp": 0, "--tiled-mlp-tiles": 1, "--tiled-loss": 0, "--tiled-loss-tiles": 1,
                "--cp-impl": 1, "--untied-heads-per-stage": 1, "--untied-overlap-stages": 0}
"""The flags auto-fit chooses, with the number of values each takes."""


def strip_memory_flags(argv: list[str]) -> list[str]:
    """`argv` without the flags auto-fit chooses (`--flag value` and `--flag=value` forms)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg.split("=", 1)[0] in MEMORY_FLAGS:
            skip = 0 if "=" in arg else MEMORY_FLAGS[arg]
        else:
            out.append(arg)
    return out


# --- the candidates -------------------------------------------------------------------------


def tile_ladder(default: int) -> list[int]:
    """Tile counts tried: the default, halved (rounded up) while it stays >= 2; ascending."""
    ladder, t = {default}, default
    while t > 2:
        t = math.ceil(t / 2)
        ladder.add(t)
    return sorted(ladder)


@dataclass(frozen=True)
class SearchSpace:
    """Each choice's levels, from the least memory saving to the most; a point indexes one level of each."""

    modes: tuple[tuple[str, str], ...]
    """(recompute, offload) levels."""
    mlp_tiles: tuple[int | None, ...]
    """MLP tile counts (None: not tiled)."""
    loss_tiles: tuple[int | None, ...]
    """Loss tile counts (None: not tiled)."""
    attention: tuple[tuple[str | None, int | None, bool], ...]
    """(cp_impl, heads_per_stage, pipelined stages) levels: Ulysses, then Untied Ulysses by heads per stage,
    descending, synchronous, then the same pipelined."""
    offload_every: tuple[int, ...] = (1,)
    """Sparse-offload k levels (ascending; they apply to the offloading modes only)."""
    offload_keep_last: int | None = None
    """--offload-keep-last of every offloading candidate (as the user gave it)."""
    keep_attention: tuple[bool, ...] = (False,)
    """Kept attention levels, (True, False) when searched (they apply to full recompute only; the other
    modes keep their attention anyway and take level 0)."""

    @property
    def sizes(self) -> tuple[int, ...]:
        return (len(self.modes), len(self.mlp_tiles), len(self.loss_tiles), len(self.attention),
                len(self.offload_every), len(self.keep_attention))

    def offloads(self, point: tuple[int, ...]) -> bool:
        return self.modes[point[0]][1] != "none"

    def canonical(self, point: tuple[int, ...]) -> tuple[int, ...]:
        """The point itself, or without offload its k level at 1 (k means nothing there), and without full
        recompute its kept-attention level at 0."""
        k = point[4] if self.offloads(point) else 0
        keep = point[5] if self.modes[point[0]][0] == "full" else 0
        return (*point[:4], k, keep)

    def candidate(self, point: tuple[int, ...]) -> Candidate:
        (rec, off), mlp, loss, (impl, u, overlap) = (self.modes[point[0]], self.mlp_tiles[point[1]],
                                                     self.loss_tiles[point[2]], self.attention[point[3]])
        return Candidate(rec, off, mlp, loss, impl, u, self.offload_every[point[4]] if off != "none" else 1,
                         self.keep_attention[point[5]] and rec == "full", overlap,
                         self.offload_keep_last if off != "none" else None)

    def points(self) -> list[tuple[int, ...]]:
        """Every distinct candidate's point (k levels only with offload)."""
        return [p for p in itertools.product(*(range(n) for n in self.sizes)) if self.canonical(p) == p]


def search_space(cfg: TrainConfig) -> SearchSpace:
    """The candidates for `cfg`: its model, length and cp degree fixed."""
    c, cp = cfg.model_config(), cfg.parallel.context_parallel_size
    tokens = cfg.data.micro_batch_size * cfg.data.seq_length // cp
    plan = plan_chunks(tokens, c.hidden_size, c.ffn_hidden_size, c.vocab_size, 2 if cfg.train.bf16 else 4)
    attention: list[tuple[str | None, int | None, bool]] = [(None, None, False)]
    a2a = cfg.context_layout().a2a_size  # the all-to-all level (the whole cp group without a ring)
    if a2a > 1:
        attention = [("ulysses", None, False)]
        if "untied_ulysses" in CP_IMPLS:
            stages = sorted(valid_heads_per_stage(c.num_attention_heads, c.num_query_groups, a2a), reverse=True)
            attention += [("untied_ulysses", u, overlap) for overlap in (False, True)
                          for u in stages if u < c.num_attention_heads]
    offloading = dataclasses.replace(cfg.memory_stack(), recompute_granularity="full", offload_mode="prefetch")
    slots = {}  # k levels that change the host slots (a model of few layers has fewer)
    for k in OFFLOAD_EVERY:
        slots.setdefault(dataclasses.replace(offloading, offload_every_k_layers=k).host_slots(c.num_layers), k)
    return SearchSpace(MODES, (None, *tile_ladder(plan.mlp_tiles)), (None, *tile_ladder(plan.loss_tiles)),
                       tuple(attention), tuple(slots.values()), cfg.memory.offload_keep_last, (True, False))


# --- the search -----------------------------------------------------------------------------


@dataclass
class Traced:
    """One estimate the search made."""

    candidate: Candidate
    """The stack traced."""
    estimate: Estimate
    """Its memory on the machine."""
    cost: StepTime
    """Its predicted step time."""


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
    """Size of the search space."""
    capped: bool = False
    """The trace cap stopped the search: the answer is the fastest known to fit, maybe not the fastest."""
    time_model: TimeModel = field(default_factory=TimeModel)
    """The rates the step times were predicted at."""

    @property
    def runner_up(self) -> Traced | None:
        """The fastest traced stack that fits besides the answer."""
        others = [t for t in self.traced if t.estimate.fits and t.candidate != self.choice]
        return min(others, key=lambda t: t.cost.step_s, default=None)


class _Knowledge:
    """What the traces so far imply about any point, under the monotonicity assumption."""

    def __init__(self, space: SearchSpace, offload_modes: set[int]):
        self.space, self.offload_modes = space, offload_modes
        self.family = [(impl, overlap) for impl, _, overlap in space.attention]  # pipelined: one of their own
        self.gpu_fits: list[tuple[int, ...]] = []
        self.gpu_fails: list[tuple[int, ...]] = []
        self.offload_host_fits: dict[tuple[int, int], bool] = {}
        """By (k level, kept-attention level): whether the host holds the offloaded tensors (the same for every
        offloading mode)."""
        self.estimates: dict[tuple[int, ...], Estimate] = {}

    def record(self, point: tuple[int, ...], e: Estimate) -> None:
        self.estimates[point] = e
        (self.gpu_fits if e.fits_gpu else self.gpu_fails).append(point)
        if point[0] in self.offload_modes:
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


def auto_fit(cfg: TrainConfig, machine: Machine, time_model: TimeModel | None = None,
             max_traces: int = DEFAULT_MAX_TRACES,
             evaluate: Callable[[TrainConfig, Machine, int], Estimate] = estimate,
             on_estimate: Callable[[Candidate, Estimate], None] | None = None,
             space: SearchSpace | None = None) -> AutoFitResult:
    """The fastest candidate of `space` (default `search_space(cfg)`) that fits `machine`, by `time_model`
    (default: the machine's published rates)."""
    time_model = time_model or TimeModel.for_machine(machine, cfg)
    search = _Search(cfg, machine, time_model, max_traces, evaluate, on_estimate, space or search_space(cfg))
    fastest = min(search.space.points(), key=lambda p: (search.cost(p).step_s, p))
    best = fastest if search.fits(fastest) else None  # one trace when no technique is needed
    for levels in sorted(_families(search.space), key=search.floor):
        if best is None or search.floor(levels) < search.cost(best).step_s:
            best = search.family(levels, best)
    best = search.pipelined(best)
    result = search.result
    if best is not None:
        result.choice, result.estimate = search.space.candidate(best), search.known.estimates[best]
        result.cost = search.cost(best)
    return result


class _Search:
    """The state of one auto-fit search: knowledge, traces, costs."""

    def __init__(self, cfg: TrainConfig, machine: Machine, time_model: TimeModel, max_traces: int,
                 evaluate: Callable[[TrainConfig, Machine, int], Estimate],
                 on_estimate: Callable[[Candidate, Estimate], None] | None, space: SearchSpace):
        self.cfg, self.machine, self.time_model, self.max_traces = cfg, machine, time_model, max_traces
        self.evaluate, self.on_estimate, self.space = evaluate, on_estimate, space
        self.known = _Knowledge(space, {i for i, (_, off) in enumerate(space.modes) if off != "none"})
        self.result = AutoFitResult(None, None, None, candidates=len(space.points()), time_model=time_model)
        self.costs: dict[tuple[int, ...], StepTime] = {}

    def cost(self, point: tuple[int, ...]) -> StepTime:
        point = self.space.canonical(point)
        if point not in self.costs:
            cfg = self.space.candidate(point).apply(self.cfg)
            self.costs[point] = self.time_model.predict(cfg, self.machine.num_gpus)
        return self.costs[point]

    def floor(self, levels: list[int]) -> float:
        """The fastest candidate's cost in one attention family."""
        return min(self.cost(p).step_s for p in _family_points(self.space, levels))

    def fits(self, point: tuple[int, ...], force: bool = False) -> bool | None:
        """Whether `point` fits, traced when unknown (always with `force`); None when the cap stops it."""
        point = self.space.canonical(point)
        status = self.known.status(point)
        if (status is None or force) and point not in self.known.estimates:
            if len(self.result.traced) >= self.max_traces and not force:
                self.result.capped = True
                return None
            candidate = self.space.candidate(point)
            e = self.evaluate(candidate.apply(self.cfg), self.machine, self.cfg.data.seq_length)
            self.known.record(point, e)
            self.result.traced.append(Traced(candidate, e, self.cost(point)))
            if self.on_estimate:
                self.on_estimate(candidate, e)
            status = e.fits
        return status

    def pipelined(self, best: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The answer's memory stack with pipelined Untied stages (`--untied-overlap-stages`): at an Untied
        answer's stage width or the widest narrower one (any width for a Ulysses answer) that fits and is
        predicted faster; else `best`. Pipelining costs stage buffers and saves exposed exchange time only,
        so it is tried on the answer rather than searched as a family of its own: a pipelined stage wider
        than the answer's holds more than the synchronous one that did not fit."""
        if best is None:
            return None
        impl, u, overlap = self.space.attention[best[3]]
        if impl not in ("ulysses", "untied_ulysses") or overlap:
            return best
        u = u or self.cfg.model_config().num_attention_heads
        for level, (other, v, pipelined) in enumerate(self.space.attention):
            point = self.space.canonical((*best[:3], level, *best[4:]))
            if other == "untied_ulysses" and pipelined and v <= u \
                    and self.cost(point).step_s < self.cost(best).step_s:
                if self.fits(point) and self.fits(point, force=True):
                    return point
        return best

    def family(self, levels: list[int], best: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The fastest point of one family that fits and is faster than `best` (else `best`)."""
        top = _strongest(self.space, self.known, self.fits, levels)
        if top is None:
            return best
        lower = _lower_bounds(top, levels, self.fits)
        box = [p for p in _family_points(self.space, levels) if _within(self.space, lower, top, p) and p[0] <= top[0]]
        for point in sorted(box, key=lambda p: (self.cost(p).step_s, p)):
            if best is not None and (self.cost(point).step_s, point) >= (self.cost(best).step_s, best):
                return best
            for probe in _probes(point, top):
                if self.known.status(point) is not None:
                    break
                self.fits(probe)
            if self.fits(point) and self.fits(point, force=True):
                return point
        return best


def _within(space: SearchSpace, lower: tuple[int, ...], top: tuple[int, ...], point: tuple[int, ...]) -> bool:
    """`point` is at or above the lower bounds found at `top`. The bounds of k and of kept attention hold the
    host's limit when `top` offloads: they bind the points that offload as `top` does, not the others (kept
    attention costs those GPU bytes instead, bounded by the GPU traces)."""
    dims = [0, 1, 2, 3] + ([4, 5] if space.offloads(point) == space.offloads(top) else [])
    return all(lower[i] <= point[i] for i in dims)


def _probes(point: tuple[int, ...], top: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Points to trace before `point`: it with both tile choices, then the loss's, at their strongest.
    Tile counts cost little, so when one of these does not fit, neither does anything below it: a failure
    rules out a whole column of candidates at once."""
    both = (point[0], top[1], top[2], *point[3:])
    loss = (point[0], point[1], top[2], *point[3:])
    return [p for p in dict.fromkeys((both, loss)) if p != point]


def _family_points(space: SearchSpace, levels: list[int]) -> list[tuple[int, ...]]:
    return [p for p in space.points() if p[3] in levels]


def _families(space: SearchSpace) -> list[list[int]]:
    """Attention levels by family (Ulysses; Untied Ulysses by stage width): memory is ordered within one only.
    Pipelined Untied levels are no family: `_Search.pipelined` tries them on the answer."""
    families: dict[str | None, list[int]] = {}
    for i, (impl, _, overlap) in enumerate(space.attention):
        if not overlap:
            families.setdefault(impl, []).append(i)
    return list(families.values())


def _strongest(space: SearchSpace, known: _Knowledge, fits, levels: list[int]) -> tuple[int, ...] | None:
    """The strongest point of one attention family that fits (offload dropped when the host cannot hold it)."""
    for mode in range(len(space.modes) - 1, -1, -1):
        offloads = mode in known.offload_modes
        if offloads and known.host_fits(len(space.offload_every) - 1, len(space.keep_attention) - 1) is False:
            continue
        point = space.canonical((mode, len(space.mlp_tiles) - 1, len(space.loss_tiles) - 1, levels[-1],
                                 len(space.offload_every) - 1, len(space.keep_attention) - 1))
        if fits(point):
            return point
        e = known.estimates.get(point)
        if e is None or not e.fits_gpu:
            return None  # capped, or out of GPU memory: weaker modes hold more
    return None


def _lower_bounds(top: tuple[int, ...], levels: list[int], fits) -> tuple[int, ...]:
    """For each choice, the weakest level that fits with every other choice at `top` (binary search)."""
    lower = list(top)
    for k in range(len(top)):
        lo, hi = (levels[0], top[k]) if k == 3 else (0, top[k])
        while lo < hi:
            mid = (lo + hi) // 2
            status = fits(tuple(mid if i == k else v for i, v in enumerate(top)))
            if status is None:
                break  # capped: lo stays a valid bound
            lo, hi = (lo, mid) if status else (mid + 1, hi)
        lower[k] = lo
    return tuple(lower)


# --- output ---------------------------------------------------------------------------------


def _estimate_json(e: Estimate) -> dict:
    return {"fits": e.fits, "gpu_peak_gib": round(e.gpu_peak_bytes / GIB, 3),
            "host_peak_gib": round(e.host_bytes_per_node / GIB, 3)}


def auto_fit_json(result: AutoFitResult, command: list[str] | None = None) -> dict:
    """The answer (flags, memory, predicted step time), the runner-up, the rates and every trace."""
    out: dict = {"flags": None, "fits": False, "candidates": result.candidates, "capped": result.capped,
                 "rates": result.time_model.rates.name, "attention_rates": result.time_model.family}
    if result.choice is not None:
        out.update(flags=result.choice.flags(), **_estimate_json(result.estimate), time=result.cost.to_json())
        if command is not None:
            out["command"] = command + result.choice.flags()
    runner_up = result.runner_up
    if runner_up is not None:
        out["runner_up"] = {"flags": runner_up.candidate.flags(), **_estimate_json(runner_up.estimate),
                            "time": runner_up.cost.to_json()}
    out["traced"] = [{"flags": t.candidate.flags(), **_estimate_json(t.estimate), "step_s": round(t.cost.step_s, 6)}
                     for t in result.traced]
    return out


def _choice_lines(title: str, flags: list[str], e: Estimate, c: StepTime) -> list[str]:
    causes = ", ".join(f"{k} {v:.2f}" for k, v in c.seconds.items() if v >= 0.005)
    return [f"{title}: {' '.join(flags) or '(none: no memory technique needed)'}",
            f"  GPU {e.gpu_peak_bytes / GIB:.2f} GiB of {e.gpu_budget_bytes / GIB:.2f}; "
            f"host {e.host_bytes_per_node / GIB:.0f} GiB per node of {e.host_budget_bytes / GIB:.0f}",
            f"  predicted step {c.step_s:.2f} s, {c.tokens_per_s:,.0f} tokens/s, MFU {100 * c.mfu:.1f}% "
            f"(s: {causes})"]


def auto_fit_text(result: AutoFitResult, command: list[str] | None = None) -> str:
    """For people: the flags to paste, the memory, the predicted step time, the runner-up, and the traces."""
    lines = [f"auto-fit: {len(result.traced)} of {result.candidates} candidate stacks traced"
             + (" (trace cap reached: the fastest known to fit, maybe not the fastest)" if result.capped else "")]
    if result.choice is None:
        lines.append("no candidate fits: not even the strongest stack")
    else:
        lines += _choice_lines("fastest stack that fits", result.choice.flags(), result.estimate, result.cost)
        if command is not None:
            lines.append("paste: " + " ".join(command + result.choice.flags()))
        if result.runner_up is not None:
            r = result.runner_up
            lines += _choice_lines("runner-up (traced)", r.candidate.flags(), r.estimate, r.cost)
    m = result.time_model
    lines.append(f"step times predicted at the {m.rates.name} rates, attention as {m.family} (planning/timing.py; "
                 "predictions, not measurements)")
    lines.append("traced (in order):")
    for t in result.traced:
        verdict = "fits" if t.estimate.fits else ("no (host)" if t.estimate.fits_gpu else "no")
        lines.append(f"  {verdict:<9} GPU {t.estimate.gpu_peak_bytes / GIB:8.2f} GiB  host/node "
                     f"{t.estimate.host_bytes_per_node / GIB:7.0f} GiB  step {t.cost.step_s:9.3f} s  "
                     f"{' '.join(t.candidate.flags()) or '(no memory flags)'}")
    return "\n".join(lines)
