"""Tokenizers built from tiny local models: ids, round trips, specials, vocabulary size."""

from __future__ import annotations

import json
import os

import pytest

from megatron_lc.data.tokenizers import ByteTokenizer, build_tokenizer, llama3_special_tokens
from adversarial import reference_tiktoken

SAMPLE = "the long context of a book: café naïve 数据 🙂 12345\nand every token counts"


def assert_common_interface(tokenizer) -> None:
    ids = tokenizer.tokenize(SAMPLE)
    assert ids and all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.detokenize(ids) == SAMPLE
    assert 0 <= tokenizer.eod < tokenizer.vocab_size and 0 <= tokenizer.bos < tokenizer.vocab_size
    assert tokenizer.eod not in ids and tokenizer.bos not in ids  # no specials added by tokenize
    assert tokenizer.tokenize("") == []


def test_sentencepiece_tokenizer_round_trips_and_uses_eos_as_eod(sentencepiece_model):
    tokenizer = build_tokenizer("SentencePieceTokenizer", sentencepiece_model)
    assert_common_interface(tokenizer)
    assert (tokenizer.bos, tokenizer.eod) == (1, 2)
    assert tokenizer.vocab_size <= 400


def test_sentencepiece_training_is_fixed_by_corpus_and_seed(tmp_path, corpus_texts):
    from megatron_lc.data.tokenizers import train_sentencepiece

    lines = [line for text in corpus_texts for line in text.splitlines()] * 3
    vocabularies = [
        open(train_sentencepiece(lines, tmp_path / name, 300, max_sentences=200).replace(".model", ".vocab")).read()
        for name in ("first", "second")
    ]
    assert vocabularies[0] == vocabularies[1]


def test_huggingface_tokenizer_reads_a_tokenizer_json_file(huggingface_tokenizer_json):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", huggingface_tokenizer_json)
    assert_common_interface(tokenizer)
    assert tokenizer.eod == 0  # "<|endoftext|>", found by name without a tokenizer_config.json
    assert tokenizer.bos == 1  # "<s>"


def test_huggingface_tokenizer_reads_a_directory_and_its_config(huggingface_tokenizer_json, tmp_path):
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(open(huggingface_tokenizer_json).read())
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>", "bos_token": {"content": "<s>"}}))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", directory)
    assert_common_interface(tokenizer)
    assert tokenizer.eod == tokenizer.bos == 1


def test_tiktokenizer_reads_a_bpe_file_and_places_llama3_specials_after_the_ranks(tiktoken_file, tiktoken_merges):
    tokenizer = build_tokenizer("TikTokenizer", tiktoken_file)
    assert_common_interface(tokenizer)
    base = 256 + len(tiktoken_merges)
    assert tokenizer.vocab_size == base + 256
    assert (tokenizer.bos, tokenizer.eod) == (base, base + 1)  # <|begin_of_text|>, <|end_of_text|>
    the = 256 + tiktoken_merges.index(b"the")
    assert tokenizer.tokenize("the") == [the]


def test_tiktokenizer_encodes_special_token_text_as_plain_text(tiktoken_file):
    tokenizer = build_tokenizer("TikTokenizer", tiktoken_file)
    ids = tokenizer.tokenize("<|end_of_text|>")
    assert tokenizer.eod not in ids and tokenizer.detokenize(ids) == "<|end_of_text|>"


def test_tiktokenizer_encodes_long_runs_whole_in_linear_time(tiktoken_file):
    import time

    tokenizer = build_tokenizer("TikTokenizer", tiktoken_file)
    encoding = reference_tiktoken(tiktoken_file)
    text = "x" * 300_000 + " " * 100_001 + "the end"
    start = time.perf_counter()
    ids = tokenizer.tokenize(text)
    assert time.perf_counter() - start < 5.0  # a quadratic merge would take minutes
    assert ids == encoding.encode_ordinary(text)


def test_llama3_special_tokens_match_the_published_layout():
    specials = llama3_special_tokens()
    assert len(specials) == 256
    assert specials[:2] == ["<|begin_of_text|>", "<|end_of_text|>"]
    assert specials[9] == "<|eot_id|>" and specials[-1] == "<|reserved_special_token_250|>"


def test_byte_tokenizer_needs_no_file():
    tokenizer = build_tokenizer("ByteTokenizer")
    assert isinstance(tokenizer, ByteTokenizer)
    assert_common_interface(tokenizer)
    assert tokenizer.vocab_size == 258 and tokenizer.tokenize("A") == [65]


def test_unknown_tokenizer_type_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown tokenizer type 'BertWordPieceCase'.*SentencePieceTokenizer"):
        build_tokenizer("BertWordPieceCase", "x")


def test_missing_tokenizer_model_names_the_path(tmp_path):
    missing = os.fspath(tmp_path / "nope.model")
    with pytest.raises(FileNotFoundError, match=f"tokenizer model not found: {missing}"):
        build_tokenizer("SentencePieceTokenizer", missing)
    with pytest.raises(ValueError, match="needs a tokenizer model path"):
        build_tokenizer("TikTokenizer")


def test_malformed_tiktoken_file_names_the_line(tmp_path):
    path = tmp_path / "bad.model"
    path.write_text("IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"bad\.model:2: not a 'base64 rank' line"):
        build_tokenizer("TikTokenizer", path)
