"""Texts to token arrays, in worker processes: documents grouped into tasks, each encoded whole (or in exact pieces
past `PIECE_CHARS`), with BOS/EOD, sentence splitting or a chat template as configured, in input order
(`preprocess.py` runs it)."""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np

from megatron_lc.data.chat import ChatEncoder, EncodedConversation
from megatron_lc.data.chat_records import ChatSettings, Conversation
from megatron_lc.data.corpus import Document, InvalidInputError
from megatron_lc.data.loss_mask import LOSS_MASK_DTYPE
from megatron_lc.data.sentences import sentence_splitter, split_all
from megatron_lc.data.tokenizers import TokenizeError, Tokenizer, TokenizerSpec, text_pieces

# Documents go to workers in groups of about this many characters: large enough to
# amortise inter-process transfer, small enough to keep every worker busy.
TASK_CHARS = 256_000

# A longer document is encoded in pieces of about this many characters by a tokenizer that cuts exactly:
# a piece costs the tokenizer at most ~19 MB at `preprocess_cli.TOKENIZER_BYTES_PER_CHAR`; a call per piece costs
# nothing measurable.
PIECE_CHARS = 100_000


@dataclass(frozen=True)
class EncodeConfig:
    """What a worker needs to turn texts into token arrays."""

    tokenizer: TokenizerSpec
    dtype: str
    append_eod: bool
    prepend_bos: bool
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    chat: ChatSettings | None = None


@dataclass
class Task:
    """Consecutive records (one text per key each, or one conversation) encoded by one worker call."""

    records: list[tuple[str, ...] | tuple[Conversation]] = field(default_factory=list)
    locations: list[str] = field(default_factory=list)
    chars: int = 0


@dataclass(frozen=True)
class EncodedKey:
    """One key's documents of a task: their sequences' tokens back to back, each sequence's length, and
    each document's number of sequences (None: one each)."""

    tokens: np.ndarray
    lengths: np.ndarray
    sequences_per_document: np.ndarray | None = None
    loss_mask: np.ndarray | None = None  # uint8, one per token (chat.py)
    rejected: tuple[tuple[str, str, str], ...] = ()  # (location, reason, detail) of records left out
    locations: tuple[str, ...] = ()  # each document's input record (`file:line`), where known

    @property
    def documents(self) -> int:
        return len(self.lengths) if self.sequences_per_document is None else len(self.sequences_per_document)


@functools.lru_cache(maxsize=4)
def cached_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """One tokenizer per worker process, built on its first task."""
    return spec.build()


@functools.lru_cache(maxsize=4)
def cached_chat_encoder(spec: TokenizerSpec, settings: ChatSettings) -> ChatEncoder:
    """One chat encoder per worker process, built on its first task."""
    return ChatEncoder(spec.model, settings)


def encode_task(config: EncodeConfig, records: Sequence[tuple[str, ...]],
                locations: Sequence[str] = ()) -> list[EncodedKey]:
    """Each key's documents, every text encoded whole, with BOS/EOD as configured; text the tokenizer
    refuses is an `InvalidInputError` naming its record. Conversations: see `encode_conversations`."""
    if config.chat is not None:
        return [encode_conversations(cached_chat_encoder(config.tokenizer, config.chat),
                                     [record[0] for record in records], locations, config.dtype)]
    try:
        encoded = _encode_records(config, records)
    except TokenizeError as error:
        raise InvalidInputError(_refused_record(config, records, locations, error)) from None
    return [dataclasses.replace(key, locations=tuple(locations)) for key in encoded]


def _refused_record(config: EncodeConfig, records: Sequence[tuple[str, ...]], locations: Sequence[str],
                    error: TokenizeError) -> str:
    """`file:line: why` for the first record whose text the tokenizer refuses."""
    tokenizer = cached_tokenizer(config.tokenizer)
    for location, record in zip(locations, records):
        for text in record:
            try:
                tokenizer.tokenize(text)
            except TokenizeError as first:
                return f"{location}: {first}"
    return str(error)


def _encode_records(config: EncodeConfig, records: Sequence[tuple[str, ...]]) -> list[EncodedKey]:
    tokenizer = cached_tokenizer(config.tokenizer)
    prefix = [tokenizer.bos] if config.prepend_bos else []
    suffix = [tokenizer.eod] if config.append_eod else []
    encoded = []
    for key_index in range(len(records[0])):
        texts = [record[key_index] for record in records]
        if config.split_sentences:
            encoded.append(encode_sentences(tokenizer, texts, config, prefix, suffix))
        else:
            encoded.append(pack_documents(encode_documents(tokenizer, texts, config.dtype), prefix, suffix,
                                          config.dtype))
    return encoded


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str], dtype: str) -> list[list[int] | np.ndarray]:
    """Each text's ids: in one batch call, except each text over `PIECE_CHARS` characters that the tokenizer
    cuts exactly, which is encoded piece by piece into an array."""
    cut = [tokenizer.cuts_long_documents and len(text) > PIECE_CHARS for text in texts]
    whole = [text for text, long in zip(texts, cut) if not long]
    encoded = iter(tokenizer.tokenize_batch(whole) if whole else [])
    return [encode_in_pieces(tokenizer, text, dtype) if long else next(encoded) for text, long in zip(texts, cut)]


def encode_in_pieces(tokenizer: Tokenizer, text: str, dtype: str) -> np.ndarray:
    """The ids of `text` as an array of `dtype`, encoded in pieces of about `PIECE_CHARS` characters (the
    tokenizer must cut exactly): memory is a piece's encoding plus the ids so far, 2 or 4 bytes each."""
    parts = [np.array(tokenizer.tokenize(piece), dtype=dtype) for piece in text_pieces(text, PIECE_CHARS)]
    return np.concatenate(parts)


