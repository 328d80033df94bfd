"""Megatron's data flags: weighted blends, --split by document, the index cache, bad flags."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatron_lc.data.blending import BlendedSamples, blending_indices
from megatron_lc.data.index_cache import IndexCache
from megatron_lc.data.indexed_dataset import IndexedDataset, write_dataset
from megatron_lc.data.loader import MicroBatchLoader
from megatron_lc.data.samples import LongSequenceSamples
from megatron_lc.data.sources import (
    build_datasets,
    check_token_ids,
    data_prefixes,
    largest_token_id,
    parse_data_path,
    parse_split,
    split_ranges,
)

SEQ = 16


def labelled_documents(label: int, count: int, length: int = 10) -> list[np.ndarray]:
    """Document d holds `length` tokens `label*1000 + d`: every token says where it is from."""
    return [np.full(length, label * 1000 + d, dtype=np.int64) for d in range(count)]


@pytest.fixture
def prefixes(tmp_path):
    """Two datasets: A (label 1, 100 documents) and B (label 2, 40 documents)."""
    paths = {}
    for name, label, count in (("A", 1, 100), ("B", 2, 40)):
        paths[name] = str(tmp_path / name)
        write_dataset(paths[name], labelled_documents(label, count), dtype=np.uint16)
    return paths


def documents_of(source, samples: int) -> set[int]:
    """The document labels found in the first `samples` samples of `source`."""
    return {int(t) for i in range(samples) for t in source.read_tokens(i, 0, SEQ + 1)}


# --- flags ---------------------------------------------------------------------------------


def test_data_path_takes_weight_prefix_pairs_or_plain_prefixes():
    assert parse_data_path(["0.7", "a", "0.3", "b"]) == [(0.7, "a"), (0.3, "b")]
    assert parse_data_path(["a", "b"]) == [(None, "a"), (None, "b")]
    assert parse_data_path(["0.7", "a"]) == [(0.7, "a")]
    assert parse_data_path(["1e-1", "a", "2", "b"]) == [(0.1, "a"), (2.0, "b")]


@pytest.mark.parametrize(
    "values, message",
    [
        (["0.7", "a", "0.3"],
         r"--data-path: 3 values do not pair up as WEIGHT PREFIX \.\.\.: the weight '0\.3' has no prefix after it"),
        (["0.7", "a", "b"], r"3 values do not pair up .*'b' has no weight before it"),
        (["0.7", "a", "x", "b"], r"weight 'x' \(before 'b'\) is not a non-negative number"),
        (["0.7", "a", "-1", "b"], r"weight '-1' \(before 'b'\) is not a non-negative number"),
        (["0.7", "a", "nan", "b"], r"weight 'nan' \(before 'b'\) is not a non-negative number"),
        (["a", "0.3", "b"], r"'0\.3' looks like a weight among plain prefixes"),
        (["0.5", "0.5"], r"'0\.5' follows weight '0\.5' where a prefix belongs"),
        (["0.7", "a", "0", "b"], r"--data-path: weight '0' of 'b' is zero; leave the prefix out instead"),
    ],
)
def test_weights_that_are_not_numbers_or_do_not_pair_are_named(values, message):
    with pytest.raises(ValueError, match=message):
        parse_data_path(values)


def test_missing_dataset_file_is_named_with_its_flag(prefixes):
    with pytest.raises(FileNotFoundError, match=r"--valid-data-path .*nope: .*nope\.bin does not exist"):
        data_prefixes(["0.5", prefixes["A"]], valid_data_path=[prefixes["A"] + "nope"])
    named = data_prefixes(["0.5", prefixes["A"], "0.5", prefixes["B"]], [prefixes["A"]])
    assert named == [prefixes["A"], prefixes["B"]]


def test_split_is_normalised_as_megatron_does():
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    for split in ("969,30,1", "98,2", "100", "1,1,1", "0.5, 0.25, 0.25"):
        assert list(parse_split(split)) == parse_and_normalize_split(split)
    for bad in ("", "90,x", "1,2,3,4", "0,0", "-1,2"):
        with pytest.raises(ValueError, match="expected up to three non-negative numbers"):
            parse_split(bad)


def test_split_ranges_are_megatrons_document_ranges():
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    for split in ("969,30,1", "98,2,0", "1,1,1", "0,1,0"):
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        for count in (1, 7, 100, 1001, 123_457):
            expected = [None if b is None else (int(round(b[0] * count)), int(round(b[1] * count))) for b in matrix]
            assert split_ranges(count, parse_split(split)) == expected


# --- blending ------------------------------------------------------------------------------


def test_blending_index_is_megatrons():
    from megatron.core.datasets import helpers_cpp

    rng = np.random.default_rng(0)
    for count in (2, 3, 7):
        weights = rng.random(count)
        weights /= weights.sum()
        expected_sources = np.zeros(5000, dtype=np.int16)
        expected_samples = np.zeros(5000, dtype=np.int64)
        helpers_cpp.build_blending_indices(expected_sources, expected_samples, weights, count, 5000, False)
        sources, samples = blending_indices(weights.tolist(), 5000)
        np.testing.assert_array_equal(sources, expected_sources)
        np.testing.assert_array_equal(samples, expected_samples)


def test_vectorised_blending_index_equals_helpers_cpp_bit_for_bit():
    """Sizes around the block length, one to 50 sources, weights with exact ties, and an index
    continued from where a shorter one ended."""
    from megatron.core.datasets import helpers_cpp

    from megatron_lc.data.blending import normalize

    rng = np.random.default_rng(1)
    weightings = [[1.0], [0.5, 0.5], normalize([0.96, 0.6]), normalize(normalize([1, 1, 1])), [0.25] * 4,
                  normalize(rng.random(9)), normalize(rng.random(50)), normalize([1e-4, 1.0])]
    for weights in weightings:
        for size in (1, 2, 15, 16, 17, 1000, 70_001):
            expected = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64)
            helpers_cpp.build_blending_indices(*expected, np.array(weights), len(weights), size, False)
            got = blending_indices(weights, size)
            np.testing.assert_array_equal(got[0], expected[0])
            np.testing.assert_array_equal(got[1], expected[1])
            cut = size // 3
            drawn = np.bincount(expected[0][:cut], minlength=len(weights)).tolist()
            rest = blending_indices(weights, size - cut, start=cut, drawn=drawn)
            np.testing.assert_array_equal(rest[0], expected[0][cut:])
            np.testing.assert_array_equal(rest[1], expected[1][cut:])


def test_a_prefix_whose_part_rounds_to_no_document_is_named(prefixes):
    parts = build_datasets(["0.5", prefixes["A"], "0.5", prefixes["B"]], SEQ, seed=0, split="969,30,1")
    assert parts.notes == (f"--split 969,30,1: the test part of {prefixes['A']} is empty (100 documents, range "
                           f"[100, 100)); the test part is built without it",
                           f"--split 969,30,1: the test part of {prefixes['B']} is empty (40 documents, range "
                           f"[40, 40)); the test part is built without it")
    assert parts.test is None and parts.valid is not None


def test_blend_draws_in_proportion_to_weights_at_every_prefix():
    sources, samples = blending_indices([0.5, 0.3, 0.2], 10_000)
    counts = np.stack([np.cumsum(sources == d) for d in range(3)], axis=1)
    steps = np.arange(1, 10_001)[:, None]
    assert np.abs(counts - steps * np.array([0.5, 0.3, 0.2])).max() <= 1.0
    for d in range(3):  # each source's samples are taken in order, none twice
        np.testing.assert_array_equal(samples[sources == d], np.arange((sources == d).sum()))


def test_blending_index_extends_past_its_size_without_changing(prefixes):
    datasets = [LongSequenceSamples(IndexedDataset(p), SEQ, 0) for p in prefixes.values()]
    blend = BlendedSamples(datasets, [0.6, 0.4], size=10)
    beyond = [blend.locate(i) for i in range(25)]
    sources, samples = blending_indices([0.6, 0.4], 25)
    assert beyond == list(zip(sources.tolist(), samples.tolist()))


def test_weighted_blend_through_build_datasets(prefixes):
    sources = build_datasets(["0.7", prefixes["A"], "0.3", prefixes["B"]], SEQ, seed=3, num_samples={"train": 200})
    labels = [int(sources.train.read_tokens(i, 0, 1)[0]) // 1000 for i in range(200)]
    assert labels.count(1) == 140 and labels.count(2) == 60
    assert sources.valid is None and sources.test is None
    for i in range(50):  # every token of a sample comes from the dataset the index names
        assert len({int(t) // 1000 for t in sources.train.read_tokens(i, 0, SEQ + 1)}) == 1


def test_plain_prefixes_weigh_their_number_of_samples(prefixes):
    """As megatron-core: A's 1,000 tokens hold 62 samples of 16, B's 400 hold 24; the blend is
    min(asked, 62 + 24) samples long, every sample of each once."""
    sources = build_datasets([prefixes["A"], prefixes["B"]], SEQ, seed=0, num_samples={"train": 140})
    assert len(sources.train) == 86
    labels = [int(sources.train.read_tokens(i, 0, 1)[0]) // 1000 for i in range(86)]
    assert labels.count(1) == 62 and labels.count(2) == 24


def test_blend_is_deterministic_for_a_seed(prefixes):
    flags = dict(data_path=["0.7", prefixes["A"], "0.3", prefixes["B"]], seq_length=SEQ)
    first, again, other = (build_datasets(**flags, seed=s).train for s in (5, 5, 6))
    read = lambda source: [source.read_tokens(i, 0, SEQ + 1).tolist() for i in range(30)]  # noqa: E731
    assert read(first) == read(again) and read(first) != read(other)


def test_each_cp_rank_reads_only_its_slice_of_a_blended_sample(make_dataset, counting_reads):
    counted = [counting_reads(make_dataset(labelled_documents(label, 50, 37), name=f"c{label}")) for label in (1, 2)]
    blend = BlendedSamples([LongSequenceSamples(d, 64, seed=1) for d in counted], [0.5, 0.5], size=8)
    for index in range(8):
        full = blend.get(index)
        before = sum(d.tokens_read for d in counted)
        parts = [blend.get(index, cp_rank=c, cp_size=4) for c in range(4)]
        assert sum(d.tokens_read for d in counted) - before == 4 * (64 // 4 + 1)
        np.testing.assert_array_equal(np.concatenate([p.input_ids for p in parts]), full.input_ids)
        np.testing.assert_array_equal(np.concatenate([p.labels for p in parts]), full.labels)
        assert all(p.cu_seqlens == full.cu_seqlens for p in parts)


def test_loader_over_a_blend_gives_each_rank_its_samples_and_slice(prefixes):
    train = build_datasets(["0.5", prefixes["A"], "0.5", prefixes["B"]], SEQ, seed=2).train
    whole = next(MicroBatchLoader(train, micro_batch_size=2, dp_rank=0, dp_size=1))
    rank_batches = [
        next(MicroBatchLoader(train, 1, dp_rank=r, dp_size=2, cp_rank=c, cp_size=2)) for r in range(2) for c in range(2)
    ]
    for r in range(2):
        got = np.concatenate([rank_batches[2 * r + c].input_ids[0].numpy() for c in range(2)])
        np.testing.assert_array_equal(got, whole.input_ids[r].numpy())


# --- split -----------------------------------------------------------------------------------


def test_split_carves_contiguous_document_ranges_fixed_whatever_the_seed(prefixes):
    for seed in (0, 1):
        parts = build_datasets([prefixes["A"]], SEQ, seed=seed, split="80,15,5")
        assert set(parts.train.documents.tolist()) == set(range(80))
        np.testing.assert_array_equal(parts.valid.documents, np.arange(80, 95))
        np.testing.assert_array_equal(parts.test.documents, np.arange(95, 100))
        assert documents_of(parts.valid, 8) <= {1000 + d for d in range(80, 95)}
        assert documents_of(parts.train, 40) <= {1000 + d for d in range(80)}


def test_split_orders_training_documents_by_seed(prefixes):
    orders = [build_datasets([prefixes["A"]], SEQ, seed=s, split="969,30,1").train.epoch_order(0) for s in (0, 0, 1)]
    np.testing.assert_array_equal(orders[0], orders[1])
    assert not np.array_equal(orders[0], orders[2])


def test_split_of_a_blend_splits_every_prefix_and_blends_each_part(prefixes):
    parts = build_datasets(["0.5", prefixes["A"], "0.5", prefixes["B"]], SEQ, seed=0, split="50,50,0")
    assert parts.test is None
    valid_labels = documents_of(parts.valid, 20)
    assert valid_labels <= {1000 + d for d in range(50, 100)} | {2000 + d for d in range(20, 40)}
    assert {t // 1000 for t in valid_labels} == {1, 2}


def test_explicit_valid_path_replaces_the_valid_part(prefixes):
    parts = build_datasets([prefixes["A"]], SEQ, seed=0, split="90,10,0", valid_data_path=[prefixes["B"]])
    assert documents_of(parts.valid, 5) <= {2000 + d for d in range(40)}
    assert set(parts.train.documents.tolist()) == set(range(90))


def test_without_split_everything_trains(prefixes):
    parts = build_datasets([prefixes["A"]], SEQ, seed=0)
    assert len(parts.train.documents) == 100 and parts.valid is None and parts.test is None


# --- cache -----------------------------------------------------------------------------------


def _entries(directory) -> dict[str, float]:
    return {name: os.stat(os.path.join(directory, name)).st_mtime_ns for name in os.listdir(directory)}


def test_cache_is_reused_for_the_same_data_and_flags_and_rebuilt_otherwise(prefixes, tmp_path):
    cache = tmp_path / "cache"
    flags = dict(data_path=["0.7", prefixes["A"], "0.3", prefixes["B"]], seq_length=SEQ, split="90,10,0",
                 cache_path=str(cache), num_samples={"train": 50})
    read = lambda parts: [parts.train.read_tokens(i, 0, SEQ + 1).tolist() for i in range(40)]  # noqa: E731
    first = read(build_datasets(**flags, seed=0))
    built = _entries(cache)
    assert any(name.startswith("blend-") for name in built) and any(name.startswith("epoch-") for name in built)
    assert read(build_datasets(**flags, seed=0)) == first
    assert _entries(cache) == built  # read back, nothing rebuilt
    build_datasets(**flags, seed=1).train.read_tokens(0, 0, 4)
    assert set(built) < set(_entries(cache))  # another seed: other entries
    write_dataset(prefixes["B"], labelled_documents(3, 40), dtype=np.uint16)  # other data at the same prefix
    before = set(_entries(cache))
    changed = build_datasets(**flags, seed=0)
    assert 3 in {int(changed.train.read_tokens(i, 0, 1)[0]) // 1000 for i in range(40)}
    assert before < set(_entries(cache))


def test_cache_entry_with_another_description_is_rebuilt(prefixes, tmp_path):
    cache = tmp_path / "cache"
    flags = dict(data_path=[prefixes["A"]], seq_length=SEQ, seed=0, cache_path=str(cache))
    expected = build_datasets(**flags).train.read_tokens(3, 0, SEQ + 1).tolist()
    (entry,) = [name for name in os.listdir(cache) if not name.startswith(".")]
    description = cache / entry / "description.json"
    description.write_text(description.read_text().replace('"seed": 0', '"seed": 99'))
    np.save(cache / entry / "order.npy", np.zeros(100, dtype=np.int64))  # a stale entry's arrays
    assert build_datasets(**flags).train.read_tokens(3, 0, SEQ + 1).tolist() == expected
    assert '"seed": 0' in description.read_text()


# --- token ids against the vocabulary ---------------------------------------------------------


def test_token_ids_at_or_above_the_vocabulary_are_found_before_training(make_dataset):
    dataset = make_dataset([np.arange(10), np.array([3, 700, 5]), np.array([650])], name="other_tokenizer")
    check_token_ids(dataset, 701)
    message = r"other_tokenizer: token id 700 \(first at sequence 1\) is not below the vocabulary size 700"
    with pytest.raises(ValueError, match=message):
        check_token_ids(dataset, 700)


def test_build_datasets_checks_ids_against_the_vocabulary(prefixes):
    build_datasets([prefixes["A"]], SEQ, seed=0, vocab_size=1100)
    with pytest.raises(ValueError, match=r"B: token id 2039 \(first at sequence 0\) .* vocabulary size 1100"):
        build_datasets(["0.5", prefixes["A"], "0.5", prefixes["B"]], SEQ, seed=0, vocab_size=1100)


def test_largest_token_id_is_cached_by_dataset_identity(prefixes, tmp_path, make_dataset):
    cache = IndexCache(tmp_path / "cache")
    dataset = IndexedDataset(prefixes["B"])
    assert largest_token_id(dataset, cache) == 2039 and len(cache.built) == 1
    assert largest_token_id(IndexedDataset(prefixes["B"]), cache) == 2039 and len(cache.built) == 1
    assert largest_token_id(make_dataset([[], []], name="empty")) == -1


def test_cache_keeps_an_entry_another_rank_stored_first(tmp_path):
    first, second = IndexCache(tmp_path), IndexCache(tmp_path)
    description = {"kind": "test", "n": 3}
    stored = first.arrays("x", description, lambda: {"values": np.arange(3)})
    (entry,) = [p for p in tmp_path.iterdir()]
    stamp = (entry / "values.npy").stat().st_mtime_ns
    text = json.dumps(description, sort_keys=True)
    second._write(str(entry), text, {"values": np.arange(3)})  # a rank that built it too, a moment later
    assert (entry / "values.npy").stat().st_mtime_ns == stamp and sorted(os.listdir(tmp_path)) == [entry.name]
    again = second.arrays("x", description, lambda: {"values": np.zeros(3)})
    np.testing.assert_array_equal(again["values"], stored["values"])
    assert second.built == []
