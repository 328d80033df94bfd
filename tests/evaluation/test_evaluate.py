"""python -m megatron_lc.evaluate: one JSON line, the same loss on any layout, truthful refusals."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_lc.errors import ConfigError
from megatron_lc.arguments import parse_config
from megatron_lc.training.preflight import preflight
from megatron_lc.data.indexed_dataset import IndexedDatasetBuilder
from megatron_lc.training.trainer import train
from tests.helpers import free_port

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A dataset of random documents and a checkpoint trained on it for two steps."""
    work = tmp_path_factory.mktemp("evaluate")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(work / "data.bin", dtype=np.uint16) as builder:
        for length in rng.integers(20, 90, size=30):
            builder.add_item(rng.integers(1, 512, size=length))
            builder.end_document()
        builder.finalize(work / "data.idx")
    train(parse_config(["--data-path", str(work / "data"), "--seq-length", "64", "--train-iters", "2",
                        "--device", "cpu", "--save", str(work / "ckpt"), "--log-dir", str(work / "log")]))
    return work


def _evaluate(work, *args, nproc=1):
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                 f"--master-port={free_port()}", "-m"] if nproc > 1 else [sys.executable, "-m"])
    cmd = [*launcher, "megatron_lc.evaluate", "--load", str(work / "ckpt"), "--data-path", str(work / "data"),
           "--device", "cpu", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("layout", [[], ["--cp-comm-type", "p2p"], ["--reset-attention-mask"]],
                         ids=["a2a", "ring", "by-document"])
def test_context_parallel_evaluation_equals_one_process(trained, layout):
    """Also with ring attention, whose ranks hold two chunks each, and by position in each document: the loss by
    position still lands in the right buckets."""
    flags = [f for f in layout if f == "--reset-attention-mask"]
    one = _evaluate(trained, "--seq-length", "64", "--loss-by-position", "4", *flags)
    two = _evaluate(trained, "--seq-length", "64", "--loss-by-position", "4", "--context-parallel-size", "2",
                    *layout, nproc=2)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    a, b = (json.loads(out.stdout.strip().splitlines()[-1]) for out in (one, two))
    assert a["samples"] == b["samples"] > 0 and a["tokens"] == a["samples"] * 64
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert [x["loss"] for x in b["loss_by_position"]] == pytest.approx([x["loss"] for x in a["loss_by_position"]],
                                                                        rel=1e-5)


def test_loss_by_position_counts_each_token_at_its_place_in_its_document(trained):
    """With --reset-attention-mask a token's bucket is its position in its document (the context it sees): one
    bucket per position, the counts fall with the position, a position no document reaches is null; in the sample
    every position holds a token of every sample."""
    by_document = json.loads(_evaluate(trained, "--seq-length", "64", "--reset-attention-mask",
                                       "--loss-by-position", "64").stdout.strip().splitlines()[-1])
    buckets = by_document["loss_by_position"]
    assert by_document["loss_by_position_in"] == "document" and [b["start"] for b in buckets] == list(range(64))
    counts = [b["tokens"] for b in buckets]
    assert sum(counts) == by_document["valid_tokens"] and counts == sorted(counts, reverse=True) and counts[0] > counts[-1]
    assert all((b["loss"] is None) == (b["tokens"] == 0) for b in buckets)
    by_sample = json.loads(_evaluate(trained, "--seq-length", "64", "--reset-attention-mask", "--loss-by-position",
                                     "64", "--loss-by-position-in", "sample").stdout.strip().splitlines()[-1])
    assert {b["tokens"] for b in by_sample["loss_by_position"]} == {by_sample["samples"]}


@pytest.mark.parametrize("flags, words", [
    (["--passkey-trials", "3"], "--passkey-trials sets the passkey test: add --passkey"),
    (["--tokenizer-type", "ByteTokenizer"], "--tokenizer-type sets the passkey test: add --passkey"),
    (["--loss-by-position-in", "sample"], "--loss-by-position-in sample chooses the buckets of --loss-by-position"),
])
def test_a_flag_of_the_other_evaluation_is_refused_in_one_line(trained, flags, words):
    out = _evaluate(trained, "--seq-length", "64", *flags)
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr


def test_more_buckets_than_positions_is_refused_in_one_line(trained):
    out = _evaluate(trained, "--seq-length", "64", "--loss-by-position", "65")
    assert out.returncode == 2 and "--loss-by-position 65: between 1 and --seq-length 64 buckets" in out.stderr


def test_attention_crosses_documents_unless_reset_attention_mask_both_as_transformers_computes(trained, tmp_path):
    """Megatron's default attends across a sample's end-of-document tokens; `--reset-attention-mask` attends
    within each document. Each equals transformers' loss on the same tokens (one forward per sample, or per
    document), and the two differ."""
    import torch
    import torch.nn.functional as F
    import transformers

    from megatron_lc.data.indexed_dataset import IndexedDataset
    from megatron_lc.data.samples import LongSequenceSamples
    from megatron_lc.training.hf_conversion import checkpoint_to_hf

    hf = transformers.LlamaForCausalLM.from_pretrained(
        checkpoint_to_hf(str(trained / "ckpt"), str(tmp_path / "hf"), dtype=torch.float32),
        torch_dtype=torch.float32).eval()
    samples = [LongSequenceSamples(IndexedDataset(trained / "data"), 64, seed=0, shuffle=False).get(i)
               for i in range(4)]
    assert sum(len(sample.cu_seqlens) - 1 for sample in samples) > 4  # samples span documents

    def transformers_loss(per_document: bool) -> float:
        total, count = 0.0, 0
        for sample in samples:
            bounds = sample.cu_seqlens if per_document else (0, 64)
            for a, b in zip(bounds[:-1], bounds[1:]):
                with torch.no_grad():
                    logits = hf(torch.from_numpy(sample.input_ids[a:b])[None],
                                position_ids=torch.arange(a, b)[None]).logits[0]
                total += F.cross_entropy(logits, torch.from_numpy(sample.labels[a:b]), reduction="sum").item()
                count += b - a
        return total / count

    for per_document in (False, True):
        run = _evaluate(trained, "--seq-length", "64", "--num-samples", "4",
                        *(["--reset-attention-mask"] if per_document else []))
        assert run.returncode == 0, run.stderr[-2000:]
        loss = json.loads(run.stdout.strip().splitlines()[-1])["loss"]
        assert loss == pytest.approx(transformers_loss(per_document), rel=1e-5)
        assert loss != pytest.approx(transformers_loss(not per_document), rel=1e-4)


def test_sequence_longer_than_the_data_is_refused_not_reported_as_zero_loss(trained):
    out = _evaluate(trained, "--seq-length", "65536")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: --data-path")
    assert "whole samples of --seq-length 65536" in out.stderr


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="the test environment has no wandb")
def test_wandb_without_its_package_is_refused_before_any_work():
    with pytest.raises(ConfigError, match="--wandb-project p needs the wandb package"):
        preflight(parse_config(["--mock-data", "--wandb-project", "p"]))


