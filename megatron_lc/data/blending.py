"""Samples drawn from several sources in proportion to weights, as Megatron's BlendedDataset.

Megatron's blending index (`helpers_cpp.build_blending_indices`): sample `i` comes from
the source whose share lags its weight most, `argmax_d(weight_d * max(i, 1) - drawn_d)`
(first source on ties), and is that source's next sample. The index needs no seed (each
source shuffles its own documents by the seed), the sources' counts after `n` samples are
within one of `weight_d * n`, and any prefix of a longer index is the shorter index, so
the index can be extended past its first size without changing it.

Exactness: the errors are computed with the same float64 operations in the same order as
Megatron's C++ loop, so ties resolve the same way; the weights reach it normalised as
Megatron normalises them (`normalize`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from megatron_lc.data.index_cache import IndexCache
from megatron_lc.data.samples import SampleSource

_MIN_BLOCK = 16


def normalize(weights: Sequence[float]) -> list[float]:
    """Megatron's `datasets.utils.normalize`: float64 weights over numpy's sum of them.

    numpy's pairwise summation can differ from Python's `sum` in the last bit, and one
    bit flips exact ties of the blending index, so this is the same operation."""
    array = np.array(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


def _hamilton_counts(weights: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Counts near `weights * start` summing to each start: a first guess of the drawn
    counts at each block's start (the greedy keeps them within one of it)."""
    ideal = weights[None, :] * starts[:, None].astype(np.float64)
    counts = np.floor(ideal).astype(np.int64)
    short = starts - counts.sum(axis=1)
    rank = np.argsort(np.argsort(counts - ideal, axis=1, kind="stable"), axis=1, kind="stable")
    return counts + (rank < short[:, None])


