"""The training loop: build everything from a TrainConfig, then step, log, evaluate, save.

    python -m megatron_lc.train --model llama3-8b --seq-length 5242880 ...
    torchrun --nproc-per-node 8 -m megatron_lc.train ...   (also srun / mpirun)
"""

from __future__ import annotations

import math
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from megatron_lc.attention.kernel_selection import running_kernel
from megatron_lc.errors import EXIT_RESUME, ConfigError, leave_now
from megatron_lc.config import TrainConfig
from megatron_lc.training.build import build_run_optimizer, build_sharded_model, reserve_host_arenas
from megatron_lc.training.optim import HostAdamW
from megatron_lc.training.preflight import preflight
from megatron_lc.data.loader import MicroBatchLoader, WorkerLoader
from megatron_lc.data.packing import PackingSpec
from megatron_lc.data.samples import MockSamples, SampleSource
from megatron_lc.data.sources import DEFAULT_SPLIT, DEFAULT_SPLIT_WARNING, build_datasets
from megatron_lc.models.llama import count_parameters
from megatron_lc.parallel_state import ParallelState, require_launcher
from megatron_lc.training.memory_plan import read_memory_plan
from megatron_lc.training.logging import (
    MetricsLogger,
    show_library_log,
    default_log_dir,
    model_flops_utilization,
    step_flops,
    validation_ppl,
)
from megatron_lc.training.resume import apply_checkpoint_args, resume, save, take_save_lock
from megatron_lc.training.profiling import StepProfiler
from megatron_lc.training.run import Run, global_batch_size, print_rank_0
from megatron_lc.training.schedule import schedule_from_config
from megatron_lc.training.startup import start_processes
from megatron_lc.scheduler import current_job
from megatron_lc.training.step_progress import StepProgress
from megatron_lc.training.stopping import (DEFAULT_GRACE_S, StartupSignals, StepAbandoned, StopRequest, clear_stopped,
                                           deadlines, mark_stopped)
from megatron_lc.training.step import IGNORE_INDEX, step_autocast, train_step


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
        if PackingSpec.of(cfg.packing).whole_documents:
            raise ConfigError("--packing documents packs the documents of --data-path; mock data has none")
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
            num_samples=data_sizes(cfg, dp_size), shuffle=not d.no_shuffle, vocab_size=vocab_size,
            packing=PackingSpec.of(cfg.packing))
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
    d, whole_documents = cfg.data, PackingSpec.of(cfg.packing).whole_documents  # each document attends to itself
    loader = MicroBatchLoader(source, d.micro_batch_size, pstate.dp_rank, pstate.dp_size, pstate.cp_rank,
                              pstate.cp_size, reset_position_ids=d.reset_position_ids,
                              reset_attention_mask=d.reset_attention_mask or whole_documents,
                              eod_mask_loss=d.eod_mask_loss,
                              eod_token=eod, cp_ring=pstate.context_layout.ring_size,
                              cp_documents=cfg.context_layout().documents)
    return WorkerLoader(loader, d.num_workers) if d.num_workers > 0 else loader


