"""Reading raw corpora as a stream of documents, each text whole.

Inputs, by name: `*.jsonl` and `*.json` (JSON lines; a `.json` file whose first
character is `[` is one JSON array, read incrementally), `*.parquet`, directories
saved with `datasets.Dataset.save_to_disk`, and any other file as plain text (one
document per file). `.gz`, `.xz`, `.bz2` and `.zst` compression is read transparently for
JSON and text (`.zst` needs the `zstandard` package and is refused by name without it).
Other directories stand for the files inside them (recursively, sorted, hidden
entries skipped).

Nothing here holds more than one document in memory. A text is never cut: tokenizers
are not local (a unigram Viterbi pass over the whole input resolves near-ties by the
whole input), so only the whole text gives the tokenizer's ids. Bad input goes through
`InputProblems`, which raises with the file and line or, with `skip_invalid`, counts
the skip for the summary.
"""

from __future__ import annotations

import bz2
import codecs
import glob
import gzip
import io
import json
import lzma
import os
from dataclasses import dataclass, field
from typing import IO, Iterator, Mapping, Sequence, TextIO

from megatron_lc.data.chat_records import ChatSettings, Conversation, ConversationError, conversation_from_record

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
    """Bad or empty input: raises for invalid input unless `skip_invalid`, counts skips, and writes every skip's
    `location<TAB>reason<TAB>detail` line to `log` when given."""

    skip_invalid: bool = False
    counts: dict[str, ProblemCount] = field(default_factory=dict)
    log: TextIO | None = field(default=None, repr=False, compare=False)

    def invalid(self, location: Location | str, reason: str, detail: str = "") -> None:
        """Invalid input: an `InvalidInputError`, or a counted skip with `skip_invalid`."""
        if not self.skip_invalid:
            suffix = f": {detail}" if detail else ""
            raise InvalidInputError(f"{location}: {reason}{suffix} (--skip-invalid skips such input)")
        self.skipped(location, reason, detail)

    def skipped(self, location: Location | str, reason: str, detail: str = "") -> None:
        """Count one skipped document (or line) under `reason`."""
        if self.log is not None:
            self.log.write(f"{location}\t{reason}\t{' '.join(detail.split())}\n")
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
    """One input record: for each JSON key, its whole text."""

    location: Location
    texts: dict[str, str]
    conversation: Conversation | None = None  # a chat record's, read with `ReadOptions.chat`


@dataclass
class BytesRead:
    """How far the reading has come, in bytes of the input files as stored (compressed bytes for a
    compressed file): what a progress line divides by the inputs' total size."""

    finished: int = 0
    _current: IO[bytes] | None = None

    def opened(self, raw: IO[bytes]) -> None:
        self._current = raw

    def finish(self, path: str) -> None:
        """`path` is read whole."""
        self.finished += _stored_size(path)
        self._current = None

    @property
    def total(self) -> int:
        current = self._current
        try:
            inside = current.tell() if current is not None and not current.closed else 0
        except (OSError, ValueError):  # a stream that cannot tell counts when it is finished
            inside = 0
        return self.finished + inside


def _stored_size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


@dataclass(frozen=True)
class ReadOptions:
    """What to read from each record."""

    keys: tuple[str, ...] = ("text",)
    split: str = "train"  # the split read from a saved DatasetDict
    max_document_chars: int | None = None  # a longer text is invalid input, named by its place
    bytes_read: BytesRead | None = None  # advanced as the files are read, for progress lines
    chat: ChatSettings | None = None  # records are conversations under `keys` (chat.py)


COMPRESSED_SUFFIXES = (".gz", ".xz", ".bz2", ".zst")


