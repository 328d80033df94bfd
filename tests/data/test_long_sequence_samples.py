"""Sample cutting and context-parallel slicing against an in-memory reference stream."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_lc.data.samples import IGNORE_INDEX, LongSequenceSamples, MockSamples

SEQ_LENGTH = 64


class ReferenceStream:
    """Everything concatenated in memory: the stream the samples must be cut from."""

    def __init__(self, documents: list[np.ndarray], epoch_orders: list[np.ndarray]) -> None:
        self.tokens = np.concatenate([documents[d] for order in epoch_orders for d in order])
        ends = np.cumsum([len(documents[d]) for order in epoch_orders for d in order])
        self.ends = ends

    def sample(self, i: int, seq_length: int) -> np.ndarray:
        return self.tokens[i * seq_length : (i + 1) * seq_length + 1]

    def cu_seqlens(self, i: int, seq_length: int) -> tuple[int, ...]:
        start = i * seq_length
        inside = sorted({int(e) - start for e in self.ends if start < e < start + seq_length})
        return (0, *inside, seq_length)


@pytest.fixture
def documents(random_documents):
    return random_documents(7, 30, 40, vocab=500)


@pytest.fixture
def dataset(make_dataset, documents):
    return make_dataset(documents, dtype=np.uint16)


def test_unshuffled_sample_is_the_stream_slice_across_epochs(dataset, documents):
    samples = LongSequenceSamples(dataset, SEQ_LENGTH, seed=0, shuffle=False)
    epochs = 4
    reference = ReferenceStream(documents, [np.arange(len(documents))] * epochs)
    count = len(reference.tokens) // SEQ_LENGTH - 1
    assert count > 3 * len(samples)  # the loop below runs through several epochs
    for i in range(count):
        sample = samples.get(i)
        expected = reference.sample(i, SEQ_LENGTH)
        np.testing.assert_array_equal(sample.input_ids, expected[:-1])
        np.testing.assert_array_equal(sample.labels, expected[1:])
        np.testing.assert_array_equal(sample.position_ids, np.arange(SEQ_LENGTH))
        assert sample.cu_seqlens == reference.cu_seqlens(i, SEQ_LENGTH)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_document_subset_is_the_stream_of_those_documents_only(dataset, documents, shuffle, tmp_path):
    from megatron_lc.data.index_cache import IndexCache

    subset = np.arange(10, 24)
    caches = (None, IndexCache(tmp_path / "cache"), IndexCache(tmp_path / "cache"))  # no cache, stored, read back
    for cache in caches:
        samples = LongSequenceSamples(dataset, SEQ_LENGTH, seed=5, shuffle=shuffle, documents=subset, cache=cache)
        orders = [subset[samples.epoch_order(e)] for e in range(3)]
        reference = ReferenceStream(documents, orders)
        assert samples.tokens_per_epoch == sum(len(documents[d]) for d in subset)
        for i in range(len(reference.tokens) // SEQ_LENGTH - 1):
            np.testing.assert_array_equal(samples.get(i).input_ids, reference.sample(i, SEQ_LENGTH)[:-1])
            assert samples.get(i).cu_seqlens == reference.cu_seqlens(i, SEQ_LENGTH)
    assert caches[1].built and caches[2].built == []


@pytest.mark.parametrize("cp_size", [1, 2, 4, 8])
def test_cp_slices_of_shuffled_samples_match_the_reference(dataset, documents, cp_size):
    samples = LongSequenceSamples(dataset, SEQ_LENGTH, seed=3, shuffle=True)
    reference = ReferenceStream(documents, [samples.epoch_order(e) for e in range(4)])
    local = SEQ_LENGTH // cp_size
    for i in range(0, len(reference.tokens) // SEQ_LENGTH - 1, 3):
        expected = reference.sample(i, SEQ_LENGTH)
        for rank in range(cp_size):
            piece = samples.get(i, cp_rank=rank, cp_size=cp_size)
            window = expected[rank * local : (rank + 1) * local + 1]
            np.testing.assert_array_equal(piece.input_ids, window[:-1])
            np.testing.assert_array_equal(piece.labels, window[1:])  # last label = next slice's first input
            np.testing.assert_array_equal(piece.position_ids, np.arange(rank * local, (rank + 1) * local))
            assert piece.cu_seqlens == reference.cu_seqlens(i, SEQ_LENGTH)
            assert piece.input_ids.dtype == piece.labels.dtype == piece.position_ids.dtype == np.int64


def test_each_epoch_is_a_seeded_permutation_of_the_documents(dataset, documents):
    samples = LongSequenceSamples(dataset, SEQ_LENGTH, seed=11)
    orders = [samples.epoch_order(e) for e in range(3)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(len(documents)))
    assert not np.array_equal(orders[0], orders[1])
    np.testing.assert_array_equal(LongSequenceSamples(dataset, SEQ_LENGTH, seed=11).epoch_order(2), orders[2])
    assert not np.array_equal(LongSequenceSamples(dataset, SEQ_LENGTH, seed=12).epoch_order(0), orders[0])


def test_reset_position_ids_count_from_each_document_start(dataset, documents):
    samples = LongSequenceSamples(dataset, SEQ_LENGTH, seed=5)
    for i in range(6):
        full = samples.get(i, reset_position_ids=True)
        expected = np.concatenate(
            [np.arange(b - a) for a, b in zip(full.cu_seqlens[:-1], full.cu_seqlens[1:], strict=True)]
        )
        np.testing.assert_array_equal(full.position_ids, expected)
        halves = [samples.get(i, cp_rank=r, cp_size=2, reset_position_ids=True).position_ids for r in range(2)]
        np.testing.assert_array_equal(np.concatenate(halves), expected)


def test_eod_mask_loss_masks_labels_after_an_eod_input(make_dataset):
    eod = 9
    dataset = make_dataset([[1, 2, eod], [3, eod], [4, 5, 6, eod]] * 4)
    samples = LongSequenceSamples(dataset, 8, seed=0, shuffle=False)
    sample = samples.get(0, eod_mask_loss=True, eod_token=eod)
    np.testing.assert_array_equal(sample.input_ids, [1, 2, eod, 3, eod, 4, 5, 6])
    np.testing.assert_array_equal(sample.labels, [2, eod, IGNORE_INDEX, eod, IGNORE_INDEX, 5, 6, eod])
    assert sample.cu_seqlens == (0, 3, 5, 8)
    with pytest.raises(ValueError, match="eod_mask_loss needs eod_token"):
        samples.get(0, eod_mask_loss=True)


def test_a_cp_rank_reads_only_its_slice_from_the_memory_map(make_dataset, random_documents, counting_reads):
    counting = counting_reads(make_dataset(random_documents(8, 200, 500)))
    seq_length, cp_size = 4096, 8
    samples = LongSequenceSamples(counting, seq_length, seed=1)
    samples.get(2, cp_rank=5, cp_size=cp_size)
    assert counting.tokens_read == seq_length // cp_size + 1


def test_cp_size_that_does_not_divide_seq_length_is_an_error(dataset):
    samples = LongSequenceSamples(dataset, 30, seed=0)
    with pytest.raises(ValueError, match="--seq-length 30 is not divisible by 4"):
        samples.get(0, cp_rank=0, cp_size=4)
    with pytest.raises(ValueError, match="cp_rank 2 is not a rank of a context-parallel group of size 2"):
        samples.get(0, cp_rank=2, cp_size=2)


def test_len_counts_samples_inside_the_first_epoch(dataset):
    samples = LongSequenceSamples(dataset, SEQ_LENGTH, seed=0)
    assert len(samples) == (dataset.num_tokens - 1) // SEQ_LENGTH


def test_dataset_without_tokens_is_an_error(make_dataset):
    with pytest.raises(ValueError, match="holds no tokens"):
        LongSequenceSamples(make_dataset([[], []]), 8, seed=0)


def test_mock_samples_are_deterministic_and_sliced_consistently():
    mock = MockSamples(vocab_size=1000, seq_length=256, seed=4, documents_per_sample=5)
    full = mock.get(3)
    assert full.input_ids.min() >= 0 and full.input_ids.max() < 1000
    assert len(full.cu_seqlens) == 6 and full.cu_seqlens[0] == 0 and full.cu_seqlens[-1] == 256
    np.testing.assert_array_equal(
        MockSamples(1000, 256, seed=4, documents_per_sample=5).get(3).input_ids, full.input_ids
    )
    for cp_size in (2, 4, 8):
        pieces = [mock.get(3, cp_rank=r, cp_size=cp_size, reset_position_ids=True) for r in range(cp_size)]
        np.testing.assert_array_equal(np.concatenate([p.input_ids for p in pieces]), full.input_ids)
        np.testing.assert_array_equal(np.concatenate([p.labels for p in pieces]), full.labels)
        assert all(p.cu_seqlens == full.cu_seqlens for p in pieces)
    np.testing.assert_array_equal(full.labels[:-1], full.input_ids[1:])
    assert not np.array_equal(mock.get(4).input_ids, full.input_ids)
    assert not np.array_equal(MockSamples(1000, 256, seed=5).get(3).input_ids, full.input_ids)
