"""Micro-batches: data-parallel sharding, batch layout, and exact resumption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_lc.data.loader import MicroBatchLoader
from megatron_lc.data.samples import LongSequenceSamples, MockSamples

SEQ_LENGTH = 32


@pytest.fixture
def samples(make_dataset, random_documents):
    return LongSequenceSamples(make_dataset(random_documents(9, 60, 50)), SEQ_LENGTH, seed=2)


def test_dp_ranks_take_consecutive_disjoint_samples_of_each_step(samples):
    batch_size, dp_size = 2, 3
    loaders = [MicroBatchLoader(samples, batch_size, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for step in range(4):
        for rank, loader in enumerate(loaders):
            batch = next(loader)
            first = step * batch_size * dp_size + rank * batch_size
            expected = np.stack([samples.get(first + b).input_ids for b in range(batch_size)])
            np.testing.assert_array_equal(batch.input_ids.numpy(), expected)


def test_batch_has_local_tensors_and_document_boundaries_of_the_flattened_batch_with_reset_attention_mask(samples):
    loader = MicroBatchLoader(samples, micro_batch_size=3, cp_rank=1, cp_size=4, reset_position_ids=True,
                              reset_attention_mask=True)
    batch = next(loader)
    for tensor in (batch.input_ids, batch.labels, batch.position_ids):
        assert tensor.dtype == torch.int64 and tensor.shape == (3, SEQ_LENGTH // 4)
    expected = [0]
    for b in range(3):
        expected += [b * SEQ_LENGTH + x for x in samples.get(b).cu_seqlens[1:]]
    assert batch.cu_seqlens == tuple(expected) and batch.cu_seqlens[-1] == 3 * SEQ_LENGTH
    assert batch.max_seqlen == max(np.diff(expected))
    np.testing.assert_array_equal(batch.labels[2].numpy(), samples.get(2, cp_rank=1, cp_size=4).labels)


def test_without_reset_attention_mask_each_sample_is_one_attention_segment_across_its_documents(samples):
    batch = next(MicroBatchLoader(samples, micro_batch_size=3, cp_rank=1, cp_size=4, reset_position_ids=True))
    assert sum(len(samples.get(b).cu_seqlens) - 1 for b in range(3)) > 3  # the samples do hold several documents
    assert batch.cu_seqlens == (0, SEQ_LENGTH, 2 * SEQ_LENGTH, 3 * SEQ_LENGTH) and batch.max_seqlen == SEQ_LENGTH
    per_document = samples.get(1, cp_rank=1, cp_size=4, reset_position_ids=True).position_ids
    np.testing.assert_array_equal(batch.position_ids[1].numpy(), per_document)  # positions reset all the same


def test_resumed_loader_yields_exactly_what_the_uninterrupted_one_does(samples):
    settings = dict(micro_batch_size=2, dp_rank=1, dp_size=2, cp_rank=1, cp_size=2)
    uninterrupted = MicroBatchLoader(samples, **settings)
    expected = [next(uninterrupted) for _ in range(7)]
    first_run = MicroBatchLoader(samples, **settings)
    for _ in range(3):
        next(first_run)
    state = first_run.state_dict()
    assert state == {"consumed_samples": 3 * 2 * 2, "seq_length": SEQ_LENGTH, "samples_per_step": 4,
                     "stream_start": [0], "stream_position": [3 * 2 * 2 * SEQ_LENGTH]}
    resumed = MicroBatchLoader(samples, **settings)
    resumed.load_state_dict(state)
    for want in expected[3:]:
        got = next(resumed)
        for name in ("input_ids", "labels", "position_ids"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
        assert got.cu_seqlens == want.cu_seqlens


def test_state_from_a_batch_layout_that_does_not_divide_continues_at_its_token(samples):
    loader = MicroBatchLoader(samples, micro_batch_size=2, dp_size=2)
    said = loader.load_state_dict({"consumed_samples": 6, "seq_length": SEQ_LENGTH, "samples_per_step": 3,
                                   "stream_start": [0], "stream_position": [6 * SEQ_LENGTH]})
    assert f"continues at token {6 * SEQ_LENGTH}" in said and loader.consumed_samples == 0


def test_loader_stops_after_num_samples(samples):
    loader = MicroBatchLoader(samples, micro_batch_size=2, dp_size=2, num_samples=9)
    assert len(list(loader)) == 2


def test_mock_samples_go_through_the_same_loader():
    loader = MicroBatchLoader(MockSamples(vocab_size=100, seq_length=16, seed=0), 2, cp_rank=0, cp_size=2)
    batch = next(loader)
    assert batch.input_ids.shape == (2, 8) and batch.cu_seqlens[-1] == 32


def test_bad_parallel_layout_is_rejected_early(samples):
    with pytest.raises(ValueError, match="dp_rank 2 is not a rank"):
        MicroBatchLoader(samples, 1, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match=r"is not divisible by 3 \(--context-parallel-size 3\)"):
        MicroBatchLoader(samples, 1, cp_size=3)


def _record_forks(monkeypatch) -> list:
    import multiprocessing.process

    forks, start = [], multiprocessing.process.BaseProcess.start

    def recording_start(process):
        forks.append(process)
        return start(process)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
    return forks


def _same_batch(a, b) -> bool:
    return a.cu_seqlens == b.cu_seqlens and all(torch.equal(getattr(a, n), getattr(b, n))
                                                 for n in ("input_ids", "labels", "position_ids"))


def test_worker_loader_forks_once_and_follows_every_new_position_without_forking(samples, monkeypatch):
    """Workers forked by start() serve the whole run: a resume (same length, another stream start, another
    length) or a count of samples moves them, never forks again (a fork after page-locking copies the arenas
    into every worker); the batches are the in-process loader's."""
    from megatron_lc.data.loader import WorkerLoader

    forks = _record_forks(monkeypatch)
    workers = WorkerLoader(MicroBatchLoader(samples, 2), num_workers=2).start()
    assert len(forks) == 2
    plain = MicroBatchLoader(samples, 2)
    assert all(_same_batch(next(workers), plain.micro_batch(k)) for k in range(3))
    workers.load_state_dict({"consumed_samples": 2})
    assert _same_batch(next(workers), plain.micro_batch(1))
    workers.load_state_dict({"consumed_samples": 0, "seq_length": SEQ_LENGTH, "samples_per_step": 2,
                             "stream_start": [5]})
    assert _same_batch(next(workers), MicroBatchLoader(samples.continued((5,)), 2).micro_batch(0))
    workers.load_state_dict({"consumed_samples": 6, "seq_length": 8, "samples_per_step": 2,
                             "stream_position": [40]})  # read at another length: the stream continues at 40
    assert _same_batch(next(workers), MicroBatchLoader(samples.continued((40,)), 2).micro_batch(0))
    workers.continue_by_sample_count(4)
    assert _same_batch(next(workers), MicroBatchLoader(samples.continued((40,)), 2).micro_batch(2))
    assert len(forks) == 2
    workers.close()
