"""python -m megatron_lc.evaluate --passkey: the key hidden at each depth, scored teacher-forced, the same on any
context-parallel layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_lc.arguments import parse_config
from megatron_lc.data.tokenizers import ByteTokenizer
from megatron_lc.evaluation.passkey import passkey_keys, passkey_sample
from megatron_lc.training.trainer import train
from tests.helpers import free_port


def test_the_needle_sits_at_its_depth_and_the_answer_is_the_key():
    tokenizer = ByteTokenizer()  # one token per byte: the text's offsets are token positions
    needle, question, answer = (" The pass key is 12345. Remember it. 12345 is the pass key. ",
                                " What is the pass key? The pass key is", " 12345")
    filler = 401 - len(needle) - len(question) - len(answer)
    for depth in (0.0, 0.5, 1.0):
        sample = passkey_sample(tokenizer, 400, depth, "12345")
        text = bytes(int(t) for t in sample.ids).decode()
        assert len(sample.ids) == 401 and text.endswith(question + answer)
        assert text.index(needle) == round(depth * filler)
        assert bytes(int(t) for t in sample.ids[sample.answer + 1]).decode() == " 12345"  # the labels scored
    with pytest.raises(ValueError, match="--seq-length 50: the passkey's needle, question and answer alone"):
        passkey_sample(tokenizer, 50, 0.5, "12345")
    assert passkey_keys(3) == passkey_keys(3) and len(set(passkey_keys(20))) > 15


@pytest.fixture(scope="module")
def byte_checkpoint(tmp_path_factory):
    work = tmp_path_factory.mktemp("passkey")
    train(parse_config(["--mock-data", "--tokenizer-type", "ByteTokenizer", "--seq-length", "64", "--train-iters",
                        "1", "--device", "cpu", "--save", str(work / "ckpt"), "--log-dir", str(work / "log")]))
    return work / "ckpt"


def _passkey(ckpt, *args, nproc=1):
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                 f"--master-port={free_port()}", "-m"] if nproc > 1 else [sys.executable, "-m"])
    out = subprocess.run([*launcher, "megatron_lc.evaluate", "--load", str(ckpt), "--passkey", "--seq-length", "256",
                          "--passkey-trials", "2", "--device", "cpu", *args], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "passkey retrieved (" in out.stdout  # the table, then the JSON
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_passkey_rows_per_depth_and_length_are_the_same_on_two_context_parallel_ranks(byte_checkpoint, tmp_path):
    lengths = ["--passkey-lengths", "256", "384"]
    one = _passkey(byte_checkpoint, *lengths, "--passkey-plot", str(tmp_path / "passkey.png"))
    two = _passkey(byte_checkpoint, *lengths, "--context-parallel-size", "2", nproc=2)
    assert [(r["seq_length"], r["depth"]) for r in one["passkey"]] == [
        (length, depth) for length in (256, 384) for depth in (0.0, 0.25, 0.5, 0.75, 1.0)] and one["trials"] == 2
    assert (tmp_path / "passkey.png").stat().st_size > 1000
    for a, b in zip(one["passkey"], two["passkey"]):
        assert a["retrieved"] == b["retrieved"] and 0 <= a["retrieved"] <= 1
        assert b["answer_loss"] == pytest.approx(a["answer_loss"], rel=1e-5) and np.isfinite(a["answer_loss"])


def test_passkey_without_a_text_tokenizer_is_refused_in_one_line(tmp_path):
    train(parse_config(["--mock-data", "--seq-length", "64", "--train-iters", "1", "--device", "cpu", "--save",
                        str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "log")]))
    out = subprocess.run([sys.executable, "-m", "megatron_lc.evaluate", "--load", str(tmp_path / "ckpt"),
                          "--passkey", "--seq-length", "256", "--device", "cpu"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and "--passkey writes text: give --tokenizer-type" in out.stderr


def test_greedy_hits_are_the_full_logits_argmax():
    import torch

    from megatron_lc.models.llama import build_model, get_config

    model = build_model(get_config("debug"), device="cpu", seed=0).eval()
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
        labels = torch.where(torch.rand(2, 48) < 0.5, logits.argmax(-1), ids)  # half of them the argmax
        losses, hits = model(ids, labels=labels, per_token="greedy")
    assert torch.equal(hits, logits.argmax(-1) == labels) and hits.any() and not hits.all()
    torch.testing.assert_close(losses, torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels,
                                                                         reduction="none"), rtol=1e-5, atol=1e-5)
