"""preprocess: every input format, parallel and partitioned runs, long documents, bad input."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from megatron_lc.data.corpus import InvalidInputError
from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.preprocess import PreprocessOptions, preprocess, split_contiguous
from megatron_lc.data.tokenizers import ByteTokenizer
from tests.data.helpers import byte_tokens, output_bytes, read_documents



@pytest.fixture
def output_prefix(tmp_path):
    return str(tmp_path / "out" / "corpus")


@pytest.fixture
def run(output_prefix):
    """Preprocess `inputs` with ByteTokenizer and --append-eod unless told otherwise."""

    def run(inputs, **overrides):
        settings = dict(tokenizer_type="ByteTokenizer", append_eod=True, show_progress=False)
        settings.update(overrides)
        options = PreprocessOptions(inputs=tuple(map(str, inputs)), output_prefix=output_prefix, **settings)
        return preprocess(options)

    return run


# --- formats -------------------------------------------------------------------------


def test_json_lines_become_one_sequence_per_document_with_eod(run, write_jsonl, output_prefix, corpus_texts):
    path = write_jsonl("a.jsonl", [{"text": t, "id": i} for i, t in enumerate(corpus_texts)])
    summary = run([path])
    assert read_documents(output_prefix) == [byte_tokens(t) for t in corpus_texts]
    assert summary.documents == len(corpus_texts)
    assert summary.total_tokens == sum(len(byte_tokens(t)) for t in corpus_texts)
    assert IndexedDataset(f"{output_prefix}_text_document").dtype == np.uint16


def test_json_array_file_gives_the_same_dataset_as_json_lines(run, write_jsonl, output_prefix, tmp_path, corpus_texts):
    run([write_jsonl("a.jsonl", [{"text": t} for t in corpus_texts])])
    expected = output_bytes(output_prefix)
    array_path = tmp_path / "a.json"
    array_path.write_text(json.dumps([{"text": t} for t in corpus_texts], indent=2))
    run([array_path])
    assert output_bytes(output_prefix) == expected


def test_parquet_gives_the_same_dataset_as_json_lines(run, write_jsonl, output_prefix, tmp_path, corpus_texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    run([write_jsonl("a.jsonl", [{"text": t} for t in corpus_texts])])
    expected = output_bytes(output_prefix)
    pq.write_table(
        pa.table({"text": corpus_texts, "n": list(range(len(corpus_texts)))}), tmp_path / "a.parquet", row_group_size=7
    )
    run([tmp_path / "a.parquet"])
    assert output_bytes(output_prefix) == expected


def test_saved_datasets_directory_and_dataset_dict_split_are_read(run, output_prefix, tmp_path, corpus_texts):
    import datasets

    dataset = datasets.Dataset.from_dict({"text": corpus_texts})
    dataset.save_to_disk(str(tmp_path / "saved"))
    run([tmp_path / "saved"])
    assert read_documents(output_prefix) == [byte_tokens(t) for t in corpus_texts]
    splits = datasets.DatasetDict({"train": dataset.select(range(3)), "validation": dataset.select(range(3, 5))})
    splits.save_to_disk(str(tmp_path / "splits"))
    run([tmp_path / "splits"], split="validation")
    assert read_documents(output_prefix) == [byte_tokens(t) for t in corpus_texts[3:5]]
    with pytest.raises(InvalidInputError, match="no split 'test' \\(splits: train, validation\\)"):
        run([tmp_path / "splits"], split="test")


def test_plain_text_files_are_one_document_each_in_glob_order(run, output_prefix, tmp_path):
    (tmp_path / "books").mkdir()
    for name, text in [("b.txt", "second book\n"), ("a.txt", "first book\nwith two lines")]:
        (tmp_path / "books" / name).write_text(text)
    run([str(tmp_path / "books" / "*.txt")])
    assert read_documents(output_prefix) == [byte_tokens("first book\nwith two lines"), byte_tokens("second book\n")]
    run([tmp_path / "books"])  # a directory stands for its files
    assert len(read_documents(output_prefix)) == 2


def test_gzip_compressed_json_lines_are_read(run, output_prefix, tmp_path):
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as stream:
        stream.write(json.dumps({"text": "compressed"}) + "\n")
    run([tmp_path / "a.jsonl.gz"])
    assert read_documents(output_prefix) == [byte_tokens("compressed")]


def test_several_json_keys_write_one_aligned_dataset_each(run, write_jsonl, output_prefix):
    path = write_jsonl("a.jsonl", [{"q": "one", "a": "1"}, {"q": "two"}, {"q": "three", "a": "3"}])
    summary = run([path], json_keys=("q", "a"), skip_invalid=True)
    assert read_documents(output_prefix, "q") == [byte_tokens("one"), byte_tokens("three")]
    assert read_documents(output_prefix, "a") == [byte_tokens("1"), byte_tokens("3")]
    assert summary.problems.counts["missing key 'a'"].count == 1


def test_bos_and_eod_are_added_at_document_edges_only(run, write_jsonl, output_prefix):
    path = write_jsonl("a.jsonl", [{"text": "ab\n" * 10}])
    run([path], prepend_bos=True)
    assert read_documents(output_prefix) == [[ByteTokenizer.BOS_ID] + byte_tokens("ab\n" * 10)]


# --- long documents, workers, partitions ------------------------------------------------


def test_long_document_is_one_sequence(run, write_jsonl, output_prefix):
    text = "数据🙂é" * 5000 + "\n" + "word " * 3000
    run([write_jsonl("a.jsonl", [{"text": text}, {"text": "short"}])])
    assert read_documents(output_prefix) == [byte_tokens(text), byte_tokens("short")]


def test_long_plain_text_file_is_one_sequence(run, output_prefix, tmp_path):
    text = "".join(f"line {i} 🙂\r\n" for i in range(3000)) + "x" * 5000
    (tmp_path / "book.txt").write_bytes(text.encode("utf-8"))  # bytes as they are: CRLF kept
    run([tmp_path / "book.txt"])
    assert read_documents(output_prefix) == [byte_tokens(text)]


def test_two_workers_write_the_same_bytes_as_one(
    run, write_jsonl, output_prefix, corpus_texts, sentencepiece_model, monkeypatch
):
    monkeypatch.setattr("megatron_lc.data.encode.TASK_CHARS", 3000)  # many tasks in flight
    path = write_jsonl("a.jsonl", [{"text": t * 30} for t in corpus_texts])
    settings = dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sentencepiece_model)
    run([path], workers=1, **settings)
    expected = output_bytes(output_prefix)
    run([path], workers=2, **settings)
    assert output_bytes(output_prefix) == expected


def test_partitions_write_the_same_bytes_as_one_pass(run, write_jsonl, output_prefix, corpus_texts):
    paths = [write_jsonl(f"{i}.jsonl", [{"text": t} for t in corpus_texts[i::3]]) for i in range(3)]
    run(paths)
    expected = output_bytes(output_prefix)
    summary = run(paths, partitions=2, workers=2)
    assert output_bytes(output_prefix) == expected
    assert summary.documents == len(corpus_texts)
    assert sorted(os.listdir(os.path.dirname(output_prefix))) == [
        "corpus_text_document.bin",
        "corpus_text_document.idx",
        "corpus_text_document_locations.tsv",
    ]


def test_split_contiguous_keeps_order_and_uses_each_partition():
    files = [__file__] * 5
    groups = split_contiguous(files, 3)
    assert len(groups) == 3 and sum(groups, []) == files
    assert split_contiguous(files[:2], 4) == [[__file__], [__file__]]


# --- bad input ----------------------------------------------------------------------------


def test_malformed_json_line_stops_with_file_and_line(run, write_jsonl):
    path = write_jsonl("a.jsonl", [{"text": "ok"}, {"text": "ok"}, '{"text": "unterminated'])
    with pytest.raises(InvalidInputError, match=rf"{path}:3: malformed JSON: Unterminated string"):
        run([path])


def test_each_invalid_line_is_skipped_and_counted_with_skip_invalid(run, write_jsonl, output_prefix):
    records = [
        {"text": "good"},
        "{not json",
        {"other": "no text key"},
        {"text": None},
        {"text": 42},
        {"text": ["a", "list"]},
        b'{"text": "caf\xe9"}',  # Latin-1, not UTF-8
        "[1, 2]",
        {"text": "also good"},
    ]
    summary = run([write_jsonl("a.jsonl", records)], skip_invalid=True)
    assert read_documents(output_prefix) == [byte_tokens("good"), byte_tokens("also good")]
    counts = {reason: entry.count for reason, entry in summary.problems.counts.items()}
    assert counts == {
        "malformed JSON": 1,
        "missing key 'text'": 2,
        "non-string value for 'text'": 2,
        "invalid UTF-8": 1,
        "not a JSON object": 1,
    }
    assert summary.problems.counts["invalid UTF-8"].first_location.endswith("a.jsonl:7")
    assert "non-string value for 'text': 2 (first at" in summary.format()


@pytest.mark.parametrize(
    "record, message",
    [
        ({"other": 1}, "missing key 'text'"),
        ({"text": None}, "missing key 'text'"),
        ({"text": 3.5}, "non-string value for 'text': float"),
        (b'{"text": "\xff"}', "invalid UTF-8"),
    ],
)
def test_invalid_record_stops_without_skip_invalid(run, write_jsonl, record, message):
    path = write_jsonl("a.jsonl", [{"text": "fine"}, record])
    with pytest.raises(InvalidInputError, match=rf"a\.jsonl:2: {message}"):
        run([path])


def test_empty_documents_are_always_skipped_and_counted(run, write_jsonl, output_prefix, tmp_path):
    (tmp_path / "blank.txt").write_text("  \n\n")
    path = write_jsonl("a.jsonl", [{"text": ""}, {"text": " \n\t"}, {"text": "kept"}, ""])
    summary = run([path, tmp_path / "blank.txt"])  # not an error even without --skip-invalid
    assert read_documents(output_prefix) == [byte_tokens("kept")]
    assert summary.problems.counts["empty document"].count == 3  # the blank line between records is ignored


def test_invalid_utf8_in_a_text_file_names_its_line(run, tmp_path, output_prefix):
    (tmp_path / "a.txt").write_bytes(b"fine\nstill fine\nbad \xc3\x28 byte\n")
    (tmp_path / "b.txt").write_text("good")
    with pytest.raises(InvalidInputError, match=r"a\.txt:3: invalid UTF-8: byte 0xc3"):
        run([tmp_path / "a.txt"])
    summary = run([tmp_path / "a.txt", tmp_path / "b.txt"], skip_invalid=True)
    assert read_documents(output_prefix) == [byte_tokens("good")]
    assert summary.problems.counts["invalid UTF-8"].count == 1


def test_malformed_json_array_stops_or_skips_the_rest_of_the_file(run, tmp_path, output_prefix):
    (tmp_path / "a.json").write_text('[{"text": "one"},\n {"text": "two"}\n {"text": "three"}]')
    with pytest.raises(
        InvalidInputError, match=r"a\.json:3: malformed JSON array: expected ',' or ']' after an item; the rest"
    ):
        run([tmp_path / "a.json"])
    summary = run([tmp_path / "a.json"], skip_invalid=True)
    assert read_documents(output_prefix) == [byte_tokens("one"), byte_tokens("two")]
    assert summary.problems.total == 1


def test_parquet_without_the_key_column_reports_each_row(run, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "a.parquet")
    with pytest.raises(InvalidInputError, match=r"a\.parquet:row 1: missing key 'text'"):
        run([tmp_path / "a.parquet"])
    with pytest.raises(ValueError, match=r"no document .* \(skipped: 2 missing key 'text'\); nothing written"):
        run([tmp_path / "a.parquet"], skip_invalid=True)


def test_failed_run_leaves_no_index_and_no_temporary_files(run, write_jsonl, output_prefix):
    path = write_jsonl("a.jsonl", [{"text": "fine"}] * 50 + ["{broken"])
    with pytest.raises(InvalidInputError):
        run([path])
    assert os.listdir(os.path.dirname(output_prefix)) == []


def test_missing_input_is_reported_with_the_flag(run, tmp_path):
    with pytest.raises(InvalidInputError, match=r"--input .*nope\*\.jsonl: no such file"):
        run([tmp_path / "nope*.jsonl"])
