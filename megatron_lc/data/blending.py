"""Samples drawn from several sources in proportion to weights, as Megatron's BlendedDataset.

Megatron's blending index: sample `i` comes from the source whose share lags its
weight most, `argmax_d(weight_d * max(i, 1) - drawn_d)` (first source on ties), and
is that source's next sample. The index is deterministic (it needs no seed: each
source shuffles its own documents by the seed), the sources' counts after `n` samples
are within one of `weight_d * n`, and any prefix of a longer index is the shorter
index, so the index can be extended past its first size without changing it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_lc.data.index_cache import IndexCache
from megatron_lc.data.samples import SampleSource


def blending_indices(
    weights: Sequence[float], size: int, start: int = 0, drawn: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(source of each sample, its sample index within the source) for samples
    `[start, start + size)`, given each source's samples `drawn` before `start`."""
    total = float(sum(weights))
    normalized = [float(w) / total for w in weights]
    counts = list(drawn) if drawn is not None else [0] * len(weights)
    sources = np.empty(size, dtype=np.int16)
    source_samples = np.empty(size, dtype=np.int64)
    for offset in range(size):
        step = float(max(start + offset, 1))
        errors = [weight * step - count for weight, count in zip(normalized, counts)]
        chosen = errors.index(max(errors))  # first maximum, as Megatron's strict `>`
        sources[offset] = chosen
        source_samples[offset] = counts[chosen]
        counts[chosen] += 1
    return sources, source_samples


class BlendedSamples(SampleSource):
    """Sample `i` is sample `source_samples[i]` of source `sources[i]`; a context-parallel
    rank's slice is read from that source alone, so host memory stays O(S/cp)."""

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
        self.weights = [float(w) for w in weights]
        self.size = max(int(size), 1)

        def build() -> dict[str, np.ndarray]:
            return dict(zip(("sources", "source_samples"), blending_indices(self.weights, self.size)))

        # the index depends on nothing else: the sources shuffle their own documents
        cache_description = {"kind": "blending_index", "weights": self.weights, "size": self.size}
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

    def read_tokens(self, index: int, start: int, stop: int) -> np.ndarray:
        source, sample = self.locate(index)
        return self.sources[source].read_tokens(sample, start, stop)

    def cu_seqlens(self, index: int) -> tuple[int, ...]:
        source, sample = self.locate(index)
        return self.sources[source].cu_seqlens(sample)
