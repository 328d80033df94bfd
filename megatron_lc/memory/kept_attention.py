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
(``peeking(store)``: the entries stay, a host copy is fetched and kept on the host), so that a replay
runs no attention forward either.

Exact by construction: the kept tensors are those the forward computed; the recompute of a
deterministic kernel would give the same ones bit for bit.

The attention ops (``attention.kernels.attention``, Untied Ulysses' function) find the block's
store through ``active()``: ``keeping(store)`` around a block's forward asks them to ``put``
what they compute, ``replaying(store)`` around its recompute to ``take`` it back, in the same
order. The context is per thread: a block's forward and its recompute each run in one call.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter, deque

import torch

from .offload import OffloadScheduler

ATTENTION_KIND = "attention"
"""The offload scheduler's kind for kept attention tensors (their own arenas, pending set and prefetch)."""

_STATE = threading.local()


def kept_bytes_per_layer(tokens: int, heads: int, head_dim: int, itemsize: int) -> int:
    """What one block keeps for one rank: its attention output `[tokens, heads, head_dim]` in the compute dtype and
    the fp32 log-sum-exp, `heads x tokens` (per rank: `tokens` the rank's share, all heads, whatever the layout)."""
    return tokens * heads * (head_dim * itemsize + 4)


class KeptAttention:
    """One block's kept attention results, first in first out, on the host (offloaded) or the accelerator."""

    def __init__(self, offload: OffloadScheduler | None, layer_idx: int) -> None:
        self.offload, self.layer_idx = offload, layer_idx
        self.replay = False
        self.peek = False
        """With replay: read the entries in order without consuming them (a sparse offload replay)."""
        self._cursor = 0
        self._entries: deque = deque()

    def put(self, tensors, to_host, meta=None) -> None:
        """Keep `tensors` (those with `to_host[i]` on the host when this block offloads) and `meta`."""
        counts = Counter((tuple(t.shape), t.dtype) for t, h in zip(tensors, to_host) if h)
        items = []
        for t, host in zip(tensors, to_host):
            if host and self.offload is not None:
                slots = self.offload.attention_layers * counts[(tuple(t.shape), t.dtype)]
                items.append(self.offload.offload(self.layer_idx, t, kind=ATTENTION_KIND, slots=slots))
            else:
                items.append(t)
        self._entries.append((items, meta))

    def take(self):
        """The oldest kept (tensors, meta), back on the accelerator."""
        if len(self._entries) <= (self._cursor if self.peek else 0):
            raise RuntimeError(f"layer {self.layer_idx}: its recompute ran more attention calls than its forward "
                               "kept (retain_graph and double backward are unsupported with --keep-attention-output)")
        if self.peek:
            items, meta = self._entries[self._cursor]
            self._cursor += 1
        else:
            items, meta = self._entries.popleft()
        return [item if isinstance(item, torch.Tensor) else self.offload.fetch(item, keep=self.peek)
                for item in items], meta

    def __len__(self) -> int:
        return len(self._entries)


def active() -> KeptAttention | None:
    """The store of the block running now (None: attention runs as usual)."""
    return getattr(_STATE, "kept", None)


@contextlib.contextmanager
def _using(kept: KeptAttention | None, replay: bool, peek: bool = False):
    previous = active()
    if kept is not None:
        kept.replay, kept.peek, kept._cursor = replay, peek, 0
    _STATE.kept = kept
    try:
        yield kept
    finally:
        _STATE.kept = previous


def keeping(kept: KeptAttention | None):
    """Attention ops in this context keep what they compute in `kept` (None: a no-op context)."""
    return _using(kept, False) if kept is not None else contextlib.nullcontext()


def replaying(kept: KeptAttention | None):
    """Attention ops in this context take their results from `kept` (None: a no-op context)."""
    return _using(kept, True) if kept is not None else contextlib.nullcontext()


def peeking(kept: KeptAttention | None):
    """Attention ops in this context read their results from `kept` and leave them there, for the block's own
    recompute later (None: attention computed as usual, whatever the enclosing context)."""
    return _using(kept, True, peek=True)
