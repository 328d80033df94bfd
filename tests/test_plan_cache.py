"""Planner command lines answered again from the plan cache: the same output and status, no work, never for
other flags, other files, an error, `--plot` or a cache turned off."""

from __future__ import annotations

import os

import pytest

from megatron_lc import plan_cache


def _counting(out: str = "answer\n", status: int = 0):
    calls = []

    def run(argv):
        calls.append(list(argv))
        print(out, end="")
        print("  [ 3 s | 1 traced] progress", file=os.sys.stderr)
        print("a hint", file=os.sys.stderr)
        return status
    return run, calls


def test_a_command_line_answered_before_is_printed_again_without_running(tmp_path, capsys):
    run, calls = _counting()
    argv = ["--model", "llama3-8b", "--planner-cache", str(tmp_path)]
    assert plan_cache.answered(argv, run) == 0
    first = capsys.readouterr()
    assert plan_cache.answered(argv, run) == 0
    again = capsys.readouterr()
    assert len(calls) == 1
    assert again.out == first.out == "answer\n"
    assert again.err == "a hint\n"  # progress lines are not part of the answer
    assert plan_cache.answered([*argv, "--seq-length", "4096"], run) == 0  # other flags: run
    assert len(calls) == 2


def test_nothing_fits_is_an_answer_and_a_configuration_error_is_not(tmp_path, capsys):
    for status, runs in ((1, 1), (2, 2)):
        run, calls = _counting(status=status)
        argv = ["--model", "debug", "--planner-cache", str(tmp_path / str(status))]
        assert plan_cache.answered(argv, run) == status
        assert plan_cache.answered(argv, run) == status
        assert len(calls) == runs


def test_a_changed_data_file_is_answered_again(tmp_path, capsys):
    prefix = tmp_path / "corpus_text_document"
    (tmp_path / "corpus_text_document.idx").write_bytes(b"one")
    run, calls = _counting()
    argv = ["--data-path", str(prefix), "--planner-cache", str(tmp_path / "cache")]
    plan_cache.answered(argv, run)
    plan_cache.answered(argv, run)
    assert len(calls) == 1
    (tmp_path / "corpus_text_document.idx").write_bytes(b"other")
    plan_cache.answered(argv, run)
    assert len(calls) == 2


@pytest.mark.parametrize("extra", [["--planner-cache", "off"], ["--plot", "mem.png"]])
def test_no_answer_is_remembered_with_the_cache_off_or_a_plot_to_write(tmp_path, monkeypatch, capsys, extra):
    monkeypatch.setenv(plan_cache.CACHE_ENV, str(tmp_path))
    run, calls = _counting()
    plan_cache.answered(["--model", "debug", *extra], run)
    plan_cache.answered(["--model", "debug", *extra], run)
    assert len(calls) == 2
    monkeypatch.setenv(plan_cache.CACHE_ENV, "off")
    plan_cache.answered(["--model", "debug"], run)
    plan_cache.answered(["--model", "debug"], run)
    assert len(calls) == 4


def test_the_code_fingerprint_needs_no_torch_import():
    import subprocess
    import sys

    probe = "import sys; from megatron_lc import plan_cache; plan_cache.code_fingerprint(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.stdout.strip() == "False", done.stderr
