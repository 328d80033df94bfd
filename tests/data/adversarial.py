"""Text that breaks tokenizers that cut documents, and the libraries' own encoders as references.

Every reference here calls the tokenizer library directly on the whole text, never
through `megatron_lc.data.tokenizers`, so a wrapper bug cannot hide in both sides.
"""

from __future__ import annotations

import base64
import random
from collections import Counter

from megatron_lc.data.tokenizers import LLAMA3_PATTERN

_WORDS = "the long context of a book holds many tokens and every token counts in training model data".split()
_CJK = "数据训练模型上下文长度的每一个词都很重要日本語のテキストも含まれる한국어문장도있다"
_EMOJI = ["🙂", "👩‍👩‍👧‍👦", "👍🏽", "🏳️‍🌈", "🇫🇷", "e\u0301", "ﬁ", "\u200b", "\ufeff"]


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def _log_lines(rng: random.Random, count: int) -> str:
    """Commit logs and server logs: hex hashes, timestamps, URLs, paths."""
    lines = []
    for _ in range(count):
        sha = "".join(rng.choice("0123456789abcdef") for _ in range(rng.choice((7, 12, 40))))
        lines.append(
            f"{sha} 2024-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}T12:{rng.randint(10, 59)}:07Z "
            f"https://example.org/a/b?x={rng.randint(0, 10**6)}&y=%20z#frag "
            f"/usr/lib/python3.12/x.py:{rng.randint(1, 999)}"
        )
    return "\n".join(lines)


def _code(rng: random.Random) -> str:
    lines = [f"{' ' * 4 * rng.randint(1, 3)}x_{i} = f(x_{i - 1}, {rng.random():.6f})  # {_words(rng, 3)}"
             for i in range(1, 30)]
    body = "\n".join(lines)
    return f"def f(a, b):\n\treturn a*b\n\n\nclass C:\n    def g(self):\n{body}\n        return {{'k': [1, 2, 3]}}\n"


def _whitespace_runs(rng: random.Random) -> str:
    parts = []
    for _ in range(40):
        parts.append(rng.choice(_WORDS))
        runs = [" " * rng.randint(1, 90), "\t" * rng.randint(1, 9), " \t \n", "\n" * rng.randint(1, 6), "\r\n"]
        parts.append(rng.choice([*runs, "\u3000", "\xa0"]))
    return "".join(parts)


def adversarial_texts(seed: int = 0) -> list[str]:
    """Documents of every hard kind, each long enough that a cutting tokenizer would cut it."""
    rng = random.Random(seed)
    return [
        _words(rng, 12_000),  # one 70K-character line without a newline
        "".join(rng.choice(_CJK) for _ in range(30_000)),  # CJK without spaces
        _code(rng) * 40,
        _log_lines(rng, 600),
        "\r\n".join(_words(rng, rng.randint(1, 15)) for _ in range(800)) + "\r\n",  # CRLF
        _whitespace_runs(rng) * 30,
        "".join(rng.choice(_EMOJI) + rng.choice(_WORDS[:4]) * rng.randint(0, 2) for _ in range(5_000)),
        "".join(str(rng.randint(0, 10**12)) for _ in range(5_000)),  # digits without separators
        "<|end_of_text|></s><s><|begin_of_text|> text that looks like specials\n" * 50,
        "a" * 60_000 + " " * 20_000 + "!" * 20_000,  # one pre-token of 60K letters
        " leading space and trailing spaces   ",
        "x",
    ]


def training_lines(seed: int = 1) -> list[str]:
    """Lines of the same kinds to train small tokenizers on (another seed than the tests')."""
    lines: list[str] = []
    for text in adversarial_texts(seed):
        for line in text.splitlines():
            lines.extend(line[i : i + 2000] for i in range(0, len(line), 2000))
    return [line for line in lines if line.strip()]


def train_sentencepiece_model(prefix: str, model_type: str, vocab_size: int = 600) -> str:
    """A Llama-style SentencePiece model trained in-process on `training_lines`."""
    from megatron_lc.data.tokenizers import train_sentencepiece

    return train_sentencepiece(training_lines(), prefix, vocab_size=vocab_size, model_type=model_type)


def train_huggingface_unigram(path: str) -> str:
    """A Hugging Face Unigram tokenizer with a Metaspace pre-tokenizer, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", show_progress=False
    )
    tokenizer.train_from_iterator(training_lines(), trainer)
    tokenizer.save(path)
    return path


def write_tiktoken_ranks(path: str, merges: int = 400) -> str:
    """A tiktoken BPE file: the 256 bytes, then the most frequent 2-6 byte strings of the
    training lines, shorter first (every one reachable by merging shorter ones)."""
    counts: Counter[bytes] = Counter()
    for line in training_lines()[:400]:
        data = line.encode("utf-8")
        for width in range(2, 7):
            counts.update(data[i : i + width] for i in range(0, len(data) - width + 1))
    tokens = [bytes([b]) for b in range(256)]
    known = set(tokens)
    for token in sorted((t for t, _ in counts.most_common(merges * 4)), key=lambda t: (len(t), -counts[t], t)):
        if len(tokens) < 256 + merges and any(token[:i] in known and token[i:] in known for i in range(1, len(token))):
            tokens.append(token)
            known.add(token)
    with open(path, "w") as stream:
        stream.writelines(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))
    return path


def reference_sentencepiece(model_path: str):
    """`encode(text) -> ids`: SentencePiece's own encoding of the whole text."""
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=model_path)
    return processor.encode


def reference_huggingface(json_path: str):
    """`encode(text) -> ids`: the `tokenizers` library's encoding, no specials added."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(json_path)
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def reference_tiktoken(path: str):
    """A tiktoken Encoding of the BPE file with Llama 3's pattern (no specials: plain text)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(path)
    return tiktoken.Encoding("reference", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens={})
