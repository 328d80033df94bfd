"""Megatron's GPT2BPETokenizer (vocab.json + merges.txt) and NullTokenizer (space-separated ids), in
preprocessing and training. The GPT-2 files are trained here (nothing downloaded); the reference is GPT-2's
byte-level BPE written out below (Megatron's gpt2_tokenization algorithm), never this package's wrapper."""

from __future__ import annotations

import json
import os
import random
from functools import lru_cache

import numpy as np
import pytest
import regex
from adversarial import adversarial_texts

from megatron_lc.errors import EXIT_CONFIG_ERROR
from megatron_lc.errors import ConfigError
from megatron_lc.arguments import parse_config
from megatron_lc.training.preflight import preflight
from megatron_lc.data.corpus import InvalidInputError
from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.preprocess import PreprocessOptions, preprocess
from megatron_lc.data.preprocess_cli import main
from megatron_lc.data.tokenizers import GPT2BPETokenizer, NullTokenizer, build_tokenizer

from adversarial import adversarial_texts

GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

# Beyond the adversarial corpus: what GPT-2's own pattern and Megatron's plain-text handling decide.
EDGE_TEXTS = [
    "<|endoftext|> is text here, not EOD",
    "file\x1cgroup\x1drecord\x1eunit\x1f sep\x85next",  # `\s` in Python's regex: these are whitespace
    "don't we'll THEY'RE 'S it's",
    "tabs\tand\r\nCRLF  \n\n  trailing   ",
    " leading space",
    "",
]


def short_texts(seed: int) -> list[str]:
    """The adversarial corpus, each text cut to 3,000 characters: the reference below is pure Python,
    quadratic in a long word."""
    return [text[:3000] for text in adversarial_texts(seed=seed)]


