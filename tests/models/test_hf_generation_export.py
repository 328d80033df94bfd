"""An export generates as its source did: convert_from_hf keeps the source's generation_config.json and special
tokens, convert_to_hf writes them back (the eos list, sampling defaults) with the tokenizer's model_max_length at
the trained context, and a chat export whose eos misses the template's end of turn is named in one warning."""

import json
from pathlib import Path

import pytest
import torch

from megatron_lc.arguments import parse_config
from megatron_lc.testing import write_chat_tokenizer
from megatron_lc.training import checkpointing
from megatron_lc.training.hf_conversion import checkpoint_to_hf, hf_to_checkpoint
from megatron_lc.training.hf_generation import export_generation_config
from megatron_lc.training.trainer import train

transformers = pytest.importorskip("transformers")
WORDS = ["red green blue north south east west the end of a turn"] * 20


def _source(tmp_path: Path, eos_token: str = "<|eot_id|>") -> tuple[Path, transformers.PreTrainedTokenizerBase]:
    """A tiny Llama 3.1-like HF directory: weights, a chat tokenizer with a pad token, and a generation config
    with Llama 3.1 Instruct's shape (an eos list, sampling defaults)."""
    directory = tmp_path / "source"
    write_chat_tokenizer(directory, WORDS, vocab_size=300)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": eos_token,
                                                                 "pad_token": "<|end_of_text|>"}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    hf_config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(hf_config).save_pretrained(directory)
    ids = tokenizer.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    (directory / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|begin_of_text|>"), "eos_token_id": ids,
        "do_sample": True, "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.43.0"}))
    return directory, tokenizer


def test_the_source_generation_config_and_special_tokens_survive_the_round_trip(tmp_path, capsys):
    source, tokenizer = _source(tmp_path)
    hf_to_checkpoint(str(source), str(tmp_path / "ckpt"))
    meta = checkpointing.read_meta(checkpointing.latest_checkpoint(tmp_path / "ckpt"))
    assert meta["hf_generation_config"]["temperature"] == 0.6 and meta["hf_special_tokens"]["pad_token"]
    # exported with the bare tokenizer.json (no directory to read either from): the meta carries both
    out = checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype=torch.float32,
                           tokenizer_model=str(source / "tokenizer.json"), tokenizer_type="HuggingFaceTokenizer")
    written = json.loads((out / "generation_config.json").read_text())
    eot, end = tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert sorted(written["eos_token_id"]) == sorted([end, eot])
    assert (written["temperature"], written["top_p"], written["do_sample"]) == (0.6, 0.9, True)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert set(model.generation_config.eos_token_id) == {end, eot}
    exported = transformers.AutoTokenizer.from_pretrained(str(out))
    assert exported.pad_token == "<|end_of_text|>"
    assert exported.model_max_length == 512  # never trained: the model's positions
    assert "warning" not in capsys.readouterr().err


def test_a_trained_export_takes_the_tokenizer_directorys_generation_config_and_the_trained_context(tmp_path):
    source, tokenizer = _source(tmp_path)
    train(parse_config(["--mock-data", "--seq-length", "16", "--train-iters", "1", "--device", "cpu",
                        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(source),
                        "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "log")]))
    out = checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype=torch.float32)
    written = json.loads((out / "generation_config.json").read_text())
    assert set(written["eos_token_id"]) == set(tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"]))
    assert written["temperature"] == 0.6
    assert transformers.AutoTokenizer.from_pretrained(str(out)).model_max_length == 16


def test_a_chat_export_whose_eos_misses_the_end_of_turn_is_named_in_one_warning(tmp_path, capsys):
    source, tokenizer = _source(tmp_path, eos_token="<|end_of_text|>")  # a base tokenizer: eos ends documents
    (source / "generation_config.json").unlink()
    train(parse_config(["--mock-data", "--seq-length", "16", "--train-iters", "1", "--device", "cpu",
                        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(source),
                        "--save", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "log")]))
    capsys.readouterr()
    out = checkpoint_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), dtype=torch.float32)
    end, eot = tokenizer.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert lines == [f"warning: {out}: generation_config.json's eos is <|end_of_text|> ({end}), but the chat template "
                     f"ends an assistant turn with <|eot_id|> ({eot}): generate() will not stop at the end of an "
                     "answer; export with the source's generation_config.json (convert_from_hf.py keeps it; or a "
                     "--tokenizer-model directory holding it)"]


def test_the_source_eos_list_keeps_the_training_end_of_document():
    hf_config = transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, eos_token_id=7)
    source = {"eos_token_id": [1, 2], "temperature": 0.6, "transformers_version": "4.43.0"}
    assert export_generation_config(hf_config, source, 7).eos_token_id == [1, 2, 7]
    assert export_generation_config(hf_config, source, 2).eos_token_id == [1, 2]
    assert export_generation_config(hf_config, None, 7).eos_token_id == 7