def build_run(cfg: TrainConfig) -> Run:
    """Validate, initialise processes, build the sharded model, optimizer and data."""
    launch = require_launcher()  # before any process group: a run without its launcher is refused
    show_library_log(launch.local_rank == 0)  # e.g. page-locking progress, once per node
    cfg.validate(launch.world_size)  # before any process group or accelerator memory
    plan = read_memory_plan(cfg.logging.memory_plan, cfg, launch.world_size) if cfg.logging.memory_plan else None
    cfg = cfg.resolved(launch.world_size)  # --train-samples, --data-args-path, ... filled in
    preflight(cfg, launch.world_size)  # what the run needs of this machine's disks, packages, devices and host memory
    tokenizer_spec = cfg.tokenizer_spec()
    tokenizer = tokenizer_spec.build() if tokenizer_spec else None
    eod = tokenizer.eod if tokenizer else None
    spec = cfg.run_spec(launch.world_size, tokenizer.vocab_size if tokenizer else None)
    devices, pstate = start_processes(cfg, spec.dims, launch)
    p, model_config, data_vocab = cfg.parallel, spec.model, spec.data_vocab_size
    train_source, valid_source, test_source = build_sample_sources(cfg, data_vocab, pstate.dp_size, launch.rank)
    loader = _loader(train_source, cfg, pstate, eod)
    eval_loaders = tuple((source, _loader(source, cfg, pstate, eod)) for source in (valid_source, test_source)
                         if source is not None)
    for worker_loader in (loader, *(l for _, l in eval_loaders)):  # forked before anything is page-locked
        if isinstance(worker_loader, WorkerLoader):
            worker_loader.start()
    model, offload = build_sharded_model(cfg, spec, pstate, devices)
    # Everything the host keeps is weighed first, then made and page-locked before step 1 (logged; minutes for a
    # terabyte): the offload arenas (block inputs and kept attention outputs), the host optimizer's buffers.
    reserve_host_arenas(cfg, spec, model, offload, pstate.distributed)
    optimizer = build_run_optimizer(model, cfg, devices)
    accumulation = global_batch_size(cfg, pstate.dp_size) // (cfg.data.micro_batch_size * pstate.dp_size)
    return Run(cfg, launch, devices, pstate, model, optimizer, schedule_from_config(cfg, launch.world_size), offload,
               loader, valid_source, eod, accumulation, test_source=test_source, eval_loaders=eval_loaders,
               memory_plan=plan)


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


def step_peak_memory(run: Run) -> dict:
    """This step's peak memory, the largest of any rank: on CUDA the allocator's allocated and reserved bytes
    since the step began (`train_one_step` resets them), on the CPU the process's peak resident size since
    it started (the kernel keeps no per-step peak)."""
    if run.devices.is_cuda:
        peaks = [torch.cuda.max_memory_allocated(run.devices.accelerator),
                 torch.cuda.max_memory_reserved(run.devices.accelerator)]
    else:
        peaks = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 0]  # KiB
    if run.pstate.distributed:
        shared = torch.tensor(peaks, dtype=torch.float64, device=run.devices.accelerator)
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        peaks = shared.tolist()
    allocated, reserved = (p / 2**30 for p in peaks)
    return {"peak_memory_gib": allocated, **({"peak_reserved_gib": reserved} if run.devices.is_cuda else {})}


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


def validation_loss(run: Run, iters: int, source: SampleSource | None = None, first_sample: int = 0,
                    rounds: int | None = None) -> float:
    """Mean loss over `iters` global batches (Megatron's --eval-iters) of `source` (default the
    validation part) from `first_sample`, in stream order; `rounds` micro-batch rounds instead when given."""
    loader = run.eval_loader(source or run.valid_source)
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
    if run.offload is not None:
        run.offload.reset_peak()  # the logged host peak is this step's
    if run.devices.is_cuda:
        torch.cuda.reset_peak_memory_stats(run.devices.accelerator)  # the peaks logged are this step's
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
    metrics = {"step": step, "loss": loss, "loss_tokens": int(result.num_valid_tokens.item()), "lr": lr,
               "grad_norm": norm, "tokens_per_s": tokens / elapsed, "step_time_s": elapsed, **step_peak_memory(run)}
    if run.memory_plan is not None:  # the planner's allocated peak, beside the measured one
        metrics["planned_peak_gib"] = run.memory_plan.gpu_peak_gib
    if weight_decay is not None and run.schedule.wd_incr_style != "constant":
        metrics["weight_decay"] = weight_decay
    if mfu is not None:
        metrics.update(tflops_per_gpu=flops_per_gpu / 1e12, mfu=mfu)
    if run.offload is not None:
        metrics["host_offload_gib"] = run.offload.host_bytes_peak / 2**30
        metrics["host_page_locked_gib"] = run.offload.page_locked_bytes / 2**30
    if isinstance(run.optimizer, HostAdamW):  # what the plan's host bytes count of it, and what is page-locked
        metrics["host_optimizer_gib"] = run.optimizer.host_bytes() / 2**30
        metrics["host_optimizer_page_locked_gib"] = run.optimizer.page_locked_bytes() / 2**30
    return metrics


