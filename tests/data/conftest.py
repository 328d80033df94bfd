"""Tiny corpora and tokenizers made on the spot: nothing is downloaded."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import numpy as np
import pytest

from megatron_lc.data.indexed_dataset import IndexedDataset, write_dataset

WORDS = "the long context of a book holds many tokens and every token counts in training".split()


def make_text(rng: random.Random, lines: int) -> str:
    """A few lines of words, digits and some non-ASCII characters."""
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words.append(rng.choice(["café", "naïve", "Straße", "数据", "🙂", str(rng.randint(0, 99999))]))
        out.append(" ".join(words))
    return "\n".join(out) + "\n"


@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    rng = random.Random(1234)
    return [make_text(rng, rng.randint(1, 20)) for _ in range(40)]


@pytest.fixture
def write_jsonl(tmp_path):
    """Write records (dicts, or raw str/bytes lines) as a JSON-lines file."""

    def write(name: str, records: list) -> Path:
        path = tmp_path / name
        with open(path, "wb") as stream:
            for record in records:
                if isinstance(record, dict):
                    record = json.dumps(record)
                stream.write(record if isinstance(record, bytes) else record.encode("utf-8"))
                stream.write(b"\n")
        return path

    return write


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory, corpus_texts) -> str:
    from megatron_lc.data.tokenizers import train_sentencepiece

    lines = [line for text in corpus_texts for line in text.splitlines()] * 5
    return train_sentencepiece(lines, tmp_path_factory.mktemp("spm") / "tiny", vocab_size=400)


@pytest.fixture(scope="session")
def huggingface_tokenizer_json(tmp_path_factory, corpus_texts) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts, trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


TIKTOKEN_MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ng", b"ing", b"to", b"ken", b"tok"]


@pytest.fixture(scope="session")
def tiktoken_merges() -> list[bytes]:
    """The merged tokens of `tiktoken_file`, ranks 256 onwards."""
    return TIKTOKEN_MERGES


@pytest.fixture(scope="session")
def tiktoken_file(tmp_path_factory) -> str:
    """A tiktoken BPE file: the 256 bytes, then a few merges (as Llama 3's, only smaller)."""
    tokens = [bytes([b]) for b in range(256)] + TIKTOKEN_MERGES
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return str(path)


def _random_documents(seed: int, count: int, max_length: int, vocab: int = 1000) -> list[np.ndarray]:
    """Documents of random lengths (some empty) and random tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_length, size=count)
    lengths[::7] = 0
    return [rng.integers(0, vocab, size=n).astype(np.int64) for n in lengths]


@pytest.fixture
def random_documents():
    """`random_documents(seed, count, max_length, vocab=1000)`: a list of token arrays."""
    return _random_documents


@pytest.fixture
def make_dataset(tmp_path):
    """Write documents as an indexed dataset and open it."""

    def make(documents, dtype=np.uint16, name="data") -> IndexedDataset:
        prefix = tmp_path / name
        write_dataset(prefix, documents, dtype=dtype)
        return IndexedDataset(prefix)

    return make


class CountingDataset:
    """Wraps a dataset and counts the tokens read from its .bin."""

    def __init__(self, dataset) -> None:
        self._dataset = dataset
        self.tokens_read = 0

    def __getattr__(self, name):
        return getattr(self._dataset, name)

    def read_span(self, token_offset: int, count: int) -> np.ndarray:
        self.tokens_read += count
        return self._dataset.read_span(token_offset, count)


@pytest.fixture
def counting_reads():
    """`counting_reads(dataset)`: the dataset, counting the tokens read from its .bin."""
    return CountingDataset


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory, corpus_texts) -> str:
    """A Llama-3-like tokenizer directory with Llama 3 Instruct's chat template (megatron_lc.testing)."""
    from megatron_lc.testing import write_chat_tokenizer

    return write_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"), corpus_texts)


@pytest.fixture(scope="session")
def chat_hf_tokenizer(chat_tokenizer_dir):
    """`chat_tokenizer_dir` as transformers loads it: the tokenizer whose `apply_chat_template` is the reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_tokenizer_dir, local_files_only=True)


@pytest.fixture(scope="session")
def megatron_indexed_dataset():
    """megatron-core's indexed_dataset module (skips where megatron-core is not installed)."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    except ImportError as error:
        pytest.skip(f"megatron-core is not importable ({error}); install it to check compatibility")
    return indexed_dataset
