"""Checkpoint <-> Hugging Face conversion: streaming, sharded, exact, loadable by transformers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_lc.arguments import parse_config
from megatron_lc.errors import ConfigError
from megatron_lc.models.llama import build_model
from megatron_lc.training.hf_conversion import checkpoint_to_hf, config_from_meta, hf_to_checkpoint, plan_shards
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
    hf_dir = checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype=torch.bfloat16)
    assert (hf_dir / "model.safetensors").exists() and not (hf_dir / "model.safetensors.index.json").exists()
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    assert theirs.dtype == torch.bfloat16


def test_shards_hold_consecutive_tensors_within_the_limit():
    assert plan_shards({"a": 4, "b": 4, "c": 9, "d": 1}, 8) == [["a", "b"], ["c"], ["d"]]


def test_command_line_tools_convert_both_ways(tmp_path):
    """convert_to_hf.py writes the training's precision unless --dtype says otherwise, and says so."""
    _trained_checkpoint(tmp_path)
    for tool, args in (("convert_to_hf.py", ["--load", "ckpt", "--save", "hf", "--max-shard-size", "100KB"]),
                       ("convert_from_hf.py", ["--load", "hf", "--save", "back"])):
        out = subprocess.run([sys.executable, str(REPO / "tools" / "checkpoint" / tool), *args], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        if tool == "convert_to_hf.py":  # an fp32 run: fp32 weights, not a silent bf16 rounding
            assert "(float32, the checkpoint training precision; --dtype to change)" in out.stdout
            assert transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").dtype == torch.float32
    helped = subprocess.run([sys.executable, str(REPO / "tools" / "checkpoint" / "convert_to_hf.py"), "--help"],
                            capture_output=True, text=True, timeout=300)
    assert "default: the checkpoint's training precision" in " ".join(helped.stdout.split())
    assert checkpointing.read_meta(checkpointing.latest_checkpoint(tmp_path / "back"))["weights_only"]


def test_export_into_a_used_directory_replaces_the_earlier_weights(tmp_path):
    _trained_checkpoint(tmp_path)
    checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype=torch.bfloat16)  # one file
    hf_dir = checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype=torch.float32,
                              max_shard_bytes=200_000)
    assert not (hf_dir / "model.safetensors").exists()
    assert transformers.LlamaForCausalLM.from_pretrained(hf_dir).dtype == torch.float32


def _hf_model_dir(tmp_path, name="hf", **config) -> Path:
    """A tiny transformers LlamaForCausalLM saved in fp32, with `config`'s fields."""
    values = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False)
    hf_config = transformers.LlamaConfig(**{**values, **config})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.save_pretrained(tmp_path / name)
    return tmp_path / name


def _tool(name: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "checkpoint" / name), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_act", "gelu", "hidden_act='gelu': the MLP is SwiGLU, which needs 'silu'"),
    ("attention_bias", True, "attention_bias=True: the projections have no biases"),
    ("mlp_bias", True, "mlp_bias=True: the projections have no biases"),
    ("attention_dropout", 0.1, "attention_dropout=0.1: attention has no dropout"),
    ("rope_scaling", {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
     "rope_scaling.rope_type='longrope': only 'default', 'llama3', 'linear', 'yarn' and 'dynamic'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.7,
                      "mscale_all_dim": 0.7}, "rope_scaling={"),
])
def test_hf_config_fields_the_model_does_not_compute_are_refused_in_one_line(tmp_path, field, value, message):
    hf_dir = _hf_model_dir(tmp_path, **{field: value})
    out = _tool("convert_from_hf.py", ["--load", str(hf_dir), "--save", "ckpt"], tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --load {hf_dir}: {message}")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("shape", ["llama2", "llama3-original", "tinyllama-tied-mha-tp2"])
def test_converted_models_compute_transformers_logits_and_train_with_checkpoint_args(tmp_path, shape):
    """Settings the zoo fixes otherwise (eps 1e-6, 512 positions, theta, tie, pretraining_tp) convert exactly."""
    config = {"llama2": {},
              "llama3-original": {"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
                                  "initializer_range": 0.01},
              "tinyllama-tied-mha-tp2": {"num_key_value_heads": 4, "tie_word_embeddings": True, "pretraining_tp": 2}}
    hf_dir = _hf_model_dir(tmp_path, **config[shape])
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    path = hf_to_checkpoint(str(hf_dir), str(tmp_path / "ckpt"))
    ours = _load_ours(path).eval()
    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)
    history = train(parse_config(["--mock-data", "--seq-length", "32", "--train-iters", "1", "--device", "cpu",
                                  "--load", str(tmp_path / "ckpt"), "--use-checkpoint-args",
                                  "--log-dir", str(tmp_path / "log")]))
    assert [m["step"] for m in history] == [1]


