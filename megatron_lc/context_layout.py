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

Packed samples hold many documents, each attending to itself only; chunks of the sequence then leave
whole documents where they fall, and the ring ranks' work differs by the documents each got. The
document layout (`--cp-document-layout`) cuts a ring by documents instead (`SampleCut`): `split`
cuts every document head-tail into 2R pieces, ring rank r holding pieces r and 2R-1-r of each (light
documents too short for pieces of `MIN_PIECE` tokens stay whole); `local` keeps the documents whose
whole attention is small beside a ring rank's share (`LOCAL_SHARE`) whole on one ring rank, balanced
by their work, and cuts only the others head-tail. The pieces of each document are sized so that every
ring rank holds exactly S/R tokens: the documents kept whole never fill the ranks evenly, and the cut
ones absorb the difference, each ring rank's rows of them split between its head and its tail pieces
so that its work is the mean (a head row has fewer earlier keys than a tail row: `_ring_heads`). A
ring rank holds, per sample, [its first pieces of the cut documents | its second pieces | the
documents it holds whole]; only the first two travel the ring (`sent_rows`).
`sequence` is the sequence's chunks above, whatever its documents.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

CP_COMM_TYPES = ("a2a", "p2p", "a2a+p2p")
"""`--cp-comm-type` values, as Megatron-LM names them: all-to-all, ring (point-to-point), both."""
DocumentLayout = Literal["sequence", "split", "local"]
DOCUMENT_LAYOUTS: tuple[str, ...] = get_args(DocumentLayout)
MIN_PIECE = 128
"""`split` keeps a document whole when its 2R pieces would get fewer tokens than this (a flash-attention tile of rows:
a shorter piece costs a call segment and a tile for little work; cutting chat turns into pieces of a few tokens made
the CPU kernels' time 1.9x Ulysses' on the same pairs, bench/bench_packed_sft.py) and its work is light enough for the
ring's balance (`LOCAL_SHARE`)."""
LOCAL_SHARE = 0.05
"""`local`: a document stays whole on one ring rank when its attention pairs are at most this share of a ring
rank's mean: balancing whole documents by their work (largest first) then leaves the ring ranks' whole work within
about this share of each other, which the head/tail split of their cut rows (`_ring_heads`) makes up."""


@dataclass(frozen=True)
class ContextLayout:
    """The two levels of context parallelism and the token ranges they give each rank."""

    a2a_size: int = 1
    """Ranks of one all-to-all group (contiguous ranks: one node)."""
    ring_size: int = 1
    """Groups in the ring."""
    documents: DocumentLayout = "sequence"
    """How a ring cuts a sample of several documents (see the module docstring); nothing changes without a ring:
    all-to-all ranks attend over the whole sequence, their share of the heads each."""

    def __post_init__(self) -> None:
        if self.a2a_size < 1 or self.ring_size < 1:
            raise ValueError(f"context-parallel sizes must be >= 1, got a2a {self.a2a_size} x ring {self.ring_size}")
        if self.documents not in DOCUMENT_LAYOUTS:
            raise ValueError(f"--cp-document-layout {self.documents!r}: expected one of {', '.join(DOCUMENT_LAYOUTS)}")

    @property
    def cuts_documents(self) -> bool:
        """Whether a sample's documents decide what each ring rank holds."""
        return self.ring_size > 1 and self.documents != "sequence"

    def sample_cut(self, seq_length: int, cu_seqlens: Sequence[int]) -> SampleCut:
        """How one sample's documents (`cu_seqlens`: its boundaries, 0 ... seq_length) are cut over the ring."""
        return cut_sample(tuple(int(b) for b in cu_seqlens), seq_length, self.ring_size, self.documents)

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

    def token_ranges(self, seq_length: int, cp_rank: int, cu_seqlens: Sequence[int] | None = None
                     ) -> tuple[tuple[int, int], ...]:
        """Sequence positions `[start, stop)` of cp rank `cp_rank`, in the order the rank holds them; a document
        layout needs the sample's document boundaries `cu_seqlens`."""
        if not 0 <= cp_rank < self.cp_size:
            raise ValueError(f"cp_rank {cp_rank} is not a rank of a context-parallel group of size {self.cp_size}")
        self.check(seq_length)
        local = seq_length // self.cp_size
        if self.ring_size == 1:
            return ((cp_rank * local, (cp_rank + 1) * local),)
        ring_rank, a2a_rank = divmod(cp_rank, self.a2a_size)
        if self.cuts_documents:
            if cu_seqlens is None:
                raise ValueError(f"--cp-document-layout {self.documents} cuts by documents: the sample's "
                                 "boundaries are needed")
            rows = self.sample_cut(seq_length, cu_seqlens).ring_rows(ring_rank)
            return slice_ranges(rows, a2a_rank * local, (a2a_rank + 1) * local)
        chunk = seq_length // (2 * self.ring_size)
        first, stop = a2a_rank * local, (a2a_rank + 1) * local  # in the ring rank's [chunk r, chunk 2R-1-r]
        ranges = []
        for slot, index in enumerate(self.ring_chunks(ring_rank)):
            low, high = max(first, slot * chunk), min(stop, (slot + 1) * chunk)
            if high > low:
                ranges.append((index * chunk + low - slot * chunk, index * chunk + high - slot * chunk))
        return tuple(ranges)


