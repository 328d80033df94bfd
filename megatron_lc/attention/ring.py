"""Ring attention: causal attention over a sequence spread around a ring of ranks.

Ring rank r holds chunks r and 2R-1-r of each sample (see `context_layout`), laid out
per sample as [chunk r, chunk 2R-1-r] rows of q, k and v [T, heads, d]. Its keys and
values travel around the ring (to rank r+1, from rank r-1) while it attends to the
block in hand: step s holds the keys of ring rank r-s. Against its own block a rank
runs one causal call over both chunks; against an earlier chunk, only the document
that crosses from that chunk into the query chunk is attended, without a mask (every
key lies before every query). Partial outputs are merged by log-sum-exp in fp32.

A ring cut by documents (`--cp-document-layout split` or `local`, `context_layout.SampleCut`) holds per
sample [head pieces | tail pieces | whole documents] instead: every cut document's pieces r and 2R-1-r,
then the documents kept whole on this rank (`DocumentRingSchedule`). A remote block's pieces are attended,
without a mask, by the pieces after them in the same document, one call per run of documents with rows on
both sides; pieces sharing no document cost no call, and whole documents never travel (only a block's
first `sent_rows` rows do).

The backward passes the keys and values around again with fp32 dK/dV accumulators,
each rank adding its share for the block in hand; after R hops each accumulator is
back at its owner. `kv_grads="overlapped"` sends an accumulator on while the next
block attends (a second pair in flight, and the kernels' shares kept until the pair
arrives); `"in_place"` rotates the pair in place after each step, a chunk at a time
through a small staging buffer, and adds each share as the kernel makes it: one fp32
pair held, for a rotation nothing hides. The arithmetic and its order are the same,
so the results are bit for bit the same. The kernels are this package's local kernels, called with the merged
out and lse (`kernels` module contract), so every kernel works in a ring. Each call's state is kept
as that call returned it (a kernel may split one call into several of its own, each with its state,
as the memory-efficient kernel does by segments) and handed back to that call's backward.

`RingAttention` is itself a `Kernel` (same forward/backward contract, `cu_seqlens` the
boundaries of the whole micro-batch, `(0, ..., B*S)`), so it stands wherever a local
kernel does: alone (`--cp-comm-type p2p`) or inside Ulysses and Untied Ulysses
(`a2a+p2p`), where it attends over the ring rank's tokens on the heads the
all-to-all gave this rank.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.distributed as dist

from megatron_lc.attention.kernels import Kernel
from megatron_lc.attention.varlen import CuSeqlens
from megatron_lc.context_layout import ContextLayout, SampleCut
from megatron_lc.memory.tiling import RankLoop, TileBounds, every_rank, tile_bounds

RingKvGrads = Literal["overlapped", "in_place"]
RING_KV_GRADS: tuple[str, ...] = get_args(RingKvGrads)
ROTATION_CHUNK_BYTES = 256 << 20
"""Bytes of each tensor one in-place rotation step moves, about (the rotation is cut into equal chunks of at most
this many bytes, rounded up to a row: the staging buffer per tensor)."""


@dataclass(frozen=True)
class ChunkPair:
    """One kernel call: query rows attending to key rows of the block in hand."""

    q_rows: tuple[int, int]
    k_rows: tuple[int, int]
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...] | None
    """None: keys are the query rows themselves (causal)."""


def _chunk_boundaries(cu: CuSeqlens, sample_start: int, low: int, high: int) -> list[int]:
    """Document boundaries inside sample positions (low, high), relative to low."""
    first = bisect.bisect_right(cu, sample_start + low)
    last = bisect.bisect_left(cu, sample_start + high)
    return [b - sample_start - low for b in cu[first:last]]


def _document_around(cu: CuSeqlens, sample_start: int, position: int) -> tuple[int, int]:
    """(start, end) in sample positions of the document holding `position`."""
    i = bisect.bisect_right(cu, sample_start + position) - 1
    return cu[i] - sample_start, cu[i + 1] - sample_start


@dataclass(frozen=True)
class RingSchedule:
    """Which rows attend to which, for one ring rank and a micro-batch's document boundaries."""

    layout: ContextLayout
    seq_length: int
    cu_seqlens: tuple[int, ...]
    ring_rank: int

    @property
    def chunk(self) -> int:
        return self.seq_length // (2 * self.layout.ring_size)

    @property
    def samples(self) -> int:
        return self.cu_seqlens[-1] // self.seq_length

    @property
    def sent_rows(self) -> int:
        """Rows of the local keys and values that travel: all of them (both chunks of every sample)."""
        return 2 * self.chunk * self.samples

    def own_block(self) -> ChunkPair:
        """Causal attention of every local row over its own chunk: one call for the micro-batch."""
        C, S = self.chunk, self.seq_length
        cu = [0]
        for b in range(self.samples):
            for slot, index in enumerate(self.layout.ring_chunks(self.ring_rank)):
                base = (2 * b + slot) * C
                cu += [base + x for x in _chunk_boundaries(self.cu_seqlens, b * S, index * C, (index + 1) * C)]
                cu.append(base + C)
        return ChunkPair((0, 2 * C * self.samples), (0, 2 * C * self.samples), tuple(cu), None)

    def cross_pairs(self, kv_ring_rank: int) -> list[ChunkPair]:
        """Unmasked calls of local query chunks over the earlier chunks of ring rank `kv_ring_rank`'s block."""
        C, S = self.chunk, self.seq_length
        pairs = []
        for b in range(self.samples):
            for q_slot, q_chunk in enumerate(self.layout.ring_chunks(self.ring_rank)):
                for k_slot, k_chunk in enumerate(self.layout.ring_chunks(kv_ring_rank)):
                    if k_chunk >= q_chunk:
                        continue
                    start, end = _document_around(self.cu_seqlens, b * S, q_chunk * C)
                    if start >= (k_chunk + 1) * C:
                        continue  # the query chunk's first document starts after the key chunk
                    q0, k0 = (2 * b + q_slot) * C, (2 * b + k_slot) * C
                    n_q, first_k = min(end, (q_chunk + 1) * C) - q_chunk * C, max(start, k_chunk * C) - k_chunk * C
                    pairs.append(ChunkPair((q0, q0 + n_q), (k0 + first_k, k0 + C), (0, n_q), (0, C - first_k)))
        return pairs