def byte_symbols() -> dict[int, str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def reference_gpt2(vocab: dict[str, int], merges_path: str):
    """GPT-2's BPE as Megatron's gpt2_tokenization runs it: merges from `split('\\n')[1:-1]`, lowest rank
    first, unknown symbols id 0."""
    lines = open(merges_path, encoding="utf-8").read().split("\n")[1:-1]
    ranks = {tuple(line.split()): rank for rank, line in enumerate(lines)}
    symbols = byte_symbols()

    @lru_cache(maxsize=None)
    def bpe(word: str) -> tuple[str, ...]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, _ = min(pairs)
            if rank == float("inf"):
                break
            best = next(p for r, p in sorted(pairs) if r == rank)
            first, second = parts[best], parts[best + 1]
            merged, i = [], 0
            while i < len(parts):  # merge every occurrence of the pair, left to right
                if i < len(parts) - 1 and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return tuple(parts)

    def encode(text: str) -> list[int]:
        ids = []
        for word in GPT2_SPLIT.findall(text):
            ids += [vocab.get(piece, 0) for piece in bpe("".join(symbols[b] for b in word.encode("utf-8")))]
        return ids

    return encode


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """vocab.json and merges.txt of a small byte-level BPE trained on the adversarial corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(short_texts(seed=3) + EDGE_TEXTS * 20, trainer)
    directory = tmp_path_factory.mktemp("gpt2")
    vocab_path, merges_path = tokenizer.model.save(str(directory))
    return vocab_path, merges_path


def test_gpt2_ids_are_megatrons_on_adversarial_text(gpt2_files):
    vocab_path, merges_path = gpt2_files
    vocab = json.load(open(vocab_path))
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_path, merge_file=merges_path)
    reference = reference_gpt2(vocab, merges_path)
    texts = short_texts(seed=0) + EDGE_TEXTS
    for text in texts:
        assert ours.tokenize(text) == reference(text), text[:60]
    assert ours.eod == vocab["<|endoftext|>"] and ours.vocab_size == len(vocab)
    assert "<|endoftext|>" not in [ours.detokenize([i]) for i in ours.tokenize(EDGE_TEXTS[0])]
    assert ours.detokenize(ours.tokenize(texts[0])) == texts[0]


def test_gpt2_agrees_with_transformers_gpt2_tokenizer_from_the_same_files(gpt2_files):
    """transformers' GPT2Tokenizer reads the same files into the same BPE (it treats `<|endoftext|>` in text
    as the special token, and its regex engine's `\\s` lacks U+001C-U+001F: those texts are left out)."""
    from transformers import GPT2Tokenizer

    vocab_path, merges_path = gpt2_files
    theirs = GPT2Tokenizer.from_pretrained(os.path.dirname(vocab_path), local_files_only=True)
    ours = GPT2BPETokenizer(vocab_path, merges_path)
    for text in short_texts(seed=1) + EDGE_TEXTS[2:]:
        assert ours.tokenize(text) == theirs.encode(text, add_special_tokens=False), text[:60]


def test_gpt2_files_that_are_not_megatrons_are_refused_by_name(gpt2_files, tmp_path):
    vocab_path, merges_path = gpt2_files
    vocab = json.load(open(vocab_path))
    no_eod = tmp_path / "no_eod.json"
    no_eod.write_text(json.dumps({k: v for k, v in vocab.items() if k != "<|endoftext|>"}))
    with pytest.raises(ValueError, match=r"no_eod\.json: no <\|endoftext\|> entry"):
        GPT2BPETokenizer(str(no_eod), merges_path)
    no_byte = tmp_path / "no_byte.json"
    no_byte.write_text(json.dumps({k: v for k, v in vocab.items() if k != "A"}))
    with pytest.raises(ValueError, match=r"no_byte\.json: 1 of GPT-2's 256 byte symbols are missing \(first 'A'\)"):
        GPT2BPETokenizer(str(no_byte), merges_path)
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nĠ t\nthree symbols here\n")
    with pytest.raises(ValueError, match=r"merges\.txt:3: a merge is two symbols"):
        GPT2BPETokenizer(vocab_path, str(bad_merges))


def test_preprocess_with_gpt2_writes_megatrons_ids(gpt2_files, write_jsonl, tmp_path):
    vocab_path, merges_path = gpt2_files
    vocab = json.load(open(vocab_path))
    reference = reference_gpt2(vocab, merges_path)
    texts = short_texts(seed=2)[:6] + EDGE_TEXTS[:4]
    path = write_jsonl("a.jsonl", [{"text": t} for t in texts])
    assert main(["--input", str(path), "--output-prefix", str(tmp_path / "g"), "--tokenizer-type",
                 "GPT2BPETokenizer", "--vocab-file", vocab_path, "--merge-file", merges_path, "--append-eod",
                 "--no-progress", "--workers", "2"]) == 0
    dataset = IndexedDataset(tmp_path / "g_text_document")
    assert [dataset[i].tolist() for i in range(len(dataset))] == [reference(t) + [vocab["<|endoftext|>"]]
                                                                  for t in texts]
    assert dataset.dtype == np.uint16


@pytest.mark.parametrize("argv, message", [
    (["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", "m.txt"], "GPT2BPETokenizer needs --vocab-file"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "nope.json", "--merge-file", "m.txt"],
     "--vocab-file nope.json: not found (for GPT2BPETokenizer)"),
    (["--tokenizer-type", "NullTokenizer"], "NullTokenizer needs --vocab-size N (ids 0..N-1, EOD = N)"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "0"], "--vocab-size 0 must be >= 1 for NullTokenizer"),
])
def test_missing_tokenizer_flags_are_one_line_and_exit_2(argv, message, write_jsonl, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.txt").write_text("#version: 0.2\n")
    path = write_jsonl("a.jsonl", [{"text": "1 2"}])
    assert main(["--input", str(path), "--output-prefix", "o", "--no-progress", *argv]) == EXIT_CONFIG_ERROR
    assert capsys.readouterr().err.strip().splitlines() == [f"preprocess_data: error: {message}"]


# --- NullTokenizer -----------------------------------------------------------------------


def megatron_null_tokenizer_module():
    """megatron-core's null_tokenizer.py, loaded by path: importing megatron.core takes seconds."""
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "core", "tokenizers", "text", "libraries",
                        "null_tokenizer.py")
    module_spec = importlib.util.spec_from_file_location("megatron_null_tokenizer", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_null_tokenizer_is_megatrons():
    null_module = megatron_null_tokenizer_module()
    theirs, ours = null_module.NullTokenizer(5000), NullTokenizer(5000)
    rng = random.Random(0)
    for text in ["0", "4999 5000", " ".join(str(rng.randrange(5001)) for _ in range(300)), "7\n", "+3 0012 1_0"]:
        assert ours.tokenize(text) == theirs.text_to_ids(text)
    assert (ours.eod, ours.vocab_size) == (theirs.eod, theirs.vocab_size) == (5000, 5001)
    assert ours.detokenize([1, 2, 3]) == theirs.ids_to_text([1, 2, 3])


def test_preprocess_with_null_tokenizer_and_its_bad_input(write_jsonl, tmp_path):
    path = write_jsonl("a.jsonl", [{"text": "1 2 3"}, {"text": "99 0"}])
    options = dict(inputs=(str(path),), output_prefix=str(tmp_path / "n"), tokenizer_type="NullTokenizer",
                   vocab_size=100, append_eod=True, show_progress=False)
    preprocess(PreprocessOptions(**options))
    dataset = IndexedDataset(tmp_path / "n_text_document")
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2, 3, 100], [99, 0, 100]]
    bad = write_jsonl("b.jsonl", [{"text": "1 2"}, {"text": "3  4"}])
    with pytest.raises(InvalidInputError, match=r"b\.jsonl:2: NullTokenizer: word 2 \(''\) is not an integer"):
        preprocess(PreprocessOptions(**{**options, "inputs": (str(bad),)}))
    high = write_jsonl("c.jsonl", [{"text": "1 101"}])
    with pytest.raises(InvalidInputError, match=r"c\.jsonl:1: NullTokenizer: id 101 \(word 2\) is outside \[0, 100\]"):
        preprocess(PreprocessOptions(**{**options, "inputs": (str(high),), "workers": 2}))


# --- training ----------------------------------------------------------------------------


def test_training_config_takes_both_tokenizers(gpt2_files):
    null = parse_config(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"])
    assert null.tokenizer_spec().build().eod == 300
    assert null.model_config(vocab_size=null.tokenizer_spec().build().vocab_size).vocab_size == 301
    vocab_path, merges_path = gpt2_files
    gpt2 = parse_config(["--mock-data", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_path,
                         "--merge-file", merges_path])
    tokenizer = gpt2.tokenizer_spec().build()
    assert gpt2.model_config(vocab_size=tokenizer.vocab_size).vocab_size == tokenizer.vocab_size
    gpt2.validate(1)
    preflight(gpt2)
    with pytest.raises(ConfigError, match="--tokenizer-type GPT2BPETokenizer: GPT2BPETokenizer needs --merge-file"):
        preflight(parse_config(["--mock-data", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_path]))