def _eta_s(step_times: list[float], remaining: int) -> float:
    """Remaining time from the mean step time, leaving out the first step (warm-up) once others exist."""
    times = step_times[1:] or step_times
    return remaining * sum(times) / len(times)


def print_flushed(text: str) -> None:
    print(text, flush=True)


class History(list):
    """The logged metrics of each step; `stopped` says why the run stopped to be resumed (None: it finished)."""

    stopped: str | None = None


def train(cfg: TrainConfig) -> History:
    """Run training to --train-iters (or a stop request); returns the logged metrics."""
    started = time.time()  # --exit-duration-in-mins counts from here, as Megatron-LM's from start-up
    early = StartupSignals(cfg.train.exit_signal_handler)
    try:
        if cfg.checkpoint.use_checkpoint_args:
            cfg = apply_checkpoint_args(cfg)
        run = build_run(cfg)
        run.save_lock = take_save_lock(run)
        if run.save_lock is not None and run.is_logging_rank:
            clear_stopped(cfg.checkpoint.save)
        try:
            return _train_run(run, started, early)
        finally:
            for loader in (run.loader, *(l for _, l in run.eval_loaders)):
                if isinstance(loader, WorkerLoader):
                    loader.close()
            if run.save_lock is not None and run.is_logging_rank:
                run.save_lock.release()
    finally:
        early.close()


