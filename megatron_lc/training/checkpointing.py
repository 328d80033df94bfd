"""Sharded, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of `--save DIR`:

    DIR/iter_0000100/            one complete checkpoint (DCP shards + meta.json)
    DIR/latest_checkpointed_iteration.txt

A checkpoint is written to `DIR/.tmp_iter_XXXXXXX` and renamed when every rank has
finished, so a directory named `iter_*` is always complete. DCP stores each tensor with
its global shape, so a checkpoint loads on any number of ranks (dp or cp changed).
`meta.json` holds the step, the model shape (a checkpoint of another shape is refused
with both shapes named), the schedule, the data position, RNG states, and every file
written with its size. `meta.json` and the marker are written to a temporary name,
fsynced and renamed, so a crash leaves the old file or the new one, never half of one.
On load each candidate is verified against its recorded files; a damaged newest
checkpoint is reported and the newest intact one is used instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
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

from megatron_lc.config import ConfigError
from megatron_lc.parallel_state import detect_launch

LATEST = "latest_checkpointed_iteration.txt"
META = "meta.json"


def _rank() -> int:
    """This process's rank, also before the process group exists (from the launcher's environment)."""
    return dist.get_rank() if dist.is_initialized() else detect_launch().rank


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


class DamagedCheckpointError(ValueError):
    """A checkpoint whose files do not match what was recorded when it was written."""


def write_atomically(path: Path, text: str) -> None:
    """Write, fsync, rename over `path`, fsync the directory: a reader sees the old text or the new."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def written_files(directory: Path) -> dict[str, int]:
    """Every file of a checkpoint directory (but meta.json) with its size in bytes."""
    return {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file() and p.name != META}


def verify_checkpoint(path: Path) -> dict:
    """The checkpoint's meta, once its recorded files are all there at their sizes; else DamagedCheckpointError."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise DamagedCheckpointError(f"{path / META} is unreadable ({e})") from e
    if not isinstance(meta, dict) or "step" not in meta:
        raise DamagedCheckpointError(f"{path / META} has no step")
    recorded = meta.get("files", {".metadata": None})  # checkpoints older than the file list: DCP's index
    for name, size in recorded.items():
        file = path / name
        if not file.is_file():
            raise DamagedCheckpointError(f"{file}: missing")
        if size is not None and file.stat().st_size != size:
            raise DamagedCheckpointError(f"{file}: {file.stat().st_size} bytes, {size} bytes were written")
    return meta


def _candidates(root: Path) -> list[Path]:
    """Checkpoints under root, newest first: the marker's own, then every iter_* by step."""
    found = sorted(root.glob("iter_*"), reverse=True)
    try:
        marked = checkpoint_dir(root, int((root / LATEST).read_text().strip()))
    except (OSError, ValueError):
        marked = None  # no marker, or an empty or damaged one: the directories still tell
    if marked in found:
        found.remove(marked)
        found.insert(0, marked)
    return found


def newest_intact_checkpoint(root: str | Path) -> tuple[Path, dict] | None:
    """The newest intact checkpoint under root (or root itself when it is one) and its verified meta.

    A damaged candidate is reported with what is wrong, and the next older one is tried.
    """
    root = Path(root)
    if (root / META).exists():
        return root, verify_checkpoint(root)
    for path in _candidates(root):
        if not (path / META).exists():
            continue  # never completed: not a checkpoint
        try:
            return path, verify_checkpoint(path)
        except DamagedCheckpointError as e:
            if _rank() == 0:
                warnings.warn(f"skipping damaged checkpoint {path.name}: {e}", stacklevel=3)
    return None


def latest_checkpoint(root: str | Path) -> Path | None:
    """The path of `newest_intact_checkpoint(root)`, or None."""
    found = newest_intact_checkpoint(root)
    return found[0] if found else None


def save_checkpoint(root: str | Path, step: int, model, optimizer, extra: dict, keep_last: int = 2) -> Path:
    """Write model (+ optimizer, when given) shards and meta.json atomically; keep the newest `keep_last`.

    Without an optimizer the checkpoint is weights-only (`weights_only` in meta.json): a
    run loading it starts training at step 0 from these weights (e.g. converted from HF).
    """
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    else:
        extra = {**extra, "weights_only": True}
    return save_state(root, step, state, extra, keep_last)


def save_state(root: str | Path, step: int, state: dict, extra: dict, keep_last: int = 2,
               planner: dcp.SavePlanner | None = None) -> Path:
    """The DCP write behind save_checkpoint: `state` as shards, then meta.json, marker and pruning.

    `planner` may produce each tensor only when it is written (streaming conversion). Then every
    tensor gets its own file: DCP's file writer keeps a reference to each tensor it has written
    until its file is closed, so one file per rank would hold the whole state.
    """
    root, final = Path(root), checkpoint_dir(root, step)
    tmp = root / f".tmp_iter_{step:07d}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=planner is None)
    dcp.save(state, storage_writer=writer, planner=planner)
    (tmp / rng_file_name(_rank())).write_text(json.dumps(rng_state()))  # each rank's own generators
    _barrier()
    if _rank() == 0:
        meta = {"step": step, **extra, "files": written_files(tmp)}
        write_atomically(tmp / META, json.dumps(meta, indent=1, default=str))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        fsync_directory(root)
        write_atomically(root / LATEST, str(step))
        _prune(root, final, keep_last)
    _barrier()
    return final


def _prune(root: Path, final: Path, keep_last: int) -> None:
    """Keep `final` (just written) and the newest `keep_last - 1` earlier checkpoints; delete the earlier rest.

    Checkpoints of later steps (another run's, in the same directory) are left alone; 0 keeps all.
    """
    earlier = sorted(p for p in root.glob("iter_*") if p.name < final.name and (p / META).exists())
    for old in earlier[:max(0, len(earlier) - (keep_last - 1))] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def read_meta(path: str | Path) -> dict:
    if not (Path(path) / META).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {META})")
    return verify_checkpoint(Path(path))


def check_model_matches(meta: dict, model_config, path) -> None:
    """Refuse a checkpoint of another model shape, naming the differences."""
    saved = meta.get("model_config", {})
    current = dataclasses.asdict(model_config)
    diff = {k: (saved.get(k), v) for k, v in current.items()
            if k in saved and json.loads(json.dumps(saved[k], default=str)) != json.loads(json.dumps(v, default=str))}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a} vs run {b}" for k, (a, b) in diff.items())
        raise ConfigError(f"checkpoint {path} is of another model ({detail})")


def load_checkpoint(path: str | Path, model, optimizer=None) -> None:
    """Load model (and optimizer) shards from a checkpoint already verified (`newest_intact_checkpoint`)."""
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def load_state(state: dict, path: str | Path) -> None:
    """Fill the tensors of `state` (any subset of the checkpoint's) from the checkpoint at path."""
    dcp.load(state, checkpoint_id=str(path))


def load_model_weights(path: str | Path, model) -> None:
    """Model weights only (evaluation, conversion)."""
    load_checkpoint(path, model, optimizer=None)


def rng_state() -> dict:
    """This rank's generators (host, and the current CUDA device when there is one)."""
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def rng_file_name(rank: int) -> str:
    return f"rng_rank{rank}.json"


def load_rng_state(path: Path, rank: int) -> bool:
    """Restore this rank's generators from the checkpoint; False when it holds none for this rank."""
    file = Path(path) / rng_file_name(rank)
    if not file.exists():
        return False
    set_rng_state(json.loads(file.read_text()))
    return True


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
