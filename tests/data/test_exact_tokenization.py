"""Every document's ids are exactly the tokenizer library's encoding of the whole document.

The references call each library directly on the whole text (tests/data/adversarial.py);
the texts are the kinds that break tokenizers fed with pieces: long lines without
newlines, CJK without spaces, code, logs with hashes and URLs, CRLF, whitespace runs,
emoji sequences, one 60K-character pre-token.
"""

from __future__ import annotations

import json

import pytest

from megatron_lc.data.corpus import InvalidInputError
from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.preprocess import NoDocumentsError, PreprocessOptions, preprocess
from megatron_lc.data.tokenizers import build_tokenizer
from adversarial import (
    adversarial_texts,
    reference_huggingface,
    reference_sentencepiece,
    reference_tiktoken,
    train_huggingface_unigram,
    train_sentencepiece_model,
    write_tiktoken_ranks,
)

KINDS = ["sentencepiece-unigram", "sentencepiece-bpe", "huggingface-bytelevel-bpe", "huggingface-unigram", "tiktoken"]


@pytest.fixture(scope="module", params=KINDS)
def tokenizer_kind(request, tmp_path_factory):
    """(tokenizer type, model path, reference encode) for one kind of tokenizer."""
    directory = tmp_path_factory.mktemp(request.param)
    if request.param.startswith("sentencepiece"):
        model = train_sentencepiece_model(str(directory / "spm"), request.param.split("-")[1])
        return "SentencePieceTokenizer", model, reference_sentencepiece(model)
    if request.param == "huggingface-bytelevel-bpe":
        model = request.getfixturevalue("huggingface_tokenizer_json")
        return "HuggingFaceTokenizer", model, reference_huggingface(model)
    if request.param == "huggingface-unigram":
        model = train_huggingface_unigram(str(directory / "tokenizer.json"))
        return "HuggingFaceTokenizer", model, reference_huggingface(model)
    model = write_tiktoken_ranks(str(directory / "tokenizer.model"))
    return "TikTokenizer", model, reference_tiktoken(model).encode_ordinary


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return adversarial_texts(seed=0)


def run(inputs, prefix: str, tokenizer_type: str, model: str, **overrides):
    options = PreprocessOptions(
        inputs=tuple(map(str, inputs)),
        output_prefix=prefix,
        tokenizer_type=tokenizer_type,
        tokenizer_model=model,
        append_eod=True,
        show_progress=False,
        **overrides,
    )
    return preprocess(options)


def written(prefix: str) -> list[list[int]]:
    dataset = IndexedDataset(f"{prefix}_text_document")
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.mark.parametrize("workers", [1, 2])
def test_json_lines_give_the_tokenizers_own_ids_of_each_whole_document(
    tokenizer_kind, texts, tmp_path, workers, monkeypatch
):
    monkeypatch.setattr("megatron_lc.data.encode.TASK_CHARS", 50_000)  # several tasks, some of one document
    tokenizer_type, model, reference = tokenizer_kind
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    run([path], str(tmp_path / "out"), tokenizer_type, model, workers=workers)
    eod = build_tokenizer(tokenizer_type, model).eod
    assert written(str(tmp_path / "out")) == [reference(t) + [eod] for t in texts]


def test_plain_text_files_keep_crlf_and_give_the_tokenizers_own_ids(tokenizer_kind, texts, tmp_path):
    tokenizer_type, model, reference = tokenizer_kind
    for i, text in enumerate(texts):
        (tmp_path / f"{i:02d}.txt").write_bytes(text.encode("utf-8"))
    run([tmp_path / "*.txt"], str(tmp_path / "out" / "x"), tokenizer_type, model)
    eod = build_tokenizer(tokenizer_type, model).eod
    assert written(str(tmp_path / "out" / "x")) == [reference(t) + [eod] for t in texts]


def test_tokenize_batch_equals_the_reference_document_by_document(tokenizer_kind, texts):
    tokenizer_type, model, reference = tokenizer_kind
    tokenizer = build_tokenizer(tokenizer_type, model)
    assert tokenizer.tokenize_batch(texts) == [reference(t) for t in texts]
    assert [tokenizer.tokenize(t) for t in texts] == [reference(t) for t in texts]


# --- refused input ---------------------------------------------------------------------


def test_lone_surrogate_in_json_is_refused_with_file_line_and_character(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "ab\\ud800c"}\n')  # a JSON escape of half a pair
    with pytest.raises(InvalidInputError, match=r"a\.jsonl:2: lone surrogate .*U\+D800 at character 3 of 'text'"):
        run([path], str(tmp_path / "out"), "ByteTokenizer", None)
    summary = run([path], str(tmp_path / "out"), "ByteTokenizer", None, skip_invalid=True)
    assert summary.documents == 1 and summary.problems.total == 1


def test_surrogate_pair_escapes_are_one_character_and_accepted(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "smile \\ud83d\\ude42"}\n')
    run([path], str(tmp_path / "out"), "ByteTokenizer", None)
    assert written(str(tmp_path / "out")) == [list("smile 🙂".encode()) + [257]]


def test_invalid_utf8_in_json_lines_is_refused_with_file_and_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "bad \xff"}\n')
    with pytest.raises(InvalidInputError, match=r"a\.jsonl:2: invalid UTF-8"):
        run([path], str(tmp_path / "out"), "ByteTokenizer", None)


def _files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize(
    "content, keys",
    [
        ("", ("text",)),  # an empty file
        ('{"text": "  "}\n{"text": ""}\n', ("text",)),  # only blank documents
        ('{"text": "words"}\n', ("content",)),  # no text under the key asked for
    ],
)
@pytest.mark.parametrize("partitions", [1, 2])
def test_input_without_documents_is_refused_and_leaves_the_dataset_untouched(tmp_path, content, keys, partitions):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "kept", "content": "kept"}\n')
    out = tmp_path / "out"
    run([good], str(out / "x"), "ByteTokenizer", None, json_keys=keys)
    before = _files(out)
    empty = [tmp_path / "empty.jsonl", tmp_path / "empty2.jsonl"]
    for path in empty:
        path.write_text(content)
    with pytest.raises(NoDocumentsError, match=r"no document with text under --json-keys .*left as they were"):
        run(empty, str(out / "x"), "ByteTokenizer", None, json_keys=keys, partitions=partitions, skip_invalid=True)
    assert _files(out) == before  # same files, same bytes, no temporary files left
