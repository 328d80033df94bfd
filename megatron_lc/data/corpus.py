"""Reading raw corpora as a stream of documents, each text in bounded pieces.

Inputs, by name: `*.jsonl` and `*.json` (JSON lines; a `.json` file whose first
character is `[` is one JSON array, read incrementally), `*.parquet`, directories
saved with `datasets.Dataset.save_to_disk`, and any other file as plain text (one
document per file). `.gz` compression is read transparently for JSON and text.
Other directories stand for the files inside them (recursively, sorted, hidden
entries skipped).

Nothing here holds more than one document (and for plain-text files, one piece) in
memory. Bad input goes through `InputProblems`, which raises with the file and line
or, with `skip_invalid`, counts the skip for the summary.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import json
import os
from dataclasses import dataclass, field
from typing import IO, Iterable, Iterator, Mapping, Sequence

# Long texts are tokenized in pieces of about this many characters, cut after a
# newline where possible: tokenizer cost stays linear (SentencePiece encodes 1 MB
# inputs about 3x slower per byte than 16 KB ones) and workers stay balanced.
DEFAULT_PIECE_CHARS = 16_384
_READ_BLOCK_BYTES = 1 << 20
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class InvalidInputError(ValueError):
    """Input that cannot be processed; the message starts with `file:line`."""


@dataclass(frozen=True)
class Location:
    """Where a document comes from: a 1-based line, JSON-array item, or table row."""

    path: str
    number: int
    unit: str = "line"

    def __str__(self) -> str:
        return f"{self.path}:{self.number}" if self.unit == "line" else f"{self.path}:{self.unit} {self.number}"


@dataclass
class ProblemCount:
    """How often one kind of problem occurred and where it first did."""

    count: int
    first_location: str
    first_detail: str


@dataclass
class InputProblems:
    """Bad or empty input: raises for invalid input unless `skip_invalid`, counts skips."""

    skip_invalid: bool = False
    counts: dict[str, ProblemCount] = field(default_factory=dict)

    def invalid(self, location: Location, reason: str, detail: str = "") -> None:
        """Invalid input: an `InvalidInputError`, or a counted skip with `skip_invalid`."""
        if not self.skip_invalid:
            suffix = f": {detail}" if detail else ""
            raise InvalidInputError(f"{location}: {reason}{suffix} (--skip-invalid skips such input)")
        self.skipped(location, reason, detail)

    def skipped(self, location: Location, reason: str, detail: str = "") -> None:
        """Count one skipped document (or line) under `reason`."""
        entry = self.counts.get(reason)
        if entry is None:
            self.counts[reason] = ProblemCount(1, str(location), detail)
        else:
            entry.count += 1

    def merge(self, other: "InputProblems") -> None:
        """Add another run's counts (first locations from the earlier run win)."""
        for reason, entry in other.counts.items():
            mine = self.counts.get(reason)
            if mine is None:
                self.counts[reason] = ProblemCount(entry.count, entry.first_location, entry.first_detail)
            else:
                mine.count += entry.count

    @property
    def total(self) -> int:
        return sum(entry.count for entry in self.counts.values())


@dataclass
class Document:
    """One input record: for each JSON key, its text as an iterable of pieces."""

    location: Location
    texts: dict[str, Iterable[str]]


@dataclass(frozen=True)
class ReadOptions:
    """What to read from each record and how to cut long texts."""

    keys: tuple[str, ...] = ("text",)
    piece_chars: int = DEFAULT_PIECE_CHARS
    split: str = "train"  # the split read from a saved DatasetDict


def split_text(text: str, piece_chars: int = DEFAULT_PIECE_CHARS) -> Iterator[str]:
    """`text` in consecutive pieces of at most `piece_chars` characters; joined, they give
    `text` back. Cuts fall after a newline that starts a non-blank line where possible,
    where pre-tokenizers split anyway, so the ids match those of the whole text."""
    start = 0
    while len(text) - start > piece_chars:
        cut = _cut_point(text, start, start + piece_chars)
        yield text[start:cut]
        start = cut
    yield text[start:]


