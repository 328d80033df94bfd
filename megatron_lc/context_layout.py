"""Which tokens of a sequence each context-parallel rank holds.

Context parallelism has two levels (`--cp-comm-type`): an all-to-all level of
`a2a_size` contiguous ranks (Ulysses or Untied Ulysses, inside a node) and a ring of
`ring_size` such groups (ring attention, across nodes). `cp = a2a_size x ring_size`
and cp rank `c` is ring rank `c // a2a_size`, all-to-all rank `c % a2a_size`.

Without a ring the sequence is cut into `cp` contiguous slices, rank c holding slice c.
With one, causal attention would give the last ring rank all the work, so the sequence
is cut into `2 x ring_size` chunks and ring rank r holds chunks r and 2R-1-r: every
ring rank then attends over the same number of (query, key) pairs. Inside a ring
rank, its two chunks back to back are cut into `a2a_size` equal slices, one per
all-to-all rank; an all-to-all gathers them back in order, so attention sees the ring
rank's chunks as one [chunk r, chunk 2R-1-r] block per sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CP_COMM_TYPES = ("a2a", "p2p", "a2a+p2p")
"""`--cp-comm-type` values, as Megatron-LM names them: all-to-all, ring (point-to-point), both."""


@dataclass(frozen=True)
class ContextLayout:
    """The two levels of context parallelism and the token ranges they give each rank."""

    a2a_size: int = 1
    """Ranks of one all-to-all group (contiguous ranks: one node)."""
    ring_size: int = 1
    """Groups in the ring."""

    def __post_init__(self) -> None:
        if self.a2a_size < 1 or self.ring_size < 1:
            raise ValueError(f"context-parallel sizes must be >= 1, got a2a {self.a2a_size} x ring {self.ring_size}")

    @property
    def cp_size(self) -> int:
        return self.a2a_size * self.ring_size

    @property
    def comm_type(self) -> str:
        """The `--cp-comm-type` this layout is (a2a for one rank: nothing to exchange)."""
        if self.ring_size == 1:
            return "a2a"
        return "p2p" if self.a2a_size == 1 else "a2a+p2p"

    def seq_length_multiple(self) -> int:
        """What `--seq-length` must be a multiple of: cp, and with a ring 2R chunks that split over the group."""
        if self.ring_size == 1:
            return self.a2a_size
        return self.ring_size * math.lcm(2, self.a2a_size)

    def check(self, seq_length: int) -> None:
        """Refuse a sequence length the layout cannot cut evenly, naming the flags."""
        multiple = self.seq_length_multiple()
        if seq_length % multiple:
            why = (f"--context-parallel-size {self.cp_size}" if self.ring_size == 1 else
                   f"{self.ring_size} ring ranks x 2 chunks, each ring rank's share split over {self.a2a_size} "
                   "all-to-all ranks")
            raise ValueError(f"--seq-length {seq_length} is not divisible by {multiple} ({why}); "
                             f"use a multiple of {multiple}")

    def ring_chunks(self, ring_rank: int) -> tuple[int, int]:
        """The two chunk indices ring rank `ring_rank` holds (load-balanced causal split)."""
        return ring_rank, 2 * self.ring_size - 1 - ring_rank

    def token_ranges(self, seq_length: int, cp_rank: int) -> tuple[tuple[int, int], ...]:
        """Sequence positions `[start, stop)` of cp rank `cp_rank`, in the order the rank holds them."""
        if not 0 <= cp_rank < self.cp_size:
            raise ValueError(f"cp_rank {cp_rank} is not a rank of a context-parallel group of size {self.cp_size}")
        self.check(seq_length)
        local = seq_length // self.cp_size
        if self.ring_size == 1:
            return ((cp_rank * local, (cp_rank + 1) * local),)
        ring_rank, a2a_rank = divmod(cp_rank, self.a2a_size)
        chunk = seq_length // (2 * self.ring_size)
        first, stop = a2a_rank * local, (a2a_rank + 1) * local  # in the ring rank's [chunk r, chunk 2R-1-r]
        ranges = []
        for slot, index in enumerate(self.ring_chunks(ring_rank)):
            low, high = max(first, slot * chunk), min(stop, (slot + 1) * chunk)
            if high > low:
                ranges.append((index * chunk + low - slot * chunk, index * chunk + high - slot * chunk))
        return tuple(ranges)


def context_layout_from_flags(cp_size: int, comm_type: str = "a2a",
                              hierarchical_sizes: tuple[int, ...] | list[int] | None = None) -> ContextLayout:
    """The layout of `--context-parallel-size`, `--cp-comm-type` and `--hierarchical-context-parallel-sizes`."""
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type!r}: expected one of {', '.join(CP_COMM_TYPES)}")
    if comm_type != "a2a+p2p":
        if hierarchical_sizes:
            raise ValueError(f"--hierarchical-context-parallel-sizes is for --cp-comm-type a2a+p2p, "
                             f"not {comm_type}")
        return ContextLayout(a2a_size=cp_size) if comm_type == "a2a" else ContextLayout(ring_size=cp_size)
    if not hierarchical_sizes or len(hierarchical_sizes) != 2:
        raise ValueError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A R: the all-to-all "
                         f"degree (ranks of a node) and the ring degree, A x R = --context-parallel-size {cp_size}")
    a2a, ring = (int(n) for n in hierarchical_sizes)
    if a2a < 1 or ring < 1 or a2a * ring != cp_size:
        raise ValueError(f"--hierarchical-context-parallel-sizes {a2a} {ring}: the product must be "
                         f"--context-parallel-size {cp_size}")
    return ContextLayout(a2a_size=a2a, ring_size=ring)
