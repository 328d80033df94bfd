"""Where each document of a dataset came from: `PREFIX_locations.tsv` beside `PREFIX.bin/.idx`.

Preprocessing writes one line per document, in dataset order, naming its input record (`file:line`, `file:row
N`, `file:item N`), under a header line that names the number of documents and the SHA-256 of the `.idx` it was
written with. A reader uses the file only when both still hold, so ids rewritten by another tool never pair with
stale locations; a dataset without the file (written by Megatron-LM, or merged from datasets of which one has
none) is read as before, its documents named by index. What reads it: messages that must point at documents,
such as `--packing documents`' count of documents longer than `--seq-length`.
"""

from __future__ import annotations

import os
import shutil
from typing import Sequence

from megatron_lc.data.indexed_dataset import PathLike, idx_path, remove_dead_temporaries, temporary_path
from megatron_lc.data.partition_manifest import file_digest

LOCATIONS_SUFFIX = "_locations.tsv"
_HEADER = "# {count} documents of {idx} sha256 {digest}\n"


def locations_path(prefix: PathLike) -> str:
    return os.fspath(prefix) + LOCATIONS_SUFFIX


def _header(prefix: PathLike, count: int) -> str:
    return _HEADER.format(count=count, idx=os.path.basename(idx_path(prefix)), digest=file_digest(idx_path(prefix)))


class LocationsWriter:
    """Appends documents' locations to a temporary file; `finalize` (after the dataset's `.idx` is in place) puts
    the header first and moves the file into place, `abort` removes it."""

    def __init__(self, prefix: PathLike) -> None:
        self.path = locations_path(prefix)
        remove_dead_temporaries(self.path)
        self._temporary = temporary_path(self.path)
        self._stream = open(self._temporary, "w", encoding="utf-8")
        self.count = 0

    def add(self, locations: Sequence[str]) -> None:
        self._stream.writelines(f"{location}\n" for location in locations)
        self.count += len(locations)

    def abort(self) -> None:
        self._stream.close()
        if os.path.exists(self._temporary):
            os.remove(self._temporary)

    def finalize(self, prefix: PathLike) -> None:
        self._stream.close()
        _write_with_header(prefix, self.count, [self._temporary], skip_header=False)
        os.remove(self._temporary)


def _write_with_header(prefix: PathLike, count: int, bodies: Sequence[str], skip_header: bool) -> None:
    """The header for `prefix`'s current `.idx`, then each body file's lines (past its own header line with
    `skip_header`), moved into place at once."""
    final = locations_path(prefix)
    temporary = temporary_path(final)
    try:
        with open(temporary, "w", encoding="utf-8") as out:
            out.write(_header(prefix, count))
            for body in bodies:
                with open(body, encoding="utf-8") as stream:
                    if skip_header:
                        stream.readline()
                    shutil.copyfileobj(stream, out)
        os.replace(temporary, final)
    except BaseException:
        os.remove(temporary)
        raise


def remove_locations(prefix: PathLike) -> None:
    if os.path.exists(locations_path(prefix)):
        os.remove(locations_path(prefix))


def _valid_count(prefix: PathLike) -> int | None:
    """The number of documents the file lists, where its header matches the dataset's `.idx`; else None."""
    try:
        with open(locations_path(prefix), encoding="utf-8") as stream:
            first = stream.readline()
    except OSError:
        return None
    fields = first.split()
    if len(fields) != 7 or not fields[1].isdigit() or not os.path.exists(idx_path(prefix)):
        return None
    return int(fields[1]) if first == _header(prefix, int(fields[1])) else None


def concatenate_locations(input_prefixes: Sequence[PathLike], output_prefix: PathLike) -> bool:
    """The inputs' locations, in order, as the merged output's (whose `.idx` is in place); none (an old one
    removed) unless every input has valid ones. Whether written."""
    remove_locations(output_prefix)
    counts = [_valid_count(prefix) for prefix in input_prefixes]
    if any(count is None for count in counts):
        return False
    _write_with_header(output_prefix, sum(counts), [locations_path(p) for p in input_prefixes], skip_header=True)
    return True


def read_locations(prefix: PathLike, documents: Sequence[int]) -> dict[int, str]:
    """The locations of `documents` (indices), read up to the largest; empty where the dataset has no valid
    locations file."""
    if not documents or _valid_count(prefix) is None:
        return {}
    wanted, found, last = set(int(d) for d in documents), {}, max(documents)
    with open(locations_path(prefix), encoding="utf-8") as stream:
        stream.readline()
        for index, line in enumerate(stream):
            if index in wanted:
                found[index] = line.rstrip("\n")
            if index >= last:
                break
    return found
