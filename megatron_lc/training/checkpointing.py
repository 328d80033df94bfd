"""Sharded, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of `--save DIR`:

    DIR/iter_0000100/            one complete checkpoint (DCP shards + meta.json)
    DIR/latest_checkpointed_iteration.txt

A checkpoint is written to `DIR/.tmp_iter_XXXXXXX.RUN` (RUN names the writing run, which
holds `DIR/.save.lock`, see save_lock.py) and renamed when every rank has finished, so a
directory named `iter_*` is always complete. DCP stores each tensor with
its global shape, so a checkpoint loads on any number of ranks (dp or cp changed).
`meta.json` holds the step, the model shape (a checkpoint of another shape is refused
with both shapes named), the schedule, the data position, RNG states, and every file
written with its size. `meta.json` and the marker are written to a temporary name,
fsynced and renamed, so a crash leaves the old file or the new one, never half of one.
On load each candidate is verified against its recorded files; a damaged newest
checkpoint is reported and the newest intact one is used instead.

A save that cannot fit is refused before it writes (the size is known from the model
and optimizer); a write that fails midway (ENOSPC, EDQUOT, EIO) is one line naming the
file and the OS error, and its temporary directory is removed so the disk is as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from megatron_lc.errors import ConfigError
from megatron_lc.parallel_state import detect_launch
from megatron_lc.training.optim import HostAdamW

LATEST = "latest_checkpointed_iteration.txt"
META = "meta.json"
TMP_PREFIX = ".tmp_iter_"


class SaveError(ConfigError):
    """A checkpoint that cannot be written (no space, quota, I/O error): one line, exit status 2."""


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


def _recorded_step(path: Path) -> int:
    """The step a checkpoint's meta.json records (-1 when unreadable: tried last, then reported)."""
    try:
        return int(json.loads((path / META).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def _candidates(root: Path) -> list[Path]:
    """Checkpoints in and under root, newest first: the marker's own, then every other by step.

    A checkpoint directory given itself (a copied `iter_*`) is one candidate among the `iter_*`
    saved into it since, so a run resuming from and saving into it moves forward.
    """
    by_step = [(int(p.name.removeprefix("iter_")), p) for p in root.glob("iter_*")
               if p.name.removeprefix("iter_").isdigit()]
    if (root / META).exists():
        by_step.append((_recorded_step(root), root))
    found = [p for _, p in sorted(by_step, key=lambda sp: (sp[0], sp[1] != root), reverse=True)]
    try:
        marked = checkpoint_dir(root, int((root / LATEST).read_text().strip()))
    except (OSError, ValueError):
        marked = None  # no marker, or an empty or damaged one: the directories still tell
    if marked in found:
        found.remove(marked)
        found.insert(0, marked)
    return found


def newest_intact_checkpoint(root: str | Path) -> tuple[Path, dict] | None:
    """The newest intact checkpoint in or under root and its verified meta (see `_candidates`).

    A damaged candidate is reported with what is wrong, and the next older one is tried.
    """
    root = Path(root)
    for path in _candidates(root):
        if not (path / META).exists():
            continue  # never completed: not a checkpoint
        try:
            return path, verify_checkpoint(path)
        except DamagedCheckpointError as e:
            if _rank() == 0:
                warnings.warn(f"skipping damaged checkpoint {path.name}: {e}", stacklevel=3)
    return None


def checkpoint_to_load(root: str | Path, step: int | None = None, required: bool = False) -> tuple[Path, dict] | None:
    """The checkpoint --load takes and its verified meta: the one of `step` (--ckpt-step; refused when it is
    missing or damaged, never another), else the newest intact one; None when there is none, or a ConfigError
    with `required` (--exit-on-missing-checkpoint)."""
    root = Path(root)
    if step is not None:
        candidates = [p for p in (checkpoint_dir(root, step), root) if (p / META).exists()
                      and (p != root or _recorded_step(root) == step)]
        if not candidates:
            raise ConfigError(f"--ckpt-step {step}: no checkpoint of step {step} in --load {root} "
                              f"({checkpoint_dir(root, step).name} is not there)")
        try:
            return candidates[0], verify_checkpoint(candidates[0])
        except DamagedCheckpointError as e:
            raise ConfigError(f"--ckpt-step {step}: the checkpoint is damaged ({e})") from e
    found = newest_intact_checkpoint(root)
    if found is None and required:
        raise ConfigError(f"--exit-on-missing-checkpoint: --load {root} holds no checkpoint (a typo in the path?)")
    return found


def missing_checkpoint_hint(root: str | Path) -> str:
    """Why a directory with no checkpoint was given, as far as its files say: a Hugging Face model (and how to
    convert it), or likely a typo."""
    root = Path(root)
    weights = any(root.glob("*.safetensors")) or any(root.glob("pytorch_model*.bin"))
    if (root / "config.json").is_file() and weights:
        return (f"it is a Hugging Face model: convert it with python tools/checkpoint/convert_from_hf.py --load {root} "
                "--save CKPT, then give --load CKPT")
    return "a typo in the path?" if not root.exists() else "no iter_* checkpoint in it"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The path of `newest_intact_checkpoint(root)`, or None."""
    found = newest_intact_checkpoint(root)
    return found[0] if found else None


def enclosing_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint `directory` is, or lies inside (its meta.json and DCP's index), else None."""
    path = Path(directory).absolute()
    for candidate in (path, *path.parents):
        if (candidate / META).is_file() and (candidate / ".metadata").is_file():
            return candidate
    return None


def check_save_directory(directory: str | Path) -> None:
    """--save must be a run's root: checkpoints saved inside another checkpoint are lost to --load."""
    inside = enclosing_checkpoint(directory)
    if inside is not None:
        raise ConfigError(f"--save {directory}: {'is' if inside == Path(directory).absolute() else 'is inside'} "
                          f"the checkpoint {inside} (it has a {META}); save into its parent or another directory")


def holds_checkpoints(root: str | Path) -> bool:
    """Whether root has a marker or any complete checkpoint (in it or under it)."""
    root = Path(root)
    return (root / LATEST).exists() or any((p / META).exists() for p in [root, *root.glob("iter_*")])


def state_bytes(model, optimizer) -> int:
    """Bytes a checkpoint of model (+ Adam's two moments per parameter) takes: global sizes, also sharded."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params * (3 if optimizer is not None else 1)


def save_checkpoint(root: str | Path, step: int, model, optimizer, extra: dict, keep_last: int = 0,
                    run_id: str | None = None, save_optimizer: bool = True, save_rng: bool = True) -> Path:
    """Write model (+ optimizer, when given) shards and meta.json atomically; keep_last > 0 keeps the newest N.

    Without an optimizer the checkpoint is weights-only (`weights_only` in meta.json): a
    run loading it starts training at step 0 from these weights (e.g. converted from HF).
    With an optimizer but `save_optimizer` False (--no-save-optim), or `save_rng` False
    (--no-save-rng), the run's checkpoint lacks that state (`optimizer_saved` / `rng_saved`
    false in meta.json): a resume from it starts a fresh optimizer, or keeps its generators.
    """
    kept = optimizer if save_optimizer else None
    check_free_space(root, state_bytes(model, kept))
    state = {"model": get_model_state_dict(model)}
    if kept is not None:
        state["optim"] = optimizer_state(model, kept)
    elif optimizer is None:
        extra = {**extra, "weights_only": True}
    else:
        extra = {**extra, "optimizer_saved": False}
    if not save_rng:
        extra = {**extra, "rng_saved": False}
    return save_state(root, step, state, extra, keep_last, run_id=run_id, save_rng=save_rng)


def _size_text(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} bytes"


def check_free_space(root: str | Path, needed: int) -> None:
    """Refuse a save that cannot fit, before anything is written (rank 0 looks; every rank raises)."""
    error = None
    if _rank() == 0:
        free = shutil.disk_usage(root).free
        if needed > free:
            error = f"--save {root}: a checkpoint needs about {_size_text(needed)}, {_size_text(free)} free"
    error = _first_error(error)
    if error:
        raise SaveError(error)


def _first_error(local: str | None) -> str | None:
    """Every rank learns the first rank's error, so all of them stop at the same point with the same line."""
    if not dist.is_initialized():
        return local
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return next((e for e in gathered if e), None)


def _shared_run_id() -> str:
    """A name for this save's temporary directory, the same on every rank."""
    token = [uuid.uuid4().hex[:12]]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    return token[0]


class _RecordingStream(io.RawIOBase):
    """A file that keeps its first OSError instead of raising it into torch.save.

    torch.save reports a failed write as `[enforce fail at inline_container.cc]` without the OS
    error; kept here, the error is raised with its file name when the stream is closed.
    """

    def __init__(self, raw, path: Path):
        self.raw, self.path, self.error = raw, path, None

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if self.error is None:
            try:
                return self.raw.write(b)
            except OSError as e:
                self.error = OSError(e.errno, e.strerror, str(self.path))
        return len(memoryview(b))

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def flush(self) -> None:
        if self.error is None:
            try:
                self.raw.flush()
            except OSError as e:
                self.error = OSError(e.errno, e.strerror, str(self.path))

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.flush()  # the stream is closed by DCP inside the context: the file closes on leaving it


class _RecordingFileSystem(FileSystem):
    """DCP's file system with write errors raised as OSError naming the file (see _RecordingStream)."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with open(path, mode) as raw:
            stream = _RecordingStream(raw, Path(path))
            yield stream
            stream.flush()
            if stream.error is not None:
                raise stream.error
        # a close that fails (NFS reports ENOSPC or EDQUOT at close) raises its own OSError here


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed save (DCP wraps each rank's failure in a CheckpointException)."""
    stack = [e]
    while stack:
        current = stack.pop()
        if isinstance(current, OSError) and current.errno is not None:
            return current
        if isinstance(current, CheckpointException):
            stack += [f[0] if isinstance(f, tuple) else f for f in current.failures.values()]
        stack += [c for c in (current.__cause__, current.__context__) if c is not None]
    return None


def _describe_write_error(root: Path, e: BaseException) -> str | None:
    os_error = _os_error(e)
    if os_error is None:
        return None
    code = errno.errorcode.get(os_error.errno, str(os_error.errno))
    return (f"--save {root}: writing {os_error.filename or root} failed: {os_error.strerror} ({code}); "
            "its temporary directory was removed, earlier checkpoints are untouched")


def save_state(root: str | Path, step: int, state: dict, extra: dict, keep_last: int = 0,
               planner: dcp.SavePlanner | None = None, run_id: str | None = None,
               move_marker_back: bool = True, save_rng: bool = True) -> Path:
    """The DCP write behind save_checkpoint: `state` as shards, then meta.json, marker and pruning.

    `planner` may produce each tensor only when it is written (streaming conversion). Then every
    tensor gets its own file: DCP's file writer keeps a reference to each tensor it has written
    until its file is closed, so one file per rank would hold the whole state. `run_id` names the
    temporary directory (the lock holder's, see save_lock.py). Without `move_marker_back` the marker
    is left alone when it names a later step (a checkpoint added to a run's directory).
    """
    root, final = Path(root), checkpoint_dir(root, step)
    tmp = root / f"{TMP_PREFIX}{step:07d}.{run_id or _shared_run_id()}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    error, failure = None, None
    try:
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=planner is None)
        writer.fs = _RecordingFileSystem()
        dcp.save(state, storage_writer=writer, planner=planner)
        if save_rng:
            (tmp / rng_file_name(_rank())).write_text(json.dumps(rng_state()))  # each rank's own generators
    except (OSError, CheckpointException) as e:
        error, failure = _describe_write_error(root, e), e
    error = _first_error(error or (f"--save {root}: rank {_rank()} failed to write {tmp}" if failure else None))
    if error is None and _rank() == 0:
        try:
            _finish(root, tmp, final, step, extra, keep_last, move_marker_back)
        except OSError as e:
            error = _describe_write_error(root, e)
    error = _first_error(error)
    if error:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        if failure is not None and _os_error(failure) is None:
            raise failure  # not an OS error: a bug, with its traceback
        raise SaveError(error)
    _barrier()
    return final


