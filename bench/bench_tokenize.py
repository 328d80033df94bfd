#!/usr/bin/env python3
"""Preprocessing on real text: exactness against whole-document encoding, and speed.

1. Builds a JSON-lines corpus of real text from the text files of installed packages
   (READMEs, licences, changelogs, METADATA: long lines, hashes, URLs, logs, code), up
   to `--corpus-mb` megabytes, one document per file.
2. Trains a SentencePiece model on it (`--model-type unigram` by default, `--vocab-size`
   32000), or uses `--tokenizer-type/--tokenizer-model`.
3. Times a plain loop that encodes each whole document in one call (texts already in
   memory: the tokenizer's own cost), then `preprocess` end to end (JSON in, .bin/.idx
   out) for each `--workers` count, and counts documents whose written ids differ from
   the loop's.

Example:
    python bench/bench_tokenize.py --corpus-mb 40 --workers 1 2 --work-dir /tmp/tok
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from megatron_lc.data.indexed_dataset import IndexedDataset  # noqa: E402
from megatron_lc.data.preprocess import PreprocessOptions, preprocess  # noqa: E402
from megatron_lc.data.tokenizers import build_tokenizer, train_sentencepiece  # noqa: E402

_TEXT_NAMES = ("readme", "license", "licence", "copying", "copyright", "changelog", "changes", "history", "news",
               "metadata", "authors")
_TEXT_SUFFIXES = (".md", ".rst", ".txt", ".md.gz", ".txt.gz")


def text_files(roots: list[Path]) -> Iterator[Path]:
    """Files under `roots` whose name says they are prose, in sorted order."""
    for root in roots:
        for directory, names, files in sorted(os.walk(root)):
            names.sort()
            for name in sorted(files):
                if name.lower().startswith(_TEXT_NAMES) or name.endswith(_TEXT_SUFFIXES):
                    yield Path(directory) / name


def read_text(path: Path) -> str:
    """The file as UTF-8 text (decompressed when .gz); ValueError/OSError when it is not."""
    data = path.read_bytes()
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")


def build_corpus(roots: list[Path], output: Path, megabytes: float) -> int:
    """Write up to `megabytes` of valid UTF-8, non-blank text files as JSON lines; the count."""
    written = documents = 0
    with open(output, "w", encoding="utf-8") as stream:
        for path in text_files(roots):
            try:
                text = read_text(path)
            except (ValueError, OSError, EOFError):
                continue
            if not text.strip():
                continue
            stream.write(json.dumps({"text": text}) + "\n")
            written += len(text.encode("utf-8"))
            documents += 1
            if written >= megabytes * 1e6:
                break
    return documents


def read_texts(corpus: Path) -> list[str]:
    with open(corpus, encoding="utf-8") as stream:
        return [json.loads(line)["text"] for line in stream]


def train_model(texts: list[str], prefix: Path, vocab_size: int, model_type: str) -> str:
    lines = (line[:4000] for text in texts for line in text.splitlines() if line.strip())
    return train_sentencepiece(lines, prefix, vocab_size, model_type=model_type, max_sentences=300_000)


def time_plain_loop(tokenizer, texts: list[str]) -> tuple[float, list[list[int]]]:
    """Seconds to encode each whole document in one call, one thread; and the ids."""
    start = time.perf_counter()
    ids = [tokenizer.tokenize(text) for text in texts]
    return time.perf_counter() - start, ids


def time_preprocess(corpus: Path, prefix: Path, tokenizer_type: str, model: str, workers: int) -> float:
    options = PreprocessOptions(
        inputs=(str(corpus),), output_prefix=str(prefix), tokenizer_type=tokenizer_type, tokenizer_model=model,
        workers=workers, show_progress=False,
    )
    start = time.perf_counter()
    preprocess(options)
    return time.perf_counter() - start


def count_mismatches(prefix: Path, expected: list[list[int]]) -> int:
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert len(dataset) == len(expected), (len(dataset), len(expected))
    return sum(dataset[i].tolist() != ids for i, ids in enumerate(expected))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-mb", type=float, default=40)
    parser.add_argument("--source", nargs="+", default=["/usr/share/doc", sysconfig.get_paths()["purelib"]],
                        help="directories of text files")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizer-type", default="SentencePieceTokenizer")
    parser.add_argument("--tokenizer-model", help="default: a SentencePiece model trained on the corpus")
    parser.add_argument("--model-type", default="unigram", choices=("unigram", "bpe"))
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many timings")
    parser.add_argument("--work-dir", help="keep the corpus, model and outputs here")
    args = parser.parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-tokenize-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    if not corpus.exists():
        build_corpus([Path(source) for source in args.source], corpus, args.corpus_mb)
    texts = read_texts(corpus)
    model = args.tokenizer_model
    if model is None:
        model = str(work / f"spm_{args.model_type}_{args.vocab_size}.model")
        if not os.path.exists(model):
            model = train_model(texts, work / f"spm_{args.model_type}_{args.vocab_size}", args.vocab_size, args.model_type)
    tokenizer = build_tokenizer(args.tokenizer_type, model)
    loop_seconds, expected = min(time_plain_loop(tokenizer, texts) for _ in range(args.repeats))
    megabytes = corpus.stat().st_size / 1e6
    print(f"corpus: {len(texts):,} documents, {megabytes:.1f} MB of JSON lines, {sum(map(len, expected)):,} tokens")
    print(f"tokenizer: {args.tokenizer_type} {model} (vocab {tokenizer.vocab_size:,})")
    print(f"plain whole-document encode loop, 1 thread, texts in memory: {loop_seconds:.2f} s")
    for workers in args.workers:
        prefix = work / f"out_w{workers}"
        seconds = min(time_preprocess(corpus, prefix, args.tokenizer_type, model, workers) for _ in range(args.repeats))
        mismatches = count_mismatches(prefix, expected)
        print(f"preprocess --workers {workers}, JSON lines to .bin/.idx: {seconds:.2f} s "
              f"({loop_seconds / seconds:.2f}x the loop), documents differing from the loop: {mismatches}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
