"""--partitions N resumes: a rerun redoes only the partitions that did not finish, or whose files or flags
changed, and writes the same bytes as an uninterrupted run."""

from __future__ import annotations

import json
import os
import re

import pytest

from megatron_lc.data.corpus import InvalidInputError
from megatron_lc.data.indexed_dataset import write_dataset
from megatron_lc.data.partition_manifest import write_manifest
from megatron_lc.data.preprocess import (
    PreprocessOptions,
    _build_partitions,
    partition_work_dir,
    plan_partitions,
    preprocess,
)

PARTS = 3


def options_for(paths, output_prefix: str, **overrides) -> PreprocessOptions:
    settings = dict(tokenizer_type="ByteTokenizer", append_eod=True, show_progress=False, partitions=PARTS,
                    workers=PARTS)
    settings.update(overrides)
    return PreprocessOptions(inputs=tuple(map(str, paths)), output_prefix=output_prefix, **settings)


def output_bytes(prefix: str) -> tuple[bytes, bytes]:
    base = f"{prefix}_text_document"
    return open(base + ".bin", "rb").read(), open(base + ".idx", "rb").read()


def partition_lines(stderr: str) -> dict[int, str]:
    """What the rerun said of each partition: 'reused...' or 'redone: why'."""
    found = re.findall(r"partition (\d+) of \d+: (.*)", stderr)
    return {int(number) - 1: what for number, what in found}


@pytest.fixture
def corpus(write_jsonl, corpus_texts, tmp_path):
    """Three input files, the output prefix, and the bytes of an uninterrupted one-pass run."""
    paths = [write_jsonl(f"{i}.jsonl", [{"text": t} for t in corpus_texts[i::PARTS]]) for i in range(PARTS)]
    prefix = str(tmp_path / "out" / "corpus")
    preprocess(options_for(paths, prefix, partitions=1, workers=1))
    return paths, prefix, output_bytes(prefix)


def interrupted_run(options: PreprocessOptions):
    """Every partition built and recorded, the merge never reached: a run killed just before it."""
    work_dir = partition_work_dir(options)
    os.makedirs(work_dir)
    plans = plan_partitions(list(map(str, options.inputs)), options, work_dir)
    _build_partitions(plans, options)
    return plans


def test_a_partition_without_manifest_is_the_only_one_redone(corpus, capsys):
    paths, prefix, expected = corpus
    options = options_for(paths, prefix)
    plans = interrupted_run(options)
    os.remove(plans[1].manifest)  # killed before partition 1 finished
    summary = preprocess(options)
    said = partition_lines(capsys.readouterr().err)
    assert said[1] == "redone: it has no manifest (it did not finish)"
    assert said[0].startswith("reused") and said[2].startswith("reused")
    assert output_bytes(prefix) == expected
    assert summary.documents == 40
    assert not os.path.exists(partition_work_dir(options))  # removed once merged


def test_a_reused_partition_is_read_not_retokenized(corpus, capsys):
    """A partition whose manifest matches is taken as it is: forge one, and its tokens reach the output."""
    paths, prefix, _ = corpus
    options = options_for(paths, prefix)
    plans = interrupted_run(options)
    manifest = json.load(open(plans[0].manifest))
    write_dataset(plans[0].prefixes[0], [[7, 7, 7]], dtype="uint16")
    write_manifest(plans[0].manifest, manifest["producer"], plans[0].outputs, manifest["summary"])
    preprocess(options)
    tokens = open(f"{prefix}_text_document.bin", "rb").read()
    assert tokens.startswith(b"\x07\x00" * 3)


@pytest.mark.parametrize("damage, reason", [
    ("flip", r"redone: 0_text\.bin has another SHA-256 than its manifest records"),
    ("truncate", r"redone: 0_text\.idx is \d+ bytes, its manifest says \d+"),
    ("missing", r"redone: 0_text\.bin is missing"),
    ("garbled manifest", r"redone: its manifest is unreadable \(Unterminated string .*\)"),
])
def test_a_damaged_partition_is_redone(corpus, capsys, damage, reason):
    paths, prefix, expected = corpus
    options = options_for(paths, prefix)
    plans = interrupted_run(options)
    bin_file, idx_file = plans[0].outputs
    if damage == "flip":
        data = bytearray(open(bin_file, "rb").read())
        data[5] ^= 1
        open(bin_file, "wb").write(bytes(data))
    elif damage == "truncate":
        os.truncate(idx_file, os.path.getsize(idx_file) - 8)
    elif damage == "missing":
        os.remove(bin_file)
    else:
        open(plans[0].manifest, "w").write('{"format": 1, "produ')
    preprocess(options)
    said = partition_lines(capsys.readouterr().err)
    assert re.fullmatch(reason, said[0]) and said[1].startswith("reused") and said[2].startswith("reused")
    assert output_bytes(prefix) == expected


def test_other_flags_or_an_edited_input_redo_the_partitions_they_touch(corpus, capsys, write_jsonl, corpus_texts):
    paths, prefix, _ = corpus
    interrupted_run(options_for(paths, prefix))
    preprocess(options_for(paths, prefix, append_eod=False))
    said = partition_lines(capsys.readouterr().err)
    assert set(said.values()) == {"redone: it was made with other --append-eod"}

    plans = interrupted_run(options_for(paths, prefix))
    write_jsonl("2.jsonl", [{"text": t} for t in corpus_texts[2::PARTS][::-1]])  # partition 2's input edited
    os.utime(paths[2], ns=(1, 1))
    preprocess(options_for(paths, prefix))
    said = partition_lines(capsys.readouterr().err)
    assert said[2] == "redone: it was made with other input files (path, size, modification time)"
    assert said[0].startswith("reused") and said[1].startswith("reused")
    assert plans[2].files == (str(paths[2]),)


def test_a_failed_run_keeps_its_finished_partitions_and_the_rerun_redoes_the_rest(
        write_jsonl, corpus_texts, tmp_path, capsys):
    good = [[{"text": t} for t in corpus_texts[i::PARTS]] for i in range(PARTS)]
    paths = [write_jsonl(f"{i}.jsonl", records) for i, records in enumerate(good[:2])]
    paths.append(write_jsonl("2.jsonl", good[2][:3] + ["{broken"]))
    prefix = str(tmp_path / "out" / "corpus")
    options = options_for(paths, prefix)
    with pytest.raises(InvalidInputError, match=r"2\.jsonl:4: malformed JSON"):
        preprocess(options)
    assert "kept 2 finished partition(s) of 3" in capsys.readouterr().err
    write_jsonl("2.jsonl", good[2])  # the input fixed
    preprocess(options)
    said = partition_lines(capsys.readouterr().err)
    assert said[0].startswith("reused") and said[1].startswith("reused") and said[2].startswith("redone: it has no")
    resumed = output_bytes(prefix)
    preprocess(options_for(paths, prefix, partitions=1, workers=1))
    assert resumed == output_bytes(prefix)