def _decompressed(raw: IO[bytes], path: str) -> IO[bytes]:
    """A reader of the decompressed bytes of `raw` (by the name's suffix)."""
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if path.endswith(".xz"):
        return lzma.LZMAFile(raw, "rb")
    if path.endswith(".bz2"):
        return bz2.BZ2File(raw, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise InvalidInputError(f"{path}: a .zst file needs the zstandard package (pip install zstandard), "
                                    "or decompress it first (zstd -d)") from None
        # buffered: zstandard's reader has no readline, which line-by-line reading needs
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw


class _Closing:
    """The decompressed stream as a context manager that also closes the file under it."""

    def __init__(self, stream: IO[bytes], raw: IO[bytes]) -> None:
        self.stream, self.raw = stream, raw

    def __enter__(self) -> IO[bytes]:
        return self.stream

    def __exit__(self, *exc_info) -> None:
        try:
            self.stream.close()
        finally:
            self.raw.close()


def _open_binary(path: str, options: ReadOptions | None = None) -> _Closing:
    raw = open(path, "rb")
    try:
        stream = _decompressed(raw, path)
    except BaseException:
        raw.close()
        raise
    if options is not None and options.bytes_read is not None:
        options.bytes_read.opened(raw)
    return _Closing(stream, raw)


def check_length(location: Location, key: str, chars: int, options: ReadOptions, problems: InputProblems) -> bool:
    """Whether a text of `chars` characters is within --max-document-chars; else reported with its place and
    what to do instead (a tokenizer's memory grows with the document: tens to hundreds of bytes per character,
    docs/data.md)."""
    limit = options.max_document_chars
    if limit is None or chars <= limit:
        return True
    problems.invalid(location, "document over --max-document-chars",
                     f"{chars:,} characters under {key!r}, the limit is {limit:,}; split it in the input, or "
                     "raise --max-document-chars where the memory is there (fewer --workers leave each more)")
    return False


def _fields_to_document(
    location: Location, fields: object, options: ReadOptions, problems: InputProblems
) -> Document | None:
    """Validate one record's values: a Document, or None after reporting why not."""
    if not isinstance(fields, Mapping):
        problems.invalid(location, "not a JSON object", type(fields).__name__)
        return None
    if options.chat is not None:
        return _conversation_document(location, fields, options, problems)
    texts: dict[str, str] = {}
    for key in options.keys:
        value = fields.get(key)
        if value is None:
            problems.invalid(location, f"missing key {key!r}")
            return None
        if not isinstance(value, str):
            chat = " (a conversation? give --chat-template hf or FILE.jinja)" if isinstance(value, list) else ""
            problems.invalid(location, f"non-string value for {key!r}", type(value).__name__ + chat)
            return None
        if not value or value.isspace():  # isspace: no copy of a long text, unlike strip
            problems.skipped(location, "empty document", f"key {key!r}")
            return None
        surrogate = lone_surrogate(value, key)
        if surrogate:
            problems.invalid(location, "lone surrogate (not encodable as UTF-8)", surrogate)
            return None
        if not check_length(location, key, len(value), options, problems):
            return None
        texts[key] = value
    return Document(location, texts)


def _conversation_document(location: Location, fields: Mapping, options: ReadOptions,
                           problems: InputProblems) -> Document | None:
    """A chat record as a Document holding its conversation, or None after reporting why it is not one."""
    try:
        conversation = conversation_from_record(fields, options.keys, options.chat.loss_on, options.chat.train_key,
                                                options.chat.template_kwargs_keys)
    except ConversationError as error:
        problems.invalid(location, error.reason, error.detail)
        return None
    for index, message in enumerate(conversation.messages):
        surrogate = lone_surrogate(message.get("content") or "", f"message {index}")
        if surrogate:
            problems.invalid(location, "lone surrogate (not encodable as UTF-8)", surrogate)
            return None
    if not check_length(location, " ".join(options.keys), conversation.chars, options, problems):
        return None
    return Document(location, {}, conversation)


def lone_surrogate(text: str, key: str) -> str:
    """Where `text` holds a lone surrogate (JSON's "\\ud800" escapes decode to them: text
    no tokenizer can encode as UTF-8), as `U+D800 at character N of 'key'`, else ''."""
    if text.isascii():
        return ""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"U+{ord(text[error.start]):04X} at character {error.start + 1} of {key!r}"
    return ""


def read_json_lines(path: str, options: ReadOptions, problems: InputProblems) -> Iterator[Document]:
    """One record per line; blank lines are ignored."""
    with _open_binary(path, options) as stream:
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
    with _open_binary(path, options) as stream:
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


def read_text_file(path: str, options: ReadOptions, problems: InputProblems) -> Iterator[Document]:
    """The whole file as one document; invalid UTF-8 is invalid input, named by line."""
    location = Location(path, 1)
    if len(options.keys) != 1:
        raise InvalidInputError(f"{path}: a plain-text file has one field, but --json-keys names {len(options.keys)}")
    with _open_binary(path, options) as stream:
        data = stream.read()
    try:
        text = data.decode("utf-8")  # bytes as they are: CRLF and every space kept
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        problems.invalid(Location(path, line), "invalid UTF-8", f"byte {data[error.start]:#04x} ({error.reason})")
        return
    if not text or text.isspace():  # isspace: no copy of a large file, unlike strip
        problems.skipped(location, "empty document", "blank file")
        return
    if check_length(location, options.keys[0], len(text), options, problems):
        yield Document(location, {options.keys[0]: text})


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
    name = next((path[: -len(s)] for s in COMPRESSED_SUFFIXES if path.endswith(s)), path)
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
        if options.bytes_read is not None:
            options.bytes_read.finish(path)
