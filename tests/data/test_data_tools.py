"""The command lines: preprocess_data.py, merge_datasets.py, train_tokenizer.py."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from megatron_lc.data.indexed_dataset import IndexedDataset, write_dataset
from megatron_lc.data.tokenizers import build_tokenizer

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOLS / name), *map(str, args)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def jsonl_corpus(tmp_path, corpus_texts) -> Path:
    for i in range(2):
        with open(tmp_path / f"part{i}.jsonl", "w") as stream:
            for text in corpus_texts[i::2]:
                stream.write(json.dumps({"text": text}) + "\n")
    return tmp_path


def test_train_tokenizer_then_preprocess_with_two_workers(jsonl_corpus, tmp_path):
    trained = run_tool(
        "train_tokenizer.py",
        "--input",
        jsonl_corpus / "part0.jsonl",
        "--output-prefix",
        tmp_path / "tok" / "spm",
        "--vocab-size",
        "400",
    )
    assert trained.returncode == 0, trained.stderr
    model = tmp_path / "tok" / "spm.model"
    words = "the long context of a book"  # trained on whole lines, the model has pieces of several letters
    assert len(build_tokenizer("SentencePieceTokenizer", model).tokenize(words)) <= len(words.split()) + 2
    result = run_tool(
        "preprocess_data.py",
        "--input",
        str(jsonl_corpus / "part*.jsonl"),
        "--output-prefix",
        tmp_path / "out" / "c",
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        model,
        "--append-eod",
        "--workers",
        "2",
    )
    assert result.returncode == 0, result.stderr
    assert "skipped: 0" in result.stdout and "c_text_document.bin/.idx" in result.stdout
    tokenizer = build_tokenizer("SentencePieceTokenizer", model)
    first = json.loads((jsonl_corpus / "part0.jsonl").read_text().splitlines()[0])["text"]
    dataset = IndexedDataset(tmp_path / "out" / "c_text_document")
    assert dataset[0].tolist() == tokenizer.tokenize(first) + [tokenizer.eod]


def test_preprocess_reports_bad_input_with_file_and_line_and_exit_status(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    result = run_tool(
        "preprocess_data.py",
        "--input",
        tmp_path / "bad.jsonl",
        "--output-prefix",
        tmp_path / "o",
        "--tokenizer-type",
        "ByteTokenizer",
    )
    assert result.returncode == 1
    assert f"error: {tmp_path / 'bad.jsonl'}:2: malformed JSON" in result.stderr
    assert not list(tmp_path.glob("o_*"))


def test_merge_datasets_concatenates_in_the_order_given(tmp_path):
    write_dataset(tmp_path / "a", [[1, 2], [3]], dtype=np.uint16)
    write_dataset(tmp_path / "b", [[4, 5, 6]], dtype=np.uint16)
    result = run_tool("merge_datasets.py", "--input", tmp_path / "b", tmp_path / "a", "--output-prefix", tmp_path / "m")
    assert result.returncode == 0, result.stderr
    merged = IndexedDataset(tmp_path / "m")
    assert [merged[i].tolist() for i in range(len(merged))] == [[4, 5, 6], [1, 2], [3]]


def test_merge_datasets_reports_a_bad_input_file(tmp_path):
    write_dataset(tmp_path / "a", [[1]], dtype=np.uint16)
    (tmp_path / "b.idx").write_bytes(b"garbage")
    result = run_tool("merge_datasets.py", "--input", tmp_path / "a", tmp_path / "b", "--output-prefix", tmp_path / "m")
    assert result.returncode == 1 and "b.idx: truncated index" in result.stderr
    assert not (tmp_path / "m.idx").exists()


def test_megatron_core_reads_preprocess_output(jsonl_corpus, tmp_path, tiktoken_file):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
    except ImportError as error:
        pytest.skip(f"megatron-core is not importable ({error}); install it to check compatibility")
    from megatron_lc.data.preprocess import PreprocessOptions, preprocess

    prefix = str(tmp_path / "out" / "c")
    preprocess(
        PreprocessOptions(
            inputs=(str(jsonl_corpus / "part1.jsonl"),),
            output_prefix=prefix,
            tokenizer_type="TikTokenizer",
            tokenizer_model=tiktoken_file,
            append_eod=True,
            show_progress=False,
        )
    )
    theirs = MegatronIndexedDataset(prefix + "_text_document")
    ours = IndexedDataset(prefix + "_text_document")
    assert len(theirs) == len(ours) > 0
    for i in range(len(ours)):
        np.testing.assert_array_equal(theirs[i], ours[i])


def test_train_tokenizer_cuts_lines_sentencepiece_would_drop_and_says_so(tmp_path):
    """Every line over SentencePiece's 64 KiB: trained on their pieces (not its internal error), counted."""
    words = ["alpha", "beta", "gamma", "delta", "long", "context"]
    line = " ".join(words[i * 7 % 6] for i in range(15_000))  # about 80 KB, no newline
    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"text": line + str(i)}) + "\n" for i in range(3)))
    result = run_tool("train_tokenizer.py", "--input", tmp_path / "long.jsonl", "--output-prefix", tmp_path / "t",
                      "--vocab-size", "300")
    assert result.returncode == 0, result.stderr
    assert f"3 lines over 65,536 bytes cut into pieces (first in {tmp_path / 'long.jsonl'}:1)" in result.stdout
    assert (tmp_path / "t.model").exists()


def test_split_long_line_keeps_every_character_and_cuts_at_spaces():
    from megatron_lc.data.train_tokenizer import split_long_line

    line = ("ü" * 30 + " ") * 5000
    pieces = split_long_line(line, limit=1000)
    assert "".join(pieces) == line and all(len(p.encode()) <= 1000 and p.endswith(" ") for p in pieces[:-1])
    assert split_long_line("é" * 1000, limit=101) and "".join(split_long_line("é" * 1000, limit=101)) == "é" * 1000
