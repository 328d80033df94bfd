"""Built sample indices kept on disk (`--data-cache-path`), keyed by the data and the flags.

An entry is a directory `NAME-HASH/` holding `description.json` and one `.npy` per
array; HASH is a digest of the description, which names the datasets by their files'
identity (path, size, modification time, digest of the index's ends) and every flag
the arrays depend on. Other data or other flags give another description, so another
entry, built afresh; a stored entry whose description differs is never used. Entries
are written under a temporary name and renamed into place, so ranks that build the same
entry at once, or a run killed midway, never leave a partial one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Callable, Mapping

import numpy as np

from megatron_lc.data.indexed_dataset import bin_path, idx_path

_DIGEST_BYTES = 1 << 20  # of the .idx's head and tail: lengths and pointers change with the data


def file_identity(path: str) -> dict[str, object]:
    """What identifies one file's content without reading it all."""
    stat = os.stat(path)
    return {"path": os.path.realpath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def dataset_fingerprint(prefix: str) -> dict[str, object]:
    """The identity of an indexed dataset: both files, and a digest of the index."""
    digest = hashlib.sha256()
    with open(idx_path(prefix), "rb") as stream:
        digest.update(stream.read(_DIGEST_BYTES))
        size = os.fstat(stream.fileno()).st_size
        stream.seek(max(size - _DIGEST_BYTES, 0))
        digest.update(stream.read(_DIGEST_BYTES))
    return {
        "idx": file_identity(idx_path(prefix)),
        "bin": file_identity(bin_path(prefix)),
        "idx_digest": digest.hexdigest(),
    }


def array_digest(values: np.ndarray) -> str:
    """A digest of an array's dtype, shape and bytes (to describe a subset of documents)."""
    digest = hashlib.sha256(f"{values.dtype.str}{values.shape}".encode())
    digest.update(np.ascontiguousarray(values).tobytes())
    return digest.hexdigest()


def _description_text(description: Mapping[str, object]) -> str:
    return json.dumps(description, sort_keys=True, default=str)


class IndexCache:
    """Arrays built once per description; with no directory, built every time."""

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.directory = os.fspath(directory) if directory is not None else None
        self.built: list[str] = []  # entries this process built (the rest were read)

    def arrays(
        self, name: str, description: Mapping[str, object], build: Callable[[], dict[str, np.ndarray]]
    ) -> dict[str, np.ndarray]:
        """The arrays of `description`: read from the cache (memory-mapped), else built and stored."""
        if self.directory is None:
            return build()
        text = _description_text(description)
        entry = os.path.join(self.directory, f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:20]}")
        stored = self._read(entry, text)
        if stored is not None:
            return stored
        arrays = build()
        self._write(entry, text, arrays)
        self.built.append(os.path.basename(entry))
        return arrays

    @staticmethod
    def _read(entry: str, text: str) -> dict[str, np.ndarray] | None:
        """The stored arrays when `entry` holds exactly this description, else None."""
        try:
            with open(os.path.join(entry, "description.json"), encoding="utf-8") as stream:
                stored = json.load(stream)
            if _description_text(stored["description"]) != text:
                return None
            return {key: np.load(os.path.join(entry, f"{key}.npy"), mmap_mode="r") for key in stored["arrays"]}
        except (OSError, ValueError, KeyError):  # absent, partial or foreign: built afresh
            return None

    def _write(self, entry: str, text: str, arrays: Mapping[str, np.ndarray]) -> None:
        """Store under a temporary name, then rename: readers see a whole entry or none.
        An entry another rank stored meanwhile is kept (same description, same arrays)."""
        os.makedirs(self.directory, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(entry)}.", dir=self.directory)
        try:
            for key, values in arrays.items():
                np.save(os.path.join(staging, f"{key}.npy"), values)
            record = {"description": json.loads(text), "arrays": sorted(arrays)}
            with open(os.path.join(staging, "description.json"), "w", encoding="utf-8") as stream:
                json.dump(record, stream, indent=1, sort_keys=True)
            if self._read(entry, text) is not None:
                return
            if os.path.isdir(entry):  # a stale entry under the same name: replaced
                shutil.rmtree(entry, ignore_errors=True)
            os.rename(staging, entry)
        except OSError:
            if self._read(entry, text) is None:
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
