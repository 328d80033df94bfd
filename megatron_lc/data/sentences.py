"""Sentence splitting for `preprocess_data.py --split-sentences`, with Megatron-LM's meaning.

Megatron-LM splits each text with nltk's Punkt sentence tokenizer for `--lang` (default
`english`), in pieces of 1,000,000 characters (each piece split on its own), and writes
each sentence as one sequence. With `--keep-newlines` Punkt is rebuilt from the same
parameters with language variables whose period context keeps the whitespace after a
sentence end inside the sentence, so newlines survive. nltk reads the Punkt model from
its data directories (`NLTK_DATA` first): the `punkt_tab` model (nltk >= 3.9 loads it
also where Megatron-LM asks for `punkt/english.pickle`). Nothing is downloaded here.
"""

from __future__ import annotations

import functools
import os
from typing import Protocol, Sequence

# Megatron-LM splits texts in pieces of this many characters before sentence splitting.
SPLIT_PIECE_CHARS = 1_000_000

# Punkt's period context with `\s*` after the sentence end and no whitespace required before the next
# token (as Megatron-LM's CustomLanguageVars, after a well-known answer on preserving empty lines).
KEEP_NEWLINES_PERIOD_CONTEXT = r"""
    \S*                          # the word material before
    %(SentEndChars)s             # a potential sentence end
    \s*                          # whitespace kept in the sentence
    (?=(?P<after_tok>
        %(NonWord)s              # other punctuation
        |
        (?P<next_tok>\S+)        # or the next token, right after the whitespace
    ))"""


class Splitter(Protocol):
    def tokenize(self, text: str) -> list[str]: ...


class SentenceSplitError(ValueError):
    """nltk or its Punkt model is not available: the message says what to install."""


def _nltk_punkt():
    try:
        from nltk.tokenize import punkt
    except ImportError as error:
        raise SentenceSplitError(f"--split-sentences needs nltk, as in Megatron-LM ({error}): pip install nltk, "
                                 "and its Punkt model (see docs/data.md)") from None
    return punkt


def _use_nltk_data_env() -> None:
    """`NLTK_DATA` directories first, even when nltk was imported before the variable was set."""
    import nltk.data

    for root in reversed([p for p in os.environ.get("NLTK_DATA", "").split(os.pathsep) if p]):
        if root not in nltk.data.path:
            nltk.data.path.insert(0, root)


@functools.lru_cache(maxsize=4)
def sentence_splitter(lang: str, keep_newlines: bool) -> Splitter:
    """Punkt for `lang` from nltk's data directories; with `keep_newlines`, Megatron-LM's variant."""
    punkt = _nltk_punkt()
    _use_nltk_data_env()
    try:
        splitter = punkt.PunktTokenizer(lang)
    except (LookupError, ValueError, OSError):
        import nltk.data

        raise SentenceSplitError(
            f"--split-sentences --lang {lang}: nltk's Punkt model for {lang!r} is not installed (looked for "
            f"tokenizers/punkt_tab/{lang}/ in {', '.join(map(str, nltk.data.path))}); install it with "
            "python -m nltk.downloader punkt_tab, or copy it into a directory of NLTK_DATA") from None
    if not keep_newlines:
        return splitter

    class KeepNewlinesLanguageVars(punkt.PunktLanguageVars):
        _period_context_fmt = KEEP_NEWLINES_PERIOD_CONTEXT

    return punkt.PunktSentenceTokenizer(train_text=splitter._params, lang_vars=KeepNewlinesLanguageVars())


def split_sentences(splitter: Splitter, text: str) -> list[str]:
    """The sentences of `text`, split as Megatron-LM does: in pieces of `SPLIT_PIECE_CHARS` characters."""
    sentences: list[str] = []
    for start in range(0, len(text), SPLIT_PIECE_CHARS):
        sentences += splitter.tokenize(text[start : start + SPLIT_PIECE_CHARS])
    return sentences


def split_all(splitter: Splitter, texts: Sequence[str]) -> list[list[str]]:
    """Each text's sentences."""
    return [split_sentences(splitter, text) for text in texts]
