"""What a run needs of this machine, checked after the rules (`TrainConfig.validate`) and before any
process group or accelerator memory exists: the tokenizer's files, the checkpoint in `--load`, a
`--save` directory this run may own, the wandb package, a visible GPU, and every directory the run
writes. The trainer and evaluate call it; the planner, which plans for another machine, does not.
"""

from __future__ import annotations

import importlib.util

import torch

from megatron_lc.attention.kernels import FlashImplRefused, activate_flash_impl
from megatron_lc.cli import check_writable
from megatron_lc.config import TrainConfig
from megatron_lc.errors import ConfigError
from megatron_lc.training.checkpointing import check_save_directory, checkpoint_to_load, missing_checkpoint_hint


def preflight(cfg: TrainConfig) -> None:
    """Each check raises a `ConfigError` naming the flag; `cfg` is validated and resolved."""
    _check_tokenizer(cfg)
    _check_checkpoint_dirs(cfg)
    _check_packages(cfg)
    _check_device(cfg)
    for name, directory in (("--log-dir", cfg.logging.log_dir), ("--tensorboard-dir", cfg.logging.tensorboard_dir),
                            ("--data-cache-path", cfg.data.data_cache_path)):
        if directory:
            check_writable(directory, name, create=False)  # the run creates them when it starts


def _check_tokenizer(cfg: TrainConfig) -> None:
    d = cfg.data
    if not d.tokenizer_type:
        return
    try:
        vocab = cfg.tokenizer_spec().build().vocab_size
    except (ValueError, OSError) as error:
        raise ConfigError(f"--tokenizer-type {d.tokenizer_type}: {error}") from None
    if cfg.vocab_size_override() is not None and cfg.vocab_size_override() < vocab:
        raise ConfigError(f"--vocab-size {cfg.model.vocab_size} is smaller than the vocabulary of "
                          f"--tokenizer-model {d.tokenizer_model} ({vocab} ids)")


def _check_checkpoint_dirs(cfg: TrainConfig) -> None:
    c = cfg.checkpoint
    if c.load and (c.ckpt_step is not None or c.exit_on_missing_checkpoint):
        checkpoint_to_load(c.load, c.ckpt_step, c.exit_on_missing_checkpoint)  # refuses a missing one
    if c.load and c.finetune and checkpoint_to_load(c.load, c.ckpt_step) is None:  # else: random weights
        raise ConfigError(f"--finetune: --load {c.load} holds no checkpoint to fine-tune from "
                          f"({missing_checkpoint_hint(c.load)})")
    if c.save:
        check_save_directory(c.save)
        check_writable(c.save, "--save")


def _check_packages(cfg: TrainConfig) -> None:
    if cfg.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"--wandb-project {cfg.logging.wandb_project} needs the wandb package: pip install wandb")


def _check_device(cfg: TrainConfig) -> None:
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(f"--device cuda: no CUDA device is visible (torch {torch.__version__}, {build}); "
                          "use --device cpu, or auto to take a GPU when there is one")
    impl = cfg.parallel.flash_attention_impl
    on_cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available())
    if impl in ("fa3", "fa4") and on_cpu:
        raise ConfigError(f"--flash-attention-impl {impl} replaces torch's flash kernels on a CUDA GPU; this run is "
                          "on the CPU: drop the flag (or run on a GPU)")


def activate_flash(cfg: TrainConfig, device: torch.device) -> str:
    """--flash-attention-impl put behind torch's flash kernels and proven on a tiny step, or refused in one line
    (what it returns runs: 'default', 'fa3' or 'fa4')."""
    try:
        return activate_flash_impl(cfg.parallel.flash_attention_impl, device, call=cfg.attention_call())
    except FlashImplRefused as e:
        raise ConfigError(str(e)) from e