def _aligned_calls(q_lengths: list[int], k_lengths: list[int], q0: int, k0: int) -> list[ChunkPair]:
    """Unmasked calls of each cut document's query piece (rows from `q0`, pieces back to back) over the same
    document's key piece (rows from `k0`): one call per run of documents with rows on both sides (a document with
    rows on one side only breaks a run: its rows sit between the others')."""
    calls, cu_q, cu_k, start = [], [0], [0], (q0, k0)

    def close():
        if len(cu_q) > 1:
            (a, c) = start
            calls.append(ChunkPair((a, a + cu_q[-1]), (c, c + cu_k[-1]), tuple(cu_q), tuple(cu_k)))

    q, k = q0, k0
    for n_q, n_k in zip(q_lengths, k_lengths):
        if n_q and n_k:
            if len(cu_q) == 1:
                start = (q, k)
            cu_q.append(cu_q[-1] + n_q)
            cu_k.append(cu_k[-1] + n_k)
        elif n_q or n_k:
            close()
            cu_q, cu_k = [0], [0]
        q, k = q + n_q, k + n_k
    close()
    return calls


def _lengths(pieces: tuple[tuple[int, int], ...]) -> list[int]:
    return [b - a for a, b in pieces]


@dataclass(frozen=True)
class DocumentRingSchedule:
    """`RingSchedule` for a ring cut by documents (`--cp-document-layout split` or `local`, `SampleCut`): a ring
    rank holds per sample [head pieces | tail pieces | whole documents]. Its own block is one causal call (each
    piece and whole document a segment) and its tail pieces over its head pieces; a remote block's pieces are
    attended whole by the pieces after them in their document, two calls a step, every document in each; whole
    documents never leave their rank (only the first `sent_rows` rows travel)."""

    layout: ContextLayout
    seq_length: int
    cu_seqlens: tuple[int, ...]
    ring_rank: int

    @property
    def rows(self) -> int:
        return self.seq_length // self.layout.ring_size

    @property
    def samples(self) -> int:
        return self.cu_seqlens[-1] // self.seq_length

    @functools.cached_property
    def cuts(self) -> tuple[SampleCut, ...]:
        """Each sample's cut, made once per schedule (its own block and every step's pairs read them)."""
        S, cu, cuts = self.seq_length, self.cu_seqlens, []
        for sample in range(self.samples):
            first, last = bisect.bisect_left(cu, sample * S), bisect.bisect_left(cu, (sample + 1) * S)
            cuts.append(self.layout.sample_cut(S, [b - sample * S for b in cu[first:last + 1]]))
        return tuple(cuts)

    @property
    def sent_rows(self) -> int:
        """Rows of the local keys and values that travel: every sample's but the last one's whole documents."""
        return (self.samples - 1) * self.rows + self.cuts[-1].sent_rows

    def own_block(self) -> ChunkPair:
        cu = [0]
        for cut in self.cuts:
            for start, stop in cut.ring_rows(self.ring_rank):
                cu.append(cu[-1] + stop - start)
        n = self.samples * self.rows
        return ChunkPair((0, n), (0, n), tuple(cu), None)

    def cross_pairs(self, kv_ring_rank: int) -> list[ChunkPair]:
        r, pairs = self.ring_rank, []
        for b, cut in enumerate(self.cuts):
            base = b * self.rows
            q_head, q_tail = _lengths(cut.first_pieces(r)), _lengths(cut.second_pieces(r))
            k_head, k_tail = _lengths(cut.first_pieces(kv_ring_rank)), _lengths(cut.second_pieces(kv_ring_rank))
            q_tail0, k_tail0 = base + sum(q_head), base + sum(k_head)
            if kv_ring_rank == r:  # the tails over the heads of the same documents
                pairs += _aligned_calls(q_tail, k_head, q_tail0, base)
            elif kv_ring_rank < r:  # its head pieces precede both of this rank's pieces
                pairs += _aligned_calls(q_head, k_head, base, base) + _aligned_calls(q_tail, k_head, q_tail0, base)
            else:  # both its pieces precede this rank's tail piece only
                pairs += _aligned_calls(q_tail, k_head, q_tail0, base) + _aligned_calls(q_tail, k_tail, q_tail0, k_tail0)
        return pairs