def context_layout_from_flags(cp_size: int, comm_type: str = "a2a",
                              hierarchical_sizes: tuple[int, ...] | list[int] | None = None,
                              documents: str = "sequence") -> ContextLayout:
    """The layout of `--context-parallel-size`, `--cp-comm-type`, `--hierarchical-context-parallel-sizes` and
    `--cp-document-layout`."""
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type!r}: expected one of {', '.join(CP_COMM_TYPES)}")
    if comm_type != "a2a+p2p":
        if hierarchical_sizes:
            raise ValueError(f"--hierarchical-context-parallel-sizes is for --cp-comm-type a2a+p2p, "
                             f"not {comm_type}")
        return ContextLayout(a2a_size=cp_size, documents=documents) if comm_type == "a2a" else \
            ContextLayout(ring_size=cp_size, documents=documents)
    if not hierarchical_sizes or len(hierarchical_sizes) != 2:
        raise ValueError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A R: the all-to-all "
                         f"degree (ranks of a node) and the ring degree, A x R = --context-parallel-size {cp_size}")
    a2a, ring = (int(n) for n in hierarchical_sizes)
    if a2a < 1 or ring < 1 or a2a * ring != cp_size:
        raise ValueError(f"--hierarchical-context-parallel-sizes {a2a} {ring}: the product must be "
                         f"--context-parallel-size {cp_size}")
    return ContextLayout(a2a_size=a2a, ring_size=ring, documents=documents)


def slice_ranges(ranges: Sequence[tuple[int, int]], low: int, high: int) -> tuple[tuple[int, int], ...]:
    """The positions of rows `[low, high)` of the rows `ranges` lay out back to back, as ranges."""
    out, row = [], 0
    for start, stop in ranges:
        a, b = max(low, row), min(high, row + stop - start)
        if b > a:
            out.append((start + a - row, start + b - row))
        row += stop - start
    return tuple(out)


def _piece_pairs(offset: int, length: int) -> int:
    """Causal (query, key) pairs of `length` queries starting `offset` tokens into their document: every earlier
    key of the document and itself."""
    return length * offset + length * (length + 1) // 2