def encode_sentences(tokenizer: Tokenizer, texts: Sequence[str], config: EncodeConfig, prefix: list[int],
                     suffix: list[int]) -> EncodedKey:
    """Megatron's sentence level: each sentence encoded on its own, one sequence each; sentences without
    ids dropped; BOS before the first kept sentence and EOD after the last (a document left without ids
    is a document of no sequence)."""
    splitter = sentence_splitter(config.lang, config.keep_newlines)
    sequences: list[list[int]] = []
    counts = np.zeros(len(texts), dtype=np.int64)
    for index, sentences in enumerate(split_all(splitter, texts)):
        kept = [ids for ids in tokenizer.tokenize_batch(sentences) if ids]
        if kept:
            kept[0] = prefix + kept[0]
            kept[-1] = kept[-1] + suffix
        sequences += kept
        counts[index] = len(kept)
    packed = pack_documents(sequences, [], [], config.dtype)
    return EncodedKey(packed.tokens, packed.lengths, counts)


def pack_documents(documents: Sequence[list[int] | np.ndarray], prefix: list[int], suffix: list[int],
                   dtype: str) -> EncodedKey:
    """The documents' ids back to back, each between `prefix` and `suffix`, as one array (lists in one
    conversion for the whole task: cheaper than one array per document; an array document joined as is)."""
    chunks: list[np.ndarray] = []
    flat: list[int] = []
    for ids in documents:
        flat += prefix
        if isinstance(ids, np.ndarray):
            chunks += [_as_array(flat, dtype), ids.astype(dtype, copy=False)]
            flat = []
        else:
            flat += ids
        flat += suffix
    chunks.append(_as_array(flat, dtype))
    extra = len(prefix) + len(suffix)
    lengths = np.fromiter((len(ids) + extra for ids in documents), dtype=np.int64, count=len(documents))
    return EncodedKey(chunks[0] if len(chunks) == 1 else np.concatenate(chunks), lengths)


def encode_conversations(encoder: ChatEncoder, conversations: Sequence[Conversation], locations: Sequence[str],
                         dtype: str) -> EncodedKey:
    """Each conversation's ids (exactly `apply_chat_template`'s) and loss mask, back to back (with
    `--chat-documents turn`, one document per trained turn); a conversation the template refuses, or whose
    trained turns cannot be located, is left out whole and listed in `rejected`."""
    if encoder.settings.documents == "turn":
        owners = [n for n, conversation in enumerate(conversations) for _ in conversation.trained]
        turns = [turn for conversation in conversations for turn in conversation.turns()]
        encoded = encoder.encode_conversations(turns, [locations[n] for n in owners])
        errors: dict[int, EncodedConversation] = {}
        for owner, turn in zip(owners, encoded):
            if turn.error is not None:
                errors.setdefault(owner, turn)
        kept = [turn for owner, turn in zip(owners, encoded) if owner not in errors]
        kept_locations = [locations[owner] for owner in owners if owner not in errors]
        rejected = [(locations[n], e.error.reason, e.error.detail) for n, e in sorted(errors.items())]
    else:
        encoded = encoder.encode_conversations(conversations, locations)
        kept = [conversation for conversation in encoded if conversation.error is None]
        rejected = [(location, c.error.reason, c.error.detail) for location, c in zip(locations, encoded) if c.error]
        kept_locations = [location for location, c in zip(locations, encoded) if c.error is None]
    documents = [conversation.ids for conversation in kept]
    masks = [conversation.mask for conversation in kept if conversation.mask is not None]
    packed = pack_documents(documents, [], [], dtype)
    loss_mask = (np.concatenate(masks) if masks else np.zeros(0, LOSS_MASK_DTYPE)) if encoder.settings.masked else None
    return EncodedKey(packed.tokens, packed.lengths, loss_mask=loss_mask, rejected=tuple(rejected),
                      locations=tuple(kept_locations))


def _as_array(ids: list[int], dtype: str) -> np.ndarray:
    return np.fromiter(ids, dtype=dtype, count=len(ids))


def group_documents(documents: Iterable[Document], keys: Sequence[str]) -> Iterator[Task]:
    """Consecutive documents in tasks of about `TASK_CHARS` characters (a longer document
    is a task of its own: it is never cut)."""
    task = Task()
    for document in documents:
        if document.conversation is not None:
            task.records.append((document.conversation,))
            task.chars += document.conversation.chars
        else:
            record = tuple(document.texts[key] for key in keys)
            task.records.append(record)
            task.chars += sum(len(text) for text in record)
        task.locations.append(str(document.location))
        if task.chars >= TASK_CHARS:
            yield task
            task = Task()
    if task.records:
        yield task


class TokenizerPool:
    """Encodes tasks in order, in `workers` processes (in this process for one: a single
    worker process would overlap only the reading and writing, which cost less than
    sending it the texts and taking back the ids)."""

    def __init__(self, config: EncodeConfig, workers: int) -> None:
        self.config = config
        self.workers = workers
        self._pool = multiprocessing.get_context().Pool(workers) if workers > 1 else None

    def __enter__(self) -> "TokenizerPool":
        return self

    def __exit__(self, *exc_info) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()

    def map_ordered(self, tasks: Iterable[Task]) -> Iterator[list[EncodedKey]]:
        """Each task's encoding, in task order, a bounded number in flight."""
        if self._pool is None:
            for task in tasks:
                yield encode_task(self.config, task.records, task.locations)
            return
        in_flight: deque = deque()
        for task in tasks:
            in_flight.append(self._pool.apply_async(encode_task, (self.config, task.records, task.locations)))
            if len(in_flight) >= 2 * self.workers + 2:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()