class _Ring:
    """Point-to-point exchange with the ring's neighbours: send to rank r+1, receive from rank r-1."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: tuple[torch.Tensor, ...], wait: bool) -> "_Transfer":
        """Send `tensors` on and receive the same shapes from behind; `wait` blocks until both are done.

        Tensors that are column blocks of one contiguous buffer, side by side (Untied Ulysses' k and v in the
        buffer their all-to-all filled), travel as that buffer and arrive as the same views of a new one: no
        contiguous copy of each is made."""
        base = _side_by_side(tensors)
        if base is not None:
            received_base = torch.empty_like(base)
            columns = [t[0].numel() for t in tensors]
            starts = [sum(columns[:i]) for i in range(len(columns))]
            sent = (base,)
            received = tuple(received_base[:, a:a + n].view(t.shape) for t, a, n in zip(tensors, starts, columns))
            ops = [dist.P2POp(dist.isend, base, self.next, self.group),
                   dist.P2POp(dist.irecv, received_base, self.prev, self.group)]
        else:
            sent = tuple(t.contiguous() for t in tensors)
            received = tuple(torch.empty_like(t) for t in sent)
            ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
            ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        transfer = _Transfer(dist.batch_isend_irecv(ops), sent, received)
        if wait:
            transfer.wait()
        return transfer

    def rotate_in_place(self, tensors: tuple[torch.Tensor, ...], chunks: list[tuple[int, int]]) -> None:
        """Send each (contiguous) tensor on and receive the previous rank's into its place, chunk by chunk ((start,
        end) rows) through a staging buffer of the largest chunk's rows."""
        if not chunks:
            return
        largest = max(end - start for start, end in chunks)
        staging = [t.new_empty((largest, *t.shape[1:])) for t in tensors]
        for start, end in chunks:
            sent = [t[start:end] for t in tensors]
            received = [buf[:end - start] for buf in staging]
            ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
            ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            for t, r in zip(sent, received):
                t.copy_(r)


