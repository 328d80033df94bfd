"""The Megatron .bin/.idx format: exact bytes, reading, merging, and bad files."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from megatron_lc.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    bin_path,
    idx_path,
    merge_datasets,
    optimal_dtype,
    temporary_writer,
    write_dataset,
)
from megatron_lc.processes import Writer, process_start_ticks


def test_idx_header_and_arrays_have_megatron_byte_layout(tmp_path):
    prefix = tmp_path / "known"
    write_dataset(prefix, [[1, 2, 3], [4, 5]], dtype=np.uint16)
    expected_idx = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)  # version
        + struct.pack("<B", 8)  # dtype code of uint16
        + struct.pack("<Q", 2)  # sequences
        + struct.pack("<Q", 3)  # document indices
        + struct.pack("<2i", 3, 2)  # sequence lengths
        + struct.pack("<2q", 0, 6)  # byte pointers
        + struct.pack("<3q", 0, 1, 2)  # document indices
    )
    assert (tmp_path / "known.idx").read_bytes() == expected_idx
    assert (tmp_path / "known.bin").read_bytes() == struct.pack("<5H", 1, 2, 3, 4, 5)


def test_round_trip_returns_every_document_exactly(make_dataset, random_documents):
    documents = random_documents(0, 50, 300, vocab=128256)
    dataset = make_dataset(documents, dtype=np.int32)
    assert len(dataset) == 50
    assert dataset.dtype == np.int32
    for i, document in enumerate(documents):
        np.testing.assert_array_equal(dataset[i], document)
    np.testing.assert_array_equal(dataset.sequence_lengths, [len(d) for d in documents])
    np.testing.assert_array_equal(dataset.document_indices, np.arange(51))
    assert dataset.num_tokens == sum(len(d) for d in documents)


def test_bin_file_is_the_tokens_back_to_back(make_dataset, tmp_path, random_documents):
    documents = random_documents(1, 20, 100)
    make_dataset(documents, dtype=np.uint16)
    expected = np.concatenate(documents).astype("<u2").tobytes()
    assert (tmp_path / "data.bin").read_bytes() == expected


def test_get_reads_a_slice_by_offset_and_length(make_dataset):
    dataset = make_dataset([np.arange(100), np.arange(100, 150)])
    np.testing.assert_array_equal(dataset.get(1, offset=10, length=5), np.arange(110, 115))
    np.testing.assert_array_equal(dataset.get(0, offset=95), np.arange(95, 100))
    with pytest.raises(IndexError, match="out of range"):
        dataset.get(1, offset=40, length=20)
    with pytest.raises(IndexError, match="sequence 2 out of range"):
        dataset.get(2)


def test_multi_sequence_documents_keep_their_document_indices(tmp_path):
    prefix = tmp_path / "multi"
    with IndexedDatasetBuilder(bin_path(prefix), dtype=np.uint16) as builder:
        builder.add_item([1, 2])
        builder.add_item([3])
        builder.end_document()
        builder.add_tokens([4, 5])
        builder.add_tokens([6])  # a sequence built in parts is still one sequence
        builder.end_item()
        builder.end_document()
        builder.finalize(idx_path(prefix))
    dataset = IndexedDataset(prefix)
    np.testing.assert_array_equal(dataset.sequence_lengths, [2, 1, 3])
    np.testing.assert_array_equal(dataset.document_indices, [0, 2, 3])
    np.testing.assert_array_equal(dataset[2], [4, 5, 6])


def test_optimal_dtype_switches_to_int32_at_megatrons_threshold():
    assert optimal_dtype(32000) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(128256) == np.int32


def test_builder_rejects_token_ids_that_do_not_fit_the_dtype(tmp_path):
    with IndexedDatasetBuilder(bin_path(tmp_path / "x"), dtype=np.uint16) as builder:
        with pytest.raises(ValueError, match="outside uint16"):
            builder.add_item([1, 70000])


def test_merge_equals_writing_everything_at_once(tmp_path, random_documents):
    first, second = random_documents(2, 10, 50), random_documents(3, 7, 50)
    write_dataset(tmp_path / "a", first, dtype=np.uint16)
    write_dataset(tmp_path / "b", second, dtype=np.uint16)
    write_dataset(tmp_path / "all", first + second, dtype=np.uint16)
    merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "merged")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == (tmp_path / f"all{suffix}").read_bytes()


def test_merge_of_different_dtypes_names_the_file(tmp_path):
    write_dataset(tmp_path / "a", [[1]], dtype=np.uint16)
    write_dataset(tmp_path / "b", [[1]], dtype=np.int32)
    with pytest.raises(IndexedDatasetError, match=r"b\.idx: dtype int32 differs"):
        merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "m")


def test_empty_dataset_round_trips(make_dataset):
    dataset = make_dataset([])
    assert len(dataset) == 0 and dataset.num_tokens == 0


# --- bad files ---------------------------------------------------------------------


@pytest.fixture
def good_prefix(tmp_path):
    prefix = tmp_path / "good"
    write_dataset(prefix, [[1, 2, 3], [4, 5], [6]], dtype=np.uint16)
    return prefix


def _patch(path, offset: int, data: bytes) -> None:
    content = bytearray(open(path, "rb").read())
    content[offset : offset + len(data)] = data
    open(path, "wb").write(bytes(content))


def test_truncated_index_is_reported_with_its_path(good_prefix):
    path = idx_path(good_prefix)
    os.truncate(path, os.path.getsize(path) - 5)
    with pytest.raises(IndexedDatasetError, match=rf"{path}: truncated index"):
        IndexedDataset(good_prefix)


def test_index_shorter_than_its_header_is_reported(good_prefix):
    os.truncate(idx_path(good_prefix), 10)
    with pytest.raises(IndexedDatasetError, match="truncated index: 10 bytes"):
        IndexedDataset(good_prefix)


def test_foreign_file_is_reported_as_not_an_index(good_prefix):
    _patch(idx_path(good_prefix), 0, b"PK\x03\x04")
    with pytest.raises(IndexedDatasetError, match="not a Megatron indexed dataset index"):
        IndexedDataset(good_prefix)


def test_other_index_version_is_reported(good_prefix):
    _patch(idx_path(good_prefix), 9, struct.pack("<Q", 2))
    with pytest.raises(IndexedDatasetError, match="index version 2, only version 1"):
        IndexedDataset(good_prefix)


def test_unknown_dtype_code_is_reported(good_prefix):
    _patch(idx_path(good_prefix), 17, struct.pack("<B", 42))
    with pytest.raises(IndexedDatasetError, match="unknown dtype code 42"):
        IndexedDataset(good_prefix)


def test_bin_size_that_disagrees_with_the_index_is_reported(good_prefix):
    path = bin_path(good_prefix)
    os.truncate(path, 4)
    with pytest.raises(IndexedDatasetError, match=rf"{path}: 4 bytes, but .* indexes 6 uint16 tokens \(12 bytes\)"):
        IndexedDataset(good_prefix)


def test_missing_bin_is_reported(good_prefix):
    os.remove(bin_path(good_prefix))
    with pytest.raises(IndexedDatasetError, match="token file not found"):
        IndexedDataset(good_prefix)


def test_corrupted_pointers_are_reported(good_prefix):
    _patch(idx_path(good_prefix), 34 + 3 * 4 + 8, struct.pack("<q", 3))
    with pytest.raises(IndexedDatasetError, match="pointers disagree"):
        IndexedDataset(good_prefix)


def test_failed_build_leaves_no_files_and_keeps_the_old_dataset(good_prefix, tmp_path):
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    with pytest.raises(RuntimeError, match="interrupted"):
        with IndexedDatasetBuilder(bin_path(good_prefix), dtype=np.uint16) as builder:
            builder.add_item([9, 9, 9, 9])
            raise RuntimeError("interrupted")
    after = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    assert after == before  # no temporary file left, old files untouched
    np.testing.assert_array_equal(IndexedDataset(good_prefix)[0], [1, 2, 3])


def test_unfinished_build_has_no_index_at_the_final_path(tmp_path):
    builder = IndexedDatasetBuilder(bin_path(tmp_path / "new"), dtype=np.uint16)
    builder.add_item([1, 2])
    builder.end_document()
    assert not IndexedDataset.exists(tmp_path / "new")
    builder.finalize(idx_path(tmp_path / "new"))
    assert IndexedDataset.exists(tmp_path / "new")
    assert sorted(os.listdir(tmp_path)) == ["new.bin", "new.idx"]


def _dead_writer() -> Writer:
    """A process of this host that has exited: its pid and start time, as its temporaries name it."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        writer = Writer(Writer.this_process().host, child.pid, process_start_ticks(child.pid) or 0)
    finally:
        child.kill()
        child.wait()
    return writer


