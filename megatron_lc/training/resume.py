"""Resume policy and data identity: what a checkpoint must agree with to be continued, loading it, saving
one, and taking --save for this run.

A run continues a checkpoint only under the data settings it read its data with (datasets named by
content, not path), with the same learning-rate schedule unless a flag chooses, and the model the
checkpoint holds; each refusal is one line naming the flag that resolves it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch.distributed as dist

from megatron_lc.config import TrainConfig
from megatron_lc.data.blending import normalize
from megatron_lc.data.index_cache import dataset_fingerprint
from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.sources import parse_data_path, parse_split
from megatron_lc.errors import ConfigError
from megatron_lc.parallel_state import ParallelState
from megatron_lc.training import checkpointing
from megatron_lc.training.hf_generation import SOURCE_META_KEYS
from megatron_lc.training.run import Run, global_batch_size, print_rank_0
from megatron_lc.training.save_lock import SaveLock, acquire_save_lock
from megatron_lc.training.schedule import LRSchedule
from megatron_lc.training.stopping import StepTiming


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


def checkpoint_extra(run: Run, data: dict | None = None) -> dict:
    """What a checkpoint records beside the tensors; `data`: the loader's state to record (default: now)."""
    return {"model_config": dataclasses.asdict(run.model.config), "train_config": run.cfg.to_dict(),
            "schedule": run.schedule.to_dict(), "data_settings": _data_settings(run.cfg, run.pstate),
            "data": run.loader.state_dict() if data is None else data, "world_size": run.launch.world_size,
            "timing": run.timing.to_dict(), **run.source_meta}


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
    differing = [k for k, v in current.items() if k in saved and _comparable(saved[k]) != _comparable(v)
                 and k not in STREAM_CONTINUES]
    if not differing:
        return ""
    diff = "; ".join(_describe_difference(k, saved[k], current[k], cfg) for k in differing)
    if cfg.checkpoint.override_data_settings:
        return diff
    raise ConfigError(f"checkpoint {path} read its data with other settings ({diff}): restore them to resume, "
                      "pass --override-data-settings to continue (optimizer, step and data position kept), or "
                      "--finetune to start a new run from its weights")


STREAM_CONTINUES = ("--seq-length", "--global-batch-size")
"""Settings a resume may change: the token stream continues at the first token not yet trained (the loader)."""


def _layout_of(meta: dict) -> dict:
    """The checkpoint's data state, with the length and batch it was read at (older checkpoints record them
    only among their data settings)."""
    state, settings = dict(meta["data"]), meta.get("data_settings", {})
    if "seq_length" not in state and "--seq-length" in settings:
        state["seq_length"] = settings["--seq-length"]
    config = meta.get("train_config", {})
    if "samples_per_step" not in state and "world_size" in meta and "data" in config and "parallel" in config:
        dp = meta["world_size"] // config["parallel"]["context_parallel_size"]
        state["samples_per_step"] = config["data"]["micro_batch_size"] * dp
    return state


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
    """--use-checkpoint-args: the model from the checkpoint in --load, its whole recorded config (a converted
    checkpoint records no flags, only the config), with the flags given for what may change on a load (rope base
    and scaling, max positions) applied over it; a shape flag the checkpoint contradicts is refused when the
    model is checked against it."""
    if not cfg.checkpoint.load:
        raise ConfigError("--use-checkpoint-args reads the checkpoint in --load: give --load DIR")
    found = checkpointing.checkpoint_to_load(cfg.checkpoint.load, cfg.checkpoint.ckpt_step)
    if found is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint in --load {cfg.checkpoint.load}")
    path, meta = found
    flags = meta.get("train_config", {}).get("model")
    if meta.get("model_config"):
        flavour = (flags or {}).get("model", cfg.model.model)
        taken = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, model=flavour,
                                                                   checkpoint_model=meta["model_config"]))
        ours = dataclasses.asdict(taken.model_config(padded=False))
        for field, value in meta["model_config"].items():
            if field not in checkpointing.MAY_CHANGE_ON_LOAD and field in ours and ours[field] != value:
                raise ConfigError(f"--use-checkpoint-args takes the model's shape from {path}: its {field} is "
                                  f"{value}, the flags give {ours[field]}; drop the flag")
        return taken
    if not flags:
        raise ConfigError(f"--use-checkpoint-args: {path} records no model settings")
    given = {k: v for k, v in dataclasses.asdict(cfg.model).items()
             if v is not None and v != getattr(type(cfg.model)(), k)}
    return dataclasses.replace(cfg, model=type(cfg.model)(**{**flags, **given}))