def test_ids_beyond_the_vocabulary_are_refused_in_one_line_as_training_does(trained):
    """An id the embedding has no row for: one line naming the dataset, exit 2 (was an IndexError)."""
    with IndexedDatasetBuilder(trained / "wide.bin", dtype=np.uint16) as builder:
        builder.add_item(np.array([1, 2, 60000] * 40))
        builder.end_document()
        builder.finalize(trained / "wide.idx")
    cmd = [sys.executable, "-m", "megatron_lc.evaluate", "--load", str(trained / "ckpt"), "--data-path",
           str(trained / "wide"), "--seq-length", "64", "--device", "cpu"]
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "wide" in lines[0] and "60000" in lines[0], out.stderr


def test_a_blend_and_a_split_part_are_evaluated_as_training_reads_them(trained):
    """The blend syntax of training; --split picks one part, by default the validation part."""
    from megatron_lc.data.sources import build_datasets
    from megatron_lc.evaluate import build_parser
    from megatron_lc.evaluation.checkpoint_evaluation import evaluation_source

    data = str(trained / "data")
    args = build_parser().parse_args(["--load", "x", "--data-path", "0.3", data, "0.7", data, "--seq-length", "16",
                                      "--split", "50,50,0"])
    source = evaluation_source(args)
    valid = build_datasets(["0.3", data, "0.7", data], 16, 0, split="50,50,0", shuffle=False).valid
    assert len(source) == len(valid) and all(source.locate(i) == valid.locate(i) for i in range(len(valid)))
    out = _evaluate(trained, "--seq-length", "16", "--split", "50,50,0", "--split-part", "valid")
    blend = _evaluate(trained, "--seq-length", "16", "--split", "50,50,0")
    assert out.returncode == 0 and blend.returncode == 0, out.stderr[-2000:] + blend.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == json.loads(blend.stdout.strip().splitlines()[-1])
    empty = _evaluate(trained, "--seq-length", "16", "--split", "100,0,0", "--split-part", "test")
    assert empty.returncode == 2 and "the test part is empty" in empty.stderr
