"""Checkpoint <-> Hugging Face conversion: streaming, sharded, exact, loadable by transformers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_lc.config import parse_config
from megatron_lc.models.llama import build_model
from megatron_lc.models.llama.conversion import checkpoint_to_hf, config_from_meta, hf_to_checkpoint, plan_shards
from megatron_lc.training import checkpointing
from megatron_lc.training.trainer import train

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]


def _trained_checkpoint(tmp_path, model="debug") -> Path:
    train(parse_config(["--mock-data", "--model", model, "--seq-length", "32", "--train-iters", "1", "--device",
                        "cpu", "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "log")]))
    return checkpointing.latest_checkpoint(tmp_path / "ckpt")


def _load_ours(path: Path):
    model = build_model(config_from_meta(checkpointing.read_meta(path)), device="cpu", seed=None)
    checkpointing.load_model_weights(path, model)
    return model


@pytest.mark.parametrize("model", ["debug", "debug-tied"])
def test_sharded_round_trip_is_exact_and_transformers_gives_our_logits(tmp_path, model):
    path = _trained_checkpoint(tmp_path, model)
    hf_dir = checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype=torch.float32,
                              max_shard_bytes=200_000)
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((hf_dir / f).exists() for f in files)
    ours = _load_ours(path).eval()
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)
    back = _load_ours(hf_to_checkpoint(str(hf_dir), str(tmp_path / "back")))
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_bf16_export_is_one_file_when_it_fits(tmp_path):
    _trained_checkpoint(tmp_path)
    hf_dir = checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert (hf_dir / "model.safetensors").exists() and not (hf_dir / "model.safetensors.index.json").exists()
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    assert theirs.dtype == torch.bfloat16


def test_shards_hold_consecutive_tensors_within_the_limit():
    assert plan_shards({"a": 4, "b": 4, "c": 9, "d": 1}, 8) == [["a", "b"], ["c"], ["d"]]


def test_command_line_tools_convert_both_ways(tmp_path):
    _trained_checkpoint(tmp_path)
    for tool, args in (("convert_to_hf.py", ["--load", "ckpt", "--save", "hf", "--max-shard-size", "100KB"]),
                       ("convert_from_hf.py", ["--load", "hf", "--save", "back"])):
        out = subprocess.run([sys.executable, str(REPO / "tools" / "checkpoint" / tool), *args], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
    assert checkpointing.read_meta(checkpointing.latest_checkpoint(tmp_path / "back"))["weights_only"]


def test_export_into_a_used_directory_replaces_the_earlier_weights(tmp_path):
    _trained_checkpoint(tmp_path)
    checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))  # one file, bf16
    hf_dir = checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype=torch.float32,
                              max_shard_bytes=200_000)
    assert not (hf_dir / "model.safetensors").exists()
    assert transformers.LlamaForCausalLM.from_pretrained(hf_dir).dtype == torch.float32
