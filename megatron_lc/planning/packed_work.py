"""The documents of packed samples (`--packing documents`) as the time model counts them: where their lengths
come from, and what each context-parallel rank computes of them.

A packed sample's attention is its documents' causal squares, sum L (L + 1) / 2 pairs, not the sample's S (S + 1)
/ 2; which rank computes which pairs depends on how the layout cuts the sample (`--cp-document-layout`), and the
slowest rank decides the step. The lengths are the run's own when the planner is given its data (`--data-path`
and `--packing documents`): the first samples the run draws, packed exactly as training packs them (its seed, split,
blend and `--long-documents`; the packing of one epoch, cached under `--data-cache-path` as training caches it).
Without data they are an assumed mix, named in the planner's output: `assumed_lengths` (chat fine-tuning data as
bench/bench_packing.py models it), packed by the same `pack_epoch`. A histogram of the index would be faster to
read but loses what the packer does (which documents share a sample, and the padding at each sample's end), which is
exactly what decides the per-rank imbalance.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_lc.config import TrainConfig
from megatron_lc.data.packing import PackingSpec, pack_epoch
from megatron_lc.errors import ConfigError

SAMPLES = 60
"""Samples the clock draws (at least; more when one step's data-parallel micro-batches need more)."""
ASSUMED_MIX = ("assumed length mix (no --data-path): chat fine-tuning documents as bench/bench_packing.py models "
               "them (log-normal, median 1,500 tokens, capped at 32K, plus 2% of 16K-128K), packed by pack_epoch")


def assumed_lengths(count: int, seed: int = 0) -> np.ndarray:
    """Document lengths of the assumed chat fine-tuning mix: log-normal, median 1,500 tokens (sigma 1.0: a tenth
    over 5,400), capped at 32K, plus 2% long documents of 16K to 128K tokens (books, repositories). A prediction of
    what such data looks like, not a measured corpus."""
    rng = np.random.default_rng(seed)
    chat = np.minimum(rng.lognormal(np.log(1500), 1.0, size=count).astype(np.int64) + 1, 32_768)
    long = rng.random(count) < 0.02
    chat[long] = rng.integers(16_384, 131_072, size=int(long.sum()))
    return chat


@dataclass(frozen=True)
class DocumentMix:
    """The document boundaries of the samples a run draws first, and where they come from."""

    samples: tuple[tuple[int, ...], ...]
    """Each sample's cu_seqlens (0, ..., seq_length): its documents, padding as its own last segment."""
    source: str
    """One line: the data the lengths were read from, or the assumed mix."""

    @functools.cached_property
    def call_tokens(self) -> int:
        """The length attention's rate is taken at: the token-weighted mean document length, sum L^2 / sum L.

        A causal call of L tokens runs at rate / (1 + c / L) (`Rates.attention_rates`); its L (L + 1) / 2 pairs
        then take time proportional to L^2 / 2 x (1 + c / L) = L^2 / 2 + c L / 2. Summed over the documents that is
        the time of all their pairs at one length T with sum L^2 / 2 x (1 + c / T): T = sum L^2 / sum L."""
        lengths = np.concatenate([np.diff(np.asarray(cu, dtype=np.float64)) for cu in self.samples])
        return max(1, int(round(float((lengths ** 2).sum() / lengths.sum()))))


def check_packed_planning(cfg: TrainConfig, mock_data_given: bool) -> None:
    """Mock data holds no documents to pack: one line naming the flag that supplies them."""
    if PackingSpec.of(cfg.packing).whole_documents and mock_data_given:
        raise ConfigError("--packing documents with --mock-data: mock data has no documents whose lengths the step "
                          "time could be counted from; give --data-path (or leave both out to plan on an assumed "
                          "length mix)")


def document_mix(cfg: TrainConfig, draws: int = SAMPLES) -> DocumentMix | None:
    """The first `draws` samples of the run's data (None without `--packing documents`)."""
    if not PackingSpec.of(cfg.packing).whole_documents:
        return None
    d = cfg.data
    if d.data_path or d.train_data_path:
        return _data_mix(tuple(d.data_path), d.split, tuple(d.train_data_path), d.seq_length, cfg.train.seed,
                         not d.no_shuffle, d.data_cache_path, PackingSpec.of(cfg.packing), draws)
    return _assumed_mix(d.seq_length, draws)


@functools.lru_cache(maxsize=8)
def _assumed_mix(seq_length: int, draws: int) -> DocumentMix:
    count = max(1000, 2 * (draws + 1) * seq_length // 1500)
    while True:
        lengths = assumed_lengths(count)
        fitting = lengths[lengths <= seq_length]  # --long-documents drop
        order = np.random.default_rng([1234, 0]).permutation(len(fitting))
        packed = pack_epoch(fitting[order], seq_length)
        if len(packed["used"]) > draws:  # the epoch's last, partly filled sample left out
            break
        count *= 2
    samples = tuple(_cu_seqlens(fitting[order][packed["documents"][packed["sample_starts"][k]:
                                                                  packed["sample_starts"][k + 1]]], seq_length)
                    for k in range(draws))
    return DocumentMix(samples, f"{ASSUMED_MIX}: its first {draws} samples of {seq_length:,} tokens")


def _cu_seqlens(lengths: np.ndarray, seq_length: int) -> tuple[int, ...]:
    return tuple(dict.fromkeys([0, *np.cumsum(lengths).tolist(), seq_length]))


@functools.lru_cache(maxsize=8)
def _data_mix(data_path: tuple[str, ...], split: str | None, train_data_path: tuple[str, ...], seq_length: int,
              seed: int, shuffle: bool, cache_path: str | None, packing: PackingSpec, draws: int) -> DocumentMix:
    from megatron_lc.data.sources import DEFAULT_SPLIT, build_datasets

    try:
        sources = build_datasets(list(data_path), seq_length, seed, split=split or (DEFAULT_SPLIT if data_path else
                                                                                      None),
                                 train_data_path=list(train_data_path), cache_path=cache_path, shuffle=shuffle,
                                 packing=packing)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--packing documents: the step time needs the training documents' lengths: {e}") from e
    train = sources.train
    if train is None:
        raise ConfigError("--packing documents: the training part has no documents to count the step's work from "
                          "(--split)")
    taken = min(draws, len(train))
    where = " ".join(train_data_path or data_path)
    return DocumentMix(tuple(tuple(int(x) for x in train.cu_seqlens(k)) for k in range(taken)),
                       f"the first {taken} training samples of {where} as the run packs them "
                       f"(--packing documents, seed {seed})")


def total_pairs(cu_seqlens: Sequence[int]) -> float:
    """Causal pairs inside the documents of one sample (its padding one more segment), each once."""
    lengths = np.diff(np.asarray(cu_seqlens, dtype=np.float64))
    return float((lengths * (lengths + 1) / 2).sum())
