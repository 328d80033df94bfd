"""Memory techniques: block checkpointing with host offload, sequence tiling, chunk plans."""

from .recompute import checkpoint_block
from .chunks import ChunkPlan, plan_chunks
from .offload import OffloadHandle, OffloadScheduler
from .tiling import linear_cross_entropy, tiled_linear_cross_entropy, tiled_swiglu_mlp

__all__ = [
    "ChunkPlan",
    "OffloadHandle",
    "OffloadScheduler",
    "checkpoint_block",
    "linear_cross_entropy",
    "plan_chunks",
    "tiled_linear_cross_entropy",
    "tiled_swiglu_mlp",
]
