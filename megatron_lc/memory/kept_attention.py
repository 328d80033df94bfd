"""Kept attention outputs: full recompute without running the attention forward twice.

Under ``--recompute-granularity full`` a block's backward recomputes the whole block, its
attention forward kernel included: at a million tokens that kernel is most of the block's
forward. With ``--keep-attention-output`` each checkpointed block keeps, from its forward,
what its attention op produced (the attention output, the pre-``o_proj`` ``[tokens, heads, d]``,
and the fp32 log-sum-exp; plus the kernel's small rng state where it has one) in a
``KeptAttention``. In the recompute the attention op takes them back instead of calling the
kernel's forward; its backward calls the kernel's backward with them, as it would with the
recomputed ones. Projections, rotary, the all-to-alls, norms and MLP are recomputed as before
(q, k and v are needed by the attention backward, which is why they are not kept instead).

Where the block input goes to the host (``--offload-activations``, an offloaded layer), the
output and lse go there too, through the same ``OffloadScheduler`` (an arena per shape with a
slot per offloaded layer, copied on the side stream, prefetched with the layer's input);
otherwise they stay on the accelerator. Under sparse offload every offloaded layer keeps its
own (the layers that keep no input too); the blocks a sparse segment replays to rebuild an input
compute their attention as before, or with ``--replay-kept-attention`` read their kept results
(``store.peeking(record)``: the entries stay, a host copy is fetched and kept on the host), so that a replay
runs no attention forward either.

Exact by construction: the kept tensors are those the forward computed; the recompute of a
deterministic kernel would give the same ones bit for bit.

Each block that keeps its attention holds one ``KeptAttention`` (set by the memory stack's ``apply``, on
``BlockMemory.kept_attention``), and hands it to its attention op as an argument (``attention.kernels.attention``'s
``kept=``, Untied Ulysses' function likewise): nothing is read from module or thread state, so two models, or a
block run outside its checkpoint, never see another block's tensors. The recompute wrapper
(`memory/recompute.py`) sets what the op does with it, on the store itself and only around its own calls:
``store.keeping(record)`` around the block's forward (the op ``put``s what it computes into that forward's
``KeptRecord``, which the wrapper's autograd node holds), ``store.replaying(record)`` around its recompute (the op
``take``s them back, in the same order), ``store.peeking(record)`` around a sparse replay. Outside these the op
computes as usual and keeps nothing. A record per forward, not one per block, so that a forward whose backward
never runs leaves nothing for the next one to take.

The host arenas of these tensors are made before step 1 with the block inputs' (`MemoryStack.host_arenas`): each
attention backend declares what a keeping block puts on the host for the run's micro-batch (``kept_tensors``, a list
of `KeptTensor`), and `arena_slots` sizes each arena the way ``put`` fills it, so a step page-locks nothing.
"""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from .offload import OffloadScheduler

ATTENTION_KIND = "attention"
"""The offload scheduler's kind for kept attention tensors (their own arenas, pending set and prefetch)."""


def kept_bytes_per_layer(tokens: int, heads: int, head_dim: int, itemsize: int) -> int:
    """What one block keeps for one rank: its attention output `[tokens, heads, head_dim]` in the compute dtype and
    the fp32 log-sum-exp, `heads x tokens` (per rank: `tokens` the rank's share, all heads, whatever the layout)."""
    return tokens * heads * (head_dim * itemsize + 4)


