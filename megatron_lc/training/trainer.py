"""The training loop: build everything from a TrainConfig, then step, log, evaluate, save.

    python -m megatron_lc.train --model llama3-8b --seq-length 5242880 ...
    torchrun --nproc-per-node 8 -m megatron_lc.train ...   (also srun / mpirun)
"""

from __future__ import annotations

import math
import os
import resource
import signal
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_lc.attention.kernels import running_kernel
from megatron_lc.errors import ConfigError
from megatron_lc.config import TrainConfig
from megatron_lc.training.build import build_run_optimizer, build_sharded_model
from megatron_lc.training.preflight import activate_flash, preflight
from megatron_lc.data.loader import MicroBatchLoader, WorkerLoader
from megatron_lc.data.samples import MockSamples, SampleSource
from megatron_lc.data.sources import DEFAULT_SPLIT, DEFAULT_SPLIT_WARNING, build_datasets
from megatron_lc.devices import Devices, resolve_devices, set_cuda_allocator_settings
from megatron_lc.models.llama import count_parameters
from megatron_lc.parallel_state import (
    ParallelState,
    detect_launch,
    init_distributed,
    warm_up_collectives,
)
from megatron_lc.training.logging import (
    MetricsLogger,
    default_log_dir,
    model_flops_utilization,
    step_flops,
    validation_ppl,
)
from megatron_lc.training.resume import apply_checkpoint_args, resume, save, take_save_lock
from megatron_lc.training.run import Run, global_batch_size, say
from megatron_lc.training.schedule import schedule_from_config
from megatron_lc.training.step import IGNORE_INDEX, step_autocast, train_step


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
    preflight(cfg, launch.world_size)  # what the run needs of this machine's disks, packages, devices and host memory
    set_allocator_defaults()
    devices = resolve_devices(cfg.train.device, launch.local_rank)
    if devices.is_cuda:
        torch.cuda.set_device(devices.accelerator)
        activate_flash(cfg, devices.accelerator)  # before any attention and any process group
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
    optimizer = build_run_optimizer(model, cfg, devices)
    train_source, valid_source, test_source = build_sample_sources(cfg, data_vocab, pstate.dp_size, launch.rank)
    accumulation = global_batch_size(cfg, pstate.dp_size) // (cfg.data.micro_batch_size * pstate.dp_size)
    return Run(cfg, launch, devices, pstate, model, optimizer, schedule_from_config(cfg, launch.world_size), offload,
               _loader(train_source, cfg, pstate, eod), valid_source, eod, accumulation, test_source=test_source)


def _autocast(run: Run):
    return step_autocast(run.cfg.train.bf16, run.pstate, run.devices.accelerator.type)


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
    flops_per_gpu = step_flops(run.model.config, tokens, run.cfg.data.seq_length) / elapsed / run.launch.world_size
    mfu = model_flops_utilization(run.devices, flops_per_gpu)
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
        say(run, f"the checkpoint is at step {start}, --train-iters is {cfg.train.train_iters}: nothing left to do")
        return []
    g = cfg.logging
    log_dir = g.log_dir or str(default_log_dir())
    logger = MetricsLogger(log_dir, g.tensorboard_dir, cfg.train.train_iters, run.is_logging_rank,
                           validation_ppl_to_tensorboard=g.log_validation_ppl_to_tensorboard,
                           wandb=(g.wandb_project, g.wandb_exp_name, cfg.to_dict()))
    n = count_parameters(run.model)
    kernel = running_kernel(run.devices.accelerator.type, cfg.parallel.attention_kernel,
                            torch.bfloat16 if cfg.train.bf16 else torch.float32)
    say(run, f"{run.pstate} | {run.model.config.num_layers} layers, {n:,} parameters | "
              f"seq {cfg.data.seq_length} | attention: {kernel} | metrics in {log_dir}/metrics.jsonl")
    stop = StopRequest(cfg, run.devices.accelerator)
    history, step_times, began = [], [], time.monotonic()
    since_log = []  # step times since the last console line (Megatron-LM's interval time)
    try:
        for step in range(start + 1, cfg.train.train_iters + 1):
            metrics = train_one_step(run, step)
            metrics["attention_kernel"] = kernel
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
                metrics["throughput_tflops_per_gpu"] = step_flops(run.model.config, tokens, run.cfg.data.seq_length) / (seconds * 1e12 * run.launch.world_size)
            if console:
                since_log = []
            logger.log(metrics, console=console, tensorboard=tensorboard)
            history.append(metrics)
            c = cfg.checkpoint
            exiting = bool(cfg.train.exit_interval) and step % cfg.train.exit_interval == 0
            reason = stop.reason() or (f"--exit-interval {cfg.train.exit_interval}" if exiting else None)
            if c.save and ((c.save_interval and step % c.save_interval == 0) or step == cfg.train.train_iters
                           or exiting or reason):
                save(run, step)
            if reason:
                say(run, f"stopping after step {step}: {reason}" + ("" if c.save else " (no --save: nothing saved)"))
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
    say(run, f"skipping training (--skip-train): evaluating the weights of step {step}")
    if run.valid_source is not None and (g.full_validation or g.eval_iters >= 1):
        rounds = full_validation_rounds(run, run.valid_source) if g.full_validation else None
        result["val_loss"] = evaluate(run, g.eval_iters, run.valid_source, 0, rounds=rounds)
        say(run, f"validation at step {step} | lm loss {result['val_loss']:.6E} | "
                  f"lm loss PPL {validation_ppl(result['val_loss']):.6E}")
    if run.test_source is not None and g.eval_iters >= 1:
        result["test_loss"] = evaluate(run, g.eval_iters, run.test_source)
        say(run, f"test at step {step} | lm loss {result['test_loss']:.6E} | "
                  f"lm loss PPL {validation_ppl(result['test_loss']):.6E}")
    if len(result) == 1:
        raise ConfigError("--skip-train: nothing to evaluate (no validation or test part, or --eval-iters 0)")
    return result
