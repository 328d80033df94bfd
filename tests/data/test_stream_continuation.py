"""Progressive lengths continue the token stream: a run resumed at another --seq-length (or batch layout)
reads from the first token not yet trained, in the same shuffled document order, neither skipping nor
repeating a token, against one uninterrupted pass; each stream of a blend at its own position."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_lc.data.blending import BlendedSamples
from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.loader import MicroBatchLoader
from megatron_lc.data.samples import LongSequenceSamples, MockSamples
from tests.helpers import write_random_dataset


@pytest.fixture
def dataset(tmp_path):
    return IndexedDataset(write_random_dataset(tmp_path / "d", documents=60, lengths=(5, 90), vocab=500, seed=3))


def _stream(dataset, seed, shuffle=True, tokens=None) -> np.ndarray:
    """The document stream itself, read in one piece."""
    whole = LongSequenceSamples(dataset, tokens, seed, shuffle)
    return whole.read_tokens(0, 0, tokens + 1).astype(np.int64)


def _read_phases(source, phases, micro=2, dp=1):
    """Each phase (seq_length, steps, dp): a loader per dp rank at that length, resumed from the state the
    previous phase left; returns every sample's inputs and labels in stream order, and the messages."""
    inputs, labels, messages, state = [], [], [], None
    for seq_length, steps, dp in phases:
        phase_source = _at_length(source, seq_length)
        loaders = [MicroBatchLoader(phase_source, micro, rank, dp) for rank in range(dp)]
        if state is not None:
            messages += [loader.load_state_dict(state) for loader in loaders][:1]
        for _ in range(steps):
            batches = [next(loader) for loader in loaders]
            for batch in batches:  # samples in stream order: rank 0's micro-batch, then rank 1's
                for b in range(micro):
                    inputs.append(batch.input_ids[b].numpy())
                    labels.append(batch.labels[b].numpy())
        state = loaders[0].state_dict()
        assert all(loader.state_dict() == state for loader in loaders)
    return np.concatenate(inputs), np.concatenate(labels), messages


def _at_length(source, seq_length):
    if isinstance(source, BlendedSamples):
        return BlendedSamples([_at_length(s, seq_length) for s in source.sources], source.weights, source.size)
    return LongSequenceSamples(source.dataset, seq_length, source.seed, source.shuffle, source.documents)


@pytest.mark.parametrize("shuffle", [True, False])
def test_growing_lengths_read_the_stream_of_one_uninterrupted_pass(dataset, shuffle):
    source = LongSequenceSamples(dataset, 16, seed=7, shuffle=shuffle)
    phases = [(16, 3, 1), (32, 2, 1), (64, 2, 1)]  # 4K -> 8K -> 16K in miniature
    inputs, labels, messages = _read_phases(source, phases)
    total = sum(s * steps * dp * 2 for s, steps, dp in phases)
    stream = _stream(dataset, 7, shuffle, total)
    np.testing.assert_array_equal(inputs, stream[:total])  # neither skipped nor repeated
    np.testing.assert_array_equal(labels, stream[1:total + 1])
    assert messages == ["--seq-length 32 x 2 samples per step (the checkpoint read 16 x 2): the token stream "
                        "continues at token 96, the first not yet trained",
                        "--seq-length 64 x 2 samples per step (the checkpoint read 32 x 2): the token stream "
                        "continues at token 224, the first not yet trained"]


def test_a_resume_at_the_same_length_keeps_the_offset_a_length_change_gave(dataset):
    source = LongSequenceSamples(dataset, 16, seed=7)
    phases = [(16, 3, 1), (32, 1, 1), (32, 2, 1), (16, 1, 1)]
    inputs, _, messages = _read_phases(source, phases)
    total = sum(s * steps * dp * 2 for s, steps, dp in phases)
    np.testing.assert_array_equal(inputs, _stream(dataset, 7, True, total)[:total])
    assert messages[1] == ""  # sample after sample, from the offset the 16 -> 32 change set


def test_another_data_parallel_size_continues_the_stream(dataset):
    source = LongSequenceSamples(dataset, 16, seed=7)
    phases = [(16, 2, 1), (16, 2, 2), (32, 1, 2)]  # one rank, then two, then two at twice the length
    inputs, _, messages = _read_phases(source, phases)
    total = sum(s * steps * dp * 2 for s, steps, dp in phases)
    np.testing.assert_array_equal(inputs, _stream(dataset, 7, True, total)[:total])
    assert messages[0] == ""  # 4 samples consumed are one step of 4: sample after sample
    assert "the checkpoint read 16 x 4" in messages[1] and "continues at token 192" in messages[1]


def test_a_batch_layout_that_does_not_divide_the_samples_consumed_continues_at_their_token(dataset):
    source = LongSequenceSamples(dataset, 16, seed=7)
    phases = [(16, 3, 1), (16, 2, 2)]  # 6 samples consumed, 4 per step now
    inputs, _, messages = _read_phases(source, phases)
    total = sum(s * steps * dp * 2 for s, steps, dp in phases)
    np.testing.assert_array_equal(inputs, _stream(dataset, 7, True, total)[:total])
    assert "continues at token 96" in messages[0]


def test_each_stream_of_a_blend_continues_at_its_own_position(tmp_path, dataset):
    other = IndexedDataset(write_random_dataset(tmp_path / "o", documents=40, lengths=(5, 60), vocab=500, seed=4))
    parts = [LongSequenceSamples(dataset, 16, seed=7), LongSequenceSamples(other, 16, seed=8)]
    blend = BlendedSamples(parts, [0.7, 0.3], 64)
    first = MicroBatchLoader(blend, 2)
    for _ in range(5):
        next(first)
    state = first.state_dict()
    drawn = np.bincount([blend.locate(i)[0] for i in range(10)], minlength=2)
    assert state["stream_position"] == [16 * drawn[0], 16 * drawn[1]]
    longer = MicroBatchLoader(_at_length(blend, 48), 2)
    assert "continues at token" in longer.load_state_dict(state)
    for _ in range(3):
        batch = next(longer)
        for b in range(2):
            index = longer.consumed_samples - 2 + b
            source, sample = longer.samples.locate(index)
            stream_part = longer.samples.sources[source]
            start = state["stream_position"][source] + 48 * sample
            want = _stream(parts[source].dataset, parts[source].seed, True, start + 48)[start:start + 48]
            np.testing.assert_array_equal(batch.input_ids[b].numpy(), want)
            assert stream_part.token_offset == state["stream_position"][source]


def test_mock_data_at_another_length_is_refused_naming_both():
    loader = MicroBatchLoader(MockSamples(100, 16, seed=0), 1)
    next(loader)
    state = loader.state_dict()
    assert state["stream_position"] is None
    with pytest.raises(ValueError, match=r"read at --seq-length 16 x 1 samples per step \(1 samples consumed\), "
                                         "this run reads 32 x 1, and mock data is no token stream"):
        MicroBatchLoader(MockSamples(100, 32, seed=0), 1).load_state_dict(state)
    again = MicroBatchLoader(MockSamples(100, 16, seed=0), 1)
    assert again.load_state_dict(state) == "" and again.consumed_samples == 1
