"""What a run needs of this machine, checked after the rules (`TrainConfig.validate`) and before any
process group or accelerator memory exists: the tokenizer's files, the checkpoint in `--load`, a
`--save` directory this run may own, the wandb package, a visible GPU, and every directory the run
writes. The trainer and evaluate call it; the planner, which plans for another machine, does not.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from megatron_lc.attention.kernels import FlashImplRefused, activate_flash_impl
from megatron_lc.cli import check_writable
from megatron_lc.config import TrainConfig
from megatron_lc.errors import ConfigError
from megatron_lc.models.llama import build_model, count_parameters
from megatron_lc.training.checkpointing import check_save_directory, checkpoint_to_load
from megatron_lc.training.optim import HOST_STATE_BYTES_PER_PARAMETER

GIB = 2**30
LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")
"""Processes on this node, as torchrun, Open MPI, MPICH and srun say it."""


def preflight(cfg: TrainConfig, world_size: int = 1) -> None:
    """Each check raises a `ConfigError` naming the flag; `cfg` is validated and resolved."""
    _check_host_share(cfg, world_size)
    _check_tokenizer(cfg)
    _check_checkpoint_dirs(cfg)
    _check_packages(cfg)
    _check_device(cfg)
    for name, directory in (("--log-dir", cfg.logging.log_dir), ("--tensorboard-dir", cfg.logging.tensorboard_dir),
                            ("--data-cache-path", cfg.data.data_cache_path)):
        if directory:
            check_writable(directory, name, create=False)  # the run creates them when it starts


def host_share_bytes(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """(offloaded block inputs, model states) one process keeps in host memory at least: the memory stack's host
    slots of `[B*S/cp, hidden]` in the compute dtype, and with --optimizer-cpu-offload or --fsdp-cpu-offload its
    shards' 16 bytes per parameter (the kept attention outputs, buffers and the process itself come on top)."""
    model = cfg.model_config()
    tokens = cfg.data.micro_batch_size * cfg.data.seq_length // cfg.parallel.context_parallel_size
    activations = cfg.memory_stack().host_slots(model.num_layers) * tokens * model.hidden_size * (
        2 if cfg.train.bf16 else 4)
    states = 0
    if cfg.optim.optimizer_cpu_offload or cfg.parallel.fsdp_cpu_offload:
        shards = max(1, world_size // cfg.parallel.data_parallel_replicate)
        states = -(-count_parameters(build_model(model, device="meta")) // shards) * HOST_STATE_BYTES_PER_PARAMETER
    return activations, states


def _available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo: what this node can still page-lock (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_host_share(cfg: TrainConfig, world_size: int) -> None:
    """The node's host share (every local process's offloaded block inputs and model states) within what the
    node has available, or one line with the numbers."""
    activations, states = host_share_bytes(cfg, world_size)
    available = _available_host_bytes()
    if available is None or not (activations or states):
        return
    local = next((int(os.environ[v]) for v in LOCAL_SIZE_VARIABLES if os.environ.get(v, "").isdigit()), 1)
    need = local * (activations + states)
    if need > available:
        raise ConfigError(
            f"host memory: {local} process(es) on this node keep {need / GIB:,.1f} GiB on the host "
            f"({local} x ({activations / GIB:,.1f} GiB of offloaded block inputs + {states / GIB:,.1f} GiB of model "
            f"states)), more than the {available / GIB:,.1f} GiB this node has available: more GPUs, a larger "
            "--context-parallel-size, --offload-every-k-layers, or a shorter --seq-length "
            "(python tools/estimate_memory.py plans it)")


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
