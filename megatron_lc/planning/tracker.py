"""Memory tracking with a timeline: torch's MemTracker accounting, plus who allocated what, and when.

`MemTracker` (and `FSDPMemTracker` for FSDP2 models) counts the bytes of every tensor
storage by category and keeps the peak. The planner needs three more things from the
same run, which a peak snapshot cannot give:

- the peak of each *phase* of the step (forward or backward of each layer, the loss
  head, the optimizer), so that traces of a few layers extrapolate to many;
- the buffers alive at the peak, with a name (shape, dtype, the op and module that made
  them, or a name given by a kernel stand-in), so the report can say what dominates;
- which process groups the step communicates on (one communication-library
  communicator each).

The tracker records one event per change of MemTracker's byte counts (storage added,
freed, resized or re-categorised) and analyses the log after the step. It extends
MemTracker through the methods that FSDPMemTracker also extends (`_update_snap`,
`_track`, `_update_and_maybe_create_winfos`, `__torch_dispatch__`); those are private,
so this module is the one place that depends on them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from megatron_lc.training.optim import HostAdamW

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "communication buffers", "temporaries")

# MemTracker's and FSDPMemTracker's reference types (by value) -> the planner's categories.
_CATEGORY_OF_REFTYPE = {
    "Parameter": "parameters", "Sharded Param": "parameters", "Unsharded Param": "parameters", "Buffer": "parameters",
    "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "Optstate": "optimizer state", "OptState": "optimizer state",
    "Activation": "activations", "Inputs": "activations", "Other": "activations",
    "Temp": "temporaries",
    "All Gather": "communication buffers", "Reduce Scatter": "communication buffers",
}

_LAYER = re.compile(r"\blayers\.(\d+)\b")
_DEVICE_QUERY = torch.ops.prim.device.default
_PROPAGATION_FUNCTION = "_propagate_tensor_meta_non_cached"
_ALL_TO_ALL_OPS = ("c10d.alltoall_base_", "c10d.alltoall_", "_c10d_functional.all_to_all_single")
_POINT_TO_POINT_OPS = ("c10d.send", "c10d.recv_")


def category_of(reftype) -> str:
    """The planner category of a MemTracker reference type."""
    return _CATEGORY_OF_REFTYPE.get(getattr(reftype, "value", str(reftype)), "temporaries")


@dataclass
class BufferInfo:
    """One tracked storage: its name, where it lives and its category."""

    serial: int
    label: str
    device_type: str
    category: str
    fixed_category: bool = False
    """Set by `name_buffer`/collectives: later MemTracker re-categorisations are ignored."""


@dataclass(frozen=True)
class Event:
    """A change of tracked bytes (or of category, with delta 0) at one point of the step."""

    serial: int
    delta: int
    phase: str
    category: str | None = None
    probe: int = 0
    """Value of the tracker's host-bytes probe at this event (real CPU runs; 0 otherwise)."""


@dataclass
class PhasePeak:
    """Peak accelerator bytes within one phase, by category, and the event where it happened."""

    total: int
    by_category: dict[str, int]
    event_index: int


@dataclass
class TimelineAnalysis:
    """What a tracked step used: accelerator peak (overall and per phase), host peak, live buffers."""

    peak: PhasePeak
    phase_peaks: dict[str, PhasePeak]
    host_peak: int
    buffers: dict[int, BufferInfo] = field(repr=False)
    events: list[Event] = field(repr=False)
    communicator_sizes: dict[str, int] = field(default_factory=dict)
    """Ranks of each group the step communicates on."""
    all_to_all_groups: tuple[str, ...] = ()
    """The groups that carry all-to-all (their NCCL communicators connect every pair of ranks)."""
    point_to_point_groups: tuple[str, ...] = ()
    """The groups that carry send/recv (ring attention: each rank connects to its two neighbours)."""

    @property
    def communicators(self) -> tuple[str, ...]:
        """The groups the step communicates on (one NCCL communicator each)."""
        return tuple(self.communicator_sizes)

    def live_buffers(self, event_index: int, host: Callable[[str], bool]) -> dict[int, int]:
        """serial -> bytes of the accelerator buffers alive just after `event_index`."""
        live: dict[int, int] = {}
        for event in self.events[: event_index + 1]:
            if host(self.buffers[event.serial].device_type):
                continue
            live[event.serial] = live.get(event.serial, 0) + event.delta
        return {s: b for s, b in live.items() if b > 0}

    def top_buffers(self, event_index: int, host: Callable[[str], bool], count: int = 8) -> list[tuple[str, int, int]]:
        """(name, how many, total bytes) of the largest groups of same-named buffers alive at `event_index`."""
        groups: dict[str, list[int]] = {}
        for serial, nbytes in self.live_buffers(event_index, host).items():
            groups.setdefault(_LAYER.sub("layers.N", self.buffers[serial].label), []).append(nbytes)
        ranked = sorted(groups.items(), key=lambda item: -sum(item[1]))
        return [(name, len(sizes), sum(sizes)) for name, sizes in ranked[:count]]


