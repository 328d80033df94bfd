"""The machine a plan is for: named nodes with their real figures, and every memory term no trace covers.

A card's memory is what the driver hands out (`cudaMemGetInfo`'s total, the figure in
PyTorch's own out-of-memory message), not the marketing size: an "80 GB" H100 offers
79.11 GiB. From that the planner subtracts the traced step (tensors and NCCL buffers,
see `gpu_allocations.py`) and the terms below, each itemized in the report with how it is
computed and where its figure comes from. Terms marked *assumed* are readings of
sources and public reports that no GPU of ours has measured yet (`tests/gpu/run_gpu_checks.py`
records what is needed to replace them).

The host side is itemized the same way: the kernel's `struct page` array, the driver's
bookkeeping per page-locked page, the training processes, a checkpoint save's staging,
the OS and page cache. What is left holds the offloaded activations.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20
PAGE = 4096
"""x86-64 base page: host memory is page-locked and mapped for the GPU in pages of this size."""


@dataclass(frozen=True)
class Node:
    """One kind of node: its GPUs and host memory, each figure with its source."""

    name: str
    gpu: str
    gpu_memory_gib: float
    gpu_memory_source: str
    gpus_per_node: int
    host_memory_gib: float
    host_memory_source: str
    compute_capability: tuple[int, int] | None = (9, 0)
    """The GPUs' compute capability (None: no GPU): decides FA3 / FA4."""


_OOM_MESSAGE = "PyTorch's out-of-memory message ('GPU 0 has a total capacity of ...', cudaMemGetInfo's total)"
_TWO_TB = "2 TB of system memory (vendor datasheet) = 2,048e9 bytes = 1,907 GiB"

NODES: dict[str, Node] = {
    "dgx-h100": Node("dgx-h100", "H100 SXM5 80GB", 79.11, f"{_OOM_MESSAGE} on H100 80GB HBM3; torch's "
                     "total_memory reads 79.18-79.19 GiB, nvidia-smi 81,559 MiB", 8, 1907.0, f"DGX H100: {_TWO_TB}"),
    "dgx-h200": Node("dgx-h200", "H200 SXM 141GB", 139.72, f"{_OOM_MESSAGE} on H200, the lowest of 139.72-139.81 "
                     "GiB in public reports", 8, 1907.0, f"DGX H200: {_TWO_TB}"),
    "dgx-a100-80gb": Node("dgx-a100-80gb", "A100 SXM4 80GB", 79.15, f"{_OOM_MESSAGE} on A100 80GB, as in public "
                          "reports", 8, 1907.0, f"DGX A100 640GB: {_TWO_TB}", (8, 0)),
}
DEFAULT_NODE = "dgx-h100"