@dataclass(frozen=True)
class SampleCut:
    """How one sample's documents lie over a ring of `ring_size` ranks (a document layout)."""

    ring_size: int
    seq_length: int
    boundaries: tuple[int, ...]
    """The sample's documents (padding one of them): 0, ..., seq_length."""
    cut: tuple[int, ...]
    """The documents cut head-tail over the ring, in sample order."""
    cut_points: tuple[tuple[int, ...], ...]
    """Per cut document, the 2R + 1 positions bounding its pieces (piece j: `[p[j], p[j+1])`; some may be empty)."""
    owners: tuple[int, ...]
    """Per document, the ring rank holding it whole; -1 when it is cut."""

    def _pieces(self, slot: int) -> tuple[tuple[int, int], ...]:
        return tuple((p[slot], p[slot + 1]) for p in self.cut_points)

    def first_pieces(self, ring_rank: int) -> tuple[tuple[int, int], ...]:
        """Ring rank `ring_rank`'s head pieces of the cut documents (piece r of each), in order."""
        return self._pieces(ring_rank)

    def second_pieces(self, ring_rank: int) -> tuple[tuple[int, int], ...]:
        """Its tail pieces (piece 2R-1-r of each)."""
        return self._pieces(2 * self.ring_size - 1 - ring_rank)

    def whole_documents(self, ring_rank: int) -> tuple[tuple[int, int], ...]:
        b = self.boundaries
        return tuple((b[i], b[i + 1]) for i, owner in enumerate(self.owners) if owner == ring_rank)

    def ring_rows(self, ring_rank: int) -> tuple[tuple[int, int], ...]:
        """The positions ring rank `ring_rank` holds, in its order: head pieces, tail pieces, whole documents."""
        pieces = self.first_pieces(ring_rank) + self.second_pieces(ring_rank) + self.whole_documents(ring_rank)
        return tuple((a, b) for a, b in pieces if b > a)

    def cut_rows(self, ring_rank: int) -> int:
        """Rows of cut documents ring rank `ring_rank` holds (the first rows of its share)."""
        return sum(b - a for a, b in self.first_pieces(ring_rank) + self.second_pieces(ring_rank))

    @property
    def sent_rows(self) -> int:
        """Rows each ring rank's keys and values travel with: the most cut rows any ring rank holds (equal on
        every rank, so every hop exchanges one shape)."""
        return max(self.cut_rows(r) for r in range(self.ring_size))

    def segments(self, ring_rank: int) -> int:
        """Document segments of ring rank `ring_rank`'s calls in one forward: its own call's pieces and whole
        documents, and over the ring's steps each query piece with a key piece of its document before it (its tail
        over every rank's head, its head over earlier ranks' heads, its tail over later ranks' tails)."""
        R, r = self.ring_size, ring_rank
        head, tail = self._pieces(r), self._pieces(2 * R - 1 - r)
        count = len(self.ring_rows(r))
        for kv in range(R):
            k_head, k_tail = self._pieces(kv), self._pieces(2 * R - 1 - kv)
            over = [(tail, k_head)] + ([(head, k_head)] if kv < r else [(tail, k_tail)] if kv > r else [])
            count += sum(1 for q, k in over for (a, b), (c, d) in zip(q, k) if b > a and d > c)
        return count

    def pairs(self, ring_rank: int) -> int:
        """Causal (query, key) pairs the attention of ring rank `ring_rank`'s queries computes."""
        starts = [self.boundaries[i] for i in self.cut]
        total = sum(_piece_pairs(0, b - a) for a, b in self.whole_documents(ring_rank))
        for start, (a, b) in zip(starts * 2, self.first_pieces(ring_rank) + self.second_pieces(ring_rank)):
            total += _piece_pairs(a - start, b - a)
        return total


