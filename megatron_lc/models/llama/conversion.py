"""Checkpoints of this trainer <-> Hugging Face model directories."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch

from megatron_lc.models.llama import build_model
from megatron_lc.models.llama.hf import from_hf_config, from_hf_state_dict, to_hf_config, to_hf_state_dict
from megatron_lc.models.llama.model import LlamaConfig, RopeScaling
from megatron_lc.training import checkpointing


def config_from_meta(meta: dict) -> LlamaConfig:
    values = dict(meta["model_config"])
    if values.get("rope_scaling"):
        values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
    return LlamaConfig(**values)


def resolve_checkpoint(load: str, iteration: int | None) -> Path:
    path = checkpointing.checkpoint_dir(load, iteration) if iteration is not None else checkpointing.latest_checkpoint(load)
    if path is None or not (Path(path) / checkpointing.META).exists():
        raise FileNotFoundError(f"--load {load}: no complete checkpoint" + (f" for iteration {iteration}" if iteration else ""))
    return Path(path)


def checkpoint_to_hf(load: str, save: str, iteration: int | None = None, dtype=torch.bfloat16,
                     tokenizer_model: str | None = None) -> Path:
    """Write safetensors shards, config.json, generation_config.json (and tokenizer files) to `save`."""
    import transformers

    path = resolve_checkpoint(load, iteration)
    config = config_from_meta(checkpointing.read_meta(path))
    model = build_model(config, device="cpu", seed=None)
    checkpointing.load_model_weights(path, model)
    hf = transformers.LlamaForCausalLM(to_hf_config(config, torch_dtype=dtype))
    hf.load_state_dict(to_hf_state_dict(model.state_dict(), config), strict=True)
    hf.to(dtype).save_pretrained(save, safe_serialization=True)
    if tokenizer_model:
        save_tokenizer(tokenizer_model, save)
    return Path(save)


def save_tokenizer(tokenizer_model: str, save: str) -> None:
    """Copy the tokenizer next to the weights in a form transformers loads."""
    import transformers

    src = Path(tokenizer_model)
    if src.is_dir():
        for f in src.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copy(f, Path(save) / f.name)
    elif src.suffix == ".json":
        transformers.PreTrainedTokenizerFast(tokenizer_file=str(src)).save_pretrained(save)
    else:  # a SentencePiece model: transformers' Llama tokenizer reads it as tokenizer.model
        shutil.copy(src, Path(save) / "tokenizer.model")
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                  "legacy": False}
        (Path(save) / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def hf_to_checkpoint(load: str, save: str) -> Path:
    """A weights-only checkpoint of this trainer from a Hugging Face LlamaForCausalLM directory."""
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(load, torch_dtype=torch.float32)
    config = from_hf_config(hf.config)
    model = build_model(config, device="cpu", seed=None)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), config), strict=True)
    return checkpointing.save_checkpoint(save, 0, model, None, {"model_config": dataclasses.asdict(config),
                                                                 "source": str(load)})