def test_megatron_flags_set_what_a_converted_llama2_shape_needs(tmp_path):
    hf_dir = _hf_model_dir(tmp_path, initializer_range=0.01)
    hf_to_checkpoint(str(hf_dir), str(tmp_path / "ckpt"))
    flags = ["--model", "debug-tied", "--untie-embeddings-and-output-weights", "--vocab-size", "320",
             "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "96",
             "--norm-epsilon", "1e-6", "--max-position-embeddings", "512", "--init-method-std", "0.01"]
    history = train(parse_config(flags + ["--mock-data", "--seq-length", "32", "--train-iters", "1", "--device",
                                          "cpu", "--load", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "l")]))
    assert [m["step"] for m in history] == [1]  # the checkpoint's model, matched field by field


def test_rope_scaling_flags_choose_the_type_and_each_of_its_settings():
    from megatron_lc.models.llama import RopeScaling

    yarn = parse_config(["--use-rope-scaling", "--rope-scaling-type", "yarn", "--rope-scaling-factor", "4",
                         "--rope-scaling-original-max-position-embeddings", "64", "--rope-scaling-beta-fast", "16"])
    assert yarn.model_config().rope_scaling == RopeScaling(rope_type="yarn", factor=4.0,
                                                           original_max_position_embeddings=64, beta_fast=16.0)
    llama3 = parse_config(["--model", "llama3-8b", "--rope-scaling-original-max-position-embeddings", "131072",
                           "--rope-scaling-low-freq-factor", "2"]).model_config().rope_scaling
    assert (llama3.rope_type, llama3.factor, llama3.original_max_position_embeddings, llama3.low_freq_factor) == (
        "llama3", 8.0, 131072, 2.0)  # Llama 3.1's scaling, extended again from its 128K
    linear = parse_config(["--model", "llama3-8b", "--rope-scaling-type", "linear"]).model_config().rope_scaling
    assert (linear.rope_type, linear.factor) == ("linear", 8.0)


def test_rope_scaling_flags_turn_llama3_scaling_on_and_set_its_factor():
    scaled = parse_config(["--use-rope-scaling", "--rope-scaling-factor", "4"]).model_config().rope_scaling
    assert scaled is not None and scaled.factor == 4.0 and scaled.original_max_position_embeddings == 8192
    assert parse_config(["--use-rope-scaling"]).model_config().rope_scaling.factor == 8.0  # Megatron's default
    assert parse_config(["--model", "llama3-8b", "--rope-scaling-factor", "16"]).model_config().rope_scaling.factor == 16


