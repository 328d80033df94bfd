"""The one place code takes its devices from.

Training uses two devices: the accelerator that runs the step (cuda, or cpu in tests)
and the host that holds offloaded activations (cpu). The memory planner swaps both for
fake devices so its tracker can tell accelerator bytes from host bytes.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from megatron_lc.errors import ConfigError


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


PEAK_DENSE_BF16_FLOPS: dict[str, tuple[float, str]] = {
    "H100": (989.4e12, "NVIDIA H100 SXM5 datasheet"),
    "H100 PCIe": (756e12, "NVIDIA H100 datasheet, PCIe column (1,513 TFLOP/s with sparsity: half of it dense)"),
    "H100 NVL": (835.5e12, "NVIDIA H100 datasheet, NVL column, per GPU (1,671 TFLOP/s with sparsity: half dense)"),
    "H800 PCIe": (756e12, "NVIDIA H800 PCIe (the H100 PCIe's compute)"),
    "H200": (989.4e12, "NVIDIA H200 datasheet (the H100 SXM5's compute)"),
    "H800": (989.4e12, "NVIDIA H800 SXM5 (the H100 SXM5's compute)"),
    "A100": (312e12, "NVIDIA A100 datasheet"),
    "B200": (2250e12, "NVIDIA DGX B200 datasheet (72 PFLOP/s sparse FP8 per 8 GPUs: 2.25 PFLOP/s dense BF16 each)"),
}
"""Dense bf16 peak per accelerator (the name as `torch.cuda.get_device_name` contains it, e.g. "NVIDIA H100 80GB
HBM3" for the SXM card, "NVIDIA H100 PCIe"), with its source: what MFU is measured against, and what the time
model's rates start from."""


def peak_dense_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of the accelerator named `device_name` (the most specific entry it contains: a PCIe
    card is not measured against the SXM peak), or None when it is not in the table."""
    keys = [key for key in PEAK_DENSE_BF16_FLOPS if key in device_name]
    return PEAK_DENSE_BF16_FLOPS[max(keys, key=len)][0] if keys else None


def cuda_index(local_rank: int, visible: int) -> int:
    """The GPU this process uses among the `visible` ones: its local rank's, or the only one it sees (a
    scheduler binding one GPU per task, e.g. `srun --gpus-per-task=1`, shows each task its own as cuda:0)."""
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise ConfigError(f"local rank {local_rank} sees {visible} GPUs (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give each task one GPU, or run "
                          "as many tasks per node as it sees")
    return local_rank


def resolve_devices(name: str = "auto", local_rank: int = 0) -> Devices:
    """Devices for `--device NAME`: 'auto' picks CUDA when available, else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but torch.cuda.is_available() is False")
        return Devices(torch.device("cuda", cuda_index(local_rank, torch.cuda.device_count())), torch.device("cpu"))
    if name == "cpu":
        return Devices(torch.device("cpu"), torch.device("cpu"))
    raise ValueError(f"--device {name!r}: expected one of auto, cuda, cpu")


# --- the CUDA caching allocator ---------------------------------------------------------------

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
"""The variable every torch version reads for the CUDA allocator. torch >= 2.9 reads PYTORCH_ALLOC_CONF
first (c10/core/AllocatorConfig.h): when a user set that one, it is merged the same way."""
_ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", ALLOC_CONF)  # the order torch >= 2.9 reads them in
_warned_expandable_off: set[str] = set()


def _split_settings(value: str) -> list[str]:
    """`key:value` items of an allocator setting; commas inside [...] (roundup_power2_divisions) stay."""
    items, depth, current = [], 0, ""
    for ch in value:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    return [i.strip() for i in [*items, current] if i.strip()]


def with_expandable_segments(value: str | None) -> tuple[str, bool]:
    """(`value` with expandable_segments:True added, False); (`value`, True) when it turns them off.

    Expandable segments let one segment grow instead of leaving holes between fixed ones: the
    memory planner's figures assume them.
    """
    items = _split_settings(value or "")
    settings = dict(item.replace(" ", "").split(":", 1) for item in items if ":" in item)
    if "expandable_segments" in settings:
        return ",".join(items), settings["expandable_segments"] != "True"
    return ",".join([*items, "expandable_segments:True"]), False


def set_cuda_allocator_settings(env=os.environ) -> None:
    """Turn expandable segments on in the allocator settings, keeping the user's other keys; a user's
    explicit expandable_segments:False is kept, with one warning per process.

    torch reads the variable when CUDA initialises; if that already happened (a library touched
    CUDA first) the merged setting is also applied to the running allocator (its new segments).
    """
    names = [n for n in _ALLOC_CONF_VARIABLES if n in env] or [ALLOC_CONF]
    for name in names:
        env[name], turned_off = with_expandable_segments(env.get(name))
        if turned_off and name not in _warned_expandable_off:
            _warned_expandable_off.add(name)
            warnings.warn(f"{name}={env[name]} keeps expandable_segments off: the memory plan assumes them on; "
                          "without them allocator fragmentation can take several GiB per GPU at million-token "
                          "lengths", stacklevel=2)
    in_effect = names[0]
    if not with_expandable_segments(env[in_effect])[1] and torch.cuda.is_available() and torch.cuda.is_initialized():
        _apply_allocator_settings(env[in_effect])


def _apply_allocator_settings(setting: str) -> None:
    """The one use of torch's private runtime setter: torch._C._accelerator_setAllocatorSettings (torch >= 2.9,
    which torch.cuda.memory._set_allocator_settings wraps there with a deprecation warning), else the wrapper."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)
