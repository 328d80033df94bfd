"""Long documents encoded in pieces give the ids of the whole document.

The cut points (`text_pieces`) are checked against the whole-text regex scan of every pattern that cuts,
then each tokenizer that cuts is checked against its library's encoding of the whole text on the
adversarial corpus and on text aimed at the cut rule, with pieces of a few characters so that nearly
every space is a cut. Tokenizers that cannot be cut exactly are encoded whole and keep the
--max-document-chars guard.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import regex
from adversarial import (
    adversarial_texts,
    reference_huggingface,
    reference_tiktoken,
    train_sentencepiece_model,
    training_lines,
    write_tiktoken_ranks,
)

from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.encode import pack_documents
from megatron_lc.data.preprocess import PreprocessOptions, preprocess
from megatron_lc.data.preprocess_cli import main
from megatron_lc.data.tokenizers import (
    CUT_EXACT_PATTERNS,
    GPT2_EOD,
    LLAMA3_PATTERN,
    QWEN2_PATTERN,
    build_tokenizer,
    cut_offsets,
    text_pieces,
    why_not_cut_exact,
)

# Text aimed at the cut rule: spaces before digits, punctuation, contractions, other whitespace and
# combining marks; special-looking text; runs of spaces at both ends.
EDGE_TEXTS = [
    "x   1 y    2 z\t 3 w  ! v   . u  \n t \r\n s",
    "it 's we 'll THEY 'RE 'S don 't I 'm you 've he 'd",
    "a \u0301b c\u00a0 d e \u3000 f g \u2003h i \x1c j \x85 k",
    "<|endoftext|> x<|endoftext|> <s> </s> <|end_of_text|> <|begin_of_text|>y",
    "123 4567 89012 345678 9 00 1,234 5.6 7",
    "   start and end   ",
    "tail.  ",
]


def texts() -> list[str]:
    """The adversarial corpus (each text's first 20,000 characters: the kinds, not the volume, matter here)
    and the edge texts."""
    return [text[:20_000] for text in adversarial_texts(seed=0)] + [text * 20 for text in EDGE_TEXTS]


def concatenated(tokenize, text: str, piece_chars: int) -> list[int]:
    return [i for piece in text_pieces(text, piece_chars) for i in tokenize(piece)]


# --- the cut points ------------------------------------------------------------------------


def test_pieces_put_back_together_are_the_text_and_have_the_size_asked():
    for text in texts():
        pieces = list(text_pieces(text, 50))
        assert "".join(pieces) == text and all(pieces)
        assert all(len(piece) >= 50 for piece in pieces[:-1])
    assert list(text_pieces("a" * 500, 10)) == ["a" * 500]  # no space: never cut
    assert list(cut_offsets("ab cd ef", 1)) == [2, 5] and list(cut_offsets("ab cd", 5)) == []


@pytest.mark.parametrize("pattern", CUT_EXACT_PATTERNS, ids=["gpt2", "llama3", "qwen2"])
def test_every_cut_ends_a_match_of_the_whole_scan_and_each_piece_scans_as_the_whole(pattern):
    compiled = regex.compile(pattern)
    for text in texts():
        whole = iter(compiled.finditer(text))
        start = 0
        for offset in [*cut_offsets(text, 50), len(text)]:
            piece = [(start + a, start + b) for a, b in (m.span() for m in compiled.finditer(text[start:offset]))]
            assert [next(whole).span() for _ in piece] == piece and piece[-1][1] == offset
            start = offset
        assert next(whole, None) is None


def test_a_match_boundary_without_a_space_after_it_is_not_a_cut():
    """Why the rule asks for a space: Llama 3's pattern scans `x   1` as `x`, `  `, ` `, `1`, but `x   ` alone
    as `x`, `   `, so a cut after the third character of the whole scan changes the ids."""
    import tiktoken

    ranks = {bytes([b]): b for b in range(256)} | {b"  ": 256, b"   ": 257}
    encoding = tiktoken.Encoding("t", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens={})
    assert 4 in {m.end() for m in regex.finditer(LLAMA3_PATTERN, "x   1")}
    assert encoding.encode_ordinary("x   1") != encoding.encode_ordinary("x   ") + encoding.encode_ordinary("1")
    assert list(cut_offsets("x   1", 1)) == [1]


# --- each tokenizer that cuts ----------------------------------------------------------------


def _train_byte_level_bpe(path: str, pre_tokenizer, special_tokens=("<|endoftext|>", "<s>")) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_lines()[:1500] + EDGE_TEXTS * 30, trainer)
    tokenizer.save(path)
    return path


def _byte_level(add_prefix_space: bool = False):
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)


def _split_then_bytes(pattern: str):
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@pytest.fixture(scope="module")
def byte_level_json(tmp_path_factory) -> str:
    return _train_byte_level_bpe(str(tmp_path_factory.mktemp("bl") / "tokenizer.json"), _byte_level())


def _gpt2_files(json_path: str, directory) -> tuple[str, str]:
    """vocab.json and merges.txt of a byte-level BPE tokenizer.json."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(json_path).model.save(str(directory))


KINDS = ["tiktoken", "hf-bytelevel", "hf-bytelevel-prefix-space", "hf-llama3-split", "hf-qwen2-split", "gpt2"]


@pytest.fixture(scope="module", params=KINDS)
def cutting(request, tmp_path_factory, byte_level_json):
    """(our tokenizer, the whole-text reference encode) for one kind of tokenizer that cuts."""
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "tiktoken":
        model = write_tiktoken_ranks(str(directory / "tokenizer.model"))
        return build_tokenizer("TikTokenizer", model), reference_tiktoken(model).encode_ordinary
    if request.param == "gpt2":
        vocab, merges = _gpt2_files(byte_level_json, directory)
        ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
        return ours, ours.tokenize  # the whole-text call, itself checked against Megatron's elsewhere
    pre_tokenizer = {"hf-bytelevel": None, "hf-bytelevel-prefix-space": _byte_level(True),
                     "hf-llama3-split": _split_then_bytes(LLAMA3_PATTERN),
                     "hf-qwen2-split": _split_then_bytes(QWEN2_PATTERN)}[request.param]
    path = byte_level_json if pre_tokenizer is None else _train_byte_level_bpe(str(directory / "t.json"),
                                                                               pre_tokenizer)
    return build_tokenizer("HuggingFaceTokenizer", path), reference_huggingface(path)


def test_pieces_encode_to_the_ids_of_the_whole_text(cutting):
    tokenizer, reference = cutting
    assert tokenizer.cuts_long_documents
    for text in texts():
        whole = reference(text)
        for piece_chars in (2, 300):
            assert concatenated(tokenizer.tokenize, text, piece_chars) == whole, (piece_chars, text[:60])


def test_text_that_looks_like_special_tokens_is_encoded_as_the_whole_call_does(byte_level_json):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", byte_level_json)
    text = EDGE_TEXTS[3] * 5
    ids = concatenated(tokenizer.tokenize, text, 1)
    assert ids == reference_huggingface(byte_level_json)(text) and ids.count(tokenizer.eod) == 10


# --- what is not cut, and why ------------------------------------------------------------------


def _config(path: str) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


@pytest.mark.parametrize("change, reason", [
    (lambda c: c.update(normalizer={"type": "NFC"}), "it has a normalizer"),
    (lambda c: c.update(truncation={"max_length": 8, "strategy": "LongestFirst", "stride": 0,
                                    "direction": "Right"}), "it has a truncation"),
    (lambda c: c["model"].update(dropout=0.1), "its model is not a BPE without dropout"),
    (lambda c: c["added_tokens"][0].update(rstrip=True), "strips the whitespace after it"),
    (lambda c: c["added_tokens"][0].update(content="<end of text>"), "holds a space"),
    (lambda c: c["pre_tokenizer"].update(use_regex=False), "its pre-tokenizer is not"),
    (lambda c: c.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\w+|\s+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}),
     "its pre-tokenizer is not"),
])
def test_a_tokenizer_json_is_cut_only_when_the_proof_holds_for_it(byte_level_json, tmp_path, change, reason):
    config = _config(byte_level_json)
    assert why_not_cut_exact(config) == ""
    change(config)
    assert reason in why_not_cut_exact(config)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    assert not build_tokenizer("HuggingFaceTokenizer", str(path)).cuts_long_documents


