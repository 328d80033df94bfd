"""Checkpoints of this trainer <-> Hugging Face model directories."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
import sys
import uuid
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import DefaultSavePlanner

from megatron_lc.models.llama import build_model
from megatron_lc.models.llama.hf import from_hf_config, hf_rope_scaling, to_hf_config, to_hf_name
from megatron_lc.models.llama.model import LlamaConfig
from megatron_lc.models.llama.zoo import config_from_dict
from megatron_lc.errors import ConfigError
from megatron_lc.training import checkpointing
from megatron_lc.training.hf_generation import (
    META_GENERATION_CONFIG,
    META_SPECIAL_TOKENS,
    eos_misses_end_of_turn,
    export_generation_config,
    read_generation_config,
    read_special_tokens,
)
from megatron_lc.training.save_lock import acquire_save_lock


def config_from_meta(meta: dict) -> LlamaConfig:
    return config_from_dict(meta["model_config"])


def resolve_checkpoint(load: str, iteration: int | None) -> Path:
    path = checkpointing.checkpoint_dir(load, iteration) if iteration is not None else checkpointing.latest_checkpoint(load)
    if path is None or not (Path(path) / checkpointing.META).exists():
        raise FileNotFoundError(f"--load {load}: no complete checkpoint" + (f" for iteration {iteration}" if iteration else ""))
    return Path(path)


def training_dtype(meta: dict) -> torch.dtype:
    """The precision a checkpoint was trained in: bf16 compute with --bf16, else fp32."""
    return torch.bfloat16 if meta.get("train_config", {}).get("train", {}).get("bf16") else torch.float32


def checkpoint_to_hf(load: str, save: str, iteration: int | None = None, dtype: torch.dtype | None = None,
                     tokenizer_model: str | None = None, max_shard_bytes: int = 5 * 10**9,
                     tokenizer_type: str | None = None) -> Path:
    """Write safetensors shards (+ index), config.json, generation_config.json (and tokenizer files) to `save`,
    in `dtype` (default: the training's precision, `training_dtype`).

    bos/eos/pad come from the tokenizer (by default the one the checkpoint was trained with), so
    generate() stops at the training's end-of-document; without one they are left unset. The source's
    generation_config.json (kept in the meta by `hf_to_checkpoint`, else found in a tokenizer directory) is
    written back over them: its eos list and sampling defaults. The tokenizer's `model_max_length` is the trained
    context (`--seq-length`; a converted checkpoint's `max_position_embeddings`). A chat template whose end of
    turn is not among the eos ids is named in one warning on stderr.

    Streams: one tensor is read from the checkpoint at a time and one shard is held, so host
    memory is about one shard whatever the model's size.
    """
    path = resolve_checkpoint(load, iteration)
    meta = checkpointing.read_meta(path)
    config = config_from_meta(meta)
    dtype = dtype or training_dtype(meta)
    if tokenizer_model is None and tokenizer_type is None:  # the training's own, when it recorded one
        data = meta.get("train_config", {}).get("data", {})
        tokenizer_type, tokenizer_model = data.get("tokenizer_type"), data.get("tokenizer_model")
    tokenizer_dir = tokenizer_model if tokenizer_model and Path(tokenizer_model).is_dir() else None
    generation = meta.get(META_GENERATION_CONFIG) or read_generation_config(tokenizer_dir)
    export = TokenizerExport(tokenizer_model, tokenizer_type, trained_context(meta, config),
                             meta.get(META_SPECIAL_TOKENS) or {})
    out = Path(save)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    stage = out / f".partial-{uuid.uuid4().hex[:12]}"  # written whole, then moved in: a failure leaves no mix
    stage.mkdir()
    try:
        _write_export(path, config, stage, dtype, export, generation, max_shard_bytes)
        warning = eos_misses_end_of_turn(stage, out)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        remove_hf_weights(out)
        for file in stage.iterdir():
            file.replace(out / file.name)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    shutil.rmtree(stage, ignore_errors=True)
    return out


def trained_context(meta: dict, config: LlamaConfig) -> int:
    """The context a checkpoint was trained at: its run's --seq-length, else (converted, never trained) the
    model's max_position_embeddings."""
    return int(meta.get("train_config", {}).get("data", {}).get("seq_length") or config.max_position_embeddings)


@dataclasses.dataclass(frozen=True)
class TokenizerExport:
    """The tokenizer an export ships: its files, its `model_max_length`, and the special tokens a converted
    source had (pad, unk, ...; bos and eos follow the training's ids)."""

    model: str | None
    type: str | None
    model_max_length: int | None = None
    special_tokens: dict = dataclasses.field(default_factory=dict)


def _write_export(path: Path, config: LlamaConfig, out: Path, dtype: torch.dtype, export: TokenizerExport,
                  generation: dict | None, max_shard_bytes: int) -> None:
    """Everything `checkpoint_to_hf` writes, into `out`: the tokenizer first (the quickest to fail), then the
    weights shard by shard, then the configs."""
    ids = save_tokenizer(export.model, str(out), export.type, export)
    items = checkpoint_tensors(path)
    names = _hf_names_to_write(items, config)
    sizes = {hf: math.prod(items[key].size) * dtype.itemsize for hf, key in names.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = _shard_name(i, len(shards))
        tensors = {hf: read_checkpoint_tensor(path, names[hf], items[names[hf]]).to(dtype).contiguous()
                   for hf in shard}
        save_safetensors(tensors, out / file)
        weight_map.update(dict.fromkeys(shard, file))
        del tensors  # one shard at a time
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=1))
    _write_hf_config(config, dtype, out, ids, generation)


def remove_hf_weights(directory: Path) -> None:
    """Weights of an earlier export: transformers would read a stale model.safetensors before a new index."""
    for stale in [*directory.glob("model*.safetensors"), directory / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)


def _hf_names_to_write(items: dict, config: LlamaConfig) -> dict[str, str]:
    """transformers' name -> checkpoint key, in checkpoint order; a tied output weight once."""
    names = {}
    for key in items:
        hf = to_hf_name(key.removeprefix(MODEL_PREFIX))
        if not (config.tie_embeddings and hf == "lm_head.weight"):
            names[hf] = key
    return names


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive groups of names whose bytes stay within max_shard_bytes (a larger tensor alone)."""
    shards, current, used = [], [], 0
    for name, size in sizes.items():
        if current and used + size > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    return shards + [current] if current else shards


def _shard_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def save_safetensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(file), metadata={"format": "pt"})


def _write_hf_config(config: LlamaConfig, dtype: torch.dtype, out: Path, ids: SpecialIds,
                     generation: dict | None = None) -> None:
    hf_config = to_hf_config(config, torch_dtype=dtype, bos_token_id=ids.bos, eos_token_id=ids.eos,
                             pad_token_id=ids.pad)
    hf_config.save_pretrained(out)
    export_generation_config(hf_config, generation, ids.eos).save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**written, **loader_compatible_fields(config)}, indent=2,
                                                sort_keys=True))


def loader_compatible_fields(config: LlamaConfig) -> dict:
    """What every Llama loader reads, as Meta's own config.json has it: `architectures`, and the rotary
    settings in both layouts transformers has used (top-level `rope_theta` and `rope_scaling`, read by
    transformers 4 and vLLM-style loaders; `rope_parameters`, transformers 5's)."""
    scaling = hf_rope_scaling(config)
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": config.rotary_base}
    return {"architectures": ["LlamaForCausalLM"], "rope_theta": config.rotary_base, "rope_scaling": scaling,
            "rope_parameters": parameters, "max_position_embeddings": config.max_position_embeddings}


MODEL_PREFIX = "model."  # the model's tensors sit under this key in a checkpoint's state


def checkpoint_tensors(path: Path) -> dict:
    """Checkpoint key -> DCP's tensor metadata (size, dtype) of every model tensor, from its index alone."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {key: item for key, item in metadata.items() if key.startswith(MODEL_PREFIX) and hasattr(item, "size")}


def read_checkpoint_tensor(path: Path, key: str, item) -> torch.Tensor:
    """One tensor of a checkpoint, given its metadata (DCP reads only its bytes)."""
    tensor = torch.empty(item.size, dtype=item.properties.dtype)
    checkpointing.load_state({MODEL_PREFIX.rstrip("."): {key.removeprefix(MODEL_PREFIX): tensor}}, path)
    return tensor


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """The ids an export writes into config.json and generation_config.json (generate() stops at eos)."""

    bos: int | None = None
    eos: int | None = None
    pad: int | None = None


def infer_tokenizer_type(tokenizer_model: str) -> str:
    """A directory or .json is a Hugging Face tokenizer; a file SentencePiece reads is one; else tiktoken BPE."""
    path = Path(tokenizer_model)
    if path.is_dir() or path.suffix == ".json":
        return "HuggingFaceTokenizer"
    try:
        import sentencepiece

        sentencepiece.SentencePieceProcessor(model_file=str(path))
        return "SentencePieceTokenizer"
    except (OSError, RuntimeError):
        return "TikTokenizer"


def _token_or_none(getter) -> int | None:
    try:
        return getter()
    except ValueError:  # the tokenizer defines no such token
        return None


# Tokenizers whose flags are not one model path: the weights are converted, the tokenizer is not written.
TOKENIZERS_NOT_WRITTEN = ("GPT2BPETokenizer", "NullTokenizer")


def save_tokenizer(tokenizer_model: str | None, save: str, tokenizer_type: str | None = None,
                   export: TokenizerExport | None = None) -> SpecialIds:
    """Write the tokenizer next to the weights in a form transformers loads natively; its special ids.

    SentencePiece: `tokenizer.model` with a Llama tokenizer config naming its specials; a
    `tokenizer.json` (or its directory): a fast tokenizer with the training EOD as eos; Llama-3
    tiktoken BPE: converted to a fast tokenizer (transformers would read that file as SentencePiece).
    """
    from megatron_lc.data.tokenizers import build_tokenizer

    tokenizer_type = tokenizer_type or (infer_tokenizer_type(tokenizer_model) if tokenizer_model else None)
    if tokenizer_type is None or tokenizer_type in TOKENIZERS_NOT_WRITTEN:
        return SpecialIds()  # GPT-2 vocab/merges and NullTokenizer: not written (see docs/training.md)
    ours = build_tokenizer(tokenizer_type, tokenizer_model)
    ids = SpecialIds(bos=_token_or_none(lambda: ours.bos), eos=_token_or_none(lambda: ours.eod))
    if tokenizer_type == "ByteTokenizer":
        return ids  # no file: the ids alone
    fast = _fast_tokenizer(tokenizer_type, tokenizer_model, ids, save, export or TokenizerExport(tokenizer_model,
                                                                                                tokenizer_type))
    if fast is not None:
        fast.save_pretrained(save)
        return dataclasses.replace(ids, pad=fast.pad_token_id)
    return ids


def _fast_tokenizer(tokenizer_type: str, tokenizer_model: str, ids: SpecialIds, save: str, export: TokenizerExport):
    """A transformers fast tokenizer with the training's specials (and the source's others: pad, unk, ...); None
    once written another way."""
    import transformers

    limit = {"model_max_length": export.model_max_length} if export.model_max_length else {}

    def token(rust, token_id):
        return rust.id_to_token(token_id) if token_id is not None else None

    if tokenizer_type == "HuggingFaceTokenizer":
        src = Path(tokenizer_model)
        if src.is_dir() and not (src / "tokenizer.json").exists():  # only a slow tokenizer: transformers' own copy
            transformers.AutoTokenizer.from_pretrained(str(src), local_files_only=True, **limit).save_pretrained(save)
            return None
        file = src / "tokenizer.json" if src.is_dir() else src
        from tokenizers import Tokenizer as RustTokenizer

        rust = RustTokenizer.from_file(str(file))
        source = (read_special_tokens(src) if src.is_dir() else None) or export.special_tokens
        others = {key: value for key, value in source.items() if key not in ("bos_token", "eos_token")
                  and isinstance(value, str) and rust.token_to_id(value) is not None}
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, bos_token=token(rust, ids.bos),
                                                    eos_token=token(rust, ids.eos), **others, **limit)
        if src.is_dir():  # the chat template travels with the tokenizer, as fine-tuned chat models need it
            fast.chat_template = transformers.AutoTokenizer.from_pretrained(str(src), local_files_only=True).chat_template
        return fast
    if tokenizer_type == "TikTokenizer":
        from transformers.convert_slow_tokenizer import TikTokenConverter

        from megatron_lc.data.tokenizers import LLAMA3_PATTERN, llama3_special_tokens

        rust = TikTokenConverter(vocab_file=tokenizer_model, pattern=LLAMA3_PATTERN,
                                 extra_special_tokens=llama3_special_tokens()).converted()
        return transformers.PreTrainedTokenizerFast(tokenizer_object=rust, bos_token=token(rust, ids.bos),
                                                    eos_token=token(rust, ids.eos), **limit)
    import sentencepiece  # SentencePiece: transformers' Llama tokenizer reads it as tokenizer.model

    processor = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model)
    shutil.copy(tokenizer_model, Path(save) / "tokenizer.model")
    piece = lambda i: processor.id_to_piece(i) if i is not None and i >= 0 else None  # noqa: E731
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False, "legacy": False,
              "bos_token": piece(ids.bos), "eos_token": piece(ids.eos), "pad_token": piece(processor.pad_id()),
              "unk_token": piece(processor.unk_id()), **limit}
    (Path(save) / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return None


def hf_to_checkpoint(load: str, save: str, force: bool = False) -> Path:
    """A weights-only checkpoint of this trainer (fp32) from a Hugging Face LlamaForCausalLM directory.

    Streams: each tensor is read from its safetensors shard only when the checkpoint writer
    reaches it, so host memory is about one tensor whatever the model's size. A config field the
    model does not compute exactly, or a tensor it would not use or of another shape, is refused.
    A `save` that already holds checkpoints is refused unless `force`; then `iter_0000000` is added
    and the marker is left at a later step, so `--load save` still resumes the run there.
    """
    import transformers

    config = from_hf_config(transformers.AutoConfig.from_pretrained(load))
    sources = hf_tensor_sources(Path(load))
    expected = build_model(config, device="meta").state_dict()
    check_hf_tensors(load, sources, expected, config)
    readers, shapes = {}, {}
    for name, like in expected.items():
        hf = _hf_source_name(name, config)
        readers[MODEL_PREFIX + name] = functools.partial(read_safetensor, sources[hf], hf, torch.float32)
        shapes[name] = torch.empty(like.shape, dtype=torch.float32, device="meta")
    check_conversion_target(save, force)
    extra = {"model_config": dataclasses.asdict(config), "source": str(load), "weights_only": True}
    for key, value in ((META_GENERATION_CONFIG, read_generation_config(load)),
                       (META_SPECIAL_TOKENS, read_special_tokens(load))):
        if value:  # written back by checkpoint_to_hf: generate() stops and samples as the source did
            extra[key] = value
    lock = acquire_save_lock(save)
    try:
        return checkpointing.save_state(save, 0, {"model": shapes}, extra, planner=StreamingSavePlanner(readers),
                                        run_id=lock.run_id, move_marker_back=False)
    finally:
        lock.release()


def check_conversion_target(save: str, force: bool) -> None:
    """A converted model goes into a directory of its own: refuse one holding a run's checkpoints."""
    checkpointing.check_save_directory(save)
    if checkpointing.holds_checkpoints(save) and not force:
        raise ConfigError(f"--save {save} already holds checkpoints: give an empty directory, or --force to add "
                          "iter_0000000 there (the marker keeps naming the run's latest step)")


def _hf_source_name(name: str, config: LlamaConfig) -> str:
    hf = to_hf_name(name)
    return "model.embed_tokens.weight" if config.tie_embeddings and hf == "lm_head.weight" else hf


def check_hf_tensors(load: str, sources: dict[str, Path], expected: dict, config: LlamaConfig) -> None:
    """Every tensor the model needs, at its shape, and none it would drop (a bias, an extra layer)."""
    needed = {_hf_source_name(name, config): tuple(like.shape) for name, like in expected.items()}
    for hf, shape in needed.items():
        if hf not in sources:
            raise ConfigError(f"--load {load}: no tensor {hf!r} in its safetensors files")
        found = tuple(safetensor_shape(sources[hf], hf))
        if found != shape:
            raise ConfigError(f"--load {load}: {hf} has shape {list(found)}, the config makes it {list(shape)}")
    unused = sorted(n for n in sources if n not in needed and "rotary_emb" not in n
                    and not (config.tie_embeddings and n == "lm_head.weight"))
    if unused:
        raise ConfigError(f"--load {load}: tensors the model would not use: {', '.join(unused[:3])}"
                          + (f" and {len(unused) - 3} more" if len(unused) > 3 else ""))


def safetensor_shape(file: Path, name: str) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.get_slice(name).get_shape()


def hf_tensor_sources(directory: Path) -> dict[str, Path]:
    """transformers' tensor name -> the safetensors file holding it (index file, or one model.safetensors)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = directory / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"--load {directory}: no model.safetensors or model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def read_safetensor(file: Path, name: str, dtype: torch.dtype) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name).to(dtype)


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's save planner over meta tensors: each tensor is made by its reader when it is written.

    The plan needs only shapes and dtypes; DCP's writer asks `resolve_data` for one item at a
    time, so only the tensor being written is in memory.
    """

    def __init__(self, readers: dict[str, Callable[[], torch.Tensor]]):
        super().__init__()
        self.readers = readers

    def resolve_data(self, write_item):
        reader = self.readers.get(write_item.index.fqn)
        return reader() if reader is not None else super().resolve_data(write_item)