def _side_by_side(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The contiguous [rows, columns] buffer whose column blocks, in order, are `tensors` ([rows, ...] each, every
    row contiguous), or None when they are not laid out so (or already contiguous each)."""
    if len(tensors) < 2 or all(t.is_contiguous() for t in tensors) or tensors[0].shape[0] == 0:
        return None
    first, rows = tensors[0], tensors[0].shape[0]
    width = sum(t[0].numel() for t in tensors)
    offset = first.storage_offset()
    for t in tensors:
        row = t[0]
        if (t.shape[0] != rows or t.dtype != first.dtype or t.device != first.device
                or t.untyped_storage()._cdata != first.untyped_storage()._cdata  # fake tensors have no data_ptr
                or t.storage_offset() != offset or t.stride(0) != width or not row.is_contiguous()):
            return None
        offset += row.numel()
    return torch.as_strided(first, (rows, width), (width, 1), first.storage_offset())


@dataclass
class _Transfer:
    works: list
    sent: tuple[torch.Tensor, ...]
    """Held until the sends complete: their memory must not be reused before."""
    received: tuple[torch.Tensor, ...]

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self.works:
            work.wait()
        self.works, self.sent = [], ()
        return self.received


def _flatten_states(states: list[tuple], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each kernel call's state, in call order, after a header that says how many tensors it holds: an empty
    tensor of shape [0, count] (no memory, and its count is a shape, read without a device sync or a value that
    fake tensors lack). A kernel's count per call varies: the memory-efficient kernel splits one call into
    several by its segments, each with its own state."""
    return tuple(t for s in states for t in (like.new_empty((0, len(s))), *s))


def _unflatten_states(state: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """The per-call states `_flatten_states` laid out."""
    calls, i = [], 0
    while i < len(state):
        count = state[i].shape[1]
        calls.append(tuple(state[i + 1:i + 1 + count]))
        i += 1 + count
    return calls


def _merge(acc: torch.Tensor, lse: torch.Tensor, rows: tuple[int, int], out: torch.Tensor,
           out_lse: torch.Tensor) -> None:
    """Fold a partial result (out [n, H, d], lse [H, n]) into the running fp32 accumulators, in place."""
    a, b = rows
    old = lse[:, a:b]
    new = torch.logaddexp(old, out_lse)
    # Weights are [n, H, 1]: the [n, H, d] products are formed element by element, never as temporaries.
    acc[a:b].mul_(torch.exp(old - new).t().unsqueeze(-1)).addcmul_(out, torch.exp(out_lse - new).t().unsqueeze(-1))
    lse[:, a:b] = new


@dataclass
class RingAttention:
    """Ring attention over `group` (ring ranks) with `kernel` for every block; see the module docstring.

    `overlap=False` waits for each transfer before computing: the same results, for
    measuring what the overlap gains.
    """

    kernel: Kernel
    group: object
    layout: ContextLayout
    seq_length: int
    overlap: bool = True
    kv_grads: RingKvGrads = "overlapped"
    """How the backward's fp32 dK/dV accumulators travel (`--ring-kv-grads`; see the module docstring)."""
    rotation_chunk_bytes: int = ROTATION_CHUNK_BYTES
    tile_bounds: TileBounds = tile_bounds
    """The chunks the in-place rotation of the dK/dV accumulators runs over (`--ring-kv-grads in_place`): every
    one in a run; the planner's runs two (`planning.fake_world.representative_tile_bounds`): every chunk passes
    through the same staging buffer, so the largest and its neighbour give the rotation's peak."""
    rank_loop: RankLoop = every_rank
    """The steps run, by the ring rank whose keys they hold (`step`: ring rank r - step), and the last step
    always: every one in a run. The planner runs steps 0, 1 and the last (`planning.fake_world.representative_ranks`):
    from step 1 on, every step holds the same buffers (the block in hand, the next in flight, a pair of
    accumulators) and the planner's rank 0 attends the same pairs, so the three give the step's exact peak; the
    kernel calls' saved states of the steps skipped (16 bytes of rng state a call for the planner's
    flash stand-ins) are the only bytes not traced."""
    ring: _Ring = field(init=False)

    def __post_init__(self) -> None:
        if self.layout.ring_size < 2:
            raise ValueError("ring attention needs a ring of at least 2 ranks")
        self.ring = _Ring(self.group)
        if self.ring.size != self.layout.ring_size:
            raise ValueError(f"ring group of {self.ring.size} ranks for a ring of {self.layout.ring_size}")
        self.layout.check(self.seq_length)

    @property
    def name(self) -> str:
        return f"ring({self.kernel.name})"

    def as_kernel(self) -> Kernel:
        return Kernel(self.name, self.forward, self.backward)

    def _schedule(self, q: torch.Tensor, cu_seqlens: CuSeqlens) -> RingSchedule | DocumentRingSchedule:
        cu = tuple(cu_seqlens)
        if cu[-1] % self.seq_length or q.shape[0] * self.layout.ring_size != cu[-1]:
            raise ValueError(f"ring attention over {q.shape[0]} local tokens x {self.layout.ring_size} ring ranks: "
                             f"cu_seqlens must cover whole samples of {self.seq_length} tokens, got {cu[-1]}")
        kind = DocumentRingSchedule if self.layout.cuts_documents else RingSchedule
        return kind(self.layout, self.seq_length, cu, self.ring.rank)

    def _kv_rank(self, step: int) -> int:
        return (self.ring.rank - step) % self.ring.size

    def _steps(self) -> list[int]:
        """The steps run (see `rank_loop`)."""
        return sorted(set(self.rank_loop(self.ring.size)) | {self.ring.size - 1})

    def forward(self, q, k, v, cu_seqlens, scale=None):
        schedule = self._schedule(q, cu_seqlens)
        own = schedule.own_block()
        out, lse, state = self.kernel.forward(q, k, v, own.cu_q, scale)
        acc, states = out.to(lse.dtype), [state]
        sent = schedule.sent_rows  # a document cut keeps whole documents home
        kv = (k[:sent], v[:sent]) if sent < k.shape[0] else (k, v)
        for step in self._steps():
            last = step == self.ring.size - 1
            transfer = None if last else self.ring.start(kv, wait=not self.overlap)
            for pair in schedule.cross_pairs(self._kv_rank(step)):
                (a, b), (c, d) = pair.q_rows, pair.k_rows
                o, l, s = self.kernel.forward(q[a:b], kv[0][c:d], kv[1][c:d], pair.cu_q, scale,
                                              cu_seqlens_k=pair.cu_k, causal=False)
                _merge(acc, lse, pair.q_rows, o, l)
                states.append(s)
            if transfer is not None:
                kv = transfer.wait()
        return acc.to(q.dtype), lse, _flatten_states(states, q)

    def backward(self, dout, q, k, v, out, lse, cu_seqlens, scale=None, state=()):
        schedule = self._schedule(q, cu_seqlens)
        steps = {step: schedule.cross_pairs(self._kv_rank(step)) for step in self._steps()}
        calls = _unflatten_states(state)
        if len(calls) != 1 + sum(map(len, steps.values())):
            raise ValueError(f"ring attention's state holds {len(calls)} kernel calls; this schedule makes "
                             f"{1 + sum(map(len, steps.values()))}")
        states = iter(calls)
        own = schedule.own_block()
        sent = schedule.sent_rows  # a document cut keeps whole documents home
        if self.kv_grads == "in_place":
            return self._backward_in_place(dout, q, k, v, out, lse, scale, own, steps, states, sent)
        gq, gk, gv = self.kernel.backward(dout, q, k, v, out, lse, own.cu_q, scale, tuple(next(states)))
        dq = gq.to(lse.dtype)
        # This step's dK/dV shares of the block in hand, kept as the kernel returned them until the
        # block's fp32 accumulator arrives: only the accumulator in flight and the next one exist in fp32.
        # Rows that never travel (whole documents) have their one share, the own block's, and stay as it is.
        shares = [((0, sent), gk[:sent], gv[:sent])]
        home = (gk[sent:], gv[sent:])
        kv, accumulator = (k[:sent], v[:sent]), None
        for step, pairs in steps.items():
            last = step == self.ring.size - 1
            kv_transfer = None if last else self.ring.start(kv, wait=not self.overlap)
            for pair in pairs:
                gq, gk, gv = self._cross_backward(pair, dout, q, kv, out, lse, scale, states)
                dq[slice(*pair.q_rows)] += gq
                shares.append((pair.k_rows, gk, gv))
            if accumulator is None:  # step 0: this rank's own block starts its round of the ring
                dk, dv = (torch.zeros(t.shape, dtype=lse.dtype, device=t.device) for t in kv)
            else:  # what the ranks before this one added to the block in hand
                dk, dv = accumulator.wait()
            for (c, d), gk, gv in shares:
                dk[c:d] += gk
                dv[c:d] += gv
            shares = []
            accumulator = self.ring.start((dk, dv), wait=not self.overlap)
            del dk, dv  # held by the transfer until it completes
            if kv_transfer is not None:
                kv = kv_transfer.wait()
        dk, dv = accumulator.wait()  # this rank's own block, back from its last hop
        return dq.to(q.dtype), _with_home_rows(dk, home[0], k.dtype), _with_home_rows(dv, home[1], v.dtype)

    def _cross_backward(self, pair: ChunkPair, dout, q, kv, out, lse, scale, states):
        """The kernel's backward of one unmasked call of local query rows over the block in hand `kv`."""
        (a, b), (c, d) = pair.q_rows, pair.k_rows
        return self.kernel.backward(dout[a:b], q[a:b], kv[0][c:d], kv[1][c:d], out[a:b], lse[:, a:b].contiguous(),
                                    pair.cu_q, scale, tuple(next(states)), cu_seqlens_k=pair.cu_k, causal=False)

    def _backward_in_place(self, dout, q, k, v, out, lse, scale, own, steps, states, sent):
        """The backward with one pair of fp32 dK/dV accumulators: each share added as the kernel makes it (in the
        order the overlapped backward adds them), the pair rotated in place after each step."""
        gq, gk, gv = self.kernel.backward(dout, q, k, v, out, lse, own.cu_q, scale, tuple(next(states)))
        dq = gq.to(lse.dtype)
        del gq
        kv = (k[:sent], v[:sent])
        home = (gk[sent:], gv[sent:])  # rows that never travel: the own block's share is their gradient
        dk, dv = (torch.zeros(t.shape, dtype=lse.dtype, device=t.device) for t in kv)
        dk += gk[:sent]
        dv += gv[:sent]
        del gk, gv
        row_bytes = k[0].numel() * dk.element_size()
        rows = dk.shape[0]
        chunks = list(self.tile_bounds(rows, -(-rows * row_bytes // max(self.rotation_chunk_bytes, 1))))
        for step, pairs in steps.items():
            last = step == self.ring.size - 1
            kv_transfer = None if last else self.ring.start(kv, wait=not self.overlap)
            for pair in pairs:
                gq, gk, gv = self._cross_backward(pair, dout, q, kv, out, lse, scale, states)
                dq[slice(*pair.q_rows)] += gq
                dk[slice(*pair.k_rows)] += gk
                dv[slice(*pair.k_rows)] += gv
                del gq, gk, gv
            if last:  # complete: rounded before the last rotation, so at most one fp32 tensor more than the pair
                dq = dq.to(q.dtype)
            self.ring.rotate_in_place((dk, dv), chunks)  # now the next block's accumulators, from behind
            if kv_transfer is not None:
                kv = kv_transfer.wait()
        dk = _with_home_rows(dk, home[0], k.dtype)  # the fp32 dk is freed before dv is rounded
        return dq, dk, _with_home_rows(dv, home[1], v.dtype)


def _with_home_rows(travelled: torch.Tensor, home: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block's gradient in `dtype`: its rows that travelled the ring (fp32 sums), then those that stayed home."""
    if home.shape[0] == 0:
        return travelled.to(dtype)
    out = torch.empty((travelled.shape[0] + home.shape[0], *home.shape[1:]), dtype=dtype, device=home.device)
    out[:travelled.shape[0]] = travelled
    out[travelled.shape[0]:] = home
    return out
