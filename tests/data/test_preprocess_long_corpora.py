"""Preprocessing long corpora: progress one can watch, compressed inputs, the output never read back as input,
and a document too long for the tokenizer's memory named instead of an out-of-memory kill."""

from __future__ import annotations

import bz2
import io
import json
import lzma
import os

import pytest

from megatron_lc.data.corpus import InvalidInputError
from megatron_lc.data.preprocess import PreprocessOptions, preprocess
from megatron_lc.data.preprocess_cli import main
from megatron_lc.data.preprocess_progress import PROGRESS_SECONDS, Progress
from tests.data.helpers import byte_tokens, output_bytes, read_documents


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Log(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_progress_lines_when_a_multiple_is_passed_and_every_30_seconds_with_bytes_and_eta():
    clock, log, read = Clock(), Log(), [0]
    progress = Progress(True, log_interval=5, total_bytes=1000, bytes_read=lambda: read[0], clock=clock, stream=log)
    for _ in range(4):  # 3, 6, 9, 12 documents: the multiples 5 and 10 are passed, never hit
        clock.now += 1
        read[0] += 100
        progress.add(3, 30)
    lines = log.getvalue().splitlines()
    assert [line.split(" documents")[0] for line in lines] == ["6", "12"]
    assert "400 B of 1.0 kB read (40.0%), 100 B/s" in lines[1] and "ETA 0:00:06" in lines[1]
    clock.now += PROGRESS_SECONDS  # one slow task, no multiple passed: a line anyway
    read[0] = 500
    progress.add(1, 10)
    assert log.getvalue().splitlines()[-1].startswith("13 documents, 130 tokens") and "500 B of 1.0 kB" in log.getvalue()


def _records(n: int) -> bytes:
    return "".join(json.dumps({"text": f"document {i} " * 3}) + "\n" for i in range(n)).encode()


@pytest.mark.parametrize("suffix,compress", [(".xz", lzma.compress), (".bz2", bz2.compress)])
def test_compressed_inputs_give_the_bytes_of_the_plain_input(tmp_path, suffix, compress):
    (tmp_path / "a.jsonl").write_bytes(_records(20))
    (tmp_path / f"b.jsonl{suffix}").write_bytes(compress(_records(20)))
    for name, prefix in (("a.jsonl", "plain"), (f"b.jsonl{suffix}", "packed")):
        preprocess(PreprocessOptions((str(tmp_path / name),), str(tmp_path / prefix), "ByteTokenizer",
                                     append_eod=True, show_progress=False))
    assert output_bytes(str(tmp_path / "plain")) == output_bytes(str(tmp_path / "packed"))


def test_zstd_is_read_or_refused_by_name(tmp_path):
    path = tmp_path / "a.jsonl.zst"
    try:
        import zstandard
    except ImportError:
        path.write_bytes(b"\x28\xb5\x2f\xfd")
        with pytest.raises(InvalidInputError, match="a.jsonl.zst: a .zst file needs the zstandard package"):
            preprocess(PreprocessOptions((str(path),), str(tmp_path / "o"), "ByteTokenizer", show_progress=False))
        return
    path.write_bytes(zstandard.ZstdCompressor().compress(_records(3)))
    preprocess(PreprocessOptions((str(path),), str(tmp_path / "o"), "ByteTokenizer", show_progress=False))
    assert len(read_documents(str(tmp_path / "o"))) == 3


def test_the_output_in_an_input_directory_is_not_read_as_documents(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_bytes(_records(4))
    argv = ["--input", str(tmp_path), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "ByteTokenizer",
            "--append-eod", "--no-progress"]
    assert main(argv) == 0
    first = output_bytes(str(tmp_path / "out"))
    assert main(argv) == 0  # again, with the previous .bin/.idx in the input directory
    assert output_bytes(str(tmp_path / "out")) == first
    assert "not reading" in capsys.readouterr().err


def test_a_document_over_max_document_chars_is_named_with_what_to_do(tmp_path, capsys):
    texts = ["short", "x" * 50, "fine too"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    argv = ["--input", str(tmp_path / "a.jsonl"), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
            "ByteTokenizer", "--max-document-chars", "20", "--no-progress"]
    assert main(argv) == 1
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and f"{tmp_path / 'a.jsonl'}:2: document over --max-document-chars" in error
    assert "50 characters" in error and "split it in the input" in error and not list(tmp_path.glob("o_*"))
    assert main([*argv, "--skip-invalid"]) == 0
    assert read_documents(str(tmp_path / "o")) == [byte_tokens(t, eod=False) for t in ("short", "fine too")]


def test_the_default_limit_leaves_every_ordinary_document_alone(tmp_path):
    from megatron_lc.data.preprocess_cli import TOKENIZER_BYTES_PER_CHAR, build_parser, options_from_args

    options = options_from_args(build_parser().parse_args(
        ["--input", "x", "--output-prefix", "o", "--tokenizer-type", "ByteTokenizer", "--workers", "8"]))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert options.max_document_chars == ram // 8 // TOKENIZER_BYTES_PER_CHAR > 1_000_000