class TimelineMixin:
    """Adds an event log to MemTracker or FSDPMemTracker (use through `make_tracker`)."""

    def _init_timeline(self, host_bytes_probe: Callable[[], int] | None) -> None:
        self._plan_events: list[Event] = []
        self._plan_buffers: dict[int, BufferInfo] = {}
        self._plan_op = "start"
        self._plan_stage = "step"
        self._plan_unit = "start"
        self._plan_groups: dict[str, int] = {}  # name -> ranks
        self._plan_all_to_all: dict[str, None] = {}
        self._plan_point_to_point: dict[str, None] = {}
        self._plan_probe = host_bytes_probe

    # --- what the step is doing now -----------------------------------------------------

    def _plan_phase(self) -> str:
        """'optimizer', or direction and unit: 'fw:layer:3', 'bw:head', ... (the last unit seen sticks)."""
        if self._in_opt:
            return "optimizer"
        unit = _innermost_unit(self._mod_tracker.parents)
        if unit is not None:
            self._plan_unit = unit
        return f"{'bw' if self._mod_tracker.is_bw else 'fw'}:{self._plan_unit}"

    def _plan_module(self) -> str:
        """The innermost active module, without the root's class name ('layers.3.mlp')."""
        parents = [p for p in self._mod_tracker.parents if p != "Global"]
        if not parents:
            return "step"
        innermost = max(parents, key=len)
        return innermost.split(".", 1)[1] if "." in innermost else "model"

    # --- MemTracker extension points -------------------------------------------------------

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        info = self._plan_buffer(winfo)
        kind = u_type.name
        if kind == "ADD":
            delta = winfo.mem_consumed
        elif kind == "DEL":
            delta = -winfo.mem_consumed
        elif kind == "SIZE":
            delta = winfo.mem_consumed - old_mem_consumed
        else:  # REF: a new category, no bytes
            if not info.fixed_category:
                info.category = category_of(winfo.reftype)
                self._plan_log(info.serial, 0, info.category)
            return
        self._plan_log(info.serial, delta)

    def _track(self, reftype, t: torch.Tensor) -> None:
        super()._track(reftype, t)
        self._plan_describe(t)

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype, update_existing: bool = False):
        winfos = super()._update_and_maybe_create_winfos(t, reftype, update_existing)
        self._plan_describe(t)
        return winfos

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY or _in_sharding_propagation():
            # A device query allocates nothing (and is half of all calls). DTensor's sharding propagation
            # runs ops on global-shape fake tensors to infer output metadata: in a real run it uses a fake
            # mode of its own, which MemTracker skips; under the planner's fake mode it would be counted.
            return func(*args, **(kwargs or {}))
        self._plan_op = str(func.overloadpacket)
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if self._plan_op.startswith(("c10d.", "_c10d_functional.")):
            self._plan_note_collective(args, kwargs or {})
        return result

    # --- bookkeeping ----------------------------------------------------------------------

    def _plan_log(self, serial: int, delta: int, category: str | None = None) -> None:
        probe = self._plan_probe() if self._plan_probe is not None else 0
        self._plan_events.append(Event(serial, delta, self._plan_phase(), category, probe))

    def _plan_buffer(self, winfo) -> BufferInfo:
        info = getattr(winfo, "_plan_info", None)
        if info is None:
            serial = len(self._plan_buffers)
            # Buffers tracked outside an op (parameters, gathered parameters, optimizer state) are named by kind.
            origin = getattr(winfo.reftype, "value", str(winfo.reftype)) if self._plan_op == "start" or \
                category_of(winfo.reftype) in ("parameters", "optimizer state") else self._plan_op
            info = BufferInfo(serial, f"{origin.replace('aten.', '')} in {self._plan_module()}", winfo.device.type,
                              category_of(winfo.reftype))
            winfo._plan_info = info
            self._plan_buffers[serial] = info
        return info

    def _plan_describe(self, t: torch.Tensor) -> None:
        """Give a just-tracked buffer its (local) shape and dtype (once)."""
        t = t.to_local() if isinstance(t, DTensor) else t
        for storage in get_untyped_storages(t):
            winfo, _ = self._WINFO.get(storage, (None, None))
            info = getattr(winfo, "_plan_info", None)
            if info is not None and "[" not in info.label:
                info.label = f"{list(t.shape)} {str(t.dtype).replace('torch.', '')} from {info.label}"

    def name_buffer(self, t: torch.Tensor, name: str, category: str | None = None) -> None:
        """Name a tracked tensor's storage (kernel stand-ins name their workspaces) and fix its category."""
        for storage in get_untyped_storages(t):
            winfo, _ = self._WINFO.get(storage, (None, None))
            info = getattr(winfo, "_plan_info", None)
            if info is None:
                continue
            info.label = f"{name} {list(t.shape)} {str(t.dtype).replace('torch.', '')}"
            if category is not None and category != info.category:
                info.category, info.fixed_category = category, True
                self._plan_log(info.serial, 0, category)

    def _plan_note_collective(self, args, kwargs) -> None:
        """Remember the group; name all-to-all buffers (their category stays: the receive buffer often
        becomes the activation itself)."""
        for value in [*args, *kwargs.values()]:
            group = _group_name_and_size(value)
            if group is not None:
                self._plan_groups.setdefault(*group)
                if self._plan_op.startswith(_ALL_TO_ALL_OPS):
                    self._plan_all_to_all.setdefault(group[0])
                elif self._plan_op.startswith(_POINT_TO_POINT_OPS):
                    self._plan_point_to_point.setdefault(group[0])
        if self._plan_op.startswith(_ALL_TO_ALL_OPS):
            tensors = [value for value in args if isinstance(value, torch.Tensor)]
            for tensor, role in zip(tensors, ("all-to-all receive buffer", "all-to-all send buffer")):
                self.name_buffer(tensor, role)

    # --- after the step -----------------------------------------------------------------

    def analyse(self, host: Callable[[str], bool] = lambda device_type: device_type == "meta") -> TimelineAnalysis:
        """Replay the log: accelerator peak overall and per phase, host peak (devices for which `host` is true)."""
        categories = {c: 0 for c in CATEGORIES}
        live: dict[int, int] = {}
        owner: dict[int, str] = {}
        host_now = host_peak = 0
        peak = PhasePeak(0, dict(categories), -1)
        phase_peaks: dict[str, PhasePeak] = {}
        for index, event in enumerate(self._plan_events):
            info = self._plan_buffers[event.serial]
            if host(info.device_type):
                host_now += event.delta
                host_peak = max(host_peak, host_now)
                continue
            old = owner.get(event.serial, info.category)
            new = event.category or old
            if new != old:  # a re-categorised buffer takes its live bytes along
                categories[old] -= live.get(event.serial, 0)
                categories[new] += live.get(event.serial, 0)
            categories[new] += event.delta
            live[event.serial] = live.get(event.serial, 0) + event.delta
            owner[event.serial] = new
            total = sum(categories.values()) - event.probe
            if total > peak.total:
                peak = PhasePeak(total, dict(categories), index)
            best = phase_peaks.get(event.phase)
            if best is None or total > best.total:
                phase_peaks[event.phase] = PhasePeak(total, dict(categories), index)
        host_peak = max(host_peak, max((e.probe for e in self._plan_events), default=0))
        return TimelineAnalysis(peak, phase_peaks, host_peak, dict(self._plan_buffers),
                                list(self._plan_events), dict(self._plan_groups), tuple(self._plan_all_to_all),
                                tuple(self._plan_point_to_point))


