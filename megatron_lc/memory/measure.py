"""Measured memory of a piece of work, by category: the one wrapper around torch's MemTracker.

`torch.distributed._tools.mem_tracker` is private; everything in the project that measures
memory goes through `measure_peak`, so a change in that module is fixed here only.
Tensors that exist before the measurement (weights, a warmed-up offload pool) are only
counted when passed in `track`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch.distributed._tools.mem_tracker import MemTracker

_CATEGORY_NAMES = {"PARAM": "parameters", "BUFFER": "buffers", "GRAD": "gradients", "ACT": "activations",
                   "TEMP": "temporaries", "OPT": "optimizer_state", "OTH": "other", "Total": "total"}


@dataclass
class MemoryPeak:
    """Bytes by category at the moment the total peaked, per device ('cpu', 'cuda:0', 'meta', ...)."""

    by_device: dict[str, dict[str, int]]

    def total(self, device: str = "cpu") -> int:
        return self.by_device.get(device, {}).get("total", 0)

    def category(self, name: str, device: str = "cpu") -> int:
        return self.by_device.get(device, {}).get(name, 0)


def _category_name(key) -> str:
    raw = str(key).rsplit(".", 1)[-1]
    return _CATEGORY_NAMES.get(raw, raw.lower())


def measure_peak(work: Callable[[], object], *track) -> MemoryPeak:
    """Run `work()` under the tracker; `track` are modules/optimizers whose existing tensors count."""
    tracker = MemTracker()
    if track:
        tracker.track_external(*track)
    with tracker:
        work()
    snapshot = tracker.get_tracker_snapshot("peak")
    return MemoryPeak({str(dev): {_category_name(k): int(v) for k, v in cats.items()}
                       for dev, cats in snapshot.items()})
