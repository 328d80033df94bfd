"""Train a small SentencePiece model (Llama-style: BPE, byte fallback) from a corpus.

Example:
    python tools/train_tokenizer.py --input 'corpus/*.jsonl' --output-prefix tok/spm --vocab-size 8000
    # writes tok/spm.model and tok/spm.vocab; use with --tokenizer-type SentencePieceTokenizer

Inputs are read as by preprocess_data.py (JSON lines, JSON, Parquet, text, saved datasets);
each non-blank line of each document is one training sentence. A line longer than
SentencePiece takes (64 KiB of UTF-8) is cut into pieces that fit, preferably at spaces,
and counted in the report: SentencePiece itself would drop it without a word.
"""

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Iterator

from megatron_lc.command_line import ArgumentParser, check_writable, run_tool
from megatron_lc.errors import ConfigError
from megatron_lc.data.corpus import InputProblems, InvalidInputError, ReadOptions, expand_inputs, read_documents
from megatron_lc.data.tokenizers import SENTENCEPIECE_MAX_SENTENCE_BYTES, train_sentencepiece


MIN_VOCAB_SIZE = 256 + 3


@dataclass
class LongLines:
    """Lines cut to fit SentencePiece: how many, and where the first one was."""

    count: int = 0
    first: str = ""

    def report(self) -> str:
        if not self.count:
            return ""
        return (f"; {self.count:,} lines over {SENTENCEPIECE_MAX_SENTENCE_BYTES:,} bytes cut into pieces "
                f"(first in {self.first})")


def split_long_line(line: str, limit: int = SENTENCEPIECE_MAX_SENTENCE_BYTES) -> list[str]:
    """`line` in pieces of at most `limit` UTF-8 bytes, cut at the last space of a piece's second half
    where there is one, else at a character boundary."""
    data = line.encode("utf-8")
    pieces = []
    while len(data) > limit:
        cut = limit
        while data[cut] & 0xC0 == 0x80:  # not inside a character
            cut -= 1
        space = data.rfind(b" ", limit // 2, cut)
        cut = space + 1 if space > 0 else cut
        pieces.append(data[:cut].decode("utf-8"))
        data = data[cut:]
    pieces.append(data.decode("utf-8"))
    return [piece for piece in pieces if piece.strip()]


def corpus_lines(files: list[str], keys: tuple[str, ...], problems: InputProblems, long: LongLines) -> Iterator[str]:
    """Non-blank lines of every document of every input, long ones cut to fit."""
    for document in read_documents(files, ReadOptions(keys), problems):
        for key in keys:
            for line in document.texts[key].splitlines():
                if not line.strip():
                    continue
                if len(line) * 4 > SENTENCEPIECE_MAX_SENTENCE_BYTES and \
                        len(line.encode("utf-8")) > SENTENCEPIECE_MAX_SENTENCE_BYTES:
                    long.count += 1
                    long.first = long.first or str(document.location)
                    yield from split_long_line(line)
                else:
                    yield line


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="train_tokenizer.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="files, globs or directories")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--max-sentences", type=int, default=1_000_000, help="lines sampled for training")
    parser.add_argument("--seed", type=int, default=0, help="of the line sampling: same corpus and seed, same model")
    parser.add_argument("--skip-invalid", action="store_true", help="skip bad input lines instead of stopping")
    return parser


def main(argv: list[str] | None = None) -> int:
    """0 when written; one line and 2 for a command line that cannot work, 1 for bad input or a failed training."""
    return run_tool("train_tokenizer", train, argv)


def train(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("vocab_size", "max_sentences"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(f"--vocab-size {args.vocab_size}: byte fallback takes {MIN_VOCAB_SIZE} ids (256 bytes, "
                          "<unk>, <s>, </s>), plus one per distinct character of the corpus")
    try:
        files = expand_inputs(args.input)
    except InvalidInputError as error:
        raise ConfigError(str(error)) from error
    check_writable(os.path.dirname(os.path.abspath(args.output_prefix)), "--output-prefix")
    problems = InputProblems(args.skip_invalid)
    long = LongLines()
    try:
        lines = corpus_lines(files, tuple(args.json_keys), problems, long)
        model = train_sentencepiece(
            lines, args.output_prefix, args.vocab_size, args.model_type, args.max_sentences, args.seed
        )
    except (InvalidInputError, ValueError, RuntimeError) as error:
        print(f"train_tokenizer: error: {error}{long.report()}", file=sys.stderr)
        return 1
    print(f"wrote {model} (skipped inputs: {problems.total}{long.report()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
