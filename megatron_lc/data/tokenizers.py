"""Tokenizers behind one small interface, built from local files only.

`build_tokenizer(tokenizer_type, tokenizer_model)` returns an object with
`tokenize(text) -> list[int]` (no special tokens added), `detokenize(ids) -> str`,
`vocab_size`, `eod` (the end-of-document id appended between documents), `bos`, and
`cuts_long_documents`: whether a long text cut by `text_pieces` encodes piece by piece to the ids
of the whole text (tiktoken, GPT2BPETokenizer, a byte-level BPE `tokenizer.json` of a known
pattern; see `_CUT` for why it is exact).

Types (Megatron's names): `SentencePieceTokenizer` (a `.model` file),
`HuggingFaceTokenizer` (a `tokenizer.json` or a directory holding one, or any local
directory `transformers.AutoTokenizer` loads), `TikTokenizer` (a tiktoken BPE file such
as Llama 3's `tokenizer.model`), `GPT2BPETokenizer` (`vocab_file` vocab.json and `merge_file`
merges.txt, as Megatron's), `NullTokenizer` (`vocab_size` N: the text is space-separated ids,
EOD = N, as Megatron's) and `ByteTokenizer` (no file: UTF-8 bytes plus BOS/EOD).
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence


class Tokenizer(ABC):
    """The interface preprocessing and training rely on."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOD."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens are dropped where the library allows)."""

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`[tokenize(t) for t in texts]`, in one library call where the library has one."""
        return [self.tokenize(text) for text in texts]

    @property
    def cuts_long_documents(self) -> bool:
        """Whether a text cut by `text_pieces` encodes, piece by piece, to the ids of the whole text."""
        return False

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special tokens included: every id is in `[0, vocab_size)`."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id."""

    @property
    @abstractmethod
    def bos(self) -> int:
        """Beginning-of-sequence id."""


# Where a long text is cut: between a printable ASCII character and a space. For the regex pre-tokenizers
# that cut (GPT-2's, Llama 3's, Qwen2's: `CUT_EXACT_PATTERNS`) this is exact, in any regex engine:
# - no alternative matches a non-space followed by a space (a space is only ever a match's optional first
#   character, or inside a run of whitespace alone), so every scan of the whole text ends a match there;
# - the piece before the cut scans as the whole text did up to it: only a path reading past the cut could
#   differ, and consuming there fails in both texts (in the whole one it would make a match over the cut),
#   while `(?!\S)` at the cut sees a space in the whole text and the end in the piece: true in both;
# - the piece after it scans as the whole text did from it: the patterns have no look-behind or anchor.
# A regex match boundary that is not followed by a space is not enough: in `x   1` Llama 3's pattern
# matches `x`, `  `, ` `, `1`, but `x   ` alone scans as `x`, `   `.
_CUT = re.compile(r"[!-~] ")


def cut_offsets(text: str, piece_chars: int) -> Iterator[int]:
    """Offsets where `text` is cut: the first `_CUT` point at least `piece_chars` characters after the
    previous cut, as long as more than `piece_chars` characters are left (none in a text without one)."""
    start = 0
    while len(text) - start > piece_chars:
        match = _CUT.search(text, start + max(1, piece_chars) - 1)
        if match is None:
            return
        start = match.start() + 1
        yield start


def text_pieces(text: str, piece_chars: int) -> Iterator[str]:
    """`text` cut at `cut_offsets`: the pieces, in order, put back together, are `text`."""
    start = 0
    for offset in cut_offsets(text, piece_chars):
        yield text[start:offset]
        start = offset
    yield text[start:]


