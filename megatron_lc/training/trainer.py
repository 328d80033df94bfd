"""The training loop: build everything from a TrainConfig, then step, log, evaluate, save.

    python -m megatron_lc.train --model llama3-8b --seq-length 5242880 ...
    torchrun --nproc-per-node 8 -m megatron_lc.train ...   (also srun / mpirun)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_lc.attention.kernels import activate_flash_impl
from megatron_lc.errors import ConfigError
from megatron_lc.config import TrainConfig
from megatron_lc.training.build import build_sharded_model
from megatron_lc.training.preflight import preflight
from megatron_lc.data.blending import normalize
from megatron_lc.data.index_cache import dataset_fingerprint
from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.loader import MicroBatchLoader, WorkerLoader
from megatron_lc.data.samples import MockSamples, SampleSource
from megatron_lc.data.sources import DEFAULT_SPLIT, DEFAULT_SPLIT_WARNING, build_datasets, parse_data_path, parse_split
from megatron_lc.devices import Devices, resolve_devices, set_cuda_allocator_settings
from megatron_lc.models.llama import count_parameters
from megatron_lc.parallel_state import (
    LaunchInfo,
    ParallelState,
    detect_launch,
    init_distributed,
    warm_up_collectives,
)
from megatron_lc.training import checkpointing
from megatron_lc.training.save_lock import SaveLock, acquire_save_lock
from megatron_lc.training.logging import MetricsLogger, default_log_dir, validation_ppl
from megatron_lc.training.optim import build_optimizer
from megatron_lc.training.schedule import LRSchedule, schedule_from_config
from megatron_lc.training.step import IGNORE_INDEX, step_autocast, train_step

# Dense bf16 peak of known accelerators, for MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}


def set_allocator_defaults() -> None:
    """Expandable segments in the CUDA allocator's settings, merged into the user's (see devices.py).

    Called before anything touches CUDA: torch reads the variable when CUDA initialises.
    """
    set_cuda_allocator_settings()


def nccl_version() -> str:
    version = torch.cuda.nccl.version()  # (major, minor, patch[, suffix]); an int in old torch
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def nccl_settings_line(warm_up_bytes: int) -> str:
    """What NCCL ran with: its version, NVLS (NVLink SHARP buffers, which the memory plan leaves out and
    NCCL turns on by default on NVSwitch systems), and the device memory the warm-up collectives took."""
    nvls = os.environ.get("NCCL_NVLS_ENABLE")
    nvls_text = (f"NCCL_NVLS_ENABLE={nvls}" if nvls is not None
                 else "NCCL_NVLS_ENABLE unset (NCCL's default: on where NVSwitch has it)")
    return (f"NCCL {nccl_version()} | {nvls_text} | warm-up collectives took {warm_up_bytes / 2**30:.2f} GiB "
            "of device memory")


def warmed_up_collectives(pstate: ParallelState, devices: Devices, rank: int) -> None:
    """Warm up the step's collectives (NCCL's connections before PyTorch's cache fills the card); on CUDA
    rank 0 prints NCCL's settings and the device memory the warm-up took (the driver's free bytes)."""
    free_before = torch.cuda.mem_get_info(devices.accelerator)[0] if devices.is_cuda else 0
    warm_up_collectives(pstate, devices.accelerator)
    if devices.is_cuda and rank == 0:
        print(nccl_settings_line(free_before - torch.cuda.mem_get_info(devices.accelerator)[0]), flush=True)


def global_batch_size(cfg: TrainConfig, dp_size: int) -> int:
    """Samples per optimizer step over all data-parallel ranks (--global-batch-size, default micro x dp)."""
    return cfg.data.global_batch_size or cfg.data.micro_batch_size * dp_size


def data_sizes(cfg: TrainConfig, dp_size: int) -> dict[str, int]:
    """Samples asked of each part, as Megatron-LM's trainer asks: every training step's, every
    evaluation's (`(train_iters // eval_interval + 1) * eval_iters` global batches) and one
    test evaluation's."""
    batch, g, t = global_batch_size(cfg, dp_size), cfg.logging, cfg.train
    evaluations = t.train_iters // g.eval_interval + 1 if g.eval_interval and not t.skip_train else 1
    sizes = {"train": t.train_samples or t.train_iters * batch, "valid": evaluations * g.eval_iters * batch,
             "test": g.eval_iters * batch}
    if g.full_validation:
        del sizes["valid"]  # one epoch of the validation part, as Megatron-LM builds it for --full-validation
    return sizes