def resume(run: Run) -> int:
    """Load the newest intact checkpoint under --load; returns the step to start from (0 without one)."""
    c = run.cfg.checkpoint
    if not c.load:
        return 0
    found = checkpointing.checkpoint_to_load(c.load, c.ckpt_step, required=c.exit_on_missing_checkpoint)
    if found is None:
        print_rank_0(run, f"--load {c.load}: no checkpoint there yet; training starts from scratch")
        return 0
    path, meta = found
    run.source_meta = {key: meta[key] for key in SOURCE_META_KEYS if meta.get(key)}
    changed = checkpointing.check_model_matches(meta, run.model.config, path)
    if changed:
        print_rank_0(run, f"model settings changed on load from {path}: {changed}")
    if meta.get("weights_only") or c.finetune:
        checkpointing.load_model_weights(path, run.model)
        print_rank_0(run, f"loaded weights from {path}; training starts at step 0")
        return 0
    if run.cfg.train.skip_train:  # evaluation only: the weights (Megatron-LM turns on --no-load-optim too)
        checkpointing.load_model_weights(path, run.model)
        print_rank_0(run, f"loaded weights from {path} (step {meta['step']})")
        return int(meta["step"])
    overridden = check_data_settings(meta, run.cfg, run.pstate, path)
    if overridden:
        print_rank_0(run, f"--override-data-settings: continuing {path} with other data settings ({overridden})")
    try:
        continued = run.loader.load_state_dict(_layout_of(meta))
    except ValueError as e:
        if not c.override_data_settings:
            raise ConfigError(f"checkpoint {path}: {e}: resume at its --seq-length and batch, or pass "
                              "--override-data-settings to continue by sample count") from None
        run.loader.continue_by_sample_count(int(meta["data"]["consumed_samples"]))
        continued = f"--override-data-settings: {e}; continuing by sample count"
    if continued:
        print_rank_0(run, continued)
    run.schedule = resumed_schedule(meta, run.cfg, run.schedule, path)
    has_optim, has_rng = meta.get("optimizer_saved", True), meta.get("rng_saved", True)
    if not has_optim and not c.no_load_optim:  # Megatron-LM loads such a checkpoint as with --no-load-optim
        print_rank_0(run, f"{path} holds no optimizer state (saved with --no-save-optim): a fresh optimizer, "
                          "as with --no-load-optim")
    if not has_rng and not c.no_load_rng:
        print_rank_0(run, f"{path} holds no generator states (saved with --no-save-rng): not restored, "
                          "as with --no-load-rng")
    checkpointing.load_checkpoint(path, run.model, run.optimizer if has_optim and not c.no_load_optim else None)
    if has_rng and not c.no_load_rng and meta.get("world_size") == run.launch.world_size:  # rank r's is rank r's
        checkpointing.load_rng_state(path, run.launch.rank)
    run.timing = StepTiming.resumed(meta.get("timing"))
    print_rank_0(run, f"resumed from {path} at step {meta['step']}")
    return int(meta["step"])


def save(run: Run, step: int, data: dict | None = None) -> None:
    """Save `step` (`data`: the loader's state at its end, when the loader has moved on since)."""
    c = run.cfg.checkpoint
    began = time.monotonic()
    path = checkpointing.save_checkpoint(c.save, step, run.model, run.optimizer, checkpoint_extra(run, data),
                                         keep_last=c.keep_last_checkpoints, run_id=run.save_lock.run_id,
                                         save_optimizer=not c.no_save_optim, save_rng=not c.no_save_rng)
    run.timing.save_times.append(time.monotonic() - began)
    print_rank_0(run, f"saved {path}")


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
