"""A dataset's loss mask reaches the labels: masked targets are ignored, at every context-parallel shard's
edges too, through blends and --split; a mask that does not match its ids is refused."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.loss_mask import open_loss_mask
from megatron_lc.data.samples import IGNORE_INDEX, LongSequenceSamples, cp_ranges
from megatron_lc.data.packing import PackingSpec
from megatron_lc.data.sources import build_datasets
from tests.helpers import write_masked_dataset


def _documents(count, seed=0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 500, size=n).tolist() for n in rng.integers(3, 40, size=count)]
    masks = [(rng.random(len(d)) < 0.5).astype(int).tolist() for d in docs]
    return docs, masks


def _expected_labels(docs, masks, S, index):
    """Labels of sample `index` of the unshuffled stream, written out from the documents."""
    stream, mask = np.concatenate(docs), np.concatenate(masks)
    window = slice(index * S, (index + 1) * S + 1)
    labels = stream[window][1:].copy()
    labels[mask[window][1:] == 0] = IGNORE_INDEX
    return labels


@pytest.mark.parametrize("cp,ring", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)])
def test_masked_targets_are_ignored_on_every_shard_and_at_its_edges(tmp_path, cp, ring):
    docs, masks = _documents(60)
    prefix = write_masked_dataset(tmp_path / "chat", docs, masks)
    dataset = IndexedDataset(prefix)
    S = 32
    samples = LongSequenceSamples(dataset, S, seed=0, shuffle=False, loss_mask=open_loss_mask(dataset))
    for index in range(len(samples)):
        want = _expected_labels(docs, masks, S, index)
        got = np.full(S, -7)
        for rank in range(cp):
            sample = samples.get(index, rank, cp, cp_ring=ring)
            positions = np.concatenate([np.arange(a, b) for a, b in cp_ranges(S, rank, cp, ring)])
            got[positions] = sample.labels
        np.testing.assert_array_equal(got, want)
        assert (want == IGNORE_INDEX).any() and (want != IGNORE_INDEX).any()


def test_plain_text_trains_on_every_target(tmp_path):
    docs, _ = _documents(20)
    prefix = write_masked_dataset(tmp_path / "plain", docs)
    dataset = IndexedDataset(prefix)
    assert open_loss_mask(dataset) is None
    sample = LongSequenceSamples(dataset, 16, seed=0, shuffle=False).get(0)
    assert (sample.labels != IGNORE_INDEX).all()


def test_blends_and_split_parts_carry_each_datasets_mask(tmp_path):
    docs, masks = _documents(80, seed=1)
    chat = write_masked_dataset(tmp_path / "chat", docs, masks)
    plain_docs, _ = _documents(80, seed=2)
    plain = write_masked_dataset(tmp_path / "plain", plain_docs)
    S = 16
    parts = build_datasets(["1", chat, "1", plain], S, seed=3, split="80,20,0", shuffle=False)
    for part, (low, high) in [("train", (0, 64)), ("valid", (64, 80))]:
        source = getattr(parts, part)
        mine = LongSequenceSamples(IndexedDataset(chat), S, 3, False, np.arange(low, high),
                                   loss_mask=open_loss_mask(IndexedDataset(chat)))
        seen_chat = seen_plain = 0
        for index in range(8):
            which, inner = source.locate(index)
            labels = source.get(index).labels
            if which == 0:
                np.testing.assert_array_equal(labels, mine.get(inner).labels)
                seen_chat += (labels == IGNORE_INDEX).any()
            else:
                assert (labels != IGNORE_INDEX).all()
                seen_plain += 1
        assert seen_chat and seen_plain


def test_a_mask_that_does_not_match_its_ids_is_refused(tmp_path):
    docs, masks = _documents(10)
    masks[3] = masks[3][:-1]
    prefix = write_masked_dataset(tmp_path / "chat", docs, masks)
    with pytest.raises(ValueError, match=r"chat_loss_mask.idx: its sequence lengths or document indices differ from .*chat.idx's"):
        open_loss_mask(IndexedDataset(prefix))


def test_masked_data_under_stream_packing_gets_one_warning_naming_packing_documents(tmp_path):
    docs, masks = _documents(40, seed=1)
    chat = write_masked_dataset(tmp_path / "chat", docs, masks)
    other = write_masked_dataset(tmp_path / "chat2", docs, masks)
    plain = write_masked_dataset(tmp_path / "plain", _documents(40, seed=2)[0])
    notes = build_datasets(["1", chat, "1", other, "1", plain], 16, seed=3).notes
    warnings = [note for note in notes if note.startswith("warning:")]
    assert warnings == [f"warning: {chat} and 1 more carries a loss mask (chat data), trained under --packing stream: "
                        "its conversations are cut where samples end and attend to the ones before them; --packing "
                        "documents packs each whole, attending to itself only (docs/sft.md)"]
    assert not any(n.startswith("warning:") for n in build_datasets([plain], 16, seed=3).notes)
    packed = build_datasets([chat], 64, seed=3, packing=PackingSpec("documents")).notes
    assert not any(n.startswith("warning:") for n in packed)
