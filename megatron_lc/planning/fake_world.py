"""What makes one rank's training step traceable on a laptop: a fake world and short tile loops.

- `fake_process_group`: a default process group of any size that moves no data, so
  DeviceMesh, FSDP2 and the context-parallel collectives run as on rank 0 of the real
  world. It is torch's test backend (`torch.testing._internal.distributed.fake_pg`), a
  private API: this function is the one place that uses it.
- `representative_tile_bounds`: a tile policy (passed to `parallelize_llama` through
  `ParallelizeOptions.tile_bounds`) under which every sequence-tile loop runs over two of
  its tiles, the largest among them. Tile buffers are allocated and freed
  tile by tile while the full-size inputs, outputs and gradient accumulators exist
  before the loop, so the memory peak of a loop is the peak of its largest tile: two
  tiles give the exact peak (and keep the "more than one tile" code paths), at the cost
  of two tiles instead of hundreds (5M tokens on 8 ranks: 160 MLP and 314 loss tiles).
- `representative_ranks`: the same for Untied Ulysses' per-rank projection loops (one GEMM per rank of the
  cp group into a slice of a buffer allocated before the loop; each iteration's temporaries are freed in the
  next): two ranks give the loop's exact peak, and cut a traced Untied step's operations by half (they are
  most of them: 8 ranks x samples x stages x layers). `--exact` traces every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from megatron_lc.memory import tiling


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group of `world_size` ranks seen from rank 0; nothing for one rank."""
    if world_size == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,  # registers the "fake" backend
    )

    if dist.is_initialized():
        raise RuntimeError("the memory planner needs its own process group, but one is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def representative_ranks(cp: int) -> range:
    """A rank-loop policy (`memory.tiling.RankLoop`) that runs the first two ranks (all of a group of one)."""
    return range(min(cp, 2))


def representative_tile_bounds(rows: int, num_tiles: int) -> Iterator[tuple[int, int]]:
    """A tile policy (`memory.tiling.TileBounds`) that runs the largest tile and one neighbour, in order."""
    tiles = list(tiling.tile_bounds(rows, num_tiles))
    if len(tiles) <= 2:
        yield from tiles
        return
    largest = max(range(len(tiles)), key=lambda i: tiles[i][1] - tiles[i][0])
    neighbour = largest + 1 if largest + 1 < len(tiles) else largest - 1
    for i in sorted((largest, neighbour)):
        yield tiles[i]
