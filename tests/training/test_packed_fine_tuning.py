"""Fine-tuning on packed, masked documents: the run says how it packed, logs its loss tokens, and
megatron_lc.evaluate gives its validation loss on the same part."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_lc.arguments import parse_config
from megatron_lc.data.packing import PackingSpec
from megatron_lc.data.sources import build_datasets
from megatron_lc.errors import ConfigError
from megatron_lc.training.trainer import train
from tests.helpers import write_masked_dataset

S = 64


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    work = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 500, size=n).tolist() for n in rng.integers(4, 50, size=60)]
    masks = [(np.arange(len(d)) >= len(d) // 3).astype(int).tolist() for d in docs]  # a prompt, then the answer
    return work, write_masked_dataset(work / "chat", docs, masks)


def test_training_reports_packing_and_its_validation_loss_is_what_evaluate_gives(chat, capsys):
    work, prefix = chat
    history = train(parse_config(["--data-path", prefix, "--split", "70,30,0", "--seq-length", str(S),
                                  "--packing", "documents", "--train-iters", "2", "--eval-interval", "2",
                                  "--full-validation", "--device", "cpu", "--save", str(work / "ckpt"),
                                  "--log-dir", str(work / "log")]))
    out = capsys.readouterr().out
    assert f"--packing documents: train part of {prefix}: 42 documents in " in out and "% padding" in out
    parts = build_datasets([prefix], S, seed=1234, split="70,30,0", packing=PackingSpec("documents"))
    train_source = parts.train
    cfg = parse_config(["--data-path", prefix])
    want = [sum(int((train_source.get(i).labels != -100).sum()) for i in range(s, s + 1)) for s in range(2)]
    assert cfg.train.seed == 1234 and [m["loss_tokens"] for m in history] == want
    evaluated = subprocess.run(
        [sys.executable, "-m", "megatron_lc.evaluate", "--load", str(work / "ckpt"), "--data-path", prefix,
         "--seq-length", str(S), "--split", "70,30,0", "--split-part", "valid", "--device", "cpu"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    valid = parts.valid
    assert result["samples"] == len(valid)
    assert result["valid_tokens"] == sum(int((valid.get(i).labels != -100).sum()) for i in range(len(valid)))
    assert result["loss"] == pytest.approx(history[-1]["val_loss"], rel=1e-5)


def test_packing_flags_that_cannot_act_are_refused_in_one_line(chat):
    _, prefix = chat
    with pytest.raises(ConfigError, match="--packing documents packs the documents of --data-path"):
        train(parse_config(["--mock-data", "--packing", "documents", "--train-iters", "1", "--device", "cpu"]))
    with pytest.raises(ConfigError, match="--long-documents drop acts with --packing documents only"):
        parse_config(["--data-path", prefix, "--long-documents", "drop"]).validate(1)
    with pytest.raises(ConfigError, match="documents are longer than --seq-length 16"):
        train(parse_config(["--data-path", prefix, "--split", "100,0,0", "--seq-length", "16", "--packing",
                            "documents", "--train-iters", "1", "--device", "cpu"]))


def test_evaluating_a_hugging_face_directory_says_how_to_convert_it(chat, tmp_path):
    from megatron_lc.evaluate import build_parser
    from megatron_lc.evaluation.checkpoint_evaluation import evaluate

    from tests.helpers import hf_model_files

    _, prefix = chat
    hf = hf_model_files(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"--load .*hf: no intact checkpoint there \(it is a Hugging Face model: "
                                          r"convert it with python tools/checkpoint/convert_from_hf.py"):
        evaluate(build_parser().parse_args(["--load", hf, "--data-path", prefix, "--seq-length", "64"]))


def test_a_packed_run_resumes_at_a_longer_seq_length_where_its_packing_stood(chat, tmp_path, capsys):
    """A checkpoint of a packed run, resumed at another --seq-length: the packing goes on from the first
    document not yet trained (the data side's exactness: tests/data/test_packing_documents.py)."""
    _, prefix = chat
    flags = ["--data-path", prefix, "--split", "100,0,0", "--packing", "documents", "--device", "cpu",
             "--save", str(tmp_path / "ckpt")]
    train(parse_config(flags + ["--seq-length", str(S), "--train-iters", "2", "--log-dir", str(tmp_path / "a")]))
    source = build_datasets([prefix], S, seed=1234, split="100,0,0", packing=PackingSpec("documents")).train
    epoch, pointer, _ = source.stream_position(2)
    capsys.readouterr()
    history = train(parse_config(flags + ["--seq-length", str(2 * S), "--train-iters", "3", "--load",
                                          str(tmp_path / "ckpt"), "--override-opt_param-scheduler",
                                          "--log-dir", str(tmp_path / "b")]))
    assert [m["step"] for m in history] == [3]
    assert f"packing continues in epoch {epoch} at document {pointer:,} of its order" in capsys.readouterr().out


def test_fine_tuned_under_cp_2_ring_it_evaluates_as_transformers_assistant_loss_of_each_conversation_alone(
        chat, tmp_path):
    """A transformers Llama, converted, fine-tuned on packed masked data under cp 2 with ring attention, then
    evaluated under cp 2 with Untied Ulysses and with ring: its loss is exactly transformers' loss over the kept
    targets of each conversation run alone, on the exported weights."""
    import torch
    import torch.nn.functional as F

    from megatron_lc.data.indexed_dataset import IndexedDataset
    from megatron_lc.data.loss_mask import open_loss_mask
    from megatron_lc.training.hf_conversion import checkpoint_to_hf, hf_to_checkpoint
    from tests.helpers import free_port

    transformers = pytest.importorskip("transformers")
    _, prefix = chat
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    hf_to_checkpoint(str(tmp_path / "hf"), str(tmp_path / "converted"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(module, *args):
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                              f"--master-port={free_port()}", "-m", module, "--device", "cpu", "--data-path", prefix,
                              "--seq-length", str(S), "--packing", "documents", "--context-parallel-size", "2", *args],
                             env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    launch("megatron_lc.train", "--load", str(tmp_path / "converted"), "--use-checkpoint-args", "--finetune",
           "--cp-comm-type", "p2p", "--split", "100,0,0", "--train-iters", "2", "--lr", "1e-3",
           "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "log"))
    results = [json.loads(launch("megatron_lc.evaluate", "--load", str(tmp_path / "ckpt"), *layout)
                          .strip().splitlines()[-1]) for layout in (["--cp-impl", "untied_ulysses"],
                                                                    ["--cp-comm-type", "p2p"])]
    hf = transformers.LlamaForCausalLM.from_pretrained(
        checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf-tuned"), dtype=torch.float32),
        torch_dtype=torch.float32).eval()
    dataset = IndexedDataset(prefix)
    mask = open_loss_mask(dataset)

    def assistant_loss(model) -> tuple[float, int]:
        """transformers' loss over the kept targets of each conversation run alone, and their count."""
        total, count = 0.0, 0
        for d in range(len(dataset)):
            ids, keep = torch.from_numpy(dataset[d].astype("int64")), torch.from_numpy(mask[d].astype(bool))
            with torch.no_grad():
                logits = model(ids[None]).logits[0, :-1]
            total += F.cross_entropy(logits[keep[1:]], ids[1:][keep[1:]], reduction="sum").item()
            count += int(keep[1:].sum())
        return total / count, count

    loss, count = assistant_loss(hf)
    for result in results:
        assert result["valid_tokens"] == count
        assert result["loss"] == pytest.approx(loss, rel=1e-5)
    before, _ = assistant_loss(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval())
    assert abs(before - loss) > 1e-3 * loss, "the fine-tuned weights were evaluated, not the converted ones"
