#!/usr/bin/env python3
"""Train a small SentencePiece model (Llama-style: BPE, byte fallback) from a corpus.

Example:
    python tools/train_tokenizer.py --input 'corpus/*.jsonl' --output-prefix tok/spm --vocab-size 8000
    # writes tok/spm.model and tok/spm.vocab; use with --tokenizer-type SentencePieceTokenizer

Inputs are read as by preprocess_data.py (JSON lines, JSON, Parquet, text, saved datasets);
each non-blank line of each document is one training sentence.
"""

import argparse
import os
import sys
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron_lc.data.corpus import InputProblems, InvalidInputError, ReadOptions, expand_inputs, read_documents  # noqa: E402
from megatron_lc.data.tokenizers import train_sentencepiece  # noqa: E402


def corpus_lines(inputs: list[str], keys: tuple[str, ...], problems: InputProblems) -> Iterator[str]:
    """Non-blank lines of every document of every input."""
    for document in read_documents(expand_inputs(inputs), ReadOptions(keys), problems):
        for key in keys:
            yield from (line for line in document.texts[key].splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="files, globs or directories")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--max-sentences", type=int, default=1_000_000, help="lines sampled for training")
    parser.add_argument("--seed", type=int, default=0, help="of the line sampling: same corpus and seed, same model")
    parser.add_argument("--skip-invalid", action="store_true", help="skip bad input lines instead of stopping")
    args = parser.parse_args(argv)
    problems = InputProblems(args.skip_invalid)
    try:
        lines = corpus_lines(args.input, tuple(args.json_keys), problems)
        model = train_sentencepiece(
            lines, args.output_prefix, args.vocab_size, args.model_type, args.max_sentences, args.seed
        )
    except (InvalidInputError, ValueError, RuntimeError) as error:
        print(f"train_tokenizer: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {model} (skipped inputs: {problems.total})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