def _run_blocks(
    weights: np.ndarray, starts: np.ndarray, drawn: np.ndarray, length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's greedy for `length` samples from each start, all blocks at once.

    Returns each block's sources and source samples `[blocks, length]` and its counts
    at the end. Counts are held as float64 (exact below 2**53) as the C++ casts them."""
    blocks = len(starts)
    counts = drawn.astype(np.float64)
    flat = counts.reshape(-1)
    offsets = np.arange(blocks) * len(weights)
    steps = starts.astype(np.float64)[:, None]
    errors = np.empty_like(counts)
    sources = np.empty((length, blocks), dtype=np.int16)
    source_samples = np.empty((length, blocks), dtype=np.float64)
    for t in range(length):
        np.multiply(np.maximum(steps + t, 1.0), weights, out=errors)  # weight * max(i, 1)
        np.subtract(errors, counts, out=errors)  # - drawn
        chosen = errors.argmax(axis=1)  # the first maximum, as the C++ strict `>`
        at = offsets + chosen
        sources[t] = chosen
        source_samples[t] = flat[at]
        flat[at] += 1.0
    return sources.T, source_samples.T.astype(np.int64), counts.astype(np.int64)


def blending_indices(
    weights: Sequence[float], size: int, start: int = 0, drawn: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(source of each sample, its sample index within the source) for samples
    `[start, start + size)`, given each source's samples `drawn` before `start`: equal
    to `helpers_cpp.build_blending_indices` bit for bit. `weights` are used as given
    (normalise them first, as Megatron does, with `normalize`).

    The greedy is sequential; it is vectorised over blocks of samples. Each block starts
    from guessed counts and runs; a block whose guess differs from the counts its
    predecessor ended with runs again from those, until every block starts where its
    predecessor ended. Block 0 starts from the true counts, so by induction every block
    is then exact. A wrong guess is forgotten within a few samples (the greedy pulls the
    counts back to within one of `weight * i`), so a second pass is normally the last."""
    w = np.asarray(weights, dtype=np.float64)
    size = int(size)
    if size <= 0:
        return np.empty(0, dtype=np.int16), np.empty(0, dtype=np.int64)
    length = max(_MIN_BLOCK, math.isqrt(size // 64))  # few Python steps, blocks wide enough to vectorise
    starts = start + np.arange(-(-size // length), dtype=np.int64) * length
    begin = _hamilton_counts(w, starts)
    begin[0] = 0 if drawn is None else np.asarray(drawn, dtype=np.int64)
    sources, source_samples, end = _run_blocks(w, starts, begin, length)
    while True:
        stale = np.flatnonzero((end[:-1] != begin[1:]).any(axis=1)) + 1
        if not len(stale):
            return sources.reshape(-1)[:size].copy(), source_samples.reshape(-1)[:size].copy()
        begin[stale] = end[stale - 1]
        sources[stale], source_samples[stale], end[stale] = _run_blocks(w, starts[stale], begin[stale], length)


class BlendedSamples(SampleSource):
    """Sample `i` is sample `source_samples[i]` of source `sources[i]`; a context-parallel
    rank's slice is read from that source alone, so host memory stays O(S/cp).

    `weights` are normalised once here, as Megatron's BlendedDataset does (explicit
    `--data-path` weights are normalised once before, by the builder: see `sources`)."""

    def __init__(
        self,
        sources: Sequence[SampleSource],
        weights: Sequence[float],
        size: int,
        cache: IndexCache | None = None,
    ) -> None:
        if not sources or len(sources) != len(weights):
            raise ValueError(f"{len(sources)} sources and {len(weights)} weights: give one weight per source")
        lengths = {source.seq_length for source in sources}
        if len(lengths) != 1:
            raise ValueError(f"blended sources have different sequence lengths {sorted(lengths)}")
        self.seq_length = lengths.pop()
        self.sources = list(sources)
        self.weights = normalize(weights)
        self.size = max(int(size), 1)

        def build() -> dict[str, np.ndarray]:
            return dict(zip(("sources", "source_samples"), blending_indices(self.weights, self.size)))

        # the index depends on nothing else: the sources shuffle their own documents
        cache_description = {"kind": "blending_index", "weights": self.weights, "size": self.size}
        self._cache = cache
        arrays = (cache or IndexCache(None)).arrays("blend", cache_description, build)
        self._sources, self._source_samples = arrays["sources"], arrays["source_samples"]

    def __len__(self) -> int:
        return self.size

    def locate(self, index: int) -> tuple[int, int]:
        """(source, sample index in that source) of blended sample `index`."""
        if index >= len(self._sources):
            self._extend(index + 1)
        return int(self._sources[index]), int(self._source_samples[index])

    def _extend(self, size: int) -> None:
        """Continue the index to at least `size` samples (doubling: amortised linear)."""
        new_size = max(size, 2 * len(self._sources))
        drawn = np.bincount(self._sources, minlength=len(self.sources)).tolist()
        more = blending_indices(self.weights, new_size - len(self._sources), len(self._sources), drawn)
        self._sources = np.concatenate([self._sources, more[0]])
        self._source_samples = np.concatenate([self._source_samples, more[1]])

    def stream_position(self, consumed: int) -> tuple[int, ...] | None:
        """Each source's position after the samples it gave to the first `consumed` blended samples (a source
        gives its samples in order: 0, 1, ...)."""
        if consumed > len(self._sources):
            self._extend(consumed)
        drawn = np.bincount(self._sources[:consumed], minlength=len(self.sources)).tolist()
        positions = [source.stream_position(count) for source, count in zip(self.sources, drawn)]
        return None if any(p is None for p in positions) else tuple(t for p in positions for t in p)

    def continues_at(self, position: tuple[int, ...]) -> str:
        if all(type(s).continues_at is SampleSource.continues_at for s in self.sources):
            return super().continues_at(position)  # token streams, one position each
        parts, at = [], 0
        for source in self.sources:
            width = len(source.stream_position(0))
            parts.append(source.continues_at(tuple(position[at:at + width])))
            at += width
        return "; ".join(parts)

    def continued(self, position: tuple[int, ...]) -> BlendedSamples:
        """The blend of each source continued at its own position, with the same weights (the blending index
        starts again: each source's stream goes on where it stood)."""
        widths = [len(source.stream_position(0)) for source in self.sources]
        if sum(widths) != len(position):
            raise ValueError(f"a position of {len(position)} streams for a blend of {sum(widths)}")
        parts, at = [], 0
        for source, width in zip(self.sources, widths):
            parts.append(source.continued(tuple(position[at:at + width])))
            at += width
        return BlendedSamples(parts, self.weights, self.size, self._cache)

    def read_tokens(self, index: int, start: int, stop: int) -> np.ndarray:
        source, sample = self.locate(index)
        return self.sources[source].read_tokens(sample, start, stop)

    def get(self, index: int, *args, **kwargs):
        """The sample as its source gives it (a packed source lays its samples out itself)."""
        source, sample = self.locate(index)
        return self.sources[source].get(sample, *args, **kwargs)

    def read_loss_mask(self, index: int, start: int, stop: int) -> np.ndarray | None:
        source, sample = self.locate(index)
        return self.sources[source].read_loss_mask(sample, start, stop)  # None from a plain-text member

    def cu_seqlens(self, index: int) -> tuple[int, ...]:
        source, sample = self.locate(index)
        return self.sources[source].cu_seqlens(sample)
