"""`--packing documents`: whole documents packed into samples, none split, each attending to itself from
position 0, padding and each document's last target masked; deterministic from the seed, cached, and
continued at another --seq-length without skipping or repeating a document."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_lc.data.index_cache import IndexCache
from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.loss_mask import open_loss_mask
from megatron_lc.data.packing import LongDocumentsError, PackedDocumentSamples, PackingSpec, pack_epoch
from megatron_lc.data.samples import IGNORE_INDEX, cp_ranges
from megatron_lc.data.sources import build_datasets
from tests.helpers import write_masked_dataset


def _chat(tmp_path, count=120, seed=0, high=60, name="chat"):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 500, size=n).tolist() for n in rng.integers(2, high, size=count)]
    masks = [(rng.random(len(d)) < 0.6).astype(int).tolist() for d in docs]
    return write_masked_dataset(tmp_path / name, docs, masks), docs, masks


def _samples(prefix, S, **kw):
    dataset = IndexedDataset(prefix)
    return PackedDocumentSamples(dataset, S, seed=kw.pop("seed", 5), loss_mask=open_loss_mask(dataset), **kw)


def _document_of(samples, docs, index):
    """Which documents sample `index` holds, found by their tokens (documents have distinct contents)."""
    chosen, _ = samples._sample_documents(index)
    return samples.documents[chosen].tolist()


def test_every_document_once_per_epoch_whole_and_within_the_sample(tmp_path):
    prefix, docs, _ = _chat(tmp_path)
    S = 64
    samples = _samples(prefix, S)
    seen = []
    for i in range(len(samples)):
        held = _document_of(samples, docs, i)
        assert sum(len(docs[d]) for d in held) <= S
        seen += held
    assert sorted(seen) == list(range(len(docs)))
    again = _samples(prefix, S)
    assert [_document_of(again, docs, i) for i in range(len(samples))] == \
        [_document_of(samples, docs, i) for i in range(len(samples))], "deterministic from the seed"
    other = _samples(prefix, S, seed=6)
    assert [_document_of(other, docs, i) for i in range(3)] != [_document_of(samples, docs, i) for i in range(3)]
    nxt = [_document_of(samples, docs, len(samples) + i) for i in range(3)]  # the next epoch, shuffled anew
    assert nxt != [_document_of(samples, docs, i) for i in range(3)]


@pytest.mark.parametrize("cp,ring", [(1, 1), (2, 1), (2, 2)])
def test_a_sample_is_its_documents_from_position_0_with_last_targets_padding_and_masks_ignored(tmp_path, cp, ring):
    prefix, docs, masks = _chat(tmp_path)
    S = 64
    samples = _samples(prefix, S)
    for index in range(4):
        held = _document_of(samples, docs, index)
        tokens, labels, positions, cu = [], [], [], [0]
        for d in held:
            ids, mask = np.asarray(docs[d]), np.asarray(masks[d])
            tokens += ids.tolist()
            target = np.append(ids[1:], IGNORE_INDEX)
            target[:-1][mask[1:] == 0] = IGNORE_INDEX
            labels += target.tolist()
            positions += list(range(len(ids)))
            cu.append(cu[-1] + len(ids))
        pad = S - len(tokens)
        tokens, labels, positions = tokens + [0] * pad, labels + [IGNORE_INDEX] * pad, positions + list(range(pad))
        if pad:
            cu.append(S)
        got = {name: np.full(S, -7) for name in ("input_ids", "labels", "position_ids")}
        for rank in range(cp):
            sample = samples.get(index, rank, cp, cp_ring=ring)
            rows = np.concatenate([np.arange(a, b) for a, b in cp_ranges(S, rank, cp, ring)])
            for name in got:
                got[name][rows] = getattr(sample, name)
            assert sample.cu_seqlens == tuple(cu)
        np.testing.assert_array_equal(got["input_ids"], tokens)
        np.testing.assert_array_equal(got["labels"], labels)
        np.testing.assert_array_equal(got["position_ids"], positions)


def test_documents_longer_than_a_sample_stop_the_run_unless_truncated_or_dropped(tmp_path):
    prefix, docs, _ = _chat(tmp_path, high=100)
    S = 64
    long = sum(len(d) > S for d in docs)
    assert long > 1
    with pytest.raises(LongDocumentsError, match=f"{long} of {len(docs)} documents are longer than --seq-length 64 "
                                                 r"\(the longest \d+ tokens; the first: document \d+ \(\d+ tokens\), document .*, \.\.\.\).*"
                                                 "--long-documents truncate or drop"):
        _samples(prefix, S)
    dropped = _samples(prefix, S, long_documents="drop")
    assert len(dropped.documents) == len(docs) - long
    assert f"{long} documents longer than a sample dropped" in dropped.note("train")
    truncated = _samples(prefix, S, long_documents="truncate")
    assert len(truncated.documents) == len(docs) and "truncated to --seq-length" in truncated.note("train")
    for i in range(len(truncated)):
        held = _document_of(truncated, docs, i)
        if len(held) == 1 and len(docs[held[0]]) > S:
            np.testing.assert_array_equal(truncated.get(i).input_ids, docs[held[0]][:S])
            break
    else:
        pytest.fail("no truncated document found")


def test_continuing_at_another_seq_length_neither_skips_nor_repeats_a_document(tmp_path):
    prefix, docs, _ = _chat(tmp_path, count=300)
    first = _samples(prefix, 64)
    for consumed in (1, 7, len(first) - 1):
        before = [d for i in range(consumed) for d in _document_of(first, docs, i)]
        position = first.stream_position(consumed)
        later = first.continued(position)
        assert later.seq_length == 64 and later.stream_position(0) == position
        for S in (64, 96, 128):
            rest = PackedDocumentSamples(first.dataset, S, 5, loss_mask=first.loss_mask, start=position)
            after = [d for i in range(len(rest)) for d in _document_of(rest, docs, i)]
            assert sorted(before + after) == list(range(len(docs))), (consumed, S)
            if S == 64:  # the same length: the same samples as the run that did not stop
                assert [_document_of(rest, docs, i) for i in range(3)] == \
                    [_document_of(first, docs, consumed + i) for i in range(3)]


def test_the_index_is_cached_and_read_back(tmp_path):
    prefix, docs, _ = _chat(tmp_path)
    cache = IndexCache(tmp_path / "cache")
    samples = PackedDocumentSamples(IndexedDataset(prefix), 64, 5, cache=cache)
    held = [_document_of(samples, docs, i) for i in range(len(samples))]
    assert cache.built
    again_cache = IndexCache(tmp_path / "cache")
    again = PackedDocumentSamples(IndexedDataset(prefix), 64, 5, cache=again_cache)
    assert [_document_of(again, docs, i) for i in range(len(again))] == held and not again_cache.built


def test_padding_is_under_5_percent_on_a_realistic_length_mix():
    """Chat-like lengths: log-normal, median 1,500 tokens, a tail to 32K; samples of 32K and 128K tokens."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(np.log(1500), 1.0, size=20_000).astype(np.int64) + 1, 32_768)
    for S in (32_768, 131_072):
        packed = pack_epoch(lengths, S)
        padding = 1 - packed["used"][:-1].sum() / ((len(packed["used"]) - 1) * S)  # the epoch's last sample aside
        assert padding <= 0.05, (S, padding)
        assert sorted(packed["documents"].tolist()) == list(range(len(lengths)))


def test_blends_and_split_parts_pack_their_own_documents(tmp_path):
    a, docs_a, _ = _chat(tmp_path, seed=1, name="a")
    b, _, _ = _chat(tmp_path, seed=2, name="b")
    parts = build_datasets(["1", a, "1", b], 64, seed=3, split="80,20,0", packing=PackingSpec("documents"))
    train, valid = parts.train, parts.valid
    assert any("--packing documents: valid part of" in n for n in parts.notes)
    for index in range(6):
        which, inner = train.locate(index)
        member = train.sources[which]
        assert isinstance(member, PackedDocumentSamples) and member.documents.max() < 96
        sample = train.get(index)
        np.testing.assert_array_equal(sample.input_ids, member.get(inner).input_ids)
    which, inner = valid.locate(0)
    assert valid.sources[which].documents.min() >= 96
