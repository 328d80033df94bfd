"""Sharded, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of `--save DIR`:

    DIR/iter_0000100/            one complete checkpoint (DCP shards + meta.json)
    DIR/latest_checkpointed_iteration.txt

A checkpoint is written to `DIR/.tmp_iter_XXXXXXX` and renamed when every rank has
finished, so a directory named `iter_*` is always complete. DCP stores each tensor with
its global shape, so a checkpoint loads on any number of ranks (dp or cp changed).
`meta.json` holds the step, the model shape (a checkpoint of another shape is refused
with both shapes named), the scheduler, the data position and RNG states.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

LATEST = "latest_checkpointed_iteration.txt"
META = "meta.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under root (or root itself when it is one), else None."""
    root = Path(root)
    if (root / META).exists():
        return root
    marker = root / LATEST
    if marker.exists():
        path = checkpoint_dir(root, int(marker.read_text().strip()))
        if (path / META).exists():
            return path
    complete = sorted(p for p in root.glob("iter_*") if (p / META).exists())
    return complete[-1] if complete else None


def save_checkpoint(root: str | Path, step: int, model, optimizer, extra: dict, keep_last: int = 2) -> Path:
    """Write model (+ optimizer, when given) shards and meta.json atomically; keep the newest `keep_last`.

    Without an optimizer the checkpoint is weights-only (`weights_only` in meta.json): a
    run loading it starts training at step 0 from these weights (e.g. converted from HF).
    """
    root, final = Path(root), checkpoint_dir(root, step)
    tmp = root / f".tmp_iter_{step:07d}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    else:
        extra = {**extra, "weights_only": True}
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        (tmp / META).write_text(json.dumps({"step": step, **extra}, indent=1, default=str))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (root / LATEST).write_text(str(step))
        _prune(root, keep_last)
    _barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    complete = sorted(p for p in root.glob("iter_*") if (p / META).exists())
    for old in complete[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def read_meta(path: str | Path) -> dict:
    meta = Path(path) / META
    if not meta.exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {META})")
    return json.loads(meta.read_text())


def check_model_matches(meta: dict, model_config, path) -> None:
    """Refuse a checkpoint of another model shape, naming the differences."""
    saved = meta.get("model_config", {})
    current = dataclasses.asdict(model_config)
    diff = {k: (saved.get(k), v) for k, v in current.items()
            if k in saved and json.loads(json.dumps(saved[k], default=str)) != json.loads(json.dumps(v, default=str))}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a} vs run {b}" for k, (a, b) in diff.items())
        raise ValueError(f"checkpoint {path} is of another model ({detail})")


def load_checkpoint(path: str | Path, model, optimizer=None) -> dict:
    """Load model (and optimizer) shards from a complete checkpoint; returns its meta."""
    meta = read_meta(path)
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return meta


def load_model_weights(path: str | Path, model) -> dict:
    """Model weights only (evaluation, conversion)."""
    return load_checkpoint(path, model, optimizer=None)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state().tolist()}
