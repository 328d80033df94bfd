"""Megatron's data flags turned into train, validation and test sample sources.

- `--data-path [W1] P1 [W2 P2 ...]`: prefixes, each with a positive weight or none (then
  each weighs its part's number of samples, as megatron-core). Weights are normalised as
  megatron-core does it (its builder's `normalize`, then BlendedDataset's again), in
  float64 with numpy's summation: one bit of difference flips exact ties of the index. `--split 969,30,1` carves train,
  validation and test from every prefix by document: contiguous ranges of the
  documents in file order, Megatron's rounding, so the parts never change with the seed;
  the seed orders the documents within each part.
- `--train-data-path` / `--valid-data-path` / `--test-data-path`: a whole blend per
  part, uncut; each one given replaces that part of `--data-path`.
- Several prefixes in a part are blended (`blending.BlendedSamples`); one is read directly.
- `--data-cache-path`: the epoch layouts and blending indices are stored there, keyed by
  the data and the flags (`index_cache`), and read back on restart.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from megatron_lc.data.blending import BlendedSamples, normalize
from megatron_lc.data.index_cache import IndexCache, dataset_fingerprint
from megatron_lc.data.indexed_dataset import IndexedDataset, bin_path, idx_path
from megatron_lc.data.loss_mask import has_loss_mask, open_loss_mask
from megatron_lc.data.packing import PackedDocumentSamples, PackingSpec
from megatron_lc.data.samples import LongSequenceSamples, SampleSource
from megatron_lc.data.tokenizers import TOKENIZER_TYPES
from megatron_lc.errors import ConfigError
from megatron_lc.flags import flag, flag_list

SPLIT_NAMES = ("train", "valid", "test")
DEFAULT_SPLIT = "969, 30, 1"  # Megatron-LM's value when --data-path comes without --split
DEFAULT_SPLIT_WARNING = ('WARNING: Please specify --split when using --data-path. Using legacy default value '
                         f'of "{DEFAULT_SPLIT}"')  # Megatron-LM's words


def _as_weight(text: str) -> float | None:
    """`text` as a finite number, else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_data_path(values: Sequence[str], flag: str = "--data-path") -> list[tuple[float | None, str]]:
    """(weight, prefix) pairs of `WEIGHT PREFIX ...`, or (None, prefix) for plain prefixes."""
    if not values:
        return []
    if _as_weight(values[0]) is None:  # plain prefixes: none may look like a weight
        stray = next((v for v in values if _as_weight(v) is not None), None)
        if stray is not None:
            raise ValueError(f"{flag}: {stray!r} looks like a weight among plain prefixes; give every prefix a "
                             "weight (W1 PREFIX1 W2 PREFIX2 ...) or none")
        return [(None, prefix) for prefix in values]
    if len(values) % 2:
        last = values[-1]
        detail = f"the weight {last!r} has no prefix after it" if _as_weight(last) is not None else (
            f"{last!r} has no weight before it")
        raise ValueError(f"{flag}: {len(values)} values do not pair up as WEIGHT PREFIX ...: {detail}")
    pairs = []
    for weight_text, prefix in zip(values[::2], values[1::2]):
        weight = _as_weight(weight_text)
        if weight is None or weight < 0:
            raise ValueError(f"{flag}: weight {weight_text!r} (before {prefix!r}) is not a non-negative number")
        if _as_weight(prefix) is not None:
            raise ValueError(f"{flag}: {prefix!r} follows weight {weight_text!r} where a prefix belongs")
        if weight == 0:  # megatron-core asserts every weight is positive
            raise ValueError(f"{flag}: weight {weight_text!r} of {prefix!r} is zero; leave the prefix out instead")
        pairs.append((weight, prefix))
    return pairs


def parse_split(split: str) -> tuple[float, float, float]:
    """`969,30,1` (or `98/2`, `100`) as normalised train, valid and test fractions."""
    parts = [part.strip() for part in split.replace("/", ",").split(",")]
    values = [_as_weight(part) for part in parts]
    if not 1 <= len(parts) <= 3 or any(v is None or v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers with a positive sum, "
                         "such as 969,30,1")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return values[0] / total, values[1] / total, values[2] / total


def split_ranges(num_documents: int, fractions: Sequence[float]) -> list[tuple[int, int] | None]:
    """Megatron's document range of each part: `[round(lo*N), round(hi*N))` of the
    cumulative fractions; None for a part of zero weight."""
    bounds = [0.0]
    for fraction in fractions:
        bounds.append(bounds[-1] + fraction)
    return [
        (int(round(low * num_documents)), int(round(high * num_documents))) if high > low else None
        for low, high in zip(bounds[:-1], bounds[1:])
    ]