def _missing_special(kind: str, source: str) -> ValueError:
    return ValueError(f"{source}: the tokenizer defines no {kind} token")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then BOS (256) and EOD (257): needs no file."""

    BOS_ID = 256
    EOD_ID = 257

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eod(self) -> int:
        return self.EOD_ID

    @property
    def bos(self) -> int:
        return self.BOS_ID


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model`; EOD is its end-of-sentence piece (`</s>`)."""

    def __init__(self, model_path: str | os.PathLike) -> None:
        import sentencepiece

        self.model_path = os.fspath(model_path)
        self._processor = sentencepiece.SentencePieceProcessor(model_file=self.model_path)

    def tokenize(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # one thread: parallelism is --workers' processes, not hidden library threads
        return self._processor.encode(list(texts), num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._processor.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def eod(self) -> int:
        return self._special(self._processor.eos_id(), "end-of-sentence (EOD)")

    @property
    def bos(self) -> int:
        return self._special(self._processor.bos_id(), "beginning-of-sentence (BOS)")

    def _special(self, token_id: int, kind: str) -> int:
        if token_id < 0:  # SentencePiece reports a disabled piece as -1
            raise _missing_special(kind, self.model_path)
        return token_id


# Names under which end-of-document and beginning-of-sequence tokens commonly appear,
# used when a bare tokenizer.json comes without a tokenizer_config.json.
_EOD_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|bos|>")


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer read from a local `tokenizer.json` (or its directory)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.path = os.fspath(path)
        json_path = Path(self.path) / "tokenizer.json" if os.path.isdir(self.path) else Path(self.path)
        self._tokenizer = RustTokenizer.from_file(str(json_path))
        config = _read_tokenizer_config(json_path.parent / "tokenizer_config.json")
        self._eod = self._resolve(config.get("eos_token"), _EOD_NAMES)
        self._bos = self._resolve(config.get("bos_token"), _BOS_NAMES)
        self.cut_refusal = why_not_cut_exact(json.loads(self._tokenizer.to_str()))

    def _resolve(self, configured: object, fallback_names: tuple[str, ...]) -> int | None:
        """The configured token's id, else the first well-known name the vocabulary has."""
        if isinstance(configured, dict):
            configured = configured.get("content")
        names = (configured,) if isinstance(configured, str) else fallback_names
        for name in names:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def cuts_long_documents(self) -> bool:
        return not self.cut_refusal

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise _missing_special("end-of-document (eos_token)", self.path)
        return self._eod

    @property
    def bos(self) -> int:
        if self._bos is None:
            raise _missing_special("beginning-of-sequence (bos_token)", self.path)
        return self._bos


def why_not_cut_exact(config: dict) -> str:
    """Why a `tokenizer.json` (as a dict) may not be cut at `_CUT` points; empty when it may: no normalizer,
    truncation or padding, a byte-level BPE without dropout whose pre-tokenizer is one of
    `CUT_EXACT_PATTERNS` (ByteLevel's own regex, or an isolating Split before a regex-free ByteLevel), and
    no added token that holds a space or takes the whitespace after it (`rstrip`): then added tokens are
    found in a piece as in the whole text, and every pre-token is one of the whole text's."""
    for key in ("normalizer", "truncation", "padding"):
        if config.get(key) is not None:
            return f"it has a {key}"
    model = config.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return "its model is not a BPE without dropout"
    for token in config.get("added_tokens") or []:
        if " " in token.get("content", " ") or token.get("rstrip"):
            return f"its added token {token.get('content')!r} holds a space or strips the whitespace after it"
    if not _cut_exact_pre_tokenizer(config.get("pre_tokenizer") or {}):
        return "its pre-tokenizer is not a byte-level split by GPT-2's, Llama 3's or Qwen2's pattern"
    return ""


def _cut_exact_pre_tokenizer(pre_tokenizer: dict) -> bool:
    if pre_tokenizer.get("type") == "ByteLevel":
        return pre_tokenizer.get("use_regex", True) is True  # GPT-2's pattern
    steps = pre_tokenizer.get("pretokenizers") or []
    if pre_tokenizer.get("type") != "Sequence" or len(steps) != 2:
        return False
    split, byte_level = steps
    return (split.get("type") == "Split" and split.get("pattern") in [{"Regex": p} for p in CUT_EXACT_PATTERNS]
            and split.get("behavior") == "Isolated" and split.get("invert") is False
            and byte_level.get("type") == "ByteLevel" and byte_level.get("use_regex") is False
            and byte_level.get("add_prefix_space") is False)


def _read_tokenizer_config(path: Path) -> dict:
    """`tokenizer_config.json` next to the tokenizer, or an empty config."""
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as stream:
        return json.load(stream)


class TransformersTokenizer(Tokenizer):
    """Any local directory `transformers.AutoTokenizer` loads (e.g. only a slow tokenizer)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from transformers import AutoTokenizer

        self.path = os.fspath(path)
        self._tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def eod(self) -> int:
        if self._tokenizer.eos_token_id is None:
            raise _missing_special("end-of-document (eos_token)", self.path)
        return self._tokenizer.eos_token_id

    @property
    def bos(self) -> int:
        if self._tokenizer.bos_token_id is None:
            raise _missing_special("beginning-of-sequence (bos_token)", self.path)
        return self._tokenizer.bos_token_id


# Llama 3's pre-tokenization pattern and special tokens, which follow the BPE ranks.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL_TOKENS = 256


def llama3_special_tokens() -> list[str]:
    """Llama 3's 256 special tokens, in id order after the BPE ranks."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(5, LLAMA3_NUM_SPECIAL_TOKENS - 5)]
    return named + reserved


def load_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """A tiktoken BPE file: one `base64(token) rank` pair per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as stream:
        for line_number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as error:
                raise ValueError(f"{os.fspath(path)}:{line_number}: not a 'base64 rank' line ({error})") from None
    return ranks


class TikTokenizer(Tokenizer):
    """A tiktoken BPE file (Llama 3's `tokenizer.model`) with Llama 3's pattern and specials."""

    def __init__(self, path: str | os.PathLike) -> None:
        import tiktoken

        self.path = os.fspath(path)
        ranks = load_tiktoken_ranks(self.path)
        specials = {name: len(ranks) + i for i, name in enumerate(llama3_special_tokens())}
        self._encoding = tiktoken.Encoding(
            name=Path(self.path).name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
        )
        self._num_ranks = len(ranks)

    def tokenize(self, text: str) -> list[int]:
        # plain text (Megatron's encode_ordinary): text that looks like a special token is not one
        return self._encoding.encode_ordinary(text)

    @property
    def cuts_long_documents(self) -> bool:
        return True  # Llama 3's pattern, one of CUT_EXACT_PATTERNS; no special token is looked for

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids if int(i) < self._num_ranks])

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    @property
    def eod(self) -> int:
        return self._encoding.encode_single_token("<|end_of_text|>")

    @property
    def bos(self) -> int:
        return self._encoding.encode_single_token("<|begin_of_text|>")


class TokenizeError(ValueError):
    """Text the tokenizer cannot encode (e.g. a word that is not an integer for NullTokenizer)."""


class NullTokenizer(Tokenizer):
    """Megatron's NullTokenizer: the text is space-separated integer ids (`text.split(' ')`, each `int()`);
    `--vocab-size N` gives ids 0..N-1, EOD = N and a vocabulary of N + 1, as Megatron's."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"--vocab-size {vocab_size} must be >= 1 for NullTokenizer")
        self._size = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        words = text.split(" ")
        try:
            ids = [int(word) for word in words]
        except ValueError:
            index, word = next((i, w) for i, w in enumerate(words) if not _is_int(w))
            raise TokenizeError(f"NullTokenizer: word {index + 1} ({word[:40]!r}) is not an integer "
                                "(the text must be ids separated by single spaces)") from None
        if ids and (min(ids) < 0 or max(ids) > self._size):
            index, bad = next((i, v) for i, v in enumerate(ids) if not 0 <= v <= self._size)
            raise TokenizeError(f"NullTokenizer: id {bad} (word {index + 1}) is outside [0, {self._size}] "
                                f"(--vocab-size {self._size}, EOD = {self._size})")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab_size(self) -> int:
        return self._size + 1

    @property
    def eod(self) -> int:
        return self._size

    @property
    def bos(self) -> int:
        raise _missing_special("beginning-of-sequence", "NullTokenizer")


def _is_int(word: str) -> bool:
    try:
        int(word)
    except ValueError:
        return False
    return True


# GPT-2's pre-tokenization pattern (Megatron's gpt2_tokenization, OpenAI's encoder), with the `regex` module.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOD = "<|endoftext|>"
# Qwen2's: Llama 3's with one digit per pre-token.
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
# The pre-tokenization patterns for which a cut at `_CUT` points is proved exact (see `_CUT`).
CUT_EXACT_PATTERNS = (GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN)


def read_gpt2_merges(path: str) -> list[tuple[str, str]]:
    """A GPT-2 `merges.txt` read as Megatron (and transformers' GPT2Tokenizer) read it: the lines of
    `text.split('\\n')[1:-1]` (the first, a version line, and the last, after the final newline, are
    dropped), each two symbols in priority order; an empty line is no merge."""
    with open(path, encoding="utf-8") as stream:
        lines = stream.read().split("\n")[1:-1]
    merges = []
    for number, line in enumerate(lines, start=2):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: a merge is two symbols, this line has {len(parts)} (--merge-file)")
        merges.append((parts[0], parts[1]))
    return merges


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


class GPT2BPETokenizer(Tokenizer):
    """Megatron's GPT2BPETokenizer from `--vocab-file vocab.json --merge-file merges.txt`: GPT-2's byte-level
    BPE, EOD = `<|endoftext|>`, vocabulary size = the entries of vocab.json. Words are cut by GPT-2's
    pattern with the `regex` module (as Megatron's, whose `\\s` differs from other engines' on a few
    control characters), then each word is merged by the `tokenizers` BPE model built from the same
    vocabulary and merges (the same lowest-rank-first merges). Text that looks like `<|endoftext|>` is
    encoded as text, as Megatron's does."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        import regex
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        self.vocab_file, self.merge_file = vocab_file, merge_file
        vocab = self._read_vocab(vocab_file)
        merges = read_gpt2_merges(merge_file)
        try:
            model = models.BPE(vocab, merges)
        except Exception as error:  # the library's own error type
            raise ValueError(f"--vocab-file {vocab_file} --merge-file {merge_file}: {error}") from None
        self._tokenizer = RustTokenizer(model)
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        self._pattern = regex.compile(GPT2_PATTERN)
        self._size = len(vocab)
        self._eod = vocab[GPT2_EOD]

    @staticmethod
    def _read_vocab(path: str) -> dict[str, int]:
        try:
            with open(path, encoding="utf-8") as stream:
                vocab = json.load(stream)
        except ValueError as error:
            raise ValueError(f"--vocab-file {path}: not a JSON vocabulary ({error})") from None
        if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
            raise ValueError(f"--vocab-file {path}: expected a JSON object of token -> id")
        if GPT2_EOD not in vocab:
            raise ValueError(f"--vocab-file {path}: no {GPT2_EOD} entry (Megatron's GPT-2 EOD)")
        missing = [char for char in _bytes_to_unicode().values() if char not in vocab]
        if missing:  # Megatron would give such bytes id 0; refuse rather than differ
            raise ValueError(f"--vocab-file {path}: {len(missing)} of GPT-2's 256 byte symbols are missing "
                             f"(first {missing[0]!r}): not a byte-level BPE vocabulary")
        return vocab

    def tokenize(self, text: str) -> list[int]:
        words = self._pattern.findall(text)
        if not words:
            return []
        return self._tokenizer.encode(words, is_pretokenized=True, add_special_tokens=False).ids

    @property
    def cuts_long_documents(self) -> bool:
        return True  # GPT-2's pattern, one of CUT_EXACT_PATTERNS; each word is merged on its own

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        raise _missing_special("beginning-of-sequence", f"--vocab-file {self.vocab_file} (Megatron's GPT-2 has none)")


def _build_huggingface(path: str) -> Tokenizer:
    """A fast tokenizer when a tokenizer.json is there, else whatever transformers loads."""
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HuggingFaceTokenizer(path)
    return TransformersTokenizer(path)


# Builders from a model path, by Megatron's type names (and their SentencePiece aliases).
_BUILDERS_FROM_FILE = {
    "SentencePieceTokenizer": SentencePieceTokenizer,
    "GPTSentencePieceTokenizer": SentencePieceTokenizer,
    "Llama2Tokenizer": SentencePieceTokenizer,
    "HuggingFaceTokenizer": _build_huggingface,
    "TikTokenizer": TikTokenizer,
}
TOKENIZER_TYPES = (*_BUILDERS_FROM_FILE, "GPT2BPETokenizer", "NullTokenizer", "ByteTokenizer")


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as its flags give it (hashable: one cached tokenizer per spec)."""

    type: str
    model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None

    def build(self) -> Tokenizer:
        return build_tokenizer(self.type, self.model, vocab_file=self.vocab_file, merge_file=self.merge_file,
                               vocab_size=self.vocab_size)

    def files(self) -> dict[str, str]:
        """The files it is read from, by flag."""
        named = {"--tokenizer-model": self.model, "--vocab-file": self.vocab_file, "--merge-file": self.merge_file}
        return {flag: path for flag, path in named.items() if path}


def _existing(path: str | os.PathLike | None, flag: str, tokenizer_type: str) -> str:
    if path is None:
        raise ValueError(f"{tokenizer_type} needs {flag}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} {path}: not found (for {tokenizer_type})")
    return path


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | os.PathLike | None = None, *,
                    vocab_file: str | None = None, merge_file: str | None = None,
                    vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer of Megatron type name `tokenizer_type`, loaded from `tokenizer_model` (GPT2BPETokenizer:
    `vocab_file` and `merge_file`; NullTokenizer: `vocab_size`)."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; expected one of {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs --vocab-size N (ids 0..N-1, EOD = N)")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_existing(vocab_file, "--vocab-file", tokenizer_type),
                                _existing(merge_file, "--merge-file", tokenizer_type))
    if tokenizer_model is None:
        raise ValueError(f"{tokenizer_type} needs a tokenizer model path (--tokenizer-model)")
    path = os.fspath(tokenizer_model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer model not found: {path} (for {tokenizer_type})")
    return _BUILDERS_FROM_FILE[tokenizer_type](path)


# SentencePiece's trainer drops longer sentences (UTF-8 bytes) without a word: callers cut them first.
SENTENCEPIECE_MAX_SENTENCE_BYTES = 1 << 16


def reservoir_sample(items: Iterable[str], size: int, seed: int) -> list[str]:
    """A uniform sample of `size` items from a stream of unknown length, fixed by `seed`."""
    rng = random.Random(seed)
    sample: list[str] = []
    for seen, item in enumerate(items):
        if seen < size:
            sample.append(item)
        else:
            slot = rng.randrange(seen + 1)
            if slot < size:
                sample[slot] = item
    return sample


def train_sentencepiece(
    sentences: Iterable[str],
    output_prefix: str | os.PathLike,
    vocab_size: int,
    model_type: str = "bpe",
    max_sentences: int = 1_000_000,
    seed: int = 0,
) -> str:
    """Train a Llama-style SentencePiece model and return the path of its `.model` file.

    As Llama 2's: no normalisation and whitespace kept as is (newlines and indentation
    matter in books and code), byte fallback for unseen characters, digits split,
    `<unk>`=0, `<s>`=1, `</s>`=2. At most `max_sentences` sentences, sampled with `seed`,
    are used: the same corpus and seed give the same model."""
    import sentencepiece

    prefix = os.fspath(output_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    sample = reservoir_sample(sentences, max_sentences, seed)  # SentencePiece's own sampling is unseeded
    if not sample:  # else SentencePiece's own internal error
        raise ValueError("no training line: the inputs hold no non-blank text under the keys")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sample),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        byte_fallback=True,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        max_sentence_length=SENTENCEPIECE_MAX_SENTENCE_BYTES,
        hard_vocab_limit=False,  # a small corpus may not support the full vocabulary
        minloglevel=2,
    )
    return prefix + ".model"