def _in_sharding_propagation() -> bool:
    """Whether DTensor is inferring an op's output metadata (a caller is its propagation function)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == _PROPAGATION_FUNCTION:
            return True
        frame = frame.f_back
    return False


def _innermost_unit(parents) -> str | None:
    """'layer:i', 'head' or 'embed' from ModTracker's active module names, or None at the root."""
    unit = None
    for name in parents:
        match = _LAYER.search(name)
        if match:
            return f"layer:{match.group(1)}"
        if name.endswith(".head") or ".head." in name:
            unit = "head"
        elif name.endswith(".embed_tokens") and unit is None:
            unit = "embed"
    return unit


def _group_name_and_size(value) -> tuple[str, int] | None:
    """(name, ranks) of a process group passed to a collective (boxed ProcessGroup, or a functional
    collective's group name)."""
    if isinstance(value, str) and value.isdigit():
        return value, torch.distributed.distributed_c10d._resolve_process_group(value).size()
    if isinstance(value, torch.ScriptObject) and "ProcessGroup" in str(value._type()):
        group = torch.distributed.ProcessGroup.unbox(value)
        return group.group_name, group.size()
    return None


class PlannerMemTracker(TimelineMixin, MemTracker):
    """MemTracker with a timeline (models without FSDP)."""

    def __init__(self, host_bytes_probe: Callable[[], int] | None = None) -> None:
        super().__init__()
        self._init_timeline(host_bytes_probe)


class PlannerFSDPMemTracker(TimelineMixin, FSDPMemTracker):
    """FSDPMemTracker with a timeline (FSDP2 models: it also sees gathered parameters and FSDP's buffers)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 host_bytes_probe: Callable[[], int] | None = None) -> None:
        super().__init__(model, optimizer)
        self._init_timeline(host_bytes_probe)


def make_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 host_bytes_probe: Callable[[], int] | None = None, extra: tuple = ()) -> MemTracker:
    """A timeline tracker for `model`: FSDPMemTracker-based for an FSDP2 model, else MemTracker-based.

    `host_bytes_probe` returns the bytes of tracked tensors that are host memory although
    on the accelerator's device (offload buffers in a real CPU run); they are subtracted
    from the accelerator and counted as host. `extra` tensors are tracked from the start.
    """
    if isinstance(optimizer, HostAdamW):  # the torch optimizer that steps, and the host tensors it steps
        extra = (*extra, *optimizer.host_buffers())
        optimizer = optimizer.inner
    if isinstance(model, FSDPModule):
        tracker = PlannerFSDPMemTracker(model, optimizer, host_bytes_probe)
        if extra:
            tracker.track_inputs(extra)
        return tracker
    tracker = PlannerMemTracker(host_bytes_probe)
    tracker.track_external(model, optimizer, *extra)
    return tracker