def largest_token_id(dataset: IndexedDataset, cache: IndexCache | None = None) -> int:
    """The largest id in `dataset` (-1 when empty): one numpy pass over the memory map,
    stored in `cache` so a restart on a large corpus does not read it again."""

    def build() -> dict[str, np.ndarray]:
        tokens = dataset.read_span(0, dataset.num_tokens)
        return {"largest": np.array([int(tokens.max()) if tokens.size else -1], dtype=np.int64)}

    if cache is None:  # no cache: no fingerprint to compute either
        return int(build()["largest"][0])
    description = {"kind": "largest_token_id", "dataset": dataset_fingerprint(dataset.path_prefix)}
    return int(cache.arrays("largest-id", description, build)["largest"][0])


def check_token_ids(dataset: IndexedDataset, vocab_size: int, cache: IndexCache | None = None) -> None:
    """Every token id of `dataset` is below `vocab_size`, else a ValueError naming the
    prefix, the largest id, the first sequence holding one, and the vocabulary size."""
    largest = largest_token_id(dataset, cache)
    if largest < vocab_size:
        return
    tokens = dataset.read_span(0, dataset.num_tokens)
    first = int(np.argmax(tokens >= vocab_size))
    sequence = int(np.searchsorted(dataset.sequence_pointers // dataset.dtype.itemsize, first, side="right") - 1)
    raise ValueError(f"{dataset.path_prefix}: token id {largest} (first at sequence {sequence}) is not below the "
                     f"vocabulary size {vocab_size}: data from another tokenizer, or --vocab-size too small")


@dataclass(frozen=True)
class DataSources:
    """One sample source per part; None where a part has no data."""

    train: SampleSource | None
    valid: SampleSource | None
    test: SampleSource | None
    notes: tuple[str, ...] = ()  # one line each, for rank 0 to print: a prefix left out of a part


@dataclass(frozen=True)
class _Part:
    """What one part is made of: (weight, prefix, document range) per dataset."""

    name: str
    members: tuple[tuple[float | None, str, tuple[int, int] | None], ...]


def _parts(
    data_path: Sequence[str], split: str | None, explicit: dict[str, Sequence[str]], datasets: dict[str, IndexedDataset]
) -> tuple[list[_Part], list[str]]:
    """Each part's members (an explicit path whole, else its range of every --data-path
    prefix), and a note for each prefix whose range of a part rounds to no document."""
    blend = parse_data_path(data_path)
    fractions = parse_split(split) if split is not None else (1.0, 0.0, 0.0)
    parts, notes = [], []
    for index, name in enumerate(SPLIT_NAMES):
        if explicit.get(name):
            members = tuple((w, p, None) for w, p in parse_data_path(explicit[name], f"--{name}-data-path"))
            parts.append(_Part(name, members))
            continue
        kept = []
        for weight, prefix in blend:
            count = len(datasets[prefix].sequence_lengths)
            document_range = split_ranges(count, fractions)[index]
            if document_range is None:  # a part of zero weight: no part at all, as in Megatron
                continue
            if document_range[1] > document_range[0]:
                kept.append((weight, prefix, document_range))
            else:  # megatron-core hangs or asserts here; the part is built without this prefix
                notes.append(f"--split {split}: the {name} part of {prefix} is empty ({count} documents, range "
                             f"[{document_range[0]}, {document_range[1]})); the {name} part is built without it")
        parts.append(_Part(name, tuple(kept)))
    return parts, notes


def data_prefixes(
    data_path: Sequence[str],
    train_data_path: Sequence[str] = (),
    valid_data_path: Sequence[str] = (),
    test_data_path: Sequence[str] = (),
) -> list[str]:
    """Every prefix the flags name, once each; a ValueError for weights that are not
    numbers or do not pair with prefixes, a FileNotFoundError for a missing file."""
    flags = {"--data-path": data_path, "--train-data-path": train_data_path,
             "--valid-data-path": valid_data_path, "--test-data-path": test_data_path}
    prefixes: dict[str, None] = {}
    for flag, values in flags.items():
        for _, prefix in parse_data_path(values, flag):
            for path in (bin_path(prefix), idx_path(prefix)):
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"{flag} {prefix}: {path} does not exist")
            prefixes[prefix] = None
    return list(prefixes)


def validate_data_flags(
    data_path: Sequence[str],
    split: str | None = None,
    train_data_path: Sequence[str] = (),
    valid_data_path: Sequence[str] = (),
    test_data_path: Sequence[str] = (),
) -> None:
    """Every data flag checked before any process group starts: one clear line on error."""
    if split is not None:
        parse_split(split)
    data_prefixes(data_path, train_data_path, valid_data_path, test_data_path)


def _open(prefixes: Sequence[str], vocab_size: int | None, cache: IndexCache) -> dict[str, IndexedDataset]:
    datasets = {}
    for prefix in dict.fromkeys(prefixes):
        datasets[prefix] = IndexedDataset(prefix)
        if vocab_size is not None:
            check_token_ids(datasets[prefix], vocab_size, cache)
    return datasets


def build_datasets(
    data_path: Sequence[str],
    seq_length: int,
    seed: int,
    split: str | None = None,
    train_data_path: Sequence[str] = (),
    valid_data_path: Sequence[str] = (),
    test_data_path: Sequence[str] = (),
    cache_path: str | None = None,
    num_samples: dict[str, int] | None = None,
    shuffle: bool = True,
    vocab_size: int | None = None,
    packing: PackingSpec = PackingSpec(),
) -> DataSources:
    """Train, validation and test sources from Megatron's data flags.

    `split=None` gives every document of `data_path` to training. `num_samples` (per
    part name) sizes the blending indices built up front; they extend on demand past it.
    Validation and test read their documents in stream order; training shuffles unless
    `shuffle` is False. With `vocab_size`, every dataset's ids are checked below it."""
    explicit = {"train": train_data_path, "valid": valid_data_path, "test": test_data_path}
    if split is not None:
        parse_split(split)  # a bad --split fails before any dataset is opened
    cache = IndexCache(cache_path)
    datasets = _open(data_prefixes(data_path, train_data_path, valid_data_path, test_data_path), vocab_size, cache)
    sources = {}
    parts, notes = _parts(data_path, split, explicit, datasets)
    notes += stream_packing_notes(datasets, packing)
    for part in parts:
        sources[part.name] = _part_source(part, datasets, seq_length, seed, shuffle and part.name == "train",
                                          cache, (num_samples or {}).get(part.name), packing)
        source = sources[part.name]
        for member in getattr(source, "sources", [source]):
            if isinstance(member, PackedDocumentSamples):
                notes.append(member.note(part.name))
    return DataSources(**sources, notes=tuple(notes))


def stream_packing_notes(datasets: dict[str, IndexedDataset], packing: PackingSpec) -> list[str]:
    """One warning where datasets with a loss mask (chat data) are cut by `--packing stream`: their conversations
    are split across samples and attend to each other, which fine-tuning rarely means."""
    masked = [prefix for prefix in datasets if has_loss_mask(prefix)]
    if packing.whole_documents or not masked:
        return []
    others = f" and {len(masked) - 1} more" if len(masked) > 1 else ""
    return [f"warning: {masked[0]}{others} carries a loss mask (chat data), trained under --packing stream: its "
            "conversations are cut where samples end and attend to the ones before them; --packing documents packs "
            "each whole, attending to itself only (docs/sft.md)"]


def blend_weights_and_size(
    weights: Sequence[float | None], lengths: Sequence[int], num_samples: int | None
) -> tuple[list[float], int]:
    """The weights handed to the blend and its length, as megatron-core's builder sets them.

    Explicit weights: normalised once here (the builder's `normalize`; the blend
    normalises again); the length is the sum of each source's `ceil(num_samples * w)`.
    No weights: each source weighs its number of samples (`lengths`), and the length is
    `min(num_samples, sum(lengths))`. Without `num_samples` (Megatron needs one for
    explicit weights, and builds its exhaustive index without weights) the length is
    `sum(lengths)`; the index itself never depends on the length (a prefix of a longer
    index is the shorter one), and extends past it on demand."""
    if any(w is None for w in weights):
        counts = [float(n) for n in lengths]
        size = sum(lengths) if num_samples is None else min(num_samples, sum(lengths))
        return counts, size
    once = normalize([float(w) for w in weights])
    size = sum(lengths) if num_samples is None else sum(math.ceil(num_samples * w) for w in once)
    return once, size


def _part_source(
    part: _Part,
    datasets: dict[str, IndexedDataset],
    seq_length: int,
    seed: int,
    shuffle: bool,
    cache: IndexCache,
    num_samples: int | None,
    packing: PackingSpec = PackingSpec(),
) -> SampleSource | None:
    """One part's source: a single dataset's samples, or their blend."""
    if not part.members:
        return None
    sources = []
    for _, prefix, document_range in part.members:
        documents = None if document_range is None else np.arange(*document_range, dtype=np.int64)
        mask = open_loss_mask(datasets[prefix])
        if packing.whole_documents:
            sources.append(PackedDocumentSamples(datasets[prefix], seq_length, seed, shuffle, documents, cache, mask,
                                                 packing.long_documents))
        else:
            sources.append(LongSequenceSamples(datasets[prefix], seq_length, seed, shuffle, documents, cache,
                                               loss_mask=mask))
    if len(sources) == 1:
        return sources[0]
    weights, size = blend_weights_and_size([m[0] for m in part.members], [len(s) for s in sources], num_samples)
    if sum(weights) <= 0:
        raise ValueError(f"--seq-length {seq_length}: no prefix of the {part.name} part holds a whole sample, so "
                         "unweighted prefixes have nothing to weigh; shorten --seq-length or give weights")
    return BlendedSamples(sources, weights, size, cache)


@dataclass
class DataArgs:
    data_path: list[str] = flag_list("indexed datasets: PREFIX ... or W1 PREFIX1 W2 PREFIX2 ... (weighted blend; "
                                     "PREFIX of PREFIX.bin/.idx); cut into train/valid/test by --split")
    split: str | None = flag(None, "train,valid,test weights carving every --data-path prefix by document, "
                                   "e.g. 969,30,1 (default with --data-path: 969, 30, 1 and a warning, as "
                                   "Megatron-LM)")
    data_args_path: str | None = flag(None, "a file holding --data-path's words (whitespace-separated: PREFIX ... "
                                            "or W1 PREFIX1 ...), for blends too long for a command line")
    per_split_data_args_path: str | None = flag(None, "a JSON file {\"train\": ..., \"valid\": ..., \"test\": "
                                                      "...}, each a string or list of --train-data-path's words "
                                                      "(valid and test may be null)")
    train_data_path: list[str] = flag_list("training blend, uncut (replaces --data-path's train part)")
    valid_data_path: list[str] = flag_list("validation blend, uncut (replaces --data-path's valid part)")
    test_data_path: list[str] = flag_list("test blend, uncut (replaces --data-path's test part)")
    data_cache_path: str | None = flag(None, "directory for built sample indices (epoch layouts, blending "
                                             "indices), reused when data and flags are the same")
    mock_data: bool = flag(False, "deterministic random tokens instead of --data-path")
    tokenizer_type: str | None = flag(None, "tokenizer of the data (for vocab size and generation)",
                                      choices=TOKENIZER_TYPES)
    tokenizer_model: str | None = flag(None, "tokenizer file or directory")
    vocab_file: str | None = flag(None, "GPT2BPETokenizer: its vocab.json")
    merge_file: str | None = flag(None, "GPT2BPETokenizer: its merges.txt")
    seq_length: int = flag(1024, "tokens per sample")
    micro_batch_size: int = flag(1, "samples per rank per forward/backward")
    global_batch_size: int | None = flag(None, "samples per step over all data-parallel ranks "
                                               "(default micro x dp; more means gradient accumulation)")
    no_shuffle: bool = flag(False, "read documents in stream order")
    num_workers: int = flag(0, "worker processes reading micro-batches ahead of the step (torch DataLoader "
                               "workers, as Megatron-LM; 0 reads them in the training process; Megatron-LM's "
                               "default is 2)")
    reset_position_ids: bool = flag(False, "restart positions at each document")
    reset_attention_mask: bool = flag(False, "attend within each document only (default: a sample attends "
                                             "across its end-of-document tokens as one sequence, as Megatron-LM)")
    eod_mask_loss: bool = flag(False, "do not train on predicting the token after an end-of-document")


def _read_text(path: str, flag_name: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{flag_name} {path}: cannot be read ({e.strerror or e})") from e


def read_data_args(path: str) -> list[str]:
    """--data-args-path: the file's whitespace-separated words are --data-path's (Megatron-LM's format)."""
    words = _read_text(path, "--data-args-path").split()
    if not words:
        raise ConfigError(f"--data-args-path {path}: the file is empty; it holds --data-path's words")
    return words


def read_per_split_data_args(path: str) -> dict[str, list[str]]:
    """--per-split-data-args-path: Megatron-LM's JSON object with keys train, valid and test, each a string of
    whitespace-separated words or a list of them (a blend as --train-data-path takes it); null: none."""
    import json

    try:
        data = json.loads(_read_text(path, "--per-split-data-args-path"))
    except ValueError as e:
        raise ConfigError(f"--per-split-data-args-path {path}: not valid JSON ({e})") from e
    if not isinstance(data, dict) or "train" not in data or set(data) - {"train", "valid", "test"}:
        raise ConfigError(f"--per-split-data-args-path {path}: expected an object with keys train, valid, test "
                          f"(got {sorted(data) if isinstance(data, dict) else type(data).__name__})")
    parts = {}
    for key in ("train", "valid", "test"):
        value = data.get(key)
        if value is None:
            parts[key] = []
        elif isinstance(value, str):
            parts[key] = value.split()
        elif isinstance(value, list) and all(isinstance(w, (str, int, float)) for w in value):
            parts[key] = [str(w) for w in value]
        else:
            raise ConfigError(f"--per-split-data-args-path {path}: {key} must be a string or a list of words, got "
                              f"{value!r}")
    if not parts["train"]:
        raise ConfigError(f"--per-split-data-args-path {path}: train is empty")
    return parts