def test_unigram_null_and_byte_tokenizers_are_not_cut(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    rust = Tokenizer(models.Unigram([("<unk>", 0.0), ("</s>", 0.0), ("a", -1.0), ("\u2581", -1.0)], 0))
    rust.pre_tokenizer = pre_tokenizers.Metaspace()
    rust.save(str(tmp_path / "tokenizer.json"))
    unigram = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tokenizer.json"))
    assert "not a BPE" in unigram.cut_refusal
    for tokenizer in (unigram, build_tokenizer("ByteTokenizer"), build_tokenizer("NullTokenizer", vocab_size=9)):
        assert not tokenizer.cuts_long_documents


def test_sentencepiece_pieces_would_change_the_ids(tmp_path):
    """SentencePiece marks whitespace itself and adds a dummy prefix: the same cuts change its ids."""
    model = train_sentencepiece_model(str(tmp_path / "spm"), "bpe")
    tokenizer = build_tokenizer("SentencePieceTokenizer", model)
    text = adversarial_texts(seed=0)[0][:5000]
    assert not tokenizer.cuts_long_documents
    assert concatenated(tokenizer.tokenize, text, 50) != tokenizer.tokenize(text)


# --- in preprocessing ------------------------------------------------------------------------


def _tiktoken(tmp_path) -> str:
    return write_tiktoken_ranks(str(tmp_path / "tokenizer.model"))


def _written(prefix: str) -> list[list[int]]:
    dataset = IndexedDataset(f"{prefix}_text_document")
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_writes_the_whole_documents_ids_for_documents_encoded_in_pieces(tmp_path, monkeypatch,
                                                                                    workers):
    monkeypatch.setattr("megatron_lc.data.encode.PIECE_CHARS", 40)
    monkeypatch.setattr("megatron_lc.data.encode.TASK_CHARS", 20_000)  # short and long in one task
    model = _tiktoken(tmp_path)
    documents = [text[:3000] for text in texts()] + ["short", "x y"]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents), encoding="utf-8")
    preprocess(PreprocessOptions((str(path),), str(tmp_path / "o"), "TikTokenizer", model, append_eod=True,
                                 prepend_bos=True, workers=workers, show_progress=False))
    tokenizer, reference = build_tokenizer("TikTokenizer", model), reference_tiktoken(model).encode_ordinary
    assert _written(str(tmp_path / "o")) == [[tokenizer.bos, *reference(t), tokenizer.eod] for t in documents]


