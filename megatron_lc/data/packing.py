"""Samples packed from whole documents (`--packing documents`), for fine-tuning.

Instead of cutting samples from the document stream (`stream`, the default), each
sample holds whole documents, none split, back to back from position 0, and padding up
to `--seq-length`. Each document attends only to itself, with positions from 0; its last
token predicts nothing (the next document is not its continuation), and padding is
masked from the loss and attends only to itself.

Packing (one epoch, from a start state): documents are taken in the epoch's seeded order;
a sample takes the next document while it fits, and when the next does not, the largest
documents that still fit among the next `LOOKAHEAD` not yet taken (pulled forward). What
a run has consumed is therefore "every document before position p of the order, and a set
of the next LOOKAHEAD": a position of three integers (epoch, p, bit mask), from which a
run at another `--seq-length` packs on, neither skipping nor repeating a document. The
index of an epoch is cached like the stream's epoch layouts (`index_cache`).

Documents longer than a sample stop the run at start (one line counting them) unless
`--long-documents truncate` (keep the first `--seq-length` tokens) or `drop`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from megatron_lc.data.document_locations import read_locations
from megatron_lc.data.index_cache import IndexCache, array_digest, dataset_fingerprint
from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.samples import IGNORE_INDEX, Sample, SampleSource, cp_ranges
from megatron_lc.flags import flag

Packing = Literal["stream", "documents"]
PACKINGS: tuple[str, ...] = get_args(Packing)
LongDocuments = Literal["stop", "truncate", "drop"]
LONG_DOCUMENTS: tuple[str, ...] = get_args(LongDocuments)
LOOKAHEAD = 63
"""Documents past the order's position a sample may pull forward to fill its end (a bit each in the position)."""
PAD_TOKEN = 0
"""The input id of padding (never a target, attending only to padding)."""


@dataclass
class PackingArgs:
    packing: str = flag("stream", "how samples are cut: stream (documents back to back, a sample cut every "
                                  "--seq-length tokens, as Megatron-LM) or documents (whole documents packed into "
                                  "each sample, none split, each attending to itself from position 0, padding "
                                  "masked)", choices=PACKINGS)
    long_documents: str = flag("stop", "--packing documents: what a document longer than --seq-length does: stop "
                                       "the run at start, truncate it to --seq-length tokens, or drop it",
                               choices=LONG_DOCUMENTS)


@dataclass(frozen=True)
class PackingSpec:
    """How a run's samples are cut (`PackingArgs` resolved)."""

    packing: Packing = "stream"
    long_documents: LongDocuments = "stop"

    @property
    def whole_documents(self) -> bool:
        return self.packing == "documents"

    @classmethod
    def of(cls, args: PackingArgs) -> PackingSpec:
        return cls(args.packing, args.long_documents)


def check_packing(args: PackingArgs) -> None:
    """The packing flags' rules, one line each (ValueError). (Mock data, which has no documents to pack, is
    refused where it is built: the planner traces any run on mock data.)"""
    if args.packing not in PACKINGS:
        raise ValueError(f"--packing {args.packing}: expected one of {', '.join(PACKINGS)}")
    if args.long_documents not in LONG_DOCUMENTS:
        raise ValueError(f"--long-documents {args.long_documents}: expected one of {', '.join(LONG_DOCUMENTS)}")
    if args.packing == "stream" and args.long_documents != "stop":
        raise ValueError(f"--long-documents {args.long_documents} acts with --packing documents only (the stream "
                         "cuts every document where a sample ends)")


class LongDocumentsError(ValueError):
    """Documents longer than a sample, with --long-documents stop."""


LISTED_LONG_DOCUMENTS = 5


def _first_documents(prefix: str, documents: np.ndarray, lengths: np.ndarray) -> str:
    """The first few of `documents` by index, each with its input record where preprocessing listed it
    (`document_locations.py`) and its length."""
    first = [int(d) for d in documents[:LISTED_LONG_DOCUMENTS]]
    where = read_locations(prefix, first)
    named = [f"document {d} ({where[d] + ', ' if d in where else ''}{int(n):,} tokens)"
             for d, n in zip(first, lengths[:LISTED_LONG_DOCUMENTS])]
    more = ", ..." if len(documents) > len(first) else ""
    return f"{'the first: ' if more else ''}{', '.join(named)}{more}"