@dataclass(frozen=True)
class KeptTensor:
    """One tensor a keeping block's attention op puts on the host, as its backend declares it before step 1."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def arena_slots(kept: Iterable[tuple[tuple[int, ...], torch.dtype]], layers: int) -> Counter:
    """Slots of each (shape, dtype) arena of kept tensors, given the (shape, dtype) of each tensor one block puts on
    the host: one per offloaded keeping layer and tensor of that shape (what ``put`` sizes an arena by, and what the
    memory stack reserves before step 1)."""
    return Counter({key: layers * count for key, count in Counter(kept).items()})


KeptMode = Literal["off", "keep", "take", "peek"]
"""What the attention op does with its block's store: compute only (outside the recompute wrapper's contexts),
compute and keep (the block's forward), take back (its recompute), read and leave in place (a sparse replay)."""


class KeptRecord:
    """What one forward of a block kept, first in first out, on the host (offloaded) or the accelerator."""

    def __init__(self, offload: OffloadScheduler | None) -> None:
        self.offload = offload
        """The scheduler that takes the host copies (None: everything stays on the accelerator)."""
        self.entries: deque = deque()

    def __len__(self) -> int:
        return len(self.entries)


class KeptAttention:
    """One block's kept attention store, handed to its attention op; in a mode only inside the recompute wrapper's
    contexts, and then reading or writing the record of the forward they name."""

    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx
        self.mode: KeptMode = "off"
        self._record: KeptRecord | None = None
        self._cursor = 0

    @property
    def keep(self) -> bool:
        """The op puts what it computes."""
        return self.mode == "keep"

    @property
    def replay(self) -> bool:
        """The op takes its results instead of computing them."""
        return self.mode in ("take", "peek")

    @property
    def peek(self) -> bool:
        """With replay: read the entries in order without consuming them (a sparse offload replay)."""
        return self.mode == "peek"

    def keeping(self, record: KeptRecord) -> contextlib.AbstractContextManager[KeptRecord]:
        """The attention op in this context keeps what it computes in `record` (the block's forward)."""
        return self._in("keep", record)

    def replaying(self, record: KeptRecord) -> contextlib.AbstractContextManager[KeptRecord]:
        """The attention op in this context takes its results from `record` (the block's recompute)."""
        return self._in("take", record)

    def peeking(self, record: KeptRecord) -> contextlib.AbstractContextManager[KeptRecord]:
        """The attention op in this context reads its results from `record` and leaves them there, for the
        block's own recompute later (a sparse offload replay)."""
        return self._in("peek", record)

    @contextlib.contextmanager
    def _in(self, mode: KeptMode, record: KeptRecord) -> Iterator[KeptRecord]:
        previous = self.mode, self._record, self._cursor
        self.mode, self._record, self._cursor = mode, record, 0
        try:
            yield record
        finally:
            self.mode, self._record, self._cursor = previous

    def put(self, tensors, to_host, meta=None) -> None:
        """Keep `tensors` (those with `to_host[i]` on the host when this forward offloads) and `meta`."""
        if not self.keep:
            raise RuntimeError(f"layer {self.layer_idx}: kept attention put outside the block's forward")
        offload = self._record.offload
        slots = arena_slots(((tuple(t.shape), t.dtype) for t, h in zip(tensors, to_host) if h),
                            offload.attention_layers if offload is not None else 0)
        items = []
        for t, host in zip(tensors, to_host):
            if host and offload is not None:
                items.append(offload.offload(self.layer_idx, t, kind=ATTENTION_KIND,
                                             slots=slots[(tuple(t.shape), t.dtype)]))
            else:
                items.append(t)
        self._record.entries.append((items, meta))

    def take(self):
        """The oldest kept (tensors, meta) of the record replayed, back on the accelerator."""
        if not self.replay:
            raise RuntimeError(f"layer {self.layer_idx}: kept attention taken outside the block's recompute")
        entries = self._record.entries
        if len(entries) <= (self._cursor if self.peek else 0):
            raise RuntimeError(f"layer {self.layer_idx}: its recompute ran more attention calls than its forward "
                               "kept (retain_graph and double backward are unsupported with --keep-attention-output)")
        if self.peek:
            items, meta = entries[self._cursor]
            self._cursor += 1
        else:
            items, meta = entries.popleft()
        return [item if isinstance(item, torch.Tensor) else self._record.offload.fetch(item, keep=self.peek)
                for item in items], meta
