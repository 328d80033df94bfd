"""Long-sequence samples cut from a document stream, sliced per context-parallel rank.

The stream is every document of an indexed dataset (or of a subset, such as one
`--split` part) back to back, in a seeded permuted order (a new permutation each epoch, as many epochs as needed). Sample `i`
is stream tokens `[i*S, (i+1)*S + 1)`: `S` inputs and, shifted by one, `S` labels.
Context-parallel rank `c` reads only its own token ranges of the sample from the
memory map (`[c*S/cp, (c+1)*S/cp)` without a ring, two chunks with one: see
`context_layout`), so its host memory is O(S/cp). Document boundaries
of the whole sample come from the index's sequence lengths, never from the tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from megatron_lc.context_layout import ContextLayout
from megatron_lc.data.index_cache import IndexCache, array_digest, dataset_fingerprint
from megatron_lc.data.indexed_dataset import IndexedDataset

IGNORE_INDEX = -100  # label value excluded from the loss


@dataclass
class Sample:
    """One cp rank's slice of a sample; arrays are int64 of length `S/cp`."""

    input_ids: np.ndarray
    labels: np.ndarray  # next tokens; IGNORE_INDEX where masked
    position_ids: np.ndarray  # global positions, or positions within each document when reset
    cu_seqlens: tuple[int, ...]  # document boundaries of the whole sample: (0, ..., S)