def test_pack_documents_joins_lists_and_arrays_in_order():
    packed = pack_documents([[1, 2], np.array([3, 4, 5]), [], np.array([6])], [0], [9], "uint16")
    assert packed.tokens.tolist() == [0, 1, 2, 9, 0, 3, 4, 5, 9, 0, 9, 0, 6, 9]
    assert packed.lengths.tolist() == [4, 5, 2, 3] and packed.tokens.dtype == np.uint16


def test_max_document_chars_applies_only_to_tokenizers_that_encode_whole(tmp_path, capsys):
    long = " ".join(["words and more words"] * 10)
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": long}) + "\n")
    common = ["--input", str(tmp_path / "a.jsonl"), "--max-document-chars", "20", "--no-progress"]
    model = _tiktoken(tmp_path)
    assert main([*common, "--output-prefix", str(tmp_path / "t"), "--tokenizer-type", "TikTokenizer",
                 "--tokenizer-model", model]) == 0
    assert _written(str(tmp_path / "t"))[1] == reference_tiktoken(model).encode_ordinary(long)
    assert main([*common, "--output-prefix", str(tmp_path / "b"), "--tokenizer-type", "ByteTokenizer"]) == 1
    assert ":2: document over --max-document-chars" in capsys.readouterr().err


def test_a_gpt2_vocabulary_keeps_its_eod_when_documents_are_cut(byte_level_json, tmp_path, monkeypatch):
    monkeypatch.setattr("megatron_lc.data.encode.PIECE_CHARS", 30)
    vocab, merges = _gpt2_files(byte_level_json, tmp_path)
    text = EDGE_TEXTS[3] * 10
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    preprocess(PreprocessOptions((str(path),), str(tmp_path / "g"), "GPT2BPETokenizer", vocab_file=vocab,
                                 merge_file=merges, append_eod=True, show_progress=False))
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert _written(str(tmp_path / "g")) == [ours.tokenize(text) + [_config(vocab)[GPT2_EOD]]]