def test_conversion_into_a_run_directory_is_refused_unless_forced_and_never_moves_the_marker_back(tmp_path):
    _trained_checkpoint(tmp_path)  # ckpt/iter_0000001, marker 1
    hf_dir = _hf_model_dir(tmp_path, vocab_size=512, hidden_size=64, intermediate_size=192, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5)
    out = _tool("convert_from_hf.py", ["--load", str(hf_dir), "--save", "ckpt"], tmp_path)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: --save ckpt already holds checkpoints: give an empty directory, or --force to add iter_0000000 there "
        "(the marker keeps naming the run's latest step)"]
    out = _tool("convert_from_hf.py", ["--load", str(hf_dir), "--save", "ckpt", "--force"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "ckpt" / checkpointing.LATEST).read_text() == "1"
    assert checkpointing.latest_checkpoint(tmp_path / "ckpt").name == "iter_0000001"
    assert (checkpointing.checkpoint_dir(tmp_path / "ckpt", 0) / checkpointing.META).exists()


# --- context extension: rope settings that take effect, and an export that says what was trained -----------


def test_rope_flags_take_effect_over_a_converted_checkpoint_and_reach_the_export(tmp_path, capsys):
    """--use-checkpoint-args takes the shape from the checkpoint and the rope base, its Llama 3 scaling and the
    trained length from the flags; the export records them in both rope layouts, loads in transformers, and
    computes our logits."""
    hf_dir = _hf_model_dir(tmp_path, rope_theta=500000.0, max_position_embeddings=32)
    hf_to_checkpoint(str(hf_dir), str(tmp_path / "ckpt"))
    capsys.readouterr()
    history = train(parse_config(["--mock-data", "--seq-length", "64", "--train-iters", "1", "--device", "cpu",
                                  "--load", str(tmp_path / "ckpt"), "--use-checkpoint-args", "--rotary-base", "2e6",
                                  "--use-rope-scaling", "--rope-scaling-factor", "4", "--save", str(tmp_path / "run"),
                                  "--log-dir", str(tmp_path / "log")]))
    out = capsys.readouterr().out
    assert [m["step"] for m in history] == [1]
    assert "model settings changed on load" in out and "rotary_base 500000.0 -> 2000000.0" in out
    trained = config_from_meta(checkpointing.read_meta(checkpointing.latest_checkpoint(tmp_path / "run")))
    assert trained.rotary_base == 2e6 and trained.rope_scaling.factor == 4.0 and trained.max_position_embeddings == 64
    export = checkpoint_to_hf(str(tmp_path / "run"), str(tmp_path / "hf-out"), dtype=torch.float32)
    written = json.loads((export / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["max_position_embeddings"] == 64
    assert written["rope_theta"] == 2e6 and written["rope_scaling"]["rope_type"] == "llama3"
    assert written["rope_scaling"]["factor"] == 4.0 and written["rope_parameters"]["rope_theta"] == 2e6
    theirs = transformers.LlamaForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
    ours = _load_ours(checkpointing.latest_checkpoint(tmp_path / "run")).eval()
    ids = torch.randint(0, 320, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_rope_change_on_load_is_taken_and_a_shape_change_names_use_checkpoint_args(tmp_path, capsys):
    path = _trained_checkpoint(tmp_path)
    base = ["--mock-data", "--seq-length", "32", "--train-iters", "2", "--device", "cpu", "--load",
            str(tmp_path / "ckpt"), "--override-opt_param-scheduler"]
    capsys.readouterr()
    history = train(parse_config(base + ["--rotary-base", "40000", "--log-dir", str(tmp_path / "a")]))
    assert [m["step"] for m in history] == [2] and "rotary_base 10000.0 -> 40000.0" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"of another model \(num_layers: checkpoint 2 vs run 3\): give its "
                                          r"shape's flags, or --use-checkpoint-args"):
        train(parse_config(base + ["--num-layers", "3"]))
    with pytest.raises(ConfigError, match=rf"--use-checkpoint-args takes the model's shape from {path}: its "
                                          r"num_layers is 2, the flags give 3; drop the flag"):
        train(parse_config(base + ["--num-layers", "3", "--use-checkpoint-args"]))


def test_a_failed_export_leaves_no_output_directory(tmp_path):
    _trained_checkpoint(tmp_path)
    with pytest.raises(Exception, match="missing.model"):
        checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), tokenizer_model=str(tmp_path / "missing.model"),
                         tokenizer_type="SentencePieceTokenizer")
    assert not (tmp_path / "hf").exists()