def test_temporaries_name_their_writer(tmp_path):
    builder = IndexedDatasetBuilder(bin_path(tmp_path / "d"), dtype=np.uint16)
    (name,) = os.listdir(tmp_path)
    assert temporary_writer(str(tmp_path / "d.bin"), name) == Writer.this_process()
    assert temporary_writer(str(tmp_path / "e.bin"), name) is None  # another path's
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_a_dead_writers_temporaries_are_removed_and_a_live_ones_kept(tmp_path, capsys):
    dead, live = _dead_writer(), Writer.this_process()
    other_host = Writer("elsewhere", dead.pid, dead.start_ticks)
    names = {
        "dead_bin": f".d.bin.{dead.tag}-0a1b2c3d4e5f.tmp",
        "dead_idx": f".d.idx.{dead.tag}-0a1b2c3d4e5f.tmp",
        "live": f".d.bin.{live.tag}-0a1b2c3d4e5f.tmp",
        "other_host": f".d.bin.{other_host.tag}-0a1b2c3d4e5f.tmp",
        "other_path": f".e.bin.{dead.tag}-0a1b2c3d4e5f.tmp",
        "unnamed_writer": ".d.bin.0123456789abcdef0123456789abcdef.tmp",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    write_dataset(tmp_path / "d", [[1, 2, 3]], dtype=np.uint16)
    left = set(os.listdir(tmp_path))
    assert names["dead_bin"] not in left and names["dead_idx"] not in left
    assert {names[k] for k in ("live", "other_host", "other_path", "unnamed_writer")} <= left
    assert {"d.bin", "d.idx"} <= left
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2  # one line for the .bin's, one for the .idx's
    assert lines[0].startswith(f"{tmp_path / 'd.bin'}: removed 1 temporary file(s) left by processes of this host")
    assert f"{names['dead_bin']} (pid {dead.pid})" in lines[0]


# --- Megatron-core's own reader and writer ----------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_core_reads_our_files_unchanged(megatron_indexed_dataset, make_dataset, dtype, random_documents):
    documents = random_documents(4, 30, 200, vocab=60000)
    ours = make_dataset(documents, dtype=dtype)
    theirs = megatron_indexed_dataset.IndexedDataset(ours.path_prefix)
    assert len(theirs) == len(documents)
    np.testing.assert_array_equal(theirs.document_indices, ours.document_indices)
    np.testing.assert_array_equal(theirs.sequence_lengths, ours.sequence_lengths)
    for i, document in enumerate(documents):
        np.testing.assert_array_equal(theirs[i], document)
    long_document = int(np.argmax(ours.sequence_lengths))
    np.testing.assert_array_equal(theirs.get(long_document, 3, 7), ours.get(long_document, 3, 7))


def test_megatron_core_builder_writes_the_same_bytes_as_ours(megatron_indexed_dataset, tmp_path, random_documents):
    import torch

    documents = random_documents(5, 12, 80)
    builder = megatron_indexed_dataset.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for document in documents:
        builder.add_item(torch.from_numpy(document))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    write_dataset(tmp_path / "ours", documents, dtype=np.uint16)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()
    ours = IndexedDataset(tmp_path / "theirs")
    np.testing.assert_array_equal(ours[3], documents[3])