def pack_epoch(lengths: np.ndarray, capacity: int, start: int = 0, taken_ahead: int = 0
               ) -> dict[str, np.ndarray]:
    """Pack documents of `lengths` (in order; each <= `capacity`) from position `start`, the documents at
    `start + j` for each bit j of `taken_ahead` already taken.

    Returns `documents` (positions in the order, sample after sample), `sample_starts` (each sample's first
    entry in `documents`, and the end), `used` (tokens of each sample), and the position after each sample:
    `pointer` and `ahead` (the bit mask of taken documents from `pointer`)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    lengths_list = lengths.tolist()
    taken = bytearray(n)
    for j in range(LOOKAHEAD):
        if taken_ahead >> j & 1 and start + j < n:
            taken[start + j] = 1
    documents: list[int] = []
    starts, used, pointers, aheads = [0], [], [], []
    p = start
    while True:
        while p < n and taken[p]:
            p += 1
        if p >= n:
            break
        room = capacity
        while p < n and (taken[p] or lengths_list[p] <= room):
            if not taken[p]:
                taken[p] = 1
                documents.append(p)
                room -= lengths_list[p]
            p += 1
        while room > 0:  # the end of the sample: the largest documents that fit, from the next LOOKAHEAD
            best, best_length = -1, 0
            for q in range(p, min(n, p + LOOKAHEAD)):
                if not taken[q] and best_length < lengths_list[q] <= room:
                    best, best_length = q, lengths_list[q]
            if best < 0:
                break
            taken[best] = 1
            documents.append(best)
            room -= best_length
        while p < n and taken[p]:
            p += 1
        ahead = 0
        for j in range(min(LOOKAHEAD, n - p)):
            if taken[p + j]:
                ahead |= 1 << j
        starts.append(len(documents))
        used.append(capacity - room)
        pointers.append(p)
        aheads.append(ahead)
    return {"documents": np.asarray(documents, dtype=np.int64), "sample_starts": np.asarray(starts, dtype=np.int64),
            "used": np.asarray(used, dtype=np.int64), "pointer": np.asarray(pointers, dtype=np.int64),
            "ahead": np.asarray(aheads, dtype=np.int64)}


class PackedDocumentSamples(SampleSource):
    """Samples of whole documents of `dataset` (a subset: `documents`), packed per epoch in seeded order.

    `start` (epoch, position, taken-ahead bits) is where sample 0 begins (a run continuing another).
    `len()` is the number of samples of the first epoch."""

    def __init__(self, dataset: IndexedDataset, seq_length: int, seed: int, shuffle: bool = True,
                 documents: np.ndarray | None = None, cache: IndexCache | None = None,
                 loss_mask: IndexedDataset | None = None, long_documents: LongDocuments = "stop",
                 start: tuple[int, int, int] = (0, 0, 0)) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.dataset, self.seq_length, self.seed, self.shuffle = dataset, seq_length, seed, shuffle
        self.all_documents = (np.arange(len(dataset.sequence_lengths), dtype=np.int64) if documents is None
                              else np.asarray(documents, dtype=np.int64))
        self.loss_mask, self.long_documents, self._cache = loss_mask, long_documents, cache
        self.start = tuple(int(x) for x in start)
        lengths = dataset.sequence_lengths[self.all_documents].astype(np.int64)
        long = lengths > seq_length
        self.long_count, self.longest = int(long.sum()), int(lengths.max()) if len(lengths) else 0
        if self.long_count and long_documents == "stop":
            raise LongDocumentsError(
                f"{dataset.path_prefix}: {self.long_count:,} of {len(lengths):,} documents are longer than "
                f"--seq-length {seq_length} (the longest {self.longest:,} tokens; "
                f"{_first_documents(dataset.path_prefix, self.all_documents[long], lengths[long])}): --packing "
                "documents splits none; pass --long-documents truncate or drop, or a longer --seq-length")
        keep = ~long if long_documents == "drop" else np.ones(len(lengths), dtype=bool)
        self.documents = self.all_documents[keep]
        self._lengths = np.minimum(lengths[keep], seq_length)
        if not len(self.documents):
            raise ValueError(f"{dataset.path_prefix}: no document left to pack (--long-documents drop)")
        self._bin_starts = dataset.sequence_pointers[self.documents] // dataset.dtype.itemsize
        self._epochs: dict[int, dict[str, np.ndarray]] = {}
        self._first_sample = [0]  # sample index at which each epoch (from the start's) begins

    # --- the index ---------------------------------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Positions in `documents` of `epoch`'s documents, in packing order."""
        if not self.shuffle:
            return np.arange(len(self._lengths), dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(len(self._lengths))

    def _epoch(self, epoch: int) -> dict[str, np.ndarray]:
        arrays = self._epochs.get(epoch)
        if arrays is None:
            first = epoch == self.start[0]
            p, ahead = (self.start[1], self.start[2]) if first else (0, 0)

            def build() -> dict[str, np.ndarray]:
                order = self.epoch_order(epoch)
                packed = pack_epoch(self._lengths[order], self.seq_length, p, ahead)
                packed["documents"] = order[packed["documents"]]
                return packed

            description = {"kind": "packed_documents", "dataset": dataset_fingerprint(self.dataset.path_prefix),
                           "documents": array_digest(self.documents), "seed": self.seed, "shuffle": self.shuffle,
                           "epoch": epoch, "seq_length": self.seq_length, "start": [p, ahead],
                           "long_documents": self.long_documents}
            arrays = (self._cache or IndexCache(None)).arrays("packed", description, build)
            if len(self._epochs) >= 2:
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[epoch] = arrays
        return arrays

    def _locate(self, index: int) -> tuple[int, int]:
        """(epoch, sample in that epoch) of sample `index`."""
        if index < 0:
            raise IndexError(f"sample index {index} is negative")
        while index >= self._first_sample[-1]:
            epoch = self.start[0] + len(self._first_sample) - 1
            self._first_sample.append(self._first_sample[-1] + len(self._epoch(epoch)["used"]))
        k = int(np.searchsorted(self._first_sample, index, side="right")) - 1
        return self.start[0] + k, index - self._first_sample[k]

    def __len__(self) -> int:
        return len(self._epoch(self.start[0])["used"])

    def padding_fraction(self) -> float:
        """Padding's share of the first epoch's sample tokens."""
        used = self._epoch(self.start[0])["used"]
        return 1.0 - float(used.sum()) / (len(used) * self.seq_length)

    def note(self, part: str) -> str:
        """One line for the log: how this part packs (samples, documents, padding, long documents)."""
        line = (f"--packing documents: {part} part of {self.dataset.path_prefix}: {len(self.documents):,} documents "
                f"in {len(self):,} samples of {self.seq_length:,} tokens, {self.padding_fraction():.2%} padding")
        if self.long_count:
            done = "truncated to --seq-length" if self.long_documents == "truncate" else "dropped"
            line += (f"; {self.long_count:,} documents longer than a sample {done} "
                     f"(--long-documents {self.long_documents})")
        return line

    def stream_position(self, consumed: int) -> tuple[int, ...]:
        if consumed == 0:
            return self.start
        epoch, k = self._locate(consumed - 1)
        arrays = self._epoch(epoch)
        pointer, ahead = int(arrays["pointer"][k]), int(arrays["ahead"][k])
        if pointer >= len(self._lengths):
            return (epoch + 1, 0, 0)
        return (epoch, pointer, ahead)

    def continues_at(self, position: tuple[int, ...]) -> str:
        epoch, pointer, ahead = (int(x) for x in position)
        pulled = f" ({bin(ahead).count('1')} after it already trained)" if ahead else ""
        return (f"packing continues in epoch {epoch} at document {pointer:,} of its order{pulled}, the first not yet "
                "trained")

    def continued(self, position: tuple[int, ...]) -> PackedDocumentSamples:
        epoch, pointer, ahead = (int(x) for x in position)
        return PackedDocumentSamples(self.dataset, self.seq_length, self.seed, self.shuffle, self.all_documents,
                                     self._cache, self.loss_mask, self.long_documents, (epoch, pointer, ahead))

    # --- samples -----------------------------------------------------------------------------------------------

    def _sample_documents(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions in `documents` of sample `index`'s documents, and their (possibly truncated) lengths."""
        epoch, k = self._locate(index)
        arrays = self._epoch(epoch)
        chosen = arrays["documents"][arrays["sample_starts"][k]:arrays["sample_starts"][k + 1]]
        return chosen, self._lengths[chosen]

    def cu_seqlens(self, index: int) -> tuple[int, ...]:
        _, lengths = self._sample_documents(index)
        ends = np.cumsum(lengths).tolist()
        return tuple(dict.fromkeys([0, *ends, self.seq_length]))  # padding, if any, one segment at the end

    def _read(self, dataset: IndexedDataset, index: int, start: int, stop: int, fill: int) -> np.ndarray:
        """Elements `[start, stop)` of sample `index` from `dataset` (ids or loss mask), `fill` past its documents:
        only the documents those positions hold are read."""
        chosen, lengths = self._sample_documents(index)
        ends = np.cumsum(lengths)
        out = np.full(stop - start, fill, dtype=np.int64)
        first = int(np.searchsorted(ends, start, side="right"))
        for d in range(first, len(chosen)):
            doc_start = int(ends[d] - lengths[d])
            if doc_start >= stop:
                break
            low, high = max(start, doc_start), min(stop, int(ends[d]))
            out[low - start:high - start] = dataset.read_span(int(self._bin_starts[chosen[d]]) + low - doc_start,
                                                              high - low)
        return out

    def read_tokens(self, index: int, start: int, stop: int) -> np.ndarray:
        return self._read(self.dataset, index, start, stop, PAD_TOKEN)

    def read_loss_mask(self, index: int, start: int, stop: int) -> np.ndarray | None:
        return None if self.loss_mask is None else self._read(self.loss_mask, index, start, stop, 0)

    def get(self, index: int, cp_rank: int = 0, cp_size: int = 1, reset_position_ids: bool = False,
            eod_mask_loss: bool = False, eod_token: int | None = None, cp_ring: int = 1,
            documents: str = "sequence") -> Sample:
        """This rank's rows only (host memory O(S/cp)); positions always restart at each document (and padding),
        whatever `reset_position_ids`."""
        if eod_mask_loss and eod_token is None:
            raise ValueError("eod_mask_loss needs eod_token (the tokenizer's EOD id)")
        cu = self.cu_seqlens(index)
        boundaries = np.asarray(cu, dtype=np.int64)
        used = int(np.sum(self._sample_documents(index)[1]))
        pieces = []
        for start, stop in cp_ranges(self.seq_length, cp_rank, cp_size, cp_ring, documents, cu):
            end = min(stop + 1, self.seq_length)  # the next token: the label of the range's last row
            tokens = self.read_tokens(index, start, end)
            labels = np.full(stop - start, IGNORE_INDEX, dtype=np.int64)
            labels[:end - start - 1] = tokens[1:]
            rows = np.arange(start, stop, dtype=np.int64)
            segment = np.searchsorted(boundaries, rows, side="right") - 1
            labels[(rows + 1 == boundaries[segment + 1]) | (rows >= used)] = IGNORE_INDEX  # last of each, padding
            if self.loss_mask is not None:
                mask = self.read_loss_mask(index, start, end)
                labels[:end - start - 1][mask[1:] == 0] = IGNORE_INDEX
            if eod_mask_loss:
                labels[tokens[:stop - start] == eod_token] = IGNORE_INDEX
            pieces.append((tokens[:stop - start], labels, rows - boundaries[segment]))
        inputs, labels, positions = (np.concatenate(column) for column in zip(*pieces))
        return Sample(input_ids=inputs, labels=labels, position_ids=positions, cu_seqlens=cu)