def _train_run(run: Run, started: float, early: StartupSignals) -> History:
    """The loop of `train` once --save is locked."""
    cfg = run.cfg
    start = resume(run)
    if cfg.train.skip_train:
        return History([skip_train(run, start)])
    if start >= cfg.train.train_iters:
        print_rank_0(run, f"the checkpoint is at step {start}, --train-iters is {cfg.train.train_iters}: "
                          "nothing left to do")
        return History()
    g = cfg.logging
    log_dir = g.log_dir or str(default_log_dir())
    logger = MetricsLogger(log_dir, g.tensorboard_dir, cfg.train.train_iters, run.is_logging_rank,
                           validation_ppl_to_tensorboard=g.log_validation_ppl_to_tensorboard,
                           wandb=(g.wandb_project, g.wandb_exp_name, cfg.to_dict()), wandb_id_dir=cfg.checkpoint.save)
    n = count_parameters(run.model)
    kernel = running_kernel(run.devices.accelerator.type, cfg.parallel.attention_kernel,
                            torch.bfloat16 if cfg.train.bf16 else torch.float32)
    layout = cfg.context_layout()
    if layout.ring_size > 1:  # what the ring cuts: the sequence's chunks or each document (--cp-document-layout)
        kernel = f"{kernel}, ring --cp-document-layout {layout.documents}"
    print_rank_0(run, f"{run.pstate} | {run.model.config.num_layers} layers, {n:,} parameters | "
                      f"seq {cfg.data.seq_length} | attention: {kernel} | metrics in {log_dir}/metrics.jsonl")
    if run.memory_plan is not None:
        print_rank_0(run, run.memory_plan.describe())
        run.timing.planned_step_s = run.memory_plan.step_s
    c = cfg.checkpoint
    resumable = [start]  # the step of the checkpoint a resume would go on from

    def abandon(reason: str) -> None:  # from the signal handler, inside a step: leave now, exit 3
        text = f"stopping inside the step: {reason}; the run resumes from step {resumable[0]}'s checkpoint"
        if c.save and run.is_logging_rank:
            mark_stopped(c.save, resumable[0], text)
        print_rank_0(run, text)
        leave_now(EXIT_RESUME)  # no teardown: other ranks may be inside a collective this one will not join

    stop = StopRequest(cfg.train.exit_signal_handler,
                       deadlines(cfg.train.exit_duration_in_mins, started, current_job()),
                       c.save_interval_minutes, run.timing, run.devices.accelerator,
                       grace_s=DEFAULT_GRACE_S if cfg.train.exit_signal_grace_secs is None
                       else cfg.train.exit_signal_grace_secs, abandon=abandon, received=early.received)
    if cfg.train.exit_signal_handler and c.save:  # a step a signal abandons is left at a block boundary, its
        stop.watch_blocks(run.model.layers)     # last finished step saved (without --save: nothing to save)
        if run.pstate.distributed:
            stop.boundary_group = dist.new_group(backend="gloo")
    history, step_times, began = History(), [], time.monotonic()
    since_log = []  # step times since the last console line (Megatron-LM's interval time)
    progress = StepProgress(list(run.model.layers), print_flushed) if run.is_logging_rank else None
    profiler = StepProfiler(cfg.profiling, run.launch.rank, start + 1, g.tensorboard_dir or log_dir,
                            run.devices.is_cuda, say=print_flushed)
    try:
        before = stop.decide(may_save=False)  # the recorded or planned step time may already not fit
        if before.for_time:  # a new incarnation of the job gets the same time: it would not either
            raise ConfigError(f"before step {start + 1}: {before.stop}; no step fits in this job's time, so a "
                              "requeue could not make progress either: ask for more time (--time, "
                              "--exit-duration-in-mins)")
        if before.stop:
            history.stopped = f"stopping before step {start + 1}: {before.stop}"
            print_rank_0(run, history.stopped + " (the checkpoint loaded is the one to resume)")
        for step in range(start + 1, cfg.train.train_iters + 1):
            if history.stopped:
                break
            if progress is not None:
                progress.begin(step, cfg.train.train_iters, run.accumulation, run.timing.step_s())
            stop.begin_step(step)
            before = _before_step(run) if cfg.train.exit_signal_handler else None  # what an abandoned step restores
            abandoned = None
            profiler.before_step(step)
            try:
                metrics = train_one_step(run, step)
            except StepAbandoned as reason:  # saved after the except block: its traceback holds the step's graph
                abandoned = str(reason)
            except BaseException:
                stop.end_step(finished=False)
                raise
            stop.end_step()
            profiler.after_step(step)
            if abandoned is not None:
                history.stopped = _save_the_last_finished_step(run, step, abandoned, before)
                resumable[0] = step - 1
                print_rank_0(run, history.stopped)
                break
            metrics["attention_kernel"] = kernel
            step_times.append(metrics["step_time_s"])
            run.timing.step_times.append(metrics["step_time_s"])
            since_log.append(metrics["step_time_s"])
            metrics.update(elapsed_s=time.monotonic() - began, eta_s=_eta_s(step_times, cfg.train.train_iters - step))
            if g.eval_interval and step % g.eval_interval == 0:
                metrics.update(run_validation(run, step // g.eval_interval - 1))
            if step == cfg.train.train_iters and run.test_source is not None and g.eval_iters >= 1:
                metrics["test_loss"] = validation_loss(run, g.eval_iters, run.test_source)  # once, as Megatron
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
            last = step == cfg.train.train_iters
            decision = stop.decide(may_save=bool(c.save)) if not last else None
            exiting = not last and bool(cfg.train.exit_interval) and step % cfg.train.exit_interval == 0
            history.stopped = f"stopping after step {step}: {decision.stop}" if decision and decision.stop else None
            if c.save and ((c.save_interval and step % c.save_interval == 0) or last or exiting
                           or (decision and decision.save)):
                save(run, step)
                stop.saved()
                resumable[0] = step
            stop.unsaved_step = step if c.save and resumable[0] != step else None  # an abandoned step saves it
            if exiting and not history.stopped:  # asked for: this invocation is done (exit 0)
                print_rank_0(run, f"stopping after step {step}: --exit-interval {cfg.train.exit_interval}"
                                  + ("" if c.save else " (no --save: nothing saved)"))
                break
            if history.stopped:
                print_rank_0(run, history.stopped + ("" if c.save else " (no --save: nothing saved)"))
                break
        if history.stopped:
            if c.save and run.is_logging_rank:
                mark_stopped(c.save, history[-1]["step"] if history else start, history.stopped)
            if run.pstate.distributed:  # written before any rank leaves: srun --kill-on-bad-exit stops the rest
                dist.barrier()
    finally:
        stop.close()
        profiler.close()
        if progress is not None:
            progress.close()
        logger.close()
    return history


def _before_step(run: Run) -> dict:
    """What a step changes before its optimizer step and a save of the step before it records: where the data
    stood, the generators."""
    state = {"data": run.loader.state_dict(), "rng": torch.get_rng_state()}
    if run.devices.is_cuda:
        state["cuda_rng"] = torch.cuda.get_rng_state(run.devices.accelerator)
    return state


def _save_the_last_finished_step(run: Run, step: int, reason: str, before: dict) -> str:
    """Drop what the abandoned `step` made (gradients, unsharded parameters, offloaded inputs), save the step before
    it as it ended; the line saying so."""
    for module in run.model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    run.optimizer.zero_grad(set_to_none=True)
    if run.offload is not None:
        run.offload.release_all()
    torch.set_rng_state(before["rng"])
    if "cuda_rng" in before:
        torch.cuda.set_rng_state(before["cuda_rng"], run.devices.accelerator)
    if run.cfg.checkpoint.save:
        save(run, step - 1, data=before["data"])
    return f"stopping inside step {step}: {reason}; step {step - 1}, never saved before, saved to resume from"


def run_validation(run: Run, evaluation: int) -> dict:
    """The `evaluation`-th validation (from 0): --eval-iters global batches from where the previous one
    stopped, or with --full-validation the whole validation part from its first sample."""
    g = run.cfg.logging
    if g.full_validation:
        return {"val_loss": validation_loss(run, 0, run.valid_source, 0, rounds=full_validation_rounds(run, run.valid_source))}
    per_evaluation = g.eval_iters * global_batch_size(run.cfg, run.pstate.dp_size)
    first = validation_window(evaluation, per_evaluation, len(run.valid_source))
    return {"val_loss": validation_loss(run, g.eval_iters, run.valid_source, first)}


def skip_train(run: Run, step: int) -> dict:
    """--skip-train: evaluate the validation part (from its first sample, --eval-iters batches or the whole of
    it with --full-validation) and the test part at the loaded step, print them, write nothing (as Megatron-LM,
    which does not write tensorboard then either); returns the results."""
    g, result = run.cfg.logging, {"step": step}
    print_rank_0(run, f"skipping training (--skip-train): evaluating the weights of step {step}")
    if run.valid_source is not None and (g.full_validation or g.eval_iters >= 1):
        rounds = full_validation_rounds(run, run.valid_source) if g.full_validation else None
        result["val_loss"] = validation_loss(run, g.eval_iters, run.valid_source, 0, rounds=rounds)
        print_rank_0(run, f"validation at step {step} | lm loss {result['val_loss']:.6E} | "
                          f"lm loss PPL {validation_ppl(result['val_loss']):.6E}")
    if run.test_source is not None and g.eval_iters >= 1:
        result["test_loss"] = validation_loss(run, g.eval_iters, run.test_source)
        print_rank_0(run, f"test at step {step} | lm loss {result['test_loss']:.6E} | "
                          f"lm loss PPL {validation_ppl(result['test_loss']):.6E}")
    if len(result) == 1:
        raise ConfigError("--skip-train: nothing to evaluate (no validation or test part, or --eval-iters 0)")
    return result