@functools.lru_cache(maxsize=256)
def cut_sample(boundaries: tuple[int, ...], seq_length: int, ring_size: int, documents: str) -> SampleCut:
    """Cut one sample's documents over a ring (`ContextLayout.sample_cut`): see the module docstring."""
    if documents not in ("split", "local"):
        raise ValueError(f"cut_sample cuts by documents (split or local), not {documents!r}")
    if boundaries[0] != 0 or boundaries[-1] != seq_length or any(b <= a for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"document boundaries must rise from 0 to --seq-length {seq_length}, got "
                         f"{boundaries[:4]}...{boundaries[-2:]}")
    R = ring_size
    capacity = seq_length // R
    lengths = [b - a for a, b in zip(boundaries, boundaries[1:])]
    pairs = [_piece_pairs(0, n) for n in lengths]
    limit = LOCAL_SHARE * sum(pairs) / R
    light = [p <= limit and n <= capacity for p, n in zip(pairs, lengths)]  # whole, it cannot unbalance the ring
    if documents == "split":  # only where its pieces would be below a tile
        whole = [w and n < 2 * R * MIN_PIECE for w, n in zip(light, lengths)]
    else:
        whole = light
    owners = [-1] * len(lengths)
    work, tokens = [0] * R, [0] * R
    # Whole documents by work, largest first, each to the ring rank with the least work among those it keeps
    # within an even share of the whole documents' tokens (one that fits none is cut instead): the cut documents
    # then give every ring rank about the same rows, and with them the same work. (A share of one more document
    # let the whole documents' tokens drift, and the cut rows that fill each rank with them: 1.2-1.4x max/mean
    # pairs on 32-64 ranks at 1M tokens, against 1.01-1.04 so.)
    kept = [i for i, w in enumerate(whole) if w]
    share = min(capacity, -(-sum(lengths[i] for i in kept) // R))
    for i in sorted(kept, key=lambda i: (-pairs[i], i)):
        fits = [r for r in range(R) if tokens[r] + lengths[i] <= share]
        if not fits:
            continue  # cut instead
        r = min(fits, key=lambda r: (work[r], tokens[r], r))
        owners[i], work[r], tokens[r] = r, work[r] + pairs[i], tokens[r] + lengths[i]
    if all(o >= 0 for o in owners) and any(t != capacity for t in tokens):
        largest = max(range(len(lengths)), key=lambda i: (lengths[i], -i))  # something must absorb the difference
        tokens[owners[largest]] -= lengths[largest]
        work[owners[largest]] -= pairs[largest]
        owners[largest] = -1
    cut = tuple(i for i, o in enumerate(owners) if o < 0)
    need = [capacity - t for t in tokens]  # rows of cut documents each whole-document bin needs for its S/R
    cut_lengths = [lengths[i] for i in cut]
    mean = sum(pairs) / R
    order, heads = _ring_heads(need, [mean - w for w in work], cut_lengths)
    slots = [0] * (2 * R)
    for position, (r, head) in enumerate(zip(order, heads)):
        slots[position], slots[2 * R - 1 - position] = head, need[r] - head
    ring_rank = {r: position for position, r in enumerate(order)}
    cut_points = tuple(tuple(boundaries[i] + p for p in row)
                       for i, row in zip(cut, _cut_points(cut_lengths, slots)))
    return SampleCut(R, seq_length, boundaries, cut, cut_points,
                     tuple(ring_rank[o] if o >= 0 else -1 for o in owners))


def _ring_heads(need: list[int], cut_work: list[float], lengths: list[int]) -> tuple[list[int], list[int]]:
    """Which whole-document bin each ring rank is (`order[position]`) and how many of its `need` cut rows are head
    rows (`heads[position]`; the rest are tail rows), so that every bin gets its `cut_work` pairs of the cut
    documents (`lengths`).

    Why: the whole documents hold far fewer pairs per token than the cut ones (they are the light ones), and
    they never fill the bins' tokens evenly (a bin of 512 tokens cannot split a document of 600), so a bin with
    fewer whole tokens needs more cut rows; with every rank's rows shared half head, half tail, its work grows
    with its rows (1.07-1.17x the mean on the worst samples). A head row costs less than a tail row (fewer
    earlier keys), so the head/tail split sets each rank's work without changing its tokens.

    Each cut document is cut in proportion to the slots (`_cut_points`): the pieces of slot j together then hold
    K/2 (P[j+1]^2 - P[j]^2) + s[j]/2 pairs, where P[j] is the rows of slots before j, s[j] = P[j+1] - P[j] and
    K = sum(n^2) / (sum n)^2. A ring rank in position q holds slots q and 2R-1-q; given the slots outside them,
    its work is linear in its head rows (more head rows: less work), so the positions are solved from the
    outside in, each exactly where [0, need] allows. The outer positions have the widest range (their slots
    frame every other), the innermost none (its slots are adjacent: it gets what is left, which is its share
    when all the others got theirs), so the bins that need the most correction go outermost."""
    total = sum(lengths)
    R = len(need)
    if not total:
        return list(range(R)), [0] * R
    K = sum(n * n for n in lengths) / total ** 2
    # In units of K/2: the sum of P^2 differences each bin's two slots must span.
    span = {r: 2 * (w - n / 2) / K for r, (w, n) in enumerate(zip(cut_work, need))}
    order, heads, low, high = [], [], 0, total  # rows of the slots placed: [0, low) and [high, total)
    while span:
        rows = sum(need[r] for r in span)
        centre = sum(span.values()) / rows if rows else 0.0  # where rows cost their mean: high + low
        r = max(span, key=lambda b: (abs(span[b] - need[b] * centre), -b))
        n, target = need[r], span.pop(r)
        middle = rows - n  # rows of the positions still inside this one's slots
        if middle:  # target = (low + x)^2 - low^2 + high^2 - (high - n + x)^2, linear in x
            x = (target - high * high + (high - n) ** 2) / (2 * (low - high + n))
            head = min(n, max(0, round(x)))
        else:
            head = n // 2
        order.append(r)
        heads.append(head)
        low, high = low + head, high - (n - head)
    return order, heads


def _cut_points(lengths: list[int], slots: list[int]) -> list[tuple[int, ...]]:
    """Each document's 2R + 1 cut points (from 0, relative to its start) over the slots, in proportion: point j
    is its length x (rows of slots before j) / (rows of all slots), rounded so that the points at j add up to the
    slots' rows before j and never fall back (a piece is never negative). Rounded at each point rather than each
    piece, a document's pieces start within a row of where they should (two where an earlier point rounded up
    holds a later one), and their start is what their work depends on: rounding each slot's remainder onto one
    document at a time (as a transport's northwest corner does) moved pieces of a few rows by tens of
    rows, 1.08x max/mean pairs on 64 ranks at 32K with no whole document."""
    total = sum(lengths)
    if total != sum(slots):
        raise ValueError(f"documents of {total} rows for slots of {sum(slots)}")
    points = [[0] for _ in lengths]
    boundary = 0
    for size in slots[:-1]:
        boundary += size
        ideal = [n * boundary / total for n in lengths]
        lower = [p[-1] for p in points]
        point = [min(n, max(lo, math.floor(c))) for n, lo, c in zip(lengths, lower, ideal)]
        left = boundary - sum(point)
        while left:
            step = 1 if left > 0 else -1
            room = [i for i, (p, n, lo) in enumerate(zip(point, lengths, lower)) if (p < n if step > 0 else p > lo)]
            room.sort(key=lambda i: (-(ideal[i] - point[i]) * step, i))  # farthest below (above) its ideal first
            for i in room[:abs(left)]:
                point[i] += step
                left -= step
        for p, x in zip(points, point):
            p.append(x)
    for p, n in zip(points, lengths):
        p.append(n)
    return [tuple(p) for p in points]


@dataclass(frozen=True)
class RankWork:
    """One cp rank's share of one packed sample, as the time model counts it."""

    tokens: int
    pairs: float
    """Causal (query, key) pairs its attention computes, in all-heads units: P pairs over H/A of the heads count
    P/A."""
    a2a_tokens: int
    """Its tokens that go through the all-to-all (all of them with an all-to-all level, else none)."""
    ring_tokens: float
    """Rows whose keys and values travel each ring hop, in all-heads units (0 without a ring)."""
    segments: int = 0
    """Document segments its attention calls of one layer's forward hold (its own call's pieces and each ring
    step's piece pairs sharing a document; one call of every document without a ring): a kernel with no
    variable-length entry point (the CPU's) runs one call per segment."""

    @property
    def exchanged_tokens(self) -> float:
        """The tokens of its that a context-parallel exchange moves: the ring's rows with a ring, else the
        all-to-all's."""
        return self.ring_tokens if self.ring_tokens else self.a2a_tokens


def packed_rank_work(layout: ContextLayout, cu_seqlens: Sequence[int], seq_length: int) -> list[RankWork]:
    """The work of each cp rank (in cp-rank order) on one sample whose documents are `cu_seqlens` (0 ... S)."""
    cu = tuple(int(b) for b in cu_seqlens)
    A, R = layout.a2a_size, layout.ring_size
    local = seq_length // layout.cp_size
    a2a_tokens = local if A > 1 else 0
    if R == 1:
        total = sum(_piece_pairs(0, b - a) for a, b in zip(cu, cu[1:]))
        return [RankWork(local, total / A, a2a_tokens, 0.0, len(cu) - 1)] * layout.cp_size
    if layout.cuts_documents:
        cut = layout.sample_cut(seq_length, cu)
        ring_pairs, sent = [cut.pairs(r) for r in range(R)], cut.sent_rows
        segments = [cut.segments(r) for r in range(R)]
    else:
        chunk = seq_length // (2 * R)
        ring_pairs, sent, segments = [], seq_length // R, []
        for r in range(R):
            total, own = 0, 0
            for index in layout.ring_chunks(r):
                low, high = index * chunk, (index + 1) * chunk
                for a, b in zip(cu, cu[1:]):
                    if b > low and a < high:
                        total += _piece_pairs(max(a, low) - a, min(b, high) - max(a, low))
                        own += 1
            ring_pairs.append(total)
            segments.append(own + _crossing_documents(layout, cu, chunk, r))
    return [RankWork(local, ring_pairs[c // A] / A, a2a_tokens, sent / A, segments[c // A])
            for c in range(layout.cp_size)]


def _crossing_documents(layout: ContextLayout, cu: tuple[int, ...], chunk: int, ring_rank: int) -> int:
    """Calls of ring rank `ring_rank` against earlier chunks of the sequence (`--cp-document-layout sequence`), over
    every ring step: one per (query chunk, earlier key chunk) that a document crosses from the key chunk into."""
    calls = 0
    for q_chunk in layout.ring_chunks(ring_rank):
        start = cu[bisect.bisect_right(cu, q_chunk * chunk) - 1]  # where the document at the chunk's start begins
        calls += sum(1 for kv in range(layout.ring_size) for k_chunk in layout.ring_chunks(kv)
                     if k_chunk < q_chunk and start < (k_chunk + 1) * chunk)
    return calls
