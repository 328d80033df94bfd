"""Megatron's indexed dataset format: a `.bin` of tokens and an `.idx` that indexes it.

The files are byte-for-byte the ones Megatron-LM writes and reads, so datasets move
freely between the two frameworks. Layout (little-endian, C order):

`.bin`: every sequence's tokens back to back, no header.

`.idx`: magic `b"MMIDIDX\\x00\\x00"`, version uint64 (= 1), dtype code uint8, sequence
count uint64 `S`, document-index count uint64 `D`, then int32[S] sequence lengths,
int64[S] byte pointers into the `.bin`, int64[D] document indices (0, then the
sequence index where each document ends; the last entry is `S`).

Writers never leave a valid-looking `.idx` behind on failure: both files are written
under temporary names and renamed into place only once complete, `.idx` last. A
temporary is named by its writer (`.NAME.HOST-PID-TICKS-UNIQUE.tmp`, see
`megatron_lc.processes`): a builder starting for a final path removes that path's
temporaries whose writer is a process of this host that is gone (a killed run's).
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
import uuid
from array import array
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from megatron_lc.processes import Writer

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, S, D
# Megatron chooses uint16 below this vocabulary size (a margin under 65536).
UINT16_VOCAB_LIMIT = 65500

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}

PathLike = str | os.PathLike


class IndexedDatasetError(ValueError):
    """A `.bin`/`.idx` pair that cannot be read: the message names the file and the fault."""


def idx_path(path_prefix: PathLike) -> str:
    """The index file of a dataset prefix."""
    return os.fspath(path_prefix) + ".idx"


def bin_path(path_prefix: PathLike) -> str:
    """The token file of a dataset prefix."""
    return os.fspath(path_prefix) + ".bin"


def dtype_code(dtype: type[np.number] | np.dtype) -> int:
    """The `.idx` code of a numpy dtype; ValueError for dtypes the format lacks."""
    wanted = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == wanted:
            return code
    raise ValueError(f"dtype {wanted} has no code in the indexed dataset format")


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """uint16 when every token id fits with Megatron's margin, else int32."""
    if vocab_size is not None and vocab_size < UINT16_VOCAB_LIMIT:
        return np.uint16
    return np.int32


