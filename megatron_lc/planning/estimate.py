"""Per-GPU and host memory of a configuration, from traced steps of a few layers.

A step of an L-layer model is traced in full when L is small. Otherwise two steps are
traced, with L1 = 2m and L2 = 2m + 1 layers (m = 2, or one more than the layers whose
block input is kept on the GPU under offload; with sparse offload every k-th input kept,
L2 = L1 + k with L1 >= 2m congruent to L modulo k, see `traced_layer_counts`), and each *phase* of the step (forward
or backward of a layer counted from the start or from the end, the loss head, the
embedding, the optimizer step) is extrapolated to L layers on the line through its two
traced peaks. This is exact, not an approximation: every layer has the same shapes, so
what a phase holds grows by the same bytes per added layer (sharded parameters,
gradients and optimizer state; kept or offloaded block inputs), and the layers in the
middle peak between the first and the last ones (their peak is affine in the layer
index), so the largest extrapolated phase peak is the step's peak. Tests compare the
extrapolation with a full trace.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron_lc.config import RunSpec, TrainConfig
from megatron_lc.models.llama import build_model, count_parameters
from megatron_lc.planning.gpu_allocations import NcclSettings, nccl_bytes
from megatron_lc.planning.timing import StepTime, TimeModel, kept_attention_bytes_per_gpu
from megatron_lc.planning.trace import StepTrace, trace_step
import megatron_lc.planning.machine as machine_terms
from megatron_lc.planning.machine import DEFAULT_NODE, GIB, NODES, Term
from megatron_lc.planning.tracker import CATEGORIES, PhasePeak

_LAYER_PHASE = re.compile(r"^(fw|bw):layer:(\d+)$")


@dataclass(frozen=True)
class Machine:
    """The cluster a configuration is planned for: a named node (`machine.NODES`), its figures overridable."""

    num_gpus: int = 8
    node: str = DEFAULT_NODE
    """The kind of node; its figures fill every field left None."""
    gpus_per_node: int | None = None
    gpu_memory_gib: float | None = None
    """Memory of one GPU as the driver hands it out (default: the node's, e.g. 79.11 for an "80 GB" H100)."""
    host_memory_gib: float | None = None
    """Physical host memory per node (default: the node's)."""
    reserve_gib: float | None = None
    """Per-GPU bytes kept free besides the traced tensors and NCCL buffers, as one number; None: the itemized
    terms of `machine.gpu_terms`."""
    host_reserve_gib: float | None = None
    """Host memory per node that offloaded activations cannot use, as one number; None: the itemized terms of
    `machine.host_terms`."""
    expandable_segments: bool = True
    """The CUDA caching allocator runs with expandable segments (the trainer sets it)."""
    nvls: bool = False
    """NCCL's NVLink SHARP buffers are on (the recipes export NCCL_NVLS_ENABLE=0)."""
    nccl: NcclSettings = NcclSettings()
    device: str = "cuda"
    """cuda: model the CUDA kernels and NCCL; cpu: trace the CPU kernels as they are (validation)."""
    flash_attn: bool = False
    """flash-attn is installed on the GPUs' machines: `auto` runs it for bf16 (torch's flash kernel otherwise)."""
    fa3: bool = False
    """FA3's flash_attn_interface is installed on the GPUs' machines: `--flash-attention-impl auto` puts it behind
    torch's flash kernel on compute capability 9.0."""

    def __post_init__(self) -> None:
        if self.node not in NODES:
            raise ValueError(f"--machine {self.node!r}: expected one of {', '.join(NODES)}")
        spec = NODES[self.node]
        if self.node == "local":  # every process on this machine, running the CPU kernels
            object.__setattr__(self, "device", "cpu")
            spec = dataclasses.replace(spec, gpus_per_node=self.num_gpus)
        for name, value in (("gpus_per_node", spec.gpus_per_node), ("gpu_memory_gib", spec.gpu_memory_gib),
                            ("host_memory_gib", spec.host_memory_gib)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    def flash_impl(self, asked: str, call=None) -> str:
        """What `--flash-attention-impl ASKED` runs on these GPUs for a run whose largest kernel call has the shape
        `call` (an `AttentionCallShape`): an implementation named is taken as installed; `auto` finds FA3 where `fa3`
        says it is installed; FA3 never takes a call past its backward's workspace limit."""
        from megatron_lc.attention.flash_impl import resolve_flash_impl

        installed = {asked} if asked != "auto" else ({"fa3"} if self.fa3 else set())
        return resolve_flash_impl(asked, NODES[self.node].compute_capability,
                                  lambda impl: "" if impl in installed else "not installed", call)[0]

    @property
    def gpus_on_node(self) -> int:
        return min(self.gpus_per_node, self.num_gpus)


@dataclass
class Estimate:
    """Memory of one configuration on one machine (rank 0's view; every rank holds the same)."""

    seq_length: int
    gpu_bytes_by_category: dict[str, int]
    """Peak accelerator bytes by category, NCCL buffers included in communication buffers."""
    nccl_bytes: int
    host_bytes_per_gpu: int
    peak_phase: str
    top_buffers: list[tuple[str, int, int]]
    communicators: int
    traced_layers: tuple[int, ...]
    machine: Machine
    seconds: float = 0.0
    extra_layer_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes by category that the layers beyond the traced ones add at the peak (extrapolation)."""
    state_bytes_per_gpu: int = 0
    """fp32 weights and optimizer state of one rank's shards: what a checkpoint save stages on the host."""
    time: StepTime | None = None
    """The step's predicted time on the machine (planning/timing.py)."""
    at_least: bool = False
    """The bytes are the fewer traced layers' alone (`estimate(..., stop_when_over=True)`): the step holds at least
    them, already over a budget, so it does not fit."""

    @property
    def gpu_peak_bytes(self) -> int:
        return sum(self.gpu_bytes_by_category.values())

    @property
    def gpu_reserve_terms(self) -> list[Term]:
        """What the card holds besides the traced step, term by term (one term when --reserve-gib is given)."""
        m = self.machine
        if m.reserve_gib is not None:
            return [Term("reserve (--reserve-gib)", int(m.reserve_gib * GIB), "given on the command line")]
        return machine_terms.gpu_terms(host_pinned_bytes_per_gpu=self.host_bytes_per_gpu if m.device == "cuda" else 0,
                                       communicators=self.communicators, expandable_segments=m.expandable_segments,
                                       nvls=m.nvls)

    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.machine.gpu_memory_gib * GIB)

    @property
    def gpu_budget_bytes(self) -> int:
        """Bytes the traced step may hold: the card less every reserve term."""
        return self.gpu_memory_bytes - machine_terms.total(self.gpu_reserve_terms)

    @property
    def host_bytes_per_node(self) -> int:
        return self.host_bytes_per_gpu * self.machine.gpus_on_node

    @property
    def fits_gpu(self) -> bool:
        return self.gpu_peak_bytes <= self.gpu_budget_bytes

    @property
    def host_reserve_terms(self) -> list[Term]:
        """What a node's RAM holds besides the offloaded activations (one term when --host-reserve-gib is given)."""
        m = self.machine
        if m.host_reserve_gib is not None:
            return [Term("host reserve (--host-reserve-gib)", int(m.host_reserve_gib * GIB), "given on the command line")]
        pinned = self.host_bytes_per_node if m.device == "cuda" else 0
        return machine_terms.host_terms(host_memory_bytes=int(m.host_memory_gib * GIB), pinned_bytes_per_node=pinned,
                                        processes_per_node=m.gpus_on_node,
                                        state_bytes_per_node=self.state_bytes_per_gpu * m.gpus_on_node)

    @property
    def host_budget_bytes(self) -> int:
        """Host bytes per node left for the offloaded activations."""
        return int(self.machine.host_memory_gib * GIB) - machine_terms.total(self.host_reserve_terms)

    @property
    def fits_host(self) -> bool:
        return self.host_bytes_per_node <= self.host_budget_bytes

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    @property
    def usages(self) -> tuple[float, float]:
        """GPU and host use, each over its budget (<= 1 fits); each monotone in the sequence length."""
        return (self.gpu_peak_bytes / max(self.gpu_budget_bytes, 1),
                self.host_bytes_per_node / max(self.host_budget_bytes, 1))

    @property
    def usage(self) -> float:
        """The larger of GPU and host use over budget (<= 1 fits); monotone in the sequence length."""
        return max(self.usages)

    def to_json(self) -> dict:
        m = self.machine
        return {
            "seq_length": self.seq_length, "fits": self.fits, "fits_gpu": self.fits_gpu, "fits_host": self.fits_host,
            "gpu_peak_gib": round(self.gpu_peak_bytes / GIB, 3),
            "gpu_budget_gib": round(self.gpu_budget_bytes / GIB, 3),
            "gpu_by_category_gib": {k: round(v / GIB, 3) for k, v in self.gpu_bytes_by_category.items()},
            "nccl_gib": round(self.nccl_bytes / GIB, 3), "machine": m.node,
            "reserve_gib": round(machine_terms.total(self.gpu_reserve_terms) / GIB, 3),
            "reserve_terms": [t.to_json() for t in self.gpu_reserve_terms], "gpu_memory_gib": m.gpu_memory_gib,
            "host_peak_gib": round(self.host_bytes_per_node / GIB, 3),
            "host_per_gpu_gib": round(self.host_bytes_per_gpu / GIB, 3), "host_memory_gib": m.host_memory_gib,
            "host_reserve_gib": round(machine_terms.total(self.host_reserve_terms) / GIB, 3),
            "host_terms": [t.to_json() for t in self.host_reserve_terms], "host_budget_gib": round(self.host_budget_bytes / GIB, 3),
            "num_gpus": m.num_gpus, "gpus_per_node": m.gpus_per_node, "peak_phase": self.peak_phase,
            "top_buffers": [{"name": n, "count": c, "gib": round(b / GIB, 3)} for n, c, b in self.top_buffers],
            "communicators": self.communicators, "traced_layers": list(self.traced_layers),
            "seconds": round(self.seconds, 2), **({"at_least": True} if self.at_least else {}),
            **({"time": self.time.to_json()} if self.time is not None else {}),
        }


def planning_config(cfg: TrainConfig, seq_length: int | None = None) -> TrainConfig:
    """A copy of `cfg` that needs no data files (the planner reads none), at `seq_length` if given."""
    data = dataclasses.replace(cfg.data, mock_data=True, data_path=[], valid_data_path=[], train_data_path=[],
                               test_data_path=[], split=None, seq_length=seq_length or cfg.data.seq_length,
                               data_cache_path=None)
    logging = dataclasses.replace(cfg.logging, eval_interval=None,  # validation data is gone with the files
                                  log_dir=None, tensorboard_dir=None)  # planning writes nowhere
    train = dataclasses.replace(cfg.train, device="auto")  # the planned machine's GPUs, not this machine's
    return dataclasses.replace(cfg, data=data, logging=logging, train=train)


def anchor_depth(spec: RunSpec) -> int:
    """m: the layers counted from each end whose phases are anchors (the rest are middle layers).

    2, or one more than the layers whose block input stays on the GPU under offload; with sparse offload
    (k > 1) at least those layers plus one whole segment, so that every position in a segment is an anchor
    at each end."""
    stack = spec.parallelize.memory
    if not stack.offloads:
        return 2
    m = max(2, stack.offload_keep_last + 1)
    k = stack.offload_every_k_layers
    return m if k == 1 else max(m, stack.offload_keep_last + k)


def traced_layer_counts(spec: RunSpec) -> tuple[int, ...]:
    """Layer counts to trace: all layers, or two small counts to extrapolate from.

    2m and 2m + 1 layers; with sparse offload (k > 1) the smallest count of at least 2m layers that is
    congruent to the model's modulo k, and k more: the traces and the model then end in the same partial
    segment, and each trace's k more layers add one whole segment (one host slot, k layers of state)."""
    stack = spec.parallelize.memory
    m, k = anchor_depth(spec), stack.offload_every_k_layers if stack.offloads else 1
    num_layers = spec.model.num_layers
    first = 2 * m + (num_layers - 2 * m) % k
    return (num_layers,) if num_layers <= first + k else (first, first + k)


def anchor(phase: str, num_layers: int, m: int) -> str | None:
    """The phase's name independent of the layer count: layers by distance from the start or the end.

    None for a middle layer (it peaks between the anchors around it)."""
    match = _LAYER_PHASE.match(phase)
    if not match:
        return phase
    direction, index = match.group(1), int(match.group(2))
    if index < m:
        return f"{direction}:layer:{index}"
    if index >= num_layers - m:
        return f"{direction}:layer:-{num_layers - index}"
    return None


def _anchored(trace: StepTrace, m: int) -> dict[str, PhasePeak]:
    peaks = {}
    for phase, peak in trace.analysis.phase_peaks.items():
        name = anchor(phase, trace.num_layers, m)
        if name is not None:
            peaks[name] = peak
    return peaks


def _extrapolate(v1: int, v2: int, l1: int, l2: int, target: int) -> int:
    return v1 + (v2 - v1) * (target - l1) // (l2 - l1)


def describe_phase(name: str, num_layers: int) -> str:
    """A person's words for an anchor: 'backward of layer 31 of 32', 'optimizer step', ..."""
    if name == "optimizer":
        return "optimizer step"
    direction, _, unit = name.partition(":")
    words = {"fw": "forward", "bw": "backward"}.get(direction, direction)
    if unit.startswith("layer:"):
        index = int(unit.split(":")[1])
        index = index if index >= 0 else num_layers + index
        return f"{words} of layer {index} (of {num_layers})"
    return f"{words} of the {unit}" if unit not in ("start",) else f"{words}, before the first layer"


@dataclass
class StepPeak:
    """The peak of an L-layer step from its traces: where, how much by category, and the host bytes."""

    anchor: str
    peak: PhasePeak
    """By category at L layers; `event_index` points into `trace`'s timeline."""
    extra_layer_bytes: dict[str, int]
    host_bytes: int
    trace: StepTrace
    """The trace whose timeline names the buffers alive at the peak."""


def combine(traces: list[StepTrace], num_layers: int, m: int) -> StepPeak:
    """The step's peak at `num_layers` layers: as traced, or extrapolated phase by phase from two traces."""
    if len(traces) == 1:
        t = traces[0]
        phase = t.analysis.events[t.analysis.peak.event_index].phase
        return StepPeak(anchor(phase, num_layers, num_layers) or phase, t.analysis.peak, {}, t.analysis.host_peak, t)
    t1, t2 = traces
    a1, a2 = _anchored(t1, m), _anchored(t2, m)
    best = None
    for name in a1.keys() & a2.keys():
        by_category = {c: _extrapolate(a1[name].by_category[c], a2[name].by_category[c], t1.num_layers,
                                       t2.num_layers, num_layers) for c in CATEGORIES}
        if best is None or sum(by_category.values()) > best.peak.total:
            extra = {c: by_category[c] - a2[name].by_category[c] for c in CATEGORIES}
            best = StepPeak(name, PhasePeak(sum(by_category.values()), by_category, a2[name].event_index), extra, 0, t2)
    best.host_bytes = _extrapolate(t1.analysis.host_peak, t2.analysis.host_peak, t1.num_layers, t2.num_layers,
                                   num_layers)
    return best


TraceJob = tuple
"""The arguments of one `trace.trace_step` call."""
TraceRunner = Callable[[Sequence[TraceJob]], list[StepTrace]]
"""Traces a step for each job, in order (elsewhere and at once, e.g. on an estimate pool's worker processes)."""


def trace_job(job: TraceJob) -> StepTrace:
    """`trace_step(*job)`: what a `TraceRunner` runs for each job (a module-level function: it pickles)."""
    return trace_step(*job)


def estimate(cfg: TrainConfig, machine: Machine, seq_length: int | None = None, exact: bool = False,
             stop_when_over: bool = False, run_traces: TraceRunner | None = None) -> Estimate:
    """Memory of `cfg` (at `seq_length`, default its own) on `machine`; `exact`: per-rank loops traced over
    every rank (`trace.trace_step`), the reference the default is tested against. `stop_when_over`: when the
    fewer traced layers alone are over the GPU's or the host's budget, the step is not traced again with more
    (more layers hold at least as much at every moment, and the budget is no larger): the answer is then those
    bytes, `at_least` (a search that only needs to know what does not fit saves that trace). `run_traces`: the
    step's traces are made together by it (an estimate pool's idle workers: one estimate in the wall time of one
    trace), every one of them, so the answer is never `at_least`; default: here, one after the other.

    With attention outputs kept by only the first N blocks (`--keep-attention-output-layers`), the step with every
    block keeping them is traced: its GPU peak bounds N's from above (every tensor alive with N keeping is alive
    with all keeping, in the same order), and the host holds exactly the arenas of the offloaded blocks that keep
    (one slot each): the others' kept bytes come off. Kept on the GPU (no offload), the step with none keeping
    plus N blocks' outputs bounds it too, and the smaller bound is taken."""
    # The traces need no data; the clock of a packed run reads its documents' lengths from the data (the planner's
    # --data-path), at the planned length.
    timed = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_length=seq_length or cfg.data.seq_length))
    cfg = planning_config(cfg, seq_length)
    cfg.validate(machine.num_gpus)
    spec = cfg.run_spec(machine.num_gpus)
    stack, num_layers = spec.parallelize.memory, spec.model.num_layers
    if stack.keep_attention_layers is None or stack.kept_attention_layers(num_layers) == stack.checkpointed_layers(
            num_layers):
        return _estimate(cfg, machine, timed, exact, stop_when_over, run_traces)
    every = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, keep_attention_output_layers=None))
    e = _estimate(every, machine, timed, exact, run_traces=run_traces)
    per_block = kept_attention_bytes_per_gpu(cfg, spec)
    kept = stack.kept_attention_layers(num_layers)
    not_keeping = stack.offloaded_layers(num_layers) - min(kept, stack.offloaded_layers(num_layers))
    by_category = e.gpu_bytes_by_category
    if not stack.offloads:  # kept on the GPU: no more than none keeping plus N blocks' outputs, at any moment
        none = _estimate(dataclasses.replace(every, memory=dataclasses.replace(every.memory,
                                                                               keep_attention_output=False)), machine, timed,
                         exact, run_traces=run_traces)
        if none.gpu_peak_bytes + kept * per_block < e.gpu_peak_bytes:
            by_category = dict(none.gpu_bytes_by_category)
            by_category["activations"] += kept * per_block
    return dataclasses.replace(e, gpu_bytes_by_category=by_category,
                               host_bytes_per_gpu=e.host_bytes_per_gpu - not_keeping * per_block,
                               time=_time(timed, machine))


