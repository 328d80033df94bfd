"""One dataclass tree for a training run; Megatron-style CLI flags derived from it.

Every field becomes a flag named as in Megatron-LM (`seq_length` -> `--seq-length`), with
the field's `help` as its help text. `--config FILE.yaml|.toml` loads a preset (keys are
field names, flat or grouped by section); flags on the command line win over the preset.
`TrainConfig.validate(world_size)` rejects impossible combinations before any process
group or accelerator memory is touched, naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import torch


def flag(default: Any, help: str, **kwargs) -> Any:
    """A config field with its help text (and optional argparse extras such as choices)."""
    return field(default=default, metadata={"help": help, **kwargs})


def flag_list(help: str, **kwargs) -> Any:
    return field(default_factory=list, metadata={"help": help, "nargs": "*", **kwargs})


@dataclass
class ModelArgs:
    model: str = flag("debug", "model flavour from the zoo (python -m megatron_lc.models --list)")
    num_layers: int | None = flag(None, "override: transformer blocks")
    hidden_size: int | None = flag(None, "override: width of the residual stream")
    ffn_hidden_size: int | None = flag(None, "override: width of the SwiGLU MLP")
    num_attention_heads: int | None = flag(None, "override: query heads")
    num_query_groups: int | None = flag(None, "override: key/value heads (GQA)")
    kv_channels: int | None = flag(None, "override: head dimension")
    vocab_size: int | None = flag(None, "override: vocabulary size (default: the tokenizer's, else the flavour's)")
    rotary_base: float | None = flag(None, "override: rotary theta")


@dataclass
class ParallelArgs:
    context_parallel_size: int = flag(1, "context-parallel degree: each sequence is split over this many ranks")
    cp_impl: str = flag("ulysses", "context-parallel attention", choices=("ulysses", "untied_ulysses"))
    untied_heads_per_stage: int | None = flag(None, "Untied Ulysses heads per stage (a multiple of cp; default cp)")
    data_parallel_replicate: int = flag(1, "HSDP replicas (outer data-parallel dimension); the rest is sharded")
    attention_kernel: str = flag("auto", "local attention kernel",
                                 choices=("auto", "flash_attn", "sdpa_flash", "cpu_flash", "reference"))
    fsdp_cpu_offload: bool = flag(False, "keep sharded parameters, gradients and optimizer state in host memory")
    no_reshard_after_forward: bool = flag(False, "keep gathered parameters between forward and backward")


@dataclass
class MemoryArgs:
    recompute_granularity: str = flag("none", "activation checkpointing: none, full (keep block inputs only), "
                                      "selective (keep attention, recompute the MLP half)",
                                      choices=("none", "full", "selective"))
    offload_activations: bool = flag(False, "keep checkpointed block inputs in host memory (needs full recompute)")
    offload_keep_last: int = flag(1, "last layers whose block inputs stay on the accelerator")
    no_offload_prefetch: bool = flag(False, "bring an offloaded block input back only when its own layer's backward "
                                     "needs it: one block input less on the accelerator, the copy no longer overlaps")
    tiled_mlp: bool = flag(False, "compute the MLP over sequence tiles, recomputed in backward")
    tiled_mlp_tiles: int | None = flag(None, "MLP tiles (default: about hidden-size tokens per tile)")
    tiled_loss: bool = flag(False, "fuse output projection and cross-entropy over sequence tiles")
    tiled_loss_tiles: int | None = flag(None, "loss tiles (default: about 1 GiB of fp32 logits per tile)")


@dataclass
class DataArgs:
    data_path: list[str] = flag_list("indexed dataset prefixes (PREFIX of PREFIX.bin/.idx)")
    valid_data_path: list[str] = flag_list("validation dataset prefixes (default: none)")
    mock_data: bool = flag(False, "deterministic random tokens instead of --data-path")
    tokenizer_type: str | None = flag(None, "tokenizer of the data (for vocab size and generation)",
                                      choices=(None, "SentencePieceTokenizer", "HuggingFaceTokenizer",
                                               "TikTokenizer", "ByteTokenizer"))
    tokenizer_model: str | None = flag(None, "tokenizer file or directory")
    seq_length: int = flag(1024, "tokens per sample")
    micro_batch_size: int = flag(1, "samples per rank per forward/backward")
    global_batch_size: int | None = flag(None, "samples per step over all data-parallel ranks "
                                               "(default micro x dp; more means gradient accumulation)")
    no_shuffle: bool = flag(False, "read documents in stream order")
    reset_position_ids: bool = flag(False, "restart positions at each document")
    eod_mask_loss: bool = flag(False, "do not train on predicting the token after an end-of-document")


@dataclass
class OptimArgs:
    lr: float = flag(3e-4, "peak learning rate")
    min_lr: float = flag(3e-5, "learning rate at the end of the cosine decay")
    lr_warmup_iters: int = flag(0, "linear warmup steps")
    weight_decay: float = flag(0.1, "AdamW weight decay")
    adam_beta1: float = flag(0.9, "AdamW beta1")
    adam_beta2: float = flag(0.95, "AdamW beta2")
    adam_eps: float = flag(1e-8, "AdamW epsilon")
    clip_grad: float = flag(1.0, "clip gradients to this global L2 norm (0: off)")


@dataclass
class TrainArgs:
    train_iters: int = flag(10, "optimizer steps")
    bf16: bool = flag(False, "bf16 parameters and compute with fp32 gradient reduction (fp32 without it)")
    device: str = flag("auto", "accelerator", choices=("auto", "cuda", "cpu"))
    seed: int = flag(1234, "seed of weights and data order")
    skip_nonfinite: bool = flag(False, "skip a step whose loss or gradient is NaN/Inf instead of stopping")
    exit_interval: int | None = flag(None, "exit after the step divisible by N (after saving), e.g. to fit a job limit")


@dataclass
class CheckpointArgs:
    save: str | None = flag(None, "directory to save checkpoints into")
    load: str | None = flag(None, "directory to resume from (latest complete checkpoint)")
    save_interval: int | None = flag(None, "save every N steps (and at the end)")
    keep_last_checkpoints: int = flag(2, "checkpoints kept in --save (older ones are deleted)")


@dataclass
class LoggingArgs:
    log_interval: int = flag(1, "steps between log lines")
    log_dir: str | None = flag(None, "where metrics.jsonl goes (default: a new directory under runs/)")
    tensorboard_dir: str | None = flag(None, "tensorboard event files (default: none)")
    eval_interval: int | None = flag(None, "validation every N steps")
    eval_iters: int = flag(2, "validation micro-batches per evaluation")


SECTIONS = {
    "model": ModelArgs, "parallel": ParallelArgs, "memory": MemoryArgs, "data": DataArgs,
    "optim": OptimArgs, "train": TrainArgs, "checkpoint": CheckpointArgs, "logging": LoggingArgs,
}


@dataclass
class TrainConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    memory: MemoryArgs = field(default_factory=MemoryArgs)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)

    def model_config(self, vocab_size: int | None = None):
        """The LlamaConfig of the run: the flavour with the overrides applied."""
        from megatron_lc.models.llama import get_config

        m = self.model
        return get_config(m.model, num_layers=m.num_layers, hidden_size=m.hidden_size,
                          ffn_hidden_size=m.ffn_hidden_size, num_attention_heads=m.num_attention_heads,
                          num_query_groups=m.num_query_groups, kv_channels=m.kv_channels,
                          vocab_size=m.vocab_size or vocab_size, rotary_base=m.rotary_base)

    def parallelize_options(self):
        """The ParallelizeOptions of the run (tile counts resolved by the chunk scheduler)."""
        from megatron_lc.memory.chunks import plan_chunks
        from megatron_lc.models.llama.parallelize import ParallelizeOptions

        c, mem, par = self.model_config(), self.memory, self.parallel
        local_tokens = self.data.micro_batch_size * self.data.seq_length // par.context_parallel_size
        plan = plan_chunks(local_tokens, c.hidden_size, c.ffn_hidden_size, c.vocab_size, 2 if self.train.bf16 else 4,
                           mlp_tiles=mem.tiled_mlp_tiles, loss_tiles=mem.tiled_loss_tiles)
        dtype = torch.bfloat16 if self.train.bf16 else torch.float32
        return ParallelizeOptions(
            cp_impl=par.cp_impl, attention_kernel=par.attention_kernel, heads_per_stage=par.untied_heads_per_stage,
            recompute_granularity=mem.recompute_granularity, offload_activations=mem.offload_activations,
            offload_keep_last=mem.offload_keep_last, offload_prefetch=not mem.no_offload_prefetch,
            mlp_tiles=plan.mlp_tiles if mem.tiled_mlp else None, loss_tiles=plan.loss_tiles if mem.tiled_loss else None,
            param_dtype=dtype, reduce_dtype=torch.float32, reshard_after_forward=not par.no_reshard_after_forward, fsdp_cpu_offload=par.fsdp_cpu_offload,
        )

    def validate(self, world_size: int) -> None:
        """Every impossible combination, with the reason and the fix, before any GPU time is spent."""
        for check in (self._check_data, self._check_parallel, self._check_memory, self._check_model):
            check(world_size)

    def _check_data(self, world_size: int) -> None:
        d = self.data
        if not d.mock_data and not d.data_path:
            raise ValueError("no data: give --data-path PREFIX (see tools/preprocess_data.py) or --mock-data")
        if d.seq_length < 1 or d.micro_batch_size < 1:
            raise ValueError(f"--seq-length {d.seq_length} and --micro-batch-size {d.micro_batch_size} must be >= 1")
        for prefix in d.data_path + d.valid_data_path:
            for suffix in (".bin", ".idx"):
                if not Path(prefix + suffix).exists():
                    raise FileNotFoundError(f"--data-path {prefix}: {prefix + suffix} does not exist")

    def _check_parallel(self, world_size: int) -> None:
        from megatron_lc.attention.ulysses import check_ulysses_shapes

        p, d = self.parallel, self.data
        cp = p.context_parallel_size
        if cp < 1 or world_size % (cp * p.data_parallel_replicate):
            raise ValueError(f"world size {world_size} is not divisible by --context-parallel-size {cp} x "
                             f"--data-parallel-replicate {p.data_parallel_replicate}")
        if d.seq_length % cp:
            raise ValueError(f"--seq-length {d.seq_length} is not divisible by --context-parallel-size {cp}; "
                             f"use a multiple of {cp}")
        if cp > 1:
            c = self.model_config()
            check_ulysses_shapes(c.num_attention_heads, c.num_query_groups, cp, d.seq_length)
        dp = world_size // cp
        if d.global_batch_size is not None and d.global_batch_size % (d.micro_batch_size * dp):
            raise ValueError(f"--global-batch-size {d.global_batch_size} is not a multiple of --micro-batch-size "
                             f"{d.micro_batch_size} x data-parallel size {dp}")

    def _check_memory(self, world_size: int) -> None:
        self.parallelize_options().validate()

    def _check_model(self, world_size: int) -> None:
        self.model_config()  # validates the flavour and overrides

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --- command line ---------------------------------------------------------------------


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_field(group, f: dataclasses.Field, hint) -> None:
    meta = dict(f.metadata)
    help_text = meta.pop("help", "")
    default = f.default if f.default is not dataclasses.MISSING else None
    if hint is bool:
        group.add_argument(_flag_name(f.name), action="store_true", default=None, help=help_text)
        return
    kind = _scalar_type(hint)
    group.add_argument(_flag_name(f.name), type=kind, default=None,
                       help=f"{help_text} (default: {default})", **meta)


def _scalar_type(hint):
    """int | None -> int, list[str] -> str, ..."""
    args = [a for a in getattr(hint, "__args__", ()) if a is not type(None)]
    return args[0] if args else hint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_lc.train",
                                     description="Train a LLaMA model on long contexts.")
    parser.add_argument("--config", default=None, help="YAML or TOML preset; command-line flags win")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _add_field(group, f, hints[f.name])
    return parser


def _load_preset(path: str) -> dict:
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    elif path.endswith(".toml"):
        import tomllib

        data = tomllib.loads(text)
    else:
        raise ValueError(f"--config {path}: expected a .yaml, .yml or .toml file")
    flat = {}
    for key, value in data.items():  # grouped by section or flat
        flat.update(value if key in SECTIONS and isinstance(value, dict) else {key: value})
    return flat


def config_from_values(values: dict) -> TrainConfig:
    """A TrainConfig from field-name -> value (unknown names are refused, naming them)."""
    cfg = TrainConfig()
    known = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    for name, value in values.items():
        name = name.replace("-", "_")
        if name not in known:
            raise ValueError(f"unknown setting {name!r}")
        if value is not None:
            setattr(getattr(cfg, known[name]), name, value)
    return cfg


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """TrainConfig from the command line (and the --config preset)."""
    args = vars(build_parser().parse_args(argv))
    preset = _load_preset(args.pop("config")) if args.get("config") else {}
    values = {**preset, **{k: v for k, v in args.items() if v is not None}}
    return config_from_values(values)