def build_sample_sources(
    cfg: TrainConfig, vocab_size: int, dp_size: int, rank: int = 0
) -> tuple[SampleSource, SampleSource | None, SampleSource | None]:
    """Training, validation and test sources: mock tokens, or Megatron's --data-path/--split/--*-data-path
    blends. `--data-path` without `--split` is split 969, 30, 1 with Megatron-LM's warning (from `rank` 0)."""
    d = cfg.data
    if d.mock_data and not d.data_path and not d.train_data_path:
        if cfg.logging.eval_interval:
            raise ConfigError("--eval-interval with --mock-data: mock data has no validation part; give "
                              "--data-path with --split or --valid-data-path")
        return MockSamples(vocab_size, d.seq_length, cfg.train.seed), None, None
    split = d.split
    if split is None and d.data_path:
        split = DEFAULT_SPLIT
        if rank == 0:
            print(DEFAULT_SPLIT_WARNING, flush=True)
    try:  # ids beyond the vocabulary, a split without training documents: one line, exit 2, before step 1
        sources = build_datasets(
            d.data_path, d.seq_length, cfg.train.seed, split=split, train_data_path=d.train_data_path,
            valid_data_path=d.valid_data_path, test_data_path=d.test_data_path, cache_path=d.data_cache_path,
            num_samples=data_sizes(cfg, dp_size), shuffle=not d.no_shuffle, vocab_size=vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if rank == 0:
        for note in sources.notes:
            print(note, flush=True)
    if sources.train is None:
        raise ConfigError(f"--split {split} leaves no training documents")
    if cfg.logging.eval_interval and sources.valid is None:
        raise ConfigError(f"--eval-interval {cfg.logging.eval_interval}: the validation part is empty "
                          f"(--split {split}); give it documents or --valid-data-path")
    return sources.train, sources.valid, sources.test


@dataclass
class Run:
    """Everything a training run is made of."""

    cfg: TrainConfig
    launch: LaunchInfo
    devices: Devices
    pstate: ParallelState
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    offload: object | None
    loader: MicroBatchLoader | WorkerLoader
    valid_source: SampleSource | None
    eod_token: int | None
    accumulation: int
    save_lock: SaveLock | None = None
    test_source: SampleSource | None = None

    @property
    def is_logging_rank(self) -> bool:
        return self.launch.rank == 0


def _loader(source, cfg: TrainConfig, pstate: ParallelState, eod: int | None) -> MicroBatchLoader | WorkerLoader:
    """This rank's micro-batches of `source`; read ahead by --num-workers worker processes when it is > 0."""
    d = cfg.data
    loader = MicroBatchLoader(source, d.micro_batch_size, pstate.dp_rank, pstate.dp_size, pstate.cp_rank,
                              pstate.cp_size, reset_position_ids=d.reset_position_ids,
                              reset_attention_mask=d.reset_attention_mask, eod_mask_loss=d.eod_mask_loss,
                              eod_token=eod, cp_ring=pstate.context_layout.ring_size)
    return WorkerLoader(loader, d.num_workers) if d.num_workers > 0 else loader


def build_run(cfg: TrainConfig) -> Run:
    """Validate, initialise processes, build the sharded model, optimizer and data."""
    launch = detect_launch()
    cfg.validate(launch.world_size)  # before any process group or accelerator memory
    cfg = cfg.resolved(launch.world_size)  # --train-samples, --data-args-path, ... filled in
    preflight(cfg)  # what the run needs of this machine's disks, packages and devices
    set_allocator_defaults()
    devices = resolve_devices(cfg.train.device, launch.local_rank)
    if devices.is_cuda:
        torch.cuda.set_device(devices.accelerator)
        impl = activate_flash_impl(cfg.parallel.flash_attention_impl, devices.accelerator)  # before any attention
        if launch.rank == 0 and impl != "default":
            print(f"attention: {impl.upper()} behind torch's flash kernels (--flash-attention-impl)", flush=True)
    init_distributed(devices.accelerator, timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    p = cfg.parallel
    pstate = ParallelState(cfg.parallel_dims(launch.world_size), devices.accelerator.type)
    warmed_up_collectives(pstate, devices, launch.rank)
    spec = cfg.tokenizer_spec()
    tokenizer = spec.build() if spec else None
    eod = tokenizer.eod if tokenizer else None
    model_config = cfg.model_config(vocab_size=tokenizer.vocab_size if tokenizer else None)  # padded (--make-vocab-...)
    data_vocab = cfg.model_config(vocab_size=tokenizer.vocab_size if tokenizer else None, padded=False).vocab_size
    model, offload = build_sharded_model(cfg, model_config, pstate, devices)
    if offload is not None:  # page-lock the host arenas before step 1 (logged; minutes for a terabyte)
        block_dtype = torch.bfloat16 if cfg.train.bf16 and pstate.distributed else torch.float32
        offload.reserve((cfg.data.micro_batch_size, cfg.data.seq_length // p.context_parallel_size,
                         model_config.hidden_size), block_dtype)
    o = cfg.optim
    optimizer = build_optimizer(model, lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
                                eps=o.adam_eps)
    train_source, valid_source, test_source = build_sample_sources(cfg, data_vocab, pstate.dp_size, launch.rank)
    accumulation = global_batch_size(cfg, pstate.dp_size) // (cfg.data.micro_batch_size * pstate.dp_size)
    return Run(cfg, launch, devices, pstate, model, optimizer, schedule_from_config(cfg, launch.world_size), offload,
               _loader(train_source, cfg, pstate, eod), valid_source, eod, accumulation, test_source=test_source)


def _autocast(run: Run):
    return step_autocast(run.cfg.train.bf16, run.pstate, run.devices.accelerator.type)


def megatron_flops(c, samples: int, seq_length: int) -> float:
    """FLOPs of one step over `samples` samples of `seq_length` tokens, as Megatron-LM's
    num_floating_point_operations counts them for a dense GQA SwiGLU model: 3 (forward, two backward
    GEMMs) x 2 (multiply-add) x, per token, the q/k/v/o projections, the SwiGLU MLP (3 matrices) of every
    layer and the logits (the padded vocabulary), plus the causal attention (half of the S x S scores, QK^T
    and PV) of each whole sample."""
    q, kv, h = c.kv_channels * c.num_attention_heads, c.kv_channels * c.num_query_groups, c.hidden_size
    tokens = samples * seq_length
    per_token = 3 * 2 * (h * c.ffn_hidden_size * 3 * c.num_layers + (h * (q + 2 * kv) + q * h) * c.num_layers
                         + h * c.vocab_size)
    attention = samples * seq_length * seq_length * (3 * 2 * q / 2 * 2) * c.num_layers
    return tokens * per_token + attention


def step_flops(run: Run, tokens: int) -> float:
    """Model FLOPs of one step over `tokens` tokens (whole samples), as Megatron-LM counts them."""
    S = run.cfg.data.seq_length
    return megatron_flops(run.model.config, tokens // S, S)


def params_norm(model: torch.nn.Module) -> float:
    """L2 norm of all parameters (the fp32 master weights, every shard; a tied matrix once), as
    Megatron-LM's calc_params_l2_norm for --log-params-norm."""
    params = list(dict.fromkeys(model.parameters()))
    total = torch.nn.utils.get_total_norm([p.detach() for p in params], norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    return float(total)


def _peak_memory_gib(run: Run) -> float:
    if run.devices.is_cuda:
        return torch.cuda.max_memory_allocated(run.devices.accelerator) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB, host process peak


def _mfu(run: Run, flops_per_s_per_gpu: float) -> float | None:
    if not run.devices.is_cuda:
        return None
    name = torch.cuda.get_device_name(run.devices.accelerator)
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    return flops_per_s_per_gpu / peak if peak else None


def validation_window(evaluation: int, per_evaluation: int, available: int) -> int:
    """First sample of the `evaluation`-th evaluation (from 0): each evaluation reads the
    `per_evaluation` samples after the previous one's, as Megatron's validation iterator
    moves on, and starts again from sample 0 when the next window would pass the end of
    the `available` samples. A function of the step, so a resumed run reads the same."""
    windows = max(available // per_evaluation, 1)
    return (evaluation % windows) * per_evaluation


def full_validation_rounds(run: Run, source: SampleSource) -> int:
    """Micro-batch rounds (one micro-batch on every data-parallel rank) that read `source` once
    (--full-validation): every whole round; fewer than micro-batch x data-parallel samples are left over."""
    per_round = run.cfg.data.micro_batch_size * run.pstate.dp_size
    if len(source) < per_round:
        raise ConfigError(f"--full-validation: the validation part holds {len(source)} samples, fewer than one "
                          f"micro-batch on each data-parallel rank ({per_round})")
    return len(source) // per_round


def evaluate(run: Run, iters: int, source: SampleSource | None = None, first_sample: int = 0,
             rounds: int | None = None) -> float:
    """Mean loss over `iters` global batches (Megatron's --eval-iters) of `source` (default the
    validation part) from `first_sample`, in stream order; `rounds` micro-batch rounds instead when given."""
    loader = _loader(source or run.valid_source, run.cfg, run.pstate, run.eod_token)
    loader.load_state_dict({"consumed_samples": first_sample})
    loss_sum = torch.zeros((), device=run.devices.accelerator)
    count = torch.zeros((), device=run.devices.accelerator)
    run.model.eval()
    with torch.no_grad(), _autocast(run):
        for _ in range(iters * run.accumulation if rounds is None else rounds):
            mb = next(loader).to(run.devices.accelerator)
            s, _ = run.model(mb.input_ids, mb.position_ids, mb.labels, mb.cu_seqlens)
            loss_sum += s.float()
            count += (mb.labels != IGNORE_INDEX).sum()
    run.model.train()
    if run.pstate.distributed:
        dist.all_reduce(loss_sum, group=run.pstate.loss_group)
        dist.all_reduce(count, group=run.pstate.loss_group)
    return (loss_sum / count.clamp(min=1)).item()


class NonFiniteError(RuntimeError):
    pass


def _check_finite(step: int, loss: float, grad_norm: float, skip: bool) -> bool:
    """True when the step may proceed; raises (or, with skip, returns False) on NaN/Inf."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return True
    message = f"step {step}: loss {loss}, grad_norm {grad_norm} is not finite"
    if skip:
        print(f"{message}: step skipped (--skip-nonfinite)", flush=True)
        return False
    raise NonFiniteError(f"{message}; lower --lr, check the data, or pass --skip-nonfinite")


def train_one_step(run: Run, step: int) -> dict:
    start = time.perf_counter()
    micro_batches = [next(run.loader) for _ in range(run.accumulation)]
    lr, weight_decay = run.schedule(step - 1), run.schedule.weight_decay(step - 1)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
        if weight_decay is not None:
            group["weight_decay"] = weight_decay
    finite = lambda r: _check_finite(step, r.loss.item(), r.grad_norm.item(), run.cfg.train.skip_nonfinite)  # noqa: E731
    with _autocast(run):
        result = train_step(run.model, run.optimizer, micro_batches, run.pstate, run.devices.accelerator,
                            run.cfg.optim.clip_grad or None, may_step=finite)
    loss, norm = result.loss.item(), result.grad_norm.item()
    elapsed = time.perf_counter() - start
    tokens = len(micro_batches) * run.cfg.data.micro_batch_size * run.cfg.data.seq_length * run.pstate.dp_size
    flops_per_gpu = step_flops(run, tokens) / elapsed / run.launch.world_size
    mfu = _mfu(run, flops_per_gpu)
    metrics = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tokens / elapsed,
               "step_time_s": elapsed, "peak_memory_gib": _peak_memory_gib(run)}
    if weight_decay is not None and run.schedule.wd_incr_style != "constant":
        metrics["weight_decay"] = weight_decay
    if mfu is not None:
        metrics.update(tflops_per_gpu=flops_per_gpu / 1e12, mfu=mfu)
    if run.offload is not None:
        metrics["host_offload_gib"] = run.offload.host_bytes_peak / 2**30
        metrics["host_page_locked_gib"] = run.offload.page_locked_bytes / 2**30
    return metrics


def _data_settings(cfg: TrainConfig, pstate: ParallelState) -> dict:
    """What fixes which tokens a step reads: a resume must see the same (the position is counted in samples).

    Datasets are named by their content (`data_identity`), not by the path typed: a copy moved to local
    NVMe, an absolute path for a relative one or `70 A 30 B` for `0.7 A 0.3 B` resume; other data behind
    the same path does not."""
    d = cfg.data
    return {"--data-path": data_identity(d.data_path, "--data-path"),
            "--train-data-path": data_identity(d.train_data_path, "--train-data-path"),
            "--split": _normalised_split(d.split), "--seq-length": d.seq_length, "--seed": cfg.train.seed,
            "--no-shuffle": d.no_shuffle, "--reset-position-ids": d.reset_position_ids,
            "--eod-mask-loss": d.eod_mask_loss,
            "--global-batch-size": global_batch_size(cfg, pstate.dp_size)}


def data_identity(values: list[str], flag: str) -> list[dict]:
    """Each dataset of a --data-path blend by its content (sequences, documents, the .idx digest the index
    cache computes, the .bin's size) with its weight as Megatron normalises it; no path."""
    if not values:
        return []
    pairs = parse_data_path(values, flag)
    weights = normalize([w for w, _ in pairs]) if pairs[0][0] is not None else [None] * len(pairs)
    identities = []
    for weight, (_, prefix) in zip(weights, pairs):
        fingerprint, dataset = dataset_fingerprint(prefix), IndexedDataset(prefix)
        identities.append({"weight": None if weight is None else round(weight, 12),
                           "sequences": len(dataset), "documents": len(dataset.document_indices) - 1,
                           "bin_bytes": fingerprint["bin"]["size"], "idx_digest": fingerprint["idx_digest"]})
    return identities


def _normalised_split(split: str | None) -> list[float] | None:
    return None if split is None else [round(x, 12) for x in parse_split(split)]


def _checkpoint_extra(run: Run) -> dict:
    return {"model_config": dataclasses.asdict(run.model.config), "train_config": run.cfg.to_dict(),
            "schedule": run.schedule.to_dict(), "data_settings": _data_settings(run.cfg, run.pstate),
            "data": run.loader.state_dict(), "world_size": run.launch.world_size}


def _differences(saved: dict, current: dict) -> str:
    return ", ".join(f"{k} {saved[k]} in the checkpoint, {v} now" for k, v in current.items()
                     if k in saved and saved[k] != v)


def resumed_schedule(meta: dict, cfg: TrainConfig, current: LRSchedule, path) -> LRSchedule:
    """The schedule to continue with: the checkpoint's and the command line's must agree unless a flag chooses."""
    if "schedule" not in meta or cfg.optim.override_opt_param_scheduler:
        return current
    saved = LRSchedule.from_dict(meta["schedule"], current)
    if saved == current or cfg.optim.use_checkpoint_opt_param_scheduler:
        return saved
    diff = _differences(saved.to_dict(), current.to_dict())
    raise ConfigError(f"checkpoint {path} has another learning-rate schedule ({diff}): pass "
                      "--override-opt_param-scheduler to use the command line's, or "
                      "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def check_data_settings(meta: dict, cfg: TrainConfig, pstate: ParallelState, path) -> str:
    """Refuse to continue a data stream under other settings (it would re-read or skip data), unless
    --override-data-settings asks to; returns what differs ('' when nothing does)."""
    saved, current = meta.get("data_settings", {}), _data_settings(cfg, pstate)
    differing = [k for k, v in current.items() if k in saved and _comparable(saved[k]) != _comparable(v)]
    if not differing:
        return ""
    diff = "; ".join(_describe_difference(k, saved[k], current[k], cfg) for k in differing)
    if cfg.checkpoint.override_data_settings:
        return diff
    raise ConfigError(f"checkpoint {path} read its data with other settings ({diff}): restore them to resume, "
                      "pass --override-data-settings to continue (optimizer, step and data position kept), or "
                      "--finetune to start a new run from its weights")


def _comparable(value):
    """JSON round trip: a checkpoint's lists and a run's tuples compare equal."""
    return json.loads(json.dumps(value))


def _describe_difference(flag: str, saved, current, cfg: TrainConfig) -> str:
    """One difference for people: a dataset named by its prefix now, the first field that differs."""
    if flag not in ("--data-path", "--train-data-path") or not (isinstance(saved, list) and isinstance(current, list)):
        return f"{flag} {saved} in the checkpoint, {current} now"
    if len(saved) != len(current):
        return f"{flag}: {len(saved)} datasets in the checkpoint, {len(current)} now"
    values = cfg.data.data_path if flag == "--data-path" else cfg.data.train_data_path
    prefixes = [prefix for _, prefix in parse_data_path(values, flag)]
    i = next(i for i, (a, b) in enumerate(zip(saved, current)) if _comparable(a) != _comparable(b))
    return f"{flag} {prefixes[i]}: {_first_field(saved[i], current[i])}"


def _first_field(saved: dict, current: dict) -> str:
    key = next(k for k in current if saved.get(k) != current.get(k))
    return f"{key} {saved.get(key)} in the checkpoint, {current.get(key)} now"


def apply_checkpoint_args(cfg: TrainConfig) -> TrainConfig:
    """--use-checkpoint-args: the model from the checkpoint in --load, its whole recorded config
    (a converted checkpoint records no flags, only the config)."""
    if not cfg.checkpoint.load:
        raise ConfigError("--use-checkpoint-args reads the checkpoint in --load: give --load DIR")
    found = checkpointing.checkpoint_to_load(cfg.checkpoint.load, cfg.checkpoint.ckpt_step)
    if found is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint in --load {cfg.checkpoint.load}")
    path, meta = found
    flags = meta.get("train_config", {}).get("model")
    if meta.get("model_config"):
        flavour = (flags or {}).get("model", cfg.model.model)
        return dataclasses.replace(cfg, model=type(cfg.model)(model=flavour, checkpoint_model=meta["model_config"]))
    if not flags:
        raise ConfigError(f"--use-checkpoint-args: {path} records no model settings")
    return dataclasses.replace(cfg, model=type(cfg.model)(**flags))


def _say(run: Run, text: str) -> None:
    if run.is_logging_rank:
        print(text, flush=True)


def resume(run: Run) -> int:
    """Load the newest intact checkpoint under --load; returns the step to start from (0 without one)."""
    c = run.cfg.checkpoint
    if not c.load:
        return 0
    found = checkpointing.checkpoint_to_load(c.load, c.ckpt_step, required=c.exit_on_missing_checkpoint)
    if found is None:
        _say(run, f"--load {c.load}: no checkpoint there yet; training starts from scratch")
        return 0
    path, meta = found
    checkpointing.check_model_matches(meta, run.model.config, path)
    if meta.get("weights_only") or c.finetune:
        checkpointing.load_model_weights(path, run.model)
        _say(run, f"loaded weights from {path}; training starts at step 0")
        return 0
    if run.cfg.train.skip_train:  # evaluation only: the weights (Megatron-LM turns on --no-load-optim too)
        checkpointing.load_model_weights(path, run.model)
        _say(run, f"loaded weights from {path} (step {meta['step']})")
        return int(meta["step"])
    overridden = check_data_settings(meta, run.cfg, run.pstate, path)
    if overridden:
        _say(run, f"--override-data-settings: continuing {path} with other data settings ({overridden})")
    run.schedule = resumed_schedule(meta, run.cfg, run.schedule, path)
    has_optim, has_rng = meta.get("optimizer_saved", True), meta.get("rng_saved", True)
    if not has_optim and not c.no_load_optim:  # Megatron-LM loads such a checkpoint as with --no-load-optim
        _say(run, f"{path} holds no optimizer state (saved with --no-save-optim): a fresh optimizer, as with "
                  "--no-load-optim")
    if not has_rng and not c.no_load_rng:
        _say(run, f"{path} holds no generator states (saved with --no-save-rng): not restored, as with --no-load-rng")
    checkpointing.load_checkpoint(path, run.model, run.optimizer if has_optim and not c.no_load_optim else None)
    run.loader.load_state_dict(meta["data"])
    if has_rng and not c.no_load_rng and meta.get("world_size") == run.launch.world_size:  # rank r's is rank r's
        checkpointing.load_rng_state(path, run.launch.rank)
    _say(run, f"resumed from {path} at step {meta['step']}")
    return int(meta["step"])


def save(run: Run, step: int) -> None:
    c = run.cfg.checkpoint
    path = checkpointing.save_checkpoint(c.save, step, run.model, run.optimizer, _checkpoint_extra(run),
                                         keep_last=c.keep_last_checkpoints, run_id=run.save_lock.run_id,
                                         save_optimizer=not c.no_save_optim, save_rng=not c.no_save_rng)
    _say(run, f"saved {path}")


def take_save_lock(run: Run) -> SaveLock | None:
    """Rank 0 locks --save for this run (see save_lock.py); every rank learns the outcome and the run's id."""
    if not run.cfg.checkpoint.save:
        return None
    outcome: list = [None, None]
    if run.is_logging_rank:
        try:
            outcome = [acquire_save_lock(run.cfg.checkpoint.save, say=print), None]
        except ConfigError as e:
            outcome = [None, str(e)]
    lock, error = outcome
    if run.pstate.distributed:  # the other ranks get the holder (for its run id) or the refusal
        shared = [lock.holder if lock else None, error]
        dist.broadcast_object_list(shared, src=0)
        holder, error = shared
        lock = lock or (SaveLock(Path(run.cfg.checkpoint.save), holder) if holder else None)
    if error:
        raise ConfigError(error)
    return lock


class StopRequest:
    """Save and stop at a step boundary on a signal (--exit-signal-handler) or on time (--exit-duration-in-mins).

    A signal may reach only some ranks, and clocks differ: every rank contributes its
    reason to one all-reduce per step, so all of them stop at the same step.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, cfg: TrainConfig, device: torch.device):
        self.handle_signals = cfg.train.exit_signal_handler
        self.deadline = (time.monotonic() + 60 * cfg.train.exit_duration_in_mins
                         if cfg.train.exit_duration_in_mins else None)
        self.device = device
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS} if self.handle_signals else {}

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    def reason(self) -> str | None:
        """Why every rank stops after this step (None: go on)."""
        if not self.handle_signals and self.deadline is None:
            return None
        flags = torch.tensor([self.received is not None, self.deadline is not None and time.monotonic() >= self.deadline],
                             dtype=torch.int32, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, timed_out = flags.tolist()
        if signalled:
            return f"signal {signal.Signals(self.received).name if self.received else 'on another rank'}"
        return "--exit-duration-in-mins reached" if timed_out else None

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _eta_s(step_times: list[float], remaining: int) -> float:
    """Remaining time from the mean step time, leaving out the first step (warm-up) once others exist."""
    times = step_times[1:] or step_times
    return remaining * sum(times) / len(times)


def train(cfg: TrainConfig) -> list[dict]:
    """Run training to --train-iters (or a stop request); returns the logged metrics."""
    if cfg.checkpoint.use_checkpoint_args:
        cfg = apply_checkpoint_args(cfg)
    run = build_run(cfg)
    run.save_lock = take_save_lock(run)
    try:
        return _train_run(run)
    finally:
        if run.save_lock is not None and run.is_logging_rank:
            run.save_lock.release()


def _train_run(run: Run) -> list[dict]:
    """The loop of `train` once --save is locked."""
    cfg = run.cfg
    start = resume(run)
    if cfg.train.skip_train:
        return [skip_train(run, start)]
    if start >= cfg.train.train_iters:
        _say(run, f"the checkpoint is at step {start}, --train-iters is {cfg.train.train_iters}: nothing left to do")
        return []
    g = cfg.logging
    log_dir = g.log_dir or str(default_log_dir())
    logger = MetricsLogger(log_dir, g.tensorboard_dir, cfg.train.train_iters, run.is_logging_rank,
                           validation_ppl_to_tensorboard=g.log_validation_ppl_to_tensorboard,
                           wandb=(g.wandb_project, g.wandb_exp_name, cfg.to_dict()))
    n = count_parameters(run.model)
    _say(run, f"{run.pstate} | {run.model.config.num_layers} layers, {n:,} parameters | "
              f"seq {cfg.data.seq_length} | metrics in {log_dir}/metrics.jsonl")
    stop = StopRequest(cfg, run.devices.accelerator)
    history, step_times, began = [], [], time.monotonic()
    since_log = []  # step times since the last console line (Megatron-LM's interval time)
    try:
        for step in range(start + 1, cfg.train.train_iters + 1):
            metrics = train_one_step(run, step)
            step_times.append(metrics["step_time_s"])
            since_log.append(metrics["step_time_s"])
            metrics.update(elapsed_s=time.monotonic() - began, eta_s=_eta_s(step_times, cfg.train.train_iters - step))
            if g.eval_interval and step % g.eval_interval == 0:
                metrics.update(run_validation(run, step // g.eval_interval - 1))
            if step == cfg.train.train_iters and run.test_source is not None and g.eval_iters >= 1:
                metrics["test_loss"] = evaluate(run, g.eval_iters, run.test_source)  # once, as Megatron
            console = ("val_loss" in metrics or step % g.log_interval == 0
                       or step in (start + 1, cfg.train.train_iters))  # every evaluation is logged at its step
            tensorboard = step % g.tensorboard_log_interval == 0
            if g.log_params_norm and (console or tensorboard):
                metrics["params_norm"] = params_norm(run.model)
            if g.log_throughput and console:
                tokens = global_batch_size(cfg, run.pstate.dp_size) * cfg.data.seq_length
                seconds = sum(since_log) / len(since_log)  # per step, over the steps since the last line
                metrics["throughput_tflops_per_gpu"] = step_flops(run, tokens) / (seconds * 1e12 * run.launch.world_size)
            if console:
                since_log = []
            logger.log(metrics, console=console, tensorboard=tensorboard)
            history.append(metrics)
            c = cfg.checkpoint
            exiting = bool(cfg.train.exit_interval) and step % cfg.train.exit_interval == 0
            reason = stop.reason()
            if c.save and ((c.save_interval and step % c.save_interval == 0) or step == cfg.train.train_iters
                           or exiting or reason):
                save(run, step)
            if reason:
                _say(run, f"stopping after step {step}: {reason}" + ("" if c.save else " (no --save: nothing saved)"))
            if exiting or reason:
                break
    finally:
        stop.close()
        logger.close()
        _close_loader(run.loader)
    return history


def _close_loader(loader) -> None:
    if isinstance(loader, WorkerLoader):
        loader.close()


def run_validation(run: Run, evaluation: int) -> dict:
    """The `evaluation`-th validation (from 0): --eval-iters global batches from where the previous one
    stopped, or with --full-validation the whole validation part from its first sample."""
    g = run.cfg.logging
    if g.full_validation:
        return {"val_loss": evaluate(run, 0, run.valid_source, 0, rounds=full_validation_rounds(run, run.valid_source))}
    per_evaluation = g.eval_iters * global_batch_size(run.cfg, run.pstate.dp_size)
    first = validation_window(evaluation, per_evaluation, len(run.valid_source))
    return {"val_loss": evaluate(run, g.eval_iters, run.valid_source, first)}


def skip_train(run: Run, step: int) -> dict:
    """--skip-train: evaluate the validation part (from its first sample, --eval-iters batches or the whole of
    it with --full-validation) and the test part at the loaded step, print them, write nothing (as Megatron-LM,
    which does not write tensorboard then either); returns the results."""
    g, result = run.cfg.logging, {"step": step}
    _say(run, f"skipping training (--skip-train): evaluating the weights of step {step}")
    if run.valid_source is not None and (g.full_validation or g.eval_iters >= 1):
        rounds = full_validation_rounds(run, run.valid_source) if g.full_validation else None
        result["val_loss"] = evaluate(run, g.eval_iters, run.valid_source, 0, rounds=rounds)
        _say(run, f"validation at step {step} | lm loss {result['val_loss']:.6E} | "
                  f"lm loss PPL {validation_ppl(result['val_loss']):.6E}")
    if run.test_source is not None and g.eval_iters >= 1:
        result["test_loss"] = evaluate(run, g.eval_iters, run.test_source)
        _say(run, f"test at step {step} | lm loss {result['test_loss']:.6E} | "
                  f"lm loss PPL {validation_ppl(result['test_loss']):.6E}")
    if len(result) == 1:
        raise ConfigError("--skip-train: nothing to evaluate (no validation or test part, or --eval-iters 0)")
    return result
