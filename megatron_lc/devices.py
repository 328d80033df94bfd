"""The one place code takes its devices from.

Training uses two devices: the accelerator that runs the step (cuda, or cpu in tests)
and the host that holds offloaded activations (cpu). The memory planner swaps both for
fake devices so its tracker can tell accelerator bytes from host bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Devices:
    """Where the step runs and where offloaded tensors live."""

    accelerator: torch.device
    """Device of parameters, activations and kernels."""
    host: torch.device
    """Device that receives offloaded activations (pinned when the accelerator is CUDA)."""

    @property
    def is_cuda(self) -> bool:
        return self.accelerator.type == "cuda"


def resolve_devices(name: str = "auto", local_rank: int = 0) -> Devices:
    """Devices for `--device NAME`: 'auto' picks CUDA when available, else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but torch.cuda.is_available() is False")
        return Devices(torch.device("cuda", local_rank), torch.device("cpu"))
    if name == "cpu":
        return Devices(torch.device("cpu"), torch.device("cpu"))
    raise ValueError(f"--device {name!r}: expected one of auto, cuda, cpu")