def _time(cfg: TrainConfig, machine: Machine) -> StepTime:
    return TimeModel.for_machine(machine, cfg).predict(cfg, machine.num_gpus)


def _estimate(cfg: TrainConfig, machine: Machine, timed: TrainConfig, exact: bool = False,
              stop_when_over: bool = False, run_traces: TraceRunner | None = None) -> Estimate:
    """`timed`: the configuration the step's time is predicted on (`cfg` with the run's data)."""
    start = time.perf_counter()
    spec = cfg.run_spec(machine.num_gpus)
    if spec.parallelize.fsdp.cpu_offload:
        raise ValueError("--fsdp-cpu-offload: the planner does not model FSDP's CPU offload yet")
    counts = traced_layer_counts(spec)
    flash_impl = machine.flash_impl(cfg.parallel.flash_attention_impl, cfg.attention_call()) \
        if machine.device == "cuda" else "default"
    jobs = [(cfg, machine.num_gpus, n, machine.device, machine.flash_attn, flash_impl, exact) for n in counts]
    traces = run_traces(jobs) if run_traces is not None and len(jobs) > 1 else []
    for n, job in zip(counts[len(traces):], jobs[len(traces):]):
        traces.append(trace_job(job))
        if stop_when_over and len(traces) < len(counts):
            fewer = _from_step(cfg, machine, spec, combine(traces, n, n), counts[:1], start, timed)
            if not fewer.fits:
                return dataclasses.replace(fewer, at_least=True)
    step = combine(traces, spec.model.num_layers, anchor_depth(spec))
    return _from_step(cfg, machine, spec, step, counts, start, timed)


