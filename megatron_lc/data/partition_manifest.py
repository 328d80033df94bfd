"""The manifest of one finished partition of `preprocess_data.py --partitions N`.

A partition's `.bin`/`.idx` files are renamed into place when complete; its manifest,
written after them (to a temporary name, synced, renamed), records what produced them
(every flag that changes the output, the tokenizer's files by digest, the partition's
input files by path, size and modification time) and what they are (each file's size
and SHA-256), with the partition's summary. A rerun reuses a partition only when its
manifest reads back, names the same producer, and every file still has its recorded
size and digest; anything else redoes the partition, and the reason is said.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

MANIFEST_FORMAT = 1
_CHUNK = 1 << 22


def file_digest(path: str) -> str:
    """SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def path_digest(path: str) -> str:
    """SHA-256 of a file, or of a directory's files (relative names and digests, sorted)."""
    if not os.path.isdir(path):
        return file_digest(path)
    digest = hashlib.sha256()
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(root, name)
            digest.update(f"{os.path.relpath(full, path)}\0{file_digest(full)}\n".encode())
    return digest.hexdigest()


def input_identity(paths: Sequence[str]) -> list[list[Any]]:
    """Each input file as [absolute path, size, modification time in ns]: an edited input changes it."""
    identity = []
    for path in paths:
        stat = os.stat(path)
        identity.append([os.path.abspath(path), stat.st_size, stat.st_mtime_ns])
    return identity


def file_records(paths: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of each file, by base name."""
    return {os.path.basename(path): {"size": os.path.getsize(path), "sha256": file_digest(path)} for path in paths}


def write_manifest(path: str, producer: dict[str, Any], outputs: Sequence[str], summary: dict[str, Any]) -> None:
    """Record `outputs` (already in place) as made by `producer`, atomically: the manifest appears whole or
    not at all."""
    manifest = {"format": MANIFEST_FORMAT, "producer": producer, "files": file_records(outputs), "summary": summary}
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as stream:
        json.dump(manifest, stream, indent=1, sort_keys=True)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)


def verified_summary(path: str, producer: dict[str, Any], outputs: Sequence[str]) -> tuple[dict | None, str]:
    """The recorded summary when the partition at `outputs` is finished and intact for `producer`, else
    None and why it must be redone."""
    try:
        with open(path, encoding="utf-8") as stream:
            manifest = json.load(stream)
    except FileNotFoundError:
        return None, "it has no manifest (it did not finish)"
    except (OSError, ValueError) as error:
        return None, f"its manifest is unreadable ({error})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None, "its manifest is of another format"
    changed = _changed_fields(manifest.get("producer"), producer)
    if changed:
        return None, f"it was made with other {', '.join(changed)}"
    recorded = manifest.get("files")
    if not isinstance(recorded, dict) or sorted(recorded) != sorted(os.path.basename(p) for p in outputs):
        return None, "its manifest lists other files"
    for output in outputs:
        damage = _damage(output, recorded[os.path.basename(output)])
        if damage:
            return None, damage
    return manifest.get("summary"), ""


def _changed_fields(recorded: object, producer: dict[str, Any]) -> list[str]:
    """The producer fields whose recorded value differs."""
    if not isinstance(recorded, dict):
        return ["flags (unreadable producer)"]
    return [name for name in sorted(set(recorded) | set(producer)) if recorded.get(name) != producer.get(name)]


def _damage(path: str, record: dict[str, Any]) -> str:
    """Why `path` is not the file the manifest records, or '' when it is."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        return f"{name} is missing"
    size = os.path.getsize(path)
    if size != record.get("size"):
        return f"{name} is {size} bytes, its manifest says {record.get('size')}"
    if file_digest(path) != record.get("sha256"):
        return f"{name} has another SHA-256 than its manifest records"
    return ""