def _finish(root: Path, tmp: Path, final: Path, step: int, extra: dict, keep_last: int,
            move_marker_back: bool) -> None:
    """Rank 0, once every rank has written its shards: meta.json, the rename, the marker, pruning."""
    meta = {"step": step, **extra, "files": written_files(tmp)}
    write_atomically(tmp / META, json.dumps(meta, indent=1, default=str))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_directory(root)
    if move_marker_back or _marked_step(root) is None or _marked_step(root) <= step:
        write_atomically(root / LATEST, str(step))
    _prune(root, final, keep_last)


def _marked_step(root: Path) -> int | None:
    try:
        return int((root / LATEST).read_text().strip())
    except (OSError, ValueError):
        return None


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


MAY_CHANGE_ON_LOAD = ("rotary_base", "rope_scaling", "max_position_embeddings", "init_std")
"""Model settings a load may change (a context extension raises the rope base or its scaling and the positions;
the initialisation is the checkpoint's weights); every other field is the model's shape or function."""


def check_model_matches(meta: dict, model_config, path) -> str:
    """Refuse a checkpoint of another model shape in one line naming the fields; returns the settings this run
    changes on load ('' when none), for the run to say."""
    saved = meta.get("model_config", {})
    current = dataclasses.asdict(model_config)
    diff = {k: (saved.get(k), v) for k, v in current.items()
            if k in saved and json.loads(json.dumps(saved[k], default=str)) != json.loads(json.dumps(v, default=str))}
    shape = {k: d for k, d in diff.items() if k not in MAY_CHANGE_ON_LOAD}
    if shape:
        detail = ", ".join(f"{k}: checkpoint {a} vs run {b}" for k, (a, b) in shape.items())
        raise ConfigError(f"checkpoint {path} is of another model ({detail}): give its shape's flags, or "
                          "--use-checkpoint-args to take the shape from it")
    return ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items() if k != "init_std")


def load_checkpoint(path: str | Path, model, optimizer=None) -> None:
    """Load model (and optimizer) shards from a checkpoint already verified (`newest_intact_checkpoint`)."""
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = optimizer_state(model, optimizer, to_load=True)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if isinstance(optimizer, HostAdamW):
        optimizer.load_checkpoint_state(state["optim"], parameter_names(model))
    elif optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def optimizer_state(model, optimizer, to_load: bool = False) -> dict:
    """The optimizer's checkpoint state, in torch's layout (`get_optimizer_state_dict`) whether the optimizer is
    resident or on the host: either resumes from the other's checkpoints."""
    if isinstance(optimizer, HostAdamW):
        return optimizer.checkpoint_state(parameter_names(model), empty=to_load)
    return get_optimizer_state_dict(model, optimizer)


def parameter_names(model) -> dict:
    """Each parameter's name in the model's state dict by the id of the parameter (FSDP2 keeps the names)."""
    return {id(p): name for name, p in model.named_parameters()}


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