def cp_ranges(seq_length: int, cp_rank: int, cp_size: int, cp_ring: int = 1, documents: str = "sequence",
              cu_seqlens: tuple[int, ...] | None = None) -> tuple[tuple[int, int], ...]:
    """Input positions `[start, stop)` of cp rank `cp_rank` (a ring of `cp_ring` cutting a sample of documents
    `cu_seqlens` by `documents`: see `context_layout`)."""
    if cp_size < 1 or cp_ring < 1 or cp_size % cp_ring:
        raise ValueError(f"context-parallel size {cp_size} is not a multiple of its ring degree {cp_ring}")
    layout = ContextLayout(a2a_size=cp_size // cp_ring, ring_size=cp_ring, documents=documents)
    return layout.token_ranges(seq_length, cp_rank, cu_seqlens)


def position_ids_for(start: int, stop: int, cu_seqlens: tuple[int, ...], reset: bool) -> np.ndarray:
    """Positions of inputs `[start, stop)`: global, or counted from each document's start."""
    positions = np.arange(start, stop, dtype=np.int64)
    if not reset:
        return positions
    boundaries = np.asarray(cu_seqlens, dtype=np.int64)
    document = np.searchsorted(boundaries, positions, side="right") - 1
    return positions - boundaries[document]


def labels_for(tokens: np.ndarray, eod_mask_loss: bool, eod_token: int | None) -> np.ndarray:
    """Next-token labels of `tokens[:-1]`; masked after an EOD input when asked (as Megatron)."""
    labels = tokens[1:].copy()
    if eod_mask_loss:
        if eod_token is None:
            raise ValueError("eod_mask_loss needs eod_token (the tokenizer's EOD id)")
        labels[tokens[:-1] == eod_token] = IGNORE_INDEX
    return labels


class SampleSource(ABC):
    """Samples of `seq_length + 1` tokens with document boundaries, read slice by slice."""

    seq_length: int

    @abstractmethod
    def read_tokens(self, index: int, start: int, stop: int) -> np.ndarray:
        """Tokens `[start, stop)` of sample `index` (positions in its `S + 1` window)."""

    @abstractmethod
    def cu_seqlens(self, index: int) -> tuple[int, ...]:
        """Document boundaries of sample `index`'s `S` inputs: 0, ..., S."""

    def read_loss_mask(self, index: int, start: int, stop: int) -> np.ndarray | None:
        """The loss mask of tokens `[start, stop)` of sample `index` (1: trained on as a target), or None when
        every token is (plain text)."""
        return None

    def stream_position(self, consumed: int) -> tuple[int, ...] | None:
        """Where each document stream under this source stands after its first `consumed` samples: the tokens
        read from the stream's beginning (every sample's `S` inputs; its last label is the next one's first
        input). None for a source that is no token stream (mock data)."""
        return None

    def continues_at(self, position: tuple[int, ...]) -> str:
        """Where a run continued at `position` goes on, in words."""
        return f"the token stream continues at token {', '.join(f'{p:,}' for p in position)}, the first not yet trained"

    def continued(self, position: tuple[int, ...]) -> SampleSource:
        """This source with its sample 0 at `position` (a `stream_position`): the same streams, at any
        `seq_length`, neither skipping nor repeating a token."""
        raise ValueError(f"{type(self).__name__} is no token stream: it cannot continue at a token position")

    def get(
        self,
        index: int,
        cp_rank: int = 0,
        cp_size: int = 1,
        reset_position_ids: bool = False,
        eod_mask_loss: bool = False,
        eod_token: int | None = None,
        cp_ring: int = 1,
        documents: str = "sequence",
    ) -> Sample:
        """Context-parallel rank `cp_rank`'s tokens of sample `index` (one range, two with a ring, a ring's pieces
        of every document when it cuts by `documents`)."""
        if index < 0:
            raise IndexError(f"sample index {index} is negative")
        cu_seqlens = self.cu_seqlens(index)
        pieces = []
        for start, stop in cp_ranges(self.seq_length, cp_rank, cp_size, cp_ring, documents, cu_seqlens):
            tokens = self.read_tokens(index, start, stop + 1).astype(np.int64)
            labels = labels_for(tokens, eod_mask_loss, eod_token)
            mask = self.read_loss_mask(index, start, stop + 1)
            if mask is not None:  # label t is token t + 1: its mask entry, read past the slice's edge as the token
                labels[mask[1:] == 0] = IGNORE_INDEX
            pieces.append((tokens[:-1], labels, position_ids_for(start, stop, cu_seqlens, reset_position_ids)))
        inputs, labels, positions = (np.concatenate(column) if len(pieces) > 1 else column[0]
                                     for column in zip(*pieces))
        return Sample(input_ids=inputs, labels=labels, position_ids=positions, cu_seqlens=cu_seqlens)


@dataclass(frozen=True)
class EpochLayout:
    """The documents of one epoch in stream order, and where each ends in the epoch."""

    order: np.ndarray  # int64 sequence indices
    ends: np.ndarray  # int64 cumulative token counts along `order`


class LongSequenceSamples(SampleSource):
    """Samples of `seq_length + 1` tokens from an indexed dataset; one sequence = one document.

    `documents` (sequence indices) restricts the stream to a subset, such as one
    `--split` part; by default it is every sequence. `loss_mask` (the dataset's, see
    `loss_mask`) is read beside the tokens, over the same documents. Any index is valid: samples past
    the first epoch continue into later epochs. `len()` is the number of samples that
    lie entirely within the first epoch. With a `cache`, epoch layouts are built once
    and read back memory-mapped (see `index_cache`).
    """

    _CACHED_EPOCHS = 2  # a sample spans at most two epochs unless S exceeds an epoch

    def __init__(
        self,
        dataset: IndexedDataset,
        seq_length: int,
        seed: int,
        shuffle: bool = True,
        documents: np.ndarray | None = None,
        cache: IndexCache | None = None,
        token_offset: int = 0,
        loss_mask: IndexedDataset | None = None,
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.dataset = dataset
        self.seq_length = seq_length
        self.seed = seed
        self.shuffle = shuffle
        self.documents = (np.arange(len(dataset.sequence_lengths), dtype=np.int64) if documents is None
                          else np.asarray(documents, dtype=np.int64))
        self._lengths = dataset.sequence_lengths[self.documents].astype(np.int64)
        self._bin_starts = dataset.sequence_pointers[self.documents] // dataset.dtype.itemsize
        self.tokens_per_epoch = int(self._lengths.sum())
        if self.tokens_per_epoch == 0:
            raise ValueError(f"{dataset.path_prefix}: the dataset holds no tokens")
        self._cache = cache
        self._layouts: dict[int, EpochLayout] = {}
        if token_offset < 0:
            raise ValueError(f"token_offset must be >= 0, got {token_offset}")
        self.token_offset = token_offset
        """Stream tokens before sample 0 (a run that continues another at a new length starts there)."""
        self.loss_mask = loss_mask

    def stream_position(self, consumed: int) -> tuple[int, ...]:
        return (self.token_offset + consumed * self.seq_length,)

    def continued(self, position: tuple[int, ...]) -> LongSequenceSamples:
        (offset,) = position
        return LongSequenceSamples(self.dataset, self.seq_length, self.seed, self.shuffle, self.documents,
                                   self._cache, token_offset=int(offset), loss_mask=self.loss_mask)

    def __len__(self) -> int:
        return (self.tokens_per_epoch - 1) // self.seq_length

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Positions in `documents` of `epoch`'s documents, in stream order."""
        if not self.shuffle:
            return np.arange(len(self._lengths), dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(len(self._lengths))

    def _layout(self, epoch: int) -> EpochLayout:
        """The layout of `epoch`, from a small cache (building one is O(documents))."""
        key = epoch if self.shuffle else 0
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._build_layout(key)
            if len(self._layouts) >= self._CACHED_EPOCHS:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = layout
        return layout

    def _build_layout(self, epoch: int) -> EpochLayout:
        def build() -> dict[str, np.ndarray]:
            order = self.epoch_order(epoch)
            return {"order": order, "ends": np.cumsum(self._lengths[order])}

        if self._cache is None:
            arrays = build()
        else:
            arrays = self._cache.arrays("epoch", self.layout_description(epoch), build)
        return EpochLayout(arrays["order"], arrays["ends"])

    def layout_description(self, epoch: int) -> dict[str, object]:
        """Everything an epoch layout depends on: the data, the documents, seed and order."""
        return {
            "kind": "epoch_layout",
            "dataset": dataset_fingerprint(self.dataset.path_prefix),
            "documents": array_digest(self.documents),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": epoch,
        }

    def read_tokens(self, index: int, start: int, stop: int) -> np.ndarray:
        return self._read(self.dataset, index, start, stop)

    def read_loss_mask(self, index: int, start: int, stop: int) -> np.ndarray | None:
        return None if self.loss_mask is None else self._read(self.loss_mask, index, start, stop)

    def _read(self, dataset: IndexedDataset, index: int, start: int, stop: int) -> np.ndarray:
        """Stream elements `[start, stop)` of sample `index` from `dataset` (the ids, or their loss mask: the
        same sequence lengths, so the same element positions)."""
        first = self.token_offset + index * self.seq_length + start
        out = np.empty(stop - start, dtype=dataset.dtype)
        filled = 0
        while filled < len(out):
            epoch, offset = divmod(first + filled, self.tokens_per_epoch)
            count = min(len(out) - filled, self.tokens_per_epoch - offset)
            self._read_epoch_span(dataset, epoch, offset, out[filled : filled + count])
            filled += count
        return out

    def _read_epoch_span(self, dataset: IndexedDataset, epoch: int, offset: int, out: np.ndarray) -> None:
        """Fill `out` with epoch tokens from `offset`, one read per run of documents
        that lie back to back in the `.bin` (a single read when not shuffled)."""
        layout = self._layout(epoch)
        stop = offset + len(out)
        first, last = np.searchsorted(layout.ends, [offset, stop - 1], side="right")
        documents = layout.order[first : last + 1]
        ends = layout.ends[first : last + 1]
        starts = ends - self._lengths[documents]
        low, high = np.maximum(starts, offset), np.minimum(ends, stop)
        bin_positions = self._bin_starts[documents] + (low - starts)
        counts = high - low
        contiguous = bin_positions[1:] == bin_positions[:-1] + counts[:-1]
        run_starts = np.concatenate(([0], np.flatnonzero(~contiguous) + 1))
        run_counts = np.add.reduceat(counts, run_starts)
        filled = 0
        for position, count in zip(bin_positions[run_starts].tolist(), run_counts.tolist(), strict=True):
            out[filled : filled + count] = dataset.read_span(position, count)
            filled += count

    def cu_seqlens(self, index: int) -> tuple[int, ...]:
        first = self.token_offset + index * self.seq_length
        boundaries = [0]
        position = first
        while position < first + self.seq_length:
            epoch, offset = divmod(position, self.tokens_per_epoch)
            limit = min(offset + first + self.seq_length - position, self.tokens_per_epoch)
            ends = self._layout(epoch).ends
            low, high = np.searchsorted(ends, [offset, limit], side="right")
            boundaries.extend((ends[low:high] + (position - offset - first)).tolist())
            position += limit - offset
        boundaries.append(self.seq_length)
        return tuple(dict.fromkeys(boundaries))  # drops repeats from empty documents


def _mix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a well-mixed, position-addressable pseudo-random hash."""
    with np.errstate(over="ignore"):
        values = values ^ (values >> np.uint64(30))
        values = values * np.uint64(0xBF58476D1CE4E5B9)
        values = values ^ (values >> np.uint64(27))
        values = values * np.uint64(0x94D049BB133111EB)
        return values ^ (values >> np.uint64(31))


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class MockSamples(SampleSource):
    """Deterministic random tokens per (seed, sample), with `documents_per_sample`
    pseudo documents so packing, masking and position reset are exercised."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, documents_per_sample: int = 4) -> None:
        if vocab_size < 1 or seq_length < 1 or documents_per_sample < 1:
            raise ValueError("vocab_size, seq_length and documents_per_sample must be positive")
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        self.documents_per_sample = min(documents_per_sample, seq_length)

    def _sample_key(self, index: int) -> np.ndarray:
        """A one-element uint64 array that seeds sample `index`'s token hash."""
        seed_hash = int(_mix64(np.array([self.seed % 2**64], dtype=np.uint64))[0])
        return _mix64(np.array([(seed_hash + index * int(_GOLDEN)) % 2**64], dtype=np.uint64))

    def read_tokens(self, index: int, start: int, stop: int) -> np.ndarray:
        positions = np.arange(start, stop, dtype=np.uint64)
        with np.errstate(over="ignore"):
            hashed = _mix64(self._sample_key(index) + positions * _GOLDEN)
        return (hashed % np.uint64(self.vocab_size)).astype(np.int64)

    def cu_seqlens(self, index: int) -> tuple[int, ...]:
        rng = np.random.default_rng([self.seed, index])
        cuts: set[int] = set()
        while len(cuts) < self.documents_per_sample - 1:
            cuts.add(int(rng.integers(1, self.seq_length)))
        return (0, *sorted(cuts), self.seq_length)
