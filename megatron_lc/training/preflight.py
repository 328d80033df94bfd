"""What a run needs of this machine, checked after the rules (`TrainConfig.validate`) and before any
process group or accelerator memory exists: the tokenizer's files, the checkpoint in `--load`, a
`--save` directory this run may own, the wandb package, a visible GPU, and every directory the run
writes. The trainer and evaluate call it; the planner, which plans for another machine, does not.
Once the model is built, `check_host_before_step_one` weighs the host memory the offload arenas and the host
optimizer will hold on each node against what the node lets the job use, before any page is locked.
"""

from __future__ import annotations

import importlib.util
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_lc.attention.flash_impl import FlashImplRefused, activate_flash_impl
from megatron_lc.command_line import check_writable
from megatron_lc.config import TrainConfig
from megatron_lc.errors import ConfigError
from megatron_lc.models.llama import build_model, count_parameters
from megatron_lc.parallel_state import local_processes
from megatron_lc.training.checkpointing import check_save_directory, checkpoint_to_load, missing_checkpoint_hint
from megatron_lc.training.optim import HOST_STATE_BYTES_PER_PARAMETER, HostOptimizerBytes

GIB = 2**30


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
    if cfg.optim.optimizer_cpu_offload or cfg.fsdp.fsdp_cpu_offload:
        shards = max(1, world_size // cfg.fsdp.data_parallel_replicate)
        states = -(-count_parameters(build_model(model, device="meta")) // shards) * HOST_STATE_BYTES_PER_PARAMETER
    return activations, states


def _check_host_share(cfg: TrainConfig, world_size: int) -> None:
    """The node's host share (every local process's offloaded block inputs and model states) within what the
    job may use there (cgroup limit and MemAvailable, `read_host_memory`), or one line with the numbers; estimated
    from the flags before any process group (`check_host_memory` weighs the arenas' exact bytes later)."""
    activations, states = host_share_bytes(cfg, world_size)
    memory = read_host_memory()
    available = memory.usable()
    if available is None or not (activations or states):
        return
    local = local_processes()
    need = local * (activations + states)
    if need > available:
        raise ConfigError(
            f"host memory: {local} process(es) on this node keep {need / GIB:,.1f} GiB on the host "
            f"({local} x ({activations / GIB:,.1f} GiB of offloaded block inputs + {states / GIB:,.1f} GiB of model "
            f"states)), more than the {available / GIB:,.1f} GiB this job may use there ({memory.describe()}): more "
            "GPUs, a larger "
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
    if on_cpu:
        cfg.profiling.refuse_on_cpu()


def activate_flash(cfg: TrainConfig, device: torch.device) -> str:
    """--flash-attention-impl put behind torch's flash kernels and proven on a tiny step, or refused in one line
    (what it returns runs: 'default', 'fa3' or 'fa4')."""
    try:
        return activate_flash_impl(cfg.parallel.flash_attention_impl, device, call=cfg.attention_call())
    except FlashImplRefused as e:
        raise ConfigError(str(e)) from e


# --- host memory the job may pin --------------------------------------------------------------------------


@dataclass(frozen=True)
class HostMemory:
    """What this node lets the job use: its memory cgroup's limit (v2 memory.max, v1
    memory.limit_in_bytes; the smallest on the path to the root) less what the cgroup holds now beyond
    reclaimable page cache, and the kernel's MemAvailable. None where not known."""

    cgroup_limit: int | None = None
    cgroup_used: int = 0
    mem_available: int | None = None
    cgroup_file: str = ""

    def usable(self) -> int | None:
        sizes = [s for s in (None if self.cgroup_limit is None else self.cgroup_limit - self.cgroup_used,
                             self.mem_available) if s is not None]
        return min(sizes) if sizes else None

    def describe(self) -> str:
        parts = []
        if self.cgroup_limit is not None:
            parts.append(f"cgroup limit {_gib(self.cgroup_limit)} ({self.cgroup_file}), {_gib(self.cgroup_used)} "
                         "of it in use")
        if self.mem_available is not None:
            parts.append(f"MemAvailable {_gib(self.mem_available)}")
        return "; ".join(parts)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


UNLIMITED = 1 << 60
"""cgroup v1 writes 'no limit' as a page-rounded 2^63 - 1; anything above this is no limit."""


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < UNLIMITED else None  # v2 writes "max"


def _stat(path: Path, *keys: str) -> int:
    try:
        fields = dict(line.split()[:2] for line in path.read_text().splitlines() if len(line.split()) >= 2)
    except OSError:
        return 0
    return next((int(fields[k]) for k in keys if k in fields), 0)


def _cgroup_limit(proc: Path, root: Path) -> tuple[int | None, int, str]:
    """(limit, bytes in use less page cache, the file that set the limit) of this process's memory cgroup."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, 0, ""
    best: tuple[int | None, int, str] = (None, 0, "")
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base, limit_name, usage_name, cache_keys = root, "memory.max", "memory.current", ("file",)
        elif "memory" in controllers.split(","):
            base, limit_name, usage_name, cache_keys = root / "memory", "memory.limit_in_bytes", \
                "memory.usage_in_bytes", ("total_cache", "cache")
        else:
            continue
        directory = base / path.lstrip("/")
        if not directory.is_dir():  # a container sees its own cgroup as the root
            directory = base
        for level in [directory, *directory.parents]:
            if base not in (level, *level.parents):
                break
            limit = _read_int(level / limit_name)
            if limit is not None and (best[0] is None or limit < best[0]):
                used = (_read_int(level / usage_name) or 0) - _stat(level / "memory.stat", *cache_keys)
                best = (limit, max(used, 0), str(level / limit_name))
    return best


def read_host_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory:
    limit, used, file = _cgroup_limit(proc, cgroup_root)
    available = _stat(proc / "meminfo", "MemAvailable:") * 1024 or None
    return HostMemory(limit, used, available, file)


def check_host_before_step_one(cfg: TrainConfig, model: torch.nn.Module, offload_bytes: int,
                               kept_attention_bytes: int = 0, memory: HostMemory | None = None) -> None:
    """`check_host_memory` for what this rank keeps on the host: `offload_bytes` of block-input arenas
    (--offload-activations), `kept_attention_bytes` of kept attention outputs (--keep-attention-output) and,
    with --optimizer-cpu-offload, the host optimizer's exact buffers and state (`HostOptimizerBytes`). Call it on
    every rank before any of them is made."""
    need, what = offload_bytes, ["the offloaded block inputs (--offload-activations)"] if offload_bytes else []
    if kept_attention_bytes:
        need += kept_attention_bytes
        what.append("their kept attention outputs (--keep-attention-output)")
    if cfg.optim.optimizer_cpu_offload:
        need += HostOptimizerBytes.of([p for p in model.parameters() if p.requires_grad]).total
        what.append("the optimizer's master weights, gradients and moments (--optimizer-cpu-offload)")
    if need:
        check_host_memory(need, " and ".join(what), memory)


def check_host_memory(need: int, what: str, memory: HostMemory | None = None) -> None:
    """Refuse, in one line with the numbers, a node whose ranks together would pin more host memory than the
    job may use there; every rank learns every node's answer, so all refuse together (call it on every rank,
    before any page is locked). `need`: this rank's bytes; `what`: the flags that ask for them."""
    memory = memory or read_host_memory()
    mine = (socket.gethostname(), need, memory.usable(), memory.describe())
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    nodes: dict[str, list] = {}
    for host, bytes_, usable, text in everyone:
        nodes.setdefault(host, [0, 0, usable, text])
        nodes[host][0] += bytes_
        nodes[host][1] += 1
    for host, (total, ranks, usable, text) in nodes.items():
        if usable is not None and total > usable:
            raise ConfigError(f"host memory on {host}: {what} would take {_gib(total)} ({ranks} ranks), more than "
                              f"this job may use there ({_gib(usable)}: {text}); ask the scheduler for more memory "
                              "(Slurm: --mem), or offload less")