def _local_node() -> Node:
    """This machine, planned as CPU processes (`--machine local`: the planner's validation on CPU)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return Node("local", "this machine's CPU", round(ram, 2), "sysconf: physical pages x page size", 0, round(ram, 2),
                "sysconf: physical pages x page size", None)


NODES["local"] = _local_node()
"""GPUs per node 0: every process of the run is on this machine."""


@dataclass(frozen=True)
class Term:
    """Bytes the traced step does not show, and why they are there."""

    name: str
    nbytes: int
    basis: str
    """How the bytes are computed, and the source of each figure."""
    assumed: bool = True
    """An assumption until a GPU has measured it."""

    def to_json(self) -> dict:
        return {"name": self.name, "gib": round(self.nbytes / GIB, 3), "basis": self.basis, "assumed": self.assumed}


CUDA_CONTEXT_BYTES = int(0.9 * GIB)
"""CUDA context and the kernel images torch, cuBLAS and NCCL load: 0.45-0.9 GiB reported on H100 (the upper end)."""
CUBLAS_WORKSPACE_BYTES = 32 * MIB
"""cuBLAS workspace per handle and stream on sm90 (torch's CublasHandlePool.cpp: 4096 KiB x 8 on Hopper)."""
CUBLAS_STREAMS = 2
"""Streams that run GEMMs: the compute stream, and one more for the autograd engine's or a library's side stream."""
ALLOCATOR_OVERHEAD_BYTES = int(0.5 * GIB)
"""The caching allocator's rounding and partly used pages with expandable segments on (assumed)."""
NO_EXPANDABLE_SEGMENTS_BYTES = int(2.9 * GIB)
"""Fragmentation without expandable segments: a replay of the traced timeline through a model of the caching
allocator's block splitting at the 7M-token headline (assumed)."""
NVLS_BYTES = int(0.25 * GIB)
"""NCCL's NVLink SHARP buffers, on by default on NVSwitch nodes (current NCCL; 2.25 GiB on NCCL <= 2.22).
The recipes export NCCL_NVLS_ENABLE=0."""
NCCL_DEVICE_BYTES_PER_COMMUNICATOR = 64 * MIB
"""NCCL's device-side structures of one communicator: channels, peer info, work FIFOs (assumed)."""
GPU_PTE_BYTES = 8
"""GPU page-table entry per mapped 4 KiB host page (page-locked memory is mapped into the GPU's address space)."""
MODEL_ERROR_BYTES = 1 * GIB
"""Kept free for what the planner gets wrong, until a GPU has measured its error."""

STRUCT_PAGE_BYTES = 64
"""Linux's `struct page` per 4 KiB page of RAM (x86-64): 1.56% of RAM that never appears as usable."""
PINNED_PAGE_BOOKKEEPING_BYTES = 16
"""The NVIDIA driver's kernel memory per page-locked 4 KiB page (assumed, about 6.5-7 GiB per node at 1.7 TB)."""
PROCESS_RESIDENT_BYTES = 8 * GIB
"""Resident memory of one training process: torch, the CUDA driver's host side, NCCL's host buffers, the data
loader (5-10 GiB reported; assumed)."""
OS_AND_PAGE_CACHE_BYTES = 16 * GIB
"""The OS, daemons and the dataset's page cache (assumed)."""
STATE_BYTES_PER_PARAMETER = 12
"""fp32 master weights and Adam's two fp32 moments: what a checkpoint save holds per parameter."""


def gpu_terms(*, host_pinned_bytes_per_gpu: int, communicators: int, expandable_segments: bool = True,
              nvls: bool = False) -> list[Term]:
    """Per-GPU bytes besides the traced tensors and NCCL's traced buffers."""
    allocator = ALLOCATOR_OVERHEAD_BYTES + (0 if expandable_segments else NO_EXPANDABLE_SEGMENTS_BYTES)
    pages = -(-host_pinned_bytes_per_gpu // PAGE)
    return [
        Term("CUDA context and kernel images", CUDA_CONTEXT_BYTES, "0.45-0.9 GiB reported on H100; the upper end"),
        Term("cuBLAS workspaces", CUBLAS_STREAMS * CUBLAS_WORKSPACE_BYTES,
             f"{CUBLAS_STREAMS} streams x 32 MiB per handle and stream on sm90 (torch CublasHandlePool.cpp)"),
        Term("allocator overhead", allocator, "rounding and partly used pages, expandable segments "
             + ("on (the trainer sets it)" if expandable_segments else "OFF: + 2.9 GiB of fragmentation")),
        Term("NCCL NVLS buffers", NVLS_BYTES if nvls else 0,
             "NVLS on: 0.25 GiB (NCCL >= 2.23)" if nvls else "NCCL_NVLS_ENABLE=0, as the recipes export"),
        Term("NCCL device structures", communicators * NCCL_DEVICE_BYTES_PER_COMMUNICATOR,
             f"{communicators} communicator(s) x 64 MiB"),
        Term("page tables of page-locked host memory", pages * GPU_PTE_BYTES,
             f"{GPU_PTE_BYTES} B per 4 KiB page of this rank's {host_pinned_bytes_per_gpu / GIB:.1f} GiB page-locked"),
        Term("model-error margin", MODEL_ERROR_BYTES, "kept free until a GPU has measured the planner's error"),
    ]


def host_terms(*, host_memory_bytes: int, pinned_bytes_per_node: int, processes_per_node: int,
               state_bytes_per_node: int) -> list[Term]:
    """Per-node host bytes besides the offloaded activations."""
    return [
        Term("struct page", host_memory_bytes // PAGE * STRUCT_PAGE_BYTES,
             "64 B per 4 KiB page of RAM (Linux x86-64 memmap)", assumed=False),
        Term("driver bookkeeping of page-locked pages", -(-pinned_bytes_per_node // PAGE) * PINNED_PAGE_BOOKKEEPING_BYTES,
             f"16 B per 4 KiB page of the {pinned_bytes_per_node / GIB:.0f} GiB page-locked"),
        Term("training processes", processes_per_node * PROCESS_RESIDENT_BYTES, f"{processes_per_node} x 8 GiB"),
        Term("checkpoint save staging", state_bytes_per_node,
             "torch.distributed.checkpoint holds each rank's fp32 weights and Adam state on the host while it "
             "writes (12 B per parameter of this node's shards; 4 B, the weights, where the optimizer's state is "
             "on the host already)", assumed=False),
        Term("OS and page cache", OS_AND_PAGE_CACHE_BYTES, "the OS, daemons and the dataset's page cache"),
    ]


def total(terms: list[Term]) -> int:
    return sum(t.nbytes for t in terms)