def _cut_point(text: str, start: int, limit: int) -> int:
    """Where to end the piece `text[start:limit]`: after a newline followed by
    non-whitespace, else after any newline, else after a space, else at `limit`."""
    newline = text.rfind("\n", start, limit)
    candidate = newline
    while candidate >= start and text[candidate + 1].isspace():
        candidate = text.rfind("\n", start, candidate)
    if candidate >= start:
        return candidate + 1
    return newline + 1 or text.rfind(" ", start, limit) + 1 or limit


def _utf8_boundary(block: bytes) -> int:
    """The end of the last complete UTF-8 character of `block` (its length if it is whole)."""
    end = len(block)
    for lead in range(end - 1, max(end - 4, 0) - 1, -1):
        byte = block[lead]
        if byte & 0xC0 != 0x80:  # a lead byte or ASCII, not a continuation byte
            width = 1 if byte < 0x80 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return end if lead + width <= end else lead
    return end


def _byte_cut(block: bytes) -> int:
    """Where to end a piece of `block`: after its last newline, else after its last
    space, else at the last UTF-8 character boundary."""
    return block.rfind(b"\n") + 1 or block.rfind(b" ") + 1 or _utf8_boundary(block)


def _open_binary(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _fields_to_document(
    location: Location, fields: object, options: ReadOptions, problems: InputProblems
) -> Document | None:
    """Validate one record's values: a Document, or None after reporting why not."""
    if not isinstance(fields, Mapping):
        problems.invalid(location, "not a JSON object", type(fields).__name__)
        return None
    texts: dict[str, Iterable[str]] = {}
    for key in options.keys:
        value = fields.get(key)
        if value is None:
            problems.invalid(location, f"missing key {key!r}")
            return None
        if not isinstance(value, str):
            problems.invalid(location, f"non-string value for {key!r}", type(value).__name__)
            return None
        if not value.strip():
            problems.skipped(location, "empty document", f"key {key!r}")
            return None
        texts[key] = split_text(value, options.piece_chars)
    return Document(location, texts)


def read_json_lines(path: str, options: ReadOptions, problems: InputProblems) -> Iterator[Document]:
    """One record per line; blank lines are ignored."""
    with _open_binary(path) as stream:
        for line_number, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            location = Location(path, line_number)
            try:
                line = raw.rstrip(b"\r\n").decode("utf-8")
            except UnicodeDecodeError as error:
                problems.invalid(location, "invalid UTF-8", f"byte {error.start + 1} of the line")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                problems.invalid(location, "malformed JSON", f"{error.msg} at column {error.colno}")
                continue
            document = _fields_to_document(location, record, options, problems)
            if document is not None:
                yield document


class _JsonArrayStream:
    """Decodes the items of one top-level JSON array without loading the whole file."""

    def __init__(self, stream: IO[bytes], path: str) -> None:
        self._stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._json = json.JSONDecoder()
        self.path = path
        self.buffer = ""
        self.position = 0
        self.line = 1  # line of `position`
        self.eof = False

    def fill(self, minimum_bytes: int) -> None:
        """Read at least `minimum_bytes` more (or to the end), dropping consumed text."""
        self.buffer = self.buffer[self.position :]
        self.position = 0
        data = self._stream.read(minimum_bytes)
        self.eof = not data
        self.buffer += self._decoder.decode(data, final=self.eof)

    def skip(self, characters: str) -> str | None:
        """Advance past `characters`; the next character, or None at the end."""
        while True:
            while self.position < len(self.buffer) and self.buffer[self.position] in characters:
                self.line += self.buffer[self.position] == "\n"
                self.position += 1
            if self.position < len(self.buffer) or self.eof:
                return self.buffer[self.position] if self.position < len(self.buffer) else None
            self.fill(_READ_BLOCK_BYTES)

    def decode_item(self) -> object:
        """The next JSON value; reads more (doubling) while the value is incomplete."""
        block = _READ_BLOCK_BYTES
        while True:
            try:
                value, end = self._json.raw_decode(self.buffer, self.position)
            except json.JSONDecodeError:
                if self.eof:
                    raise
                self.fill(block)
                block *= 2  # amortised linear cost for very large items
                continue
            self.line += self.buffer.count("\n", self.position, end)
            self.position = end
            return value


def read_json_array(path: str, options: ReadOptions, problems: InputProblems) -> Iterator[Document]:
    """The items of a top-level JSON array. A syntax error ends the file (there is no
    way to resynchronise inside an array): raised, or with `skip_invalid` counted."""
    with _open_binary(path) as stream:
        items = _JsonArrayStream(stream, path)
        try:
            items.skip(" \t\r\n")
            items.position += 1  # the opening "["
            while items.skip(" \t\r\n") not in ("]", None):
                location = Location(path, items.line)
                record = items.decode_item()
                document = _fields_to_document(location, record, options, problems)
                if document is not None:
                    yield document
                separator = items.skip(" \t\r\n")
                if separator == ",":
                    items.position += 1
                elif separator != "]":
                    raise json.JSONDecodeError("expected ',' or ']' after an item", items.buffer, items.position)
        except json.JSONDecodeError as error:
            detail = f"{error.msg}; the rest of the file is not read"
            problems.invalid(Location(path, items.line), "malformed JSON array", detail)
        except UnicodeDecodeError as error:
            problems.invalid(
                Location(path, items.line), "invalid UTF-8", f"{error.reason}; the rest of the file is not read"
            )


def _starts_with_bracket(path: str) -> bool:
    with _open_binary(path) as stream:
        return stream.read(4096).lstrip()[:1] == b"["


def first_invalid_utf8(path: str) -> tuple[int, str] | None:
    """(line, detail) of the first invalid UTF-8 in a file, or None when it is valid."""
    line = 1
    carry = b""
    with _open_binary(path) as stream:
        while True:
            data = stream.read(16 * _READ_BLOCK_BYTES)
            block = carry + data
            cut = len(block) if not data else _utf8_boundary(block)
            try:
                block[:cut].decode("utf-8")
            except UnicodeDecodeError as error:
                line += block.count(b"\n", 0, error.start)
                return line, f"byte {block[error.start]:#04x} ({error.reason})"
            if not data:
                return None
            line += block.count(b"\n", 0, cut)
            carry = block[cut:]


def text_file_pieces(path: str, piece_chars: int) -> Iterator[str]:
    """A (valid UTF-8) text file in line-aligned pieces of about `piece_chars` bytes."""
    carry = b""
    with _open_binary(path) as stream:
        while True:
            data = stream.read(piece_chars)
            block = carry + data
            if not data:
                if block:
                    yield block.decode("utf-8")
                return
            cut = _byte_cut(block)
            carry = block[cut:]
            if cut:
                yield block[:cut].decode("utf-8")


def _nonblank(pieces: Iterator[str]) -> Iterator[str] | None:
    """The same pieces, or None when they are all whitespace (peeks past blank ones)."""
    blank: list[str] = []
    for piece in pieces:
        blank.append(piece)
        if piece.strip():
            return _chain(blank, pieces)
    return None


def _chain(first: list[str], rest: Iterator[str]) -> Iterator[str]:
    yield from first
    yield from rest


def read_text_file(path: str, options: ReadOptions, problems: InputProblems) -> Iterator[Document]:
    """The whole file as one document, read in pieces; invalid UTF-8 is invalid input."""
    location = Location(path, 1)
    if len(options.keys) != 1:
        raise InvalidInputError(f"{path}: a plain-text file has one field, but --json-keys names {len(options.keys)}")
    invalid = first_invalid_utf8(path)
    if invalid is not None:
        problems.invalid(Location(path, invalid[0]), "invalid UTF-8", invalid[1])
        return
    pieces = _nonblank(text_file_pieces(path, options.piece_chars))
    if pieces is None:
        problems.skipped(location, "empty document", "blank file")
        return
    yield Document(location, {options.keys[0]: pieces})


def read_parquet(path: str, options: ReadOptions, problems: InputProblems) -> Iterator[Document]:
    """Rows of a Parquet file, a few at a time."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    columns = [key for key in options.keys if key in parquet.schema_arrow.names]
    if not columns:
        yield from _documents_without_columns(path, parquet.metadata.num_rows, options, problems)
        return
    row = 0
    for batch in parquet.iter_batches(batch_size=64, columns=columns):
        yield from _documents_from_columns(path, row, batch.num_rows, batch.to_pydict(), options, problems)
        row += batch.num_rows


def _documents_from_columns(
    path: str, first_row: int, num_rows: int, columns: Mapping[str, list], options: ReadOptions, problems: InputProblems
) -> Iterator[Document]:
    for offset in range(num_rows):
        location = Location(path, first_row + offset + 1, "row")
        record = {key: column[offset] for key, column in columns.items() if key in options.keys}
        document = _fields_to_document(location, record, options, problems)
        if document is not None:
            yield document


def _documents_without_columns(
    path: str, num_rows: int, options: ReadOptions, problems: InputProblems
) -> Iterator[Document]:
    """Every row lacks the keys: reported row by row, without reading any data."""
    for row in range(num_rows):
        _fields_to_document(Location(path, row + 1, "row"), {}, options, problems)
    return
    yield


def is_saved_dataset(path: str) -> bool:
    """Whether `path` is a directory written by `datasets`' `save_to_disk`."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, name)) for name in _DATASET_MARKERS)


def read_saved_dataset(path: str, options: ReadOptions, problems: InputProblems) -> Iterator[Document]:
    """Rows of a saved `datasets` Dataset (memory-mapped Arrow), or one split of a DatasetDict."""
    import datasets

    dataset = datasets.load_from_disk(path)
    if isinstance(dataset, datasets.DatasetDict):
        if options.split not in dataset:
            raise InvalidInputError(f"{path}: no split {options.split!r} (splits: {', '.join(dataset)}); see --split")
        dataset = dataset[options.split]
    columns = [key for key in options.keys if key in dataset.column_names]
    if not columns:
        yield from _documents_without_columns(path, len(dataset), options, problems)
        return
    dataset = dataset.select_columns(columns)
    row = 0
    for batch in dataset.iter(batch_size=64):
        num_rows = len(next(iter(batch.values()))) if batch else 0
        yield from _documents_from_columns(path, row, num_rows, batch, options, problems)
        row += num_rows


def reader_for(path: str):
    """The reader function for one input path."""
    name = path[:-3] if path.endswith(".gz") else path
    if is_saved_dataset(path):
        return read_saved_dataset
    if name.endswith(".parquet"):
        return read_parquet
    if name.endswith(".jsonl"):
        return read_json_lines
    if name.endswith(".json"):
        return read_json_array if _starts_with_bracket(path) else read_json_lines
    return read_text_file


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Files, globs and directories to a list of input paths, in the order given."""
    paths: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not matches or not all(os.path.exists(match) for match in matches):
            raise InvalidInputError(f"--input {pattern}: no such file or directory")
        for match in matches:
            paths.extend(_files_in(match))
    return paths


def _files_in(path: str) -> list[str]:
    """A file or saved dataset as itself; a plain directory as its files, recursively."""
    if not os.path.isdir(path) or is_saved_dataset(path):
        return [path]
    files: list[str] = []
    for entry in sorted(os.listdir(path)):
        if not entry.startswith("."):
            files.extend(_files_in(os.path.join(path, entry)))
    return files


def read_documents(paths: Sequence[str], options: ReadOptions, problems: InputProblems) -> Iterator[Document]:
    """Every document of every input path, in order."""
    for path in paths:
        yield from reader_for(path)(path, options, problems)
