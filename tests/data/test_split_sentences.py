"""--split-sentences and --keep-newlines, with Megatron-LM's meaning: nltk Punkt sentences, one sequence
each, documents as document indices, PREFIX_{key}_sentence.{bin,idx}. The Punkt model is trained here on
the spot (nothing downloaded) and installed as nltk's punkt_tab data under NLTK_DATA."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_lc.errors import EXIT_CONFIG_ERROR
from megatron_lc.data.indexed_dataset import IndexedDataset
from megatron_lc.data.preprocess import PreprocessOptions, preprocess
from megatron_lc.data.preprocess_cli import main
from megatron_lc.data.sentences import sentence_splitter
from megatron_lc.data.tokenizers import ByteTokenizer

import nltk.tokenize.punkt as punkt  # installed by the test extra: these tests run, never skip

# Megatron-LM's CustomLanguageVars period context, as its tools/preprocess_data.py gives it: the reference.
MEGATRON_KEEP_NEWLINES = r"""
        \S*                          # some word material
        %(SentEndChars)s             # a potential sentence ending
        \s*                       #  <-- THIS is what I changed
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            (?P<next_tok>\S+)     #  <-- Normally you would have \s+ here
        ))"""

TRAINING_TEXT = " ".join(
    ["Dr. Smith went to Washington. He arrived on Jan. 5 at noon. The U.S. team won again.",
     "Mr. Brown said no. It rained all day. Prof. Lee agreed, e.g. on the main points."] * 40)

DOCUMENTS = [
    "Dr. Smith went to Washington. He arrived at noon.\n\nThe next day it rained. Nobody cared!",
    "One sentence only",
    "Is this a question? Yes. And this\nline goes on. Mr. Brown said so.\n",
    "Lists:\n- first item.\n- second item.\n\nEnd of the list. Done.",
]


@pytest.fixture
def nltk_data(tmp_path, monkeypatch):
    """A Punkt model trained on TRAINING_TEXT, installed as punkt_tab 'english' under NLTK_DATA."""
    from nltk.tabdata import TabEncoder

    trainer = punkt.PunktTrainer()
    trainer.train(TRAINING_TEXT, finalize=True)
    params = trainer.get_params()
    lang_dir = tmp_path / "nltk_data" / "tokenizers" / "punkt_tab" / "english"
    lang_dir.mkdir(parents=True)
    encoder = TabEncoder()
    (lang_dir / "collocations.tab").write_text(encoder.tups2tab(params.collocations))
    (lang_dir / "sent_starters.txt").write_text(encoder.set2txt(params.sent_starters))
    (lang_dir / "abbrev_types.txt").write_text(encoder.set2txt(params.abbrev_types))
    (lang_dir / "ortho_context.tab").write_text(encoder.ivdict2tab(params.ortho_context))
    monkeypatch.setenv("NLTK_DATA", str(tmp_path / "nltk_data"))
    sentence_splitter.cache_clear()
    yield params
    sentence_splitter.cache_clear()


def reference(params, text: str, keep_newlines: bool) -> list[str]:
    """nltk's own Punkt with these parameters (Megatron's language variables for keep_newlines)."""
    if keep_newlines:
        class MegatronVars(punkt.PunktLanguageVars):
            _period_context_fmt = MEGATRON_KEEP_NEWLINES

        return punkt.PunktSentenceTokenizer(train_text=params, lang_vars=MegatronVars()).tokenize(text)
    return punkt.PunktSentenceTokenizer(train_text=params).tokenize(text)


def run(write_jsonl, tmp_path, **overrides):
    path = write_jsonl("docs.jsonl", [{"text": t} for t in DOCUMENTS])
    settings = dict(tokenizer_type="ByteTokenizer", append_eod=True, show_progress=False, split_sentences=True)
    settings.update(overrides)
    prefix = str(tmp_path / "out" / "c")
    preprocess(PreprocessOptions(inputs=(str(path),), output_prefix=prefix, **settings))
    return IndexedDataset(f"{prefix}_text_sentence")


@pytest.mark.parametrize("keep_newlines", [False, True])
@pytest.mark.parametrize("workers", [1, 2])
def test_each_sentence_is_a_sequence_and_documents_are_document_indices(
        nltk_data, write_jsonl, tmp_path, keep_newlines, workers):
    dataset = run(write_jsonl, tmp_path, keep_newlines=keep_newlines, workers=workers)
    expected_sequences, ends = [], [0]
    for text in DOCUMENTS:
        sentences = [list(s.encode()) for s in reference(nltk_data, text, keep_newlines) if s]
        sentences[-1].append(ByteTokenizer.EOD_ID)
        expected_sequences += sentences
        ends.append(ends[-1] + len(sentences))
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected_sequences
    assert dataset.document_indices.tolist() == ends
    assert len(expected_sequences) > len(DOCUMENTS) + 3  # the documents were split
    text = "".join(bytes(t for t in dataset[i].tolist() if t < 256).decode() for i in range(len(dataset)))
    assert ("noon.\n\nThe" in text) == keep_newlines  # Punkt drops the whitespace after a sentence unless kept


def test_keep_newlines_keeps_every_character_but_the_edges(nltk_data):
    splitter = sentence_splitter("english", True)
    text = DOCUMENTS[0]
    assert "".join(splitter.tokenize(text)) == text


def test_texts_are_split_in_megatrons_million_character_pieces(nltk_data):
    from megatron_lc.data.sentences import SPLIT_PIECE_CHARS, split_sentences

    text = "a" * (SPLIT_PIECE_CHARS + 10)  # one "sentence" Megatron cuts at the piece boundary
    assert split_sentences(sentence_splitter("english", False), text) == ["a" * SPLIT_PIECE_CHARS, "a" * 10]


def test_a_missing_punkt_model_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, write_jsonl):
    monkeypatch.setenv("NLTK_DATA", str(tmp_path / "empty"))
    sentence_splitter.cache_clear()
    path = write_jsonl("a.jsonl", [{"text": "x"}])
    status = main(["--input", str(path), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                   "ByteTokenizer", "--split-sentences", "--lang", "klingon", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == EXIT_CONFIG_ERROR and len(err) == 1
    assert err[0].startswith("preprocess_data: error: --split-sentences --lang klingon: nltk's Punkt model for "
                             "'klingon' is not installed")
    sentence_splitter.cache_clear()


def test_sentence_level_partitions_give_the_same_bytes(nltk_data, write_jsonl, tmp_path):
    paths = [write_jsonl(f"{i}.jsonl", [{"text": t}]) for i, t in enumerate(DOCUMENTS)]
    prefix = str(tmp_path / "o")

    def go(**more):
        preprocess(PreprocessOptions(inputs=tuple(map(str, paths)), output_prefix=prefix,
                                     tokenizer_type="ByteTokenizer", append_eod=True, show_progress=False,
                                     split_sentences=True, **more))
        return open(f"{prefix}_text_sentence.bin", "rb").read(), open(f"{prefix}_text_sentence.idx", "rb").read()

    assert go() == go(partitions=2, workers=2)
    assert np.frombuffer(go()[0], dtype=np.uint16).size > 0
