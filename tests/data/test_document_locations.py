"""Each document's input record, written beside the dataset by preprocessing (through workers, partitions and
skipped records), read only while it matches the ids, and named where a document must be pointed at: the documents
longer than --seq-length."""

from __future__ import annotations

import pytest

from megatron_lc.data.document_locations import locations_path, read_locations
from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.loss_mask import merge_with_loss_masks
from megatron_lc.data.packing import LongDocumentsError, PackedDocumentSamples
from megatron_lc.data.preprocess import PreprocessOptions, preprocess
from tests.helpers import write_masked_dataset


def _texts(count: int) -> list[str]:
    return ["x" * (200 if i % 7 == 3 else 10 + i) for i in range(count)]


@pytest.mark.parametrize("workers,partitions", [(1, 1), (2, 1), (1, 3)])
def test_preprocessing_lists_each_documents_input_line_and_long_documents_are_named_by_it(tmp_path, write_jsonl,
                                                                                           workers, partitions):
    texts = _texts(40)
    paths = [write_jsonl(f"part{k}.jsonl", [{"text": t} for t in texts[k * 20:(k + 1) * 20]] + ["not json"])
             for k in range(2)]
    prefix = str(tmp_path / "out" / "data")
    preprocess(PreprocessOptions(inputs=tuple(map(str, paths)), output_prefix=prefix, tokenizer_type="ByteTokenizer",
                                 show_progress=False, skip_invalid=True, workers=workers, partitions=partitions))
    dataset_prefix = f"{prefix}_text_document"
    expected = {k * 20 + i: f"{paths[k]}:{i + 1}" for k in range(2) for i in range(20)}
    assert read_locations(dataset_prefix, list(expected)) == expected
    with pytest.raises(LongDocumentsError, match=rf"the first: document 3 \({paths[0]}:4, 200 tokens\), document 10 "
                       rf"\({paths[0]}:11, 200 tokens\), document 17 \({paths[0]}:18, 200 tokens\), document 24 "
                       rf"\({paths[1]}:5, 200 tokens\), document 31 \({paths[1]}:12, 200 tokens\), \.\.\."):
        PackedDocumentSamples(IndexedDataset(dataset_prefix), 100, seed=0)


def test_locations_are_concatenated_by_a_merge_and_ignored_once_the_ids_change(tmp_path, write_jsonl):
    prefixes = []
    for k in range(2):
        path = write_jsonl(f"p{k}.jsonl", [{"text": t} for t in _texts(5)])
        out = str(tmp_path / f"o{k}")
        preprocess(PreprocessOptions(inputs=(str(path),), output_prefix=out, tokenizer_type="ByteTokenizer",
                                     show_progress=False))
        prefixes.append((f"{out}_text_document", str(path)))
    merged = str(tmp_path / "merged")
    merge_with_loss_masks([p for p, _ in prefixes], merged)
    assert read_locations(merged, [4, 5]) == {4: f"{prefixes[0][1]}:5", 5: f"{prefixes[1][1]}:1"}
    # a dataset rewritten by another writer: its old list no longer matches its .idx and is not read
    write_masked_dataset(merged, [[1, 2, 3]] * 10)
    assert read_locations(merged, [4]) == {}
    with pytest.raises(LongDocumentsError, match=r"\(the longest 3 tokens; the first: document 0 \(3 tokens\), "):
        PackedDocumentSamples(IndexedDataset(merged), 2, seed=0)
    # a merge with a dataset that has no list writes none (and removes the old)
    merge_with_loss_masks([prefixes[0][0], merged], merged + "2")
    assert not (tmp_path / (locations_path(merged + "2"))).exists()