def _from_step(cfg: TrainConfig, machine: Machine, spec: RunSpec, step: StepPeak, counts: tuple[int, ...],
               start: float, timed: TrainConfig) -> Estimate:
    """The estimate of a step whose peak is `step` (traced with `counts` layers), NCCL's buffers added."""
    num_layers = spec.model.num_layers
    analysis = step.trace.analysis
    communicators = len(analysis.communicators)
    nccl = nccl_bytes(analysis.communicator_sizes, analysis.all_to_all_groups, machine.nccl,
                      min(machine.gpus_per_node, machine.num_gpus), analysis.point_to_point_groups,
                      ring_on_node=spec.dims.cp <= machine.gpus_per_node) \
        if machine.device == "cuda" else 0
    by_category = dict(step.peak.by_category)
    by_category["communication buffers"] += nccl
    top = step.trace.analysis.top_buffers(step.peak.event_index, lambda d: d == "meta")
    return Estimate(cfg.data.seq_length, by_category, nccl, step.host_bytes, describe_phase(step.anchor, num_layers),
                    top, communicators, counts, machine, time.perf_counter() - start, step.extra_layer_bytes,
                    state_bytes_per_gpu(cfg, machine.num_gpus, spec), _time(timed, machine))


def state_bytes_per_gpu(cfg: TrainConfig, num_gpus: int, spec: RunSpec | None = None) -> int:
    """fp32 weights and Adam state of one rank's FSDP shards (sharded over all but the replicas) that a save
    stages on the host: the weights only where the optimizer's state is on the host already (`spec`: `cfg`'s
    run spec on `num_gpus`, when the caller has it)."""
    spec = spec or cfg.run_spec(num_gpus)
    shards = num_gpus // spec.dims.dp_replicate
    parameters = count_parameters(build_model(spec.model, device="meta"))
    staged = 4 if cfg.optim.optimizer_cpu_offload else machine_terms.STATE_BYTES_PER_PARAMETER
    return -(-parameters // shards) * staged