def sequence_pointers(sequence_lengths: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte offset of each sequence in the `.bin`: an exclusive prefix sum of lengths."""
    pointers = np.zeros(len(sequence_lengths), dtype=np.int64)
    if len(sequence_lengths) > 1:
        np.cumsum(sequence_lengths[:-1], dtype=np.int64, out=pointers[1:])
    return pointers * itemsize


class IndexWriter:
    """Writes one `.idx` file from sequence lengths and document indices."""

    def __init__(self, path: PathLike, dtype: type[np.number]) -> None:
        self.path = os.fspath(path)
        self.dtype = np.dtype(dtype)

    def write(self, sequence_lengths: np.ndarray, document_indices: np.ndarray) -> None:
        """Write header and arrays in the order Megatron reads them."""
        lengths = np.ascontiguousarray(sequence_lengths, dtype=np.int32)
        documents = np.ascontiguousarray(document_indices, dtype=np.int64)
        with open(self.path, "wb") as stream:
            stream.write(INDEX_MAGIC)
            stream.write(struct.pack("<Q", INDEX_VERSION))
            stream.write(struct.pack("<B", dtype_code(self.dtype)))
            stream.write(struct.pack("<Q", len(lengths)))
            stream.write(struct.pack("<Q", len(documents)))
            stream.write(lengths.astype("<i4", copy=False).tobytes(order="C"))
            pointers = sequence_pointers(lengths, self.dtype.itemsize)
            stream.write(pointers.astype("<i8", copy=False).tobytes(order="C"))
            stream.write(documents.astype("<i8", copy=False).tobytes(order="C"))


class IndexReader:
    """Reads and validates one `.idx` file; arrays are views of a memory map."""

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        self._buffer = self._map_file()
        self.dtype, sequence_count, document_count = self._read_header()
        self._check_size(sequence_count, document_count)
        offset = HEADER_SIZE
        self.sequence_lengths = self._array(np.int32, sequence_count, offset)
        offset += 4 * sequence_count
        self.sequence_pointers = self._array(np.int64, sequence_count, offset)
        offset += 8 * sequence_count
        self.document_indices = self._array(np.int64, document_count, offset)
        self._check_consistency()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def _fail(self, what: str) -> IndexedDatasetError:
        return IndexedDatasetError(f"{self.path}: {what}")

    def _map_file(self) -> np.ndarray:
        if not os.path.isfile(self.path):
            raise self._fail("index file not found")
        size = os.path.getsize(self.path)
        if size < HEADER_SIZE:
            raise self._fail(f"truncated index: {size} bytes, the header alone is {HEADER_SIZE}")
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    def _read_header(self) -> tuple[np.dtype, int, int]:
        header = bytes(self._buffer[:HEADER_SIZE])
        if header[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise self._fail(f"not a Megatron indexed dataset index (magic {header[:9]!r})")
        version, code, sequences, documents = struct.unpack("<QBQQ", header[len(INDEX_MAGIC) :])
        if version != INDEX_VERSION:
            raise self._fail(f"index version {version}, only version {INDEX_VERSION} is readable")
        if code not in DTYPE_CODES:
            raise self._fail(f"unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        return np.dtype(DTYPE_CODES[code]), sequences, documents

    def _check_size(self, sequence_count: int, document_count: int) -> None:
        expected = HEADER_SIZE + 12 * sequence_count + 8 * document_count
        actual = len(self._buffer)
        if actual < expected:
            raise self._fail(
                f"truncated index: {actual} bytes, the header announces {sequence_count} "
                f"sequences and {document_count} document indices ({expected} bytes)"
            )
        if actual not in (expected, expected + sequence_count):  # + sequence modes (multimodal)
            raise self._fail(f"index is {actual} bytes, expected {expected}")

    def _array(self, dtype: type[np.number], count: int, offset: int) -> np.ndarray:
        return np.frombuffer(self._buffer, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=offset)

    def _check_consistency(self) -> None:
        """Cheap vectorised checks that catch corrupted or hand-edited indices."""
        if np.any(self.sequence_lengths < 0):
            raise self._fail("negative sequence length")
        expected = sequence_pointers(self.sequence_lengths, self.dtype.itemsize)
        if not np.array_equal(self.sequence_pointers, expected):
            raise self._fail("sequence pointers disagree with the sequence lengths")
        documents = self.document_indices
        if len(documents) == 0 or documents[0] != 0 or documents[-1] != len(self):
            raise self._fail(f"document indices must start at 0 and end at {len(self)} (the sequence count)")
        if np.any(np.diff(documents) < 0):
            raise self._fail("document indices are not sorted")

    @property
    def num_tokens(self) -> int:
        """Tokens in the whole `.bin`."""
        return int(self.sequence_lengths.sum(dtype=np.int64))


class IndexedDataset:
    """Memory-mapped reader of a `.bin`/`.idx` pair: reads only the tokens asked for."""

    def __init__(self, path_prefix: PathLike) -> None:
        self.path_prefix = os.fspath(path_prefix)
        self.index = IndexReader(idx_path(path_prefix))
        self.dtype = self.index.dtype
        self._tokens = self._map_tokens(bin_path(path_prefix))

    def _map_tokens(self, path: str) -> np.ndarray:
        if not os.path.isfile(path):
            raise IndexedDatasetError(f"{path}: token file not found (its index is {self.index.path})")
        expected = self.index.num_tokens * self.dtype.itemsize
        actual = os.path.getsize(path)
        if actual != expected:
            raise IndexedDatasetError(
                f"{path}: {actual} bytes, but {self.index.path} indexes {self.index.num_tokens} "
                f"{self.dtype} tokens ({expected} bytes)"
            )
        if actual == 0:  # an empty file cannot be memory-mapped
            return np.empty(0, dtype=self.dtype)
        return np.asarray(np.memmap(path, dtype=self.dtype.newbyteorder("<"), mode="r"))

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.index)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx` (to its end by default)."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences in {self.path_prefix}")
        sequence_length = int(self.index.sequence_lengths[idx])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} "
                f"of length {sequence_length} in {self.path_prefix}"
            )
        start = int(self.index.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self.read_span(start, length)

    def read_span(self, token_offset: int, count: int) -> np.ndarray:
        """`count` tokens from absolute token position `token_offset` of the `.bin` (a view)."""
        return self._tokens[token_offset : token_offset + count]

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 length of every sequence."""
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 byte offset of every sequence in the `.bin`."""
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 document boundaries in sequence indices: 0, ..., len(self)."""
        return self.index.document_indices

    @property
    def num_tokens(self) -> int:
        """Tokens in the whole dataset."""
        return self.index.num_tokens

    @staticmethod
    def exists(path_prefix: PathLike) -> bool:
        """Whether both files of the prefix exist."""
        return os.path.isfile(idx_path(path_prefix)) and os.path.isfile(bin_path(path_prefix))


TEMPORARY_SUFFIX = ".tmp"


def temporary_path(final_path: str) -> str:
    """A fresh file next to `final_path` (the final rename stays on one file system), named by its writer,
    `.NAME.HOST-PID-TICKS-UNIQUE.tmp`, and created with the permissions the final file would get."""
    directory, name = os.path.split(os.path.abspath(final_path))
    path = os.path.join(directory, f".{name}.{Writer.this_process().tag}-{uuid.uuid4().hex[:12]}{TEMPORARY_SUFFIX}")
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    return path


def temporary_writer(final_path: str, file_name: str) -> Writer | None:
    """The writer of `file_name` when it is one of `final_path`'s temporaries, else None (another file, or a
    temporary named before temporaries named their writer)."""
    head = f".{os.path.basename(final_path)}."
    if not (file_name.startswith(head) and file_name.endswith(TEMPORARY_SUFFIX)):
        return None
    tag, _, unique = file_name[len(head) : -len(TEMPORARY_SUFFIX)].rpartition("-")
    if not unique.isalnum():
        return None
    return Writer.from_tag(tag)


def remove_dead_temporaries(final_path: PathLike, say: Callable[[str], None] | None = None) -> list[str]:
    """Remove the temporaries of `final_path` whose writer is a process of this host that is gone, saying so
    in one line (to stderr unless `say` is given); the names removed."""
    final_path = os.path.abspath(os.fspath(final_path))
    directory = os.path.dirname(final_path)
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    removed = []
    for file_name in names:
        writer = temporary_writer(final_path, file_name)
        if writer is not None and writer.is_dead_here():
            _remove_quietly(os.path.join(directory, file_name))
            removed.append(f"{file_name} (pid {writer.pid})")
    if removed:
        line = (f"{final_path}: removed {len(removed)} temporary file(s) left by processes of this host that are "
                f"gone: {', '.join(removed)}")
        (say or (lambda text: print(text, file=sys.stderr, flush=True)))(line)
    return removed


class IndexedDatasetBuilder:
    """Writes a `.bin` while collecting its index; `finalize` writes the `.idx`.

    Sequences are added whole with `add_item`, or in parts with `add_tokens` then
    `end_item` (a long document tokenized piece by piece is still one sequence).
    Use as a context manager so that an exception removes the partial files.
    """

    def __init__(self, bin_path: PathLike, dtype: type[np.number] = np.int32) -> None:
        self.bin_path = os.fspath(bin_path)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # fail early on dtypes the format lacks
        remove_dead_temporaries(self.bin_path)
        if self.bin_path.endswith(".bin"):
            remove_dead_temporaries(self.bin_path[: -len(".bin")] + ".idx")
        self._bin_tmp_path = temporary_path(self.bin_path)
        self._data_file = open(self._bin_tmp_path, "wb")
        self._sequence_lengths = array("q")
        self._document_indices = array("q", [0])
        self._open_item_length: int | None = None

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:
            self.abort()

    def add_tokens(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append tokens to the sequence being built (opened on first use)."""
        values = self._checked(tokens)
        self._data_file.write(values.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self._open_item_length = (self._open_item_length or 0) + len(values)

    def end_item(self) -> None:
        """Close the sequence being built (an empty one when nothing was added)."""
        length = self._open_item_length or 0
        if length > np.iinfo(np.int32).max:
            raise ValueError(f"{self.bin_path}: a sequence of {length} tokens exceeds the int32 length field")
        self._sequence_lengths.append(length)
        self._open_item_length = None

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Add one whole sequence (a numpy array, a torch tensor or a list of ids)."""
        self.add_tokens(tokens)
        self.end_item()

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray,
                      sequences_per_document: np.ndarray | None = None) -> None:
        """Append sequences given back to back (`lengths` sums to `len(tokens)`), one write for many: each
        sequence one document, or document `d` the next `sequences_per_document[d]` sequences (0 for a
        document without any, as Megatron-LM's `add_document` writes one)."""
        self._require_no_open_item("add_documents")
        if int(lengths.sum()) != len(tokens) or (len(lengths) and int(lengths.max()) > np.iinfo(np.int32).max):
            raise ValueError(f"{self.bin_path}: document lengths do not fit the tokens given")
        if sequences_per_document is None:
            sequences_per_document = np.ones(len(lengths), dtype=np.int64)
        if int(sequences_per_document.sum()) != len(lengths):
            raise ValueError(f"{self.bin_path}: sequences per document do not add up to the sequences given")
        values = self._checked(tokens)
        self._data_file.write(values.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        first = len(self._sequence_lengths)
        self._sequence_lengths.frombytes(lengths.astype(np.int64).tobytes())
        ends = first + np.cumsum(sequences_per_document, dtype=np.int64)
        self._document_indices.frombytes(ends.tobytes())

    def end_document(self) -> None:
        """Mark the sequences added since the last call as one document."""
        self._require_no_open_item("end_document")
        self._document_indices.append(len(self._sequence_lengths))

    def add_index(self, path_prefix: PathLike) -> None:
        """Append a whole dataset (all its sequences and documents) to this one."""
        self._require_no_open_item("add_index")
        index = IndexReader(idx_path(path_prefix))
        if index.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{index.path}: dtype {index.dtype} differs from the dataset being built ({self.dtype})"
            )
        IndexedDataset(path_prefix)  # validates the .bin size against the index
        offset = len(self._sequence_lengths)
        self._sequence_lengths.frombytes(index.sequence_lengths.astype(np.int64).tobytes())
        self._document_indices.frombytes((index.document_indices[1:] + offset).astype(np.int64).tobytes())
        with open(bin_path(path_prefix), "rb") as source:
            shutil.copyfileobj(source, self._data_file, length=1 << 24)

    def finalize(self, idx_path: PathLike) -> None:
        """Write the `.idx`, then move both files into place (`.idx` last)."""
        self._require_no_open_item("finalize")
        self._data_file.close()
        final_idx = os.fspath(idx_path)
        idx_tmp_path = temporary_path(final_idx)
        try:
            IndexWriter(idx_tmp_path, self.dtype).write(
                np.frombuffer(self._sequence_lengths, dtype=np.int64),
                np.frombuffer(self._document_indices, dtype=np.int64),
            )
            if os.path.exists(final_idx):  # an old index must never describe the new .bin
                os.remove(final_idx)
            os.replace(self._bin_tmp_path, self.bin_path)
            os.replace(idx_tmp_path, final_idx)
        except BaseException:
            _remove_quietly(idx_tmp_path)
            self.abort()
            raise

    def abort(self) -> None:
        """Drop the partial `.bin`; nothing is left at the final paths."""
        self._data_file.close()
        _remove_quietly(self._bin_tmp_path)

    @property
    def num_sequences(self) -> int:
        """Sequences closed so far."""
        return len(self._sequence_lengths)

    def _checked(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Tokens as an integer array whose values fit the dataset dtype (no silent wrap-around)."""
        values = np.asarray(tokens.numpy() if hasattr(tokens, "numpy") else tokens)
        if values.ndim != 1:
            values = values.reshape(-1)
        if values.size and self.dtype.kind in "iu":
            limits = np.iinfo(self.dtype)
            low, high = int(values.min()), int(values.max())
            if low < limits.min or high > limits.max:
                raise ValueError(
                    f"{self.bin_path}: token ids span [{low}, {high}], outside {self.dtype} "
                    f"[{limits.min}, {limits.max}]; use a wider dtype (int32 for vocabularies >= {UINT16_VOCAB_LIMIT})"
                )
        return values

    def _require_no_open_item(self, caller: str) -> None:
        if self._open_item_length is not None:
            raise RuntimeError(f"{caller}() called while a sequence is open: call end_item() first")


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def write_dataset(
    path_prefix: PathLike, documents: Iterable[Sequence[int] | np.ndarray], dtype: type[np.number] = np.int32
) -> None:
    """Write one sequence per document: a convenience for tests, tools and demos."""
    with IndexedDatasetBuilder(bin_path(path_prefix), dtype=dtype) as builder:
        for tokens in documents:
            builder.add_item(tokens)
            builder.end_document()
        builder.finalize(idx_path(path_prefix))


def merge_datasets(input_prefixes: Sequence[PathLike], output_prefix: PathLike) -> None:
    """Concatenate datasets of one dtype into `output_prefix`, in the order given."""
    if not input_prefixes:
        raise ValueError("no datasets to merge")
    dtype = IndexReader(idx_path(input_prefixes[0])).dtype
    Path(os.fspath(output_prefix)).parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetBuilder(bin_path(output_prefix), dtype=dtype) as builder:
        for prefix in input_prefixes:
            builder.add_index(prefix)
        builder.finalize(idx_path(output_prefix))
