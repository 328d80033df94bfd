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
import functools
import gzip
import json
import os
import re
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds, and CPU seconds of this process and of its finished children."""

    wall: float
    main_cpu: float
    workers_cpu: float


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def timed(function) -> tuple[Timing, object]:
    """Run `function()`; its Timing and result."""
    main, children = _cpu_seconds(resource.RUSAGE_SELF), _cpu_seconds(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = function()
    wall = time.perf_counter() - start
    timing = Timing(wall, _cpu_seconds(resource.RUSAGE_SELF) - main, _cpu_seconds(resource.RUSAGE_CHILDREN) - children)
    return timing, result


def plain_loop(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each whole document encoded in one call, in one thread."""
    return [tokenizer.tokenize(text) for text in texts]


def run_preprocess(corpus: Path, prefix: Path, tokenizer_type: str, model: str, workers: int) -> None:
    options = PreprocessOptions(
        inputs=(str(corpus),), output_prefix=str(prefix), tokenizer_type=tokenizer_type, tokenizer_model=model,
        workers=workers, show_progress=False,
    )
    preprocess(options)


@dataclass(frozen=True)
class CommandTiming:
    """A tool run as a user runs it: its own processing seconds, the whole command's wall
    seconds (interpreter start and imports included), and the command's CPU seconds."""

    processing: float
    command: float
    cpu: float


def run_command(command: list[str], pattern: str) -> CommandTiming:
    """Run `command`; its timing, the processing seconds parsed from its output by `pattern`."""
    timing, result = timed(lambda: subprocess.run(command, capture_output=True, text=True, check=True))
    match = re.search(pattern, result.stdout + result.stderr)
    if match is None:
        raise RuntimeError(f"no timing line from {command[1]}:\n{result.stderr[-2000:]}")
    processing = float(match.group("seconds")) if "seconds" in match.groupdict() else (
        int(match.group("documents")) / float(match.group("rate")))
    return CommandTiming(processing, timing.wall, timing.workers_cpu)


def tool_flags(corpus: Path, prefix: Path, tokenizer_type: str, model: str, workers: int) -> list[str]:
    return ["--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer-type", tokenizer_type,
            "--tokenizer-model", model, "--workers", str(workers)]


def run_ours(corpus: Path, prefix: Path, tokenizer_type: str, model: str, workers: int) -> CommandTiming:
    """tools/preprocess_data.py; processing seconds from its summary line."""
    tool = Path(__file__).resolve().parents[1] / "tools" / "preprocess_data.py"
    command = [sys.executable, str(tool), *tool_flags(corpus, prefix, tokenizer_type, model, workers), "--no-progress"]
    return run_command(command, r"tokens in (?P<seconds>[0-9.]+) s")


def run_megatron(megatron_dir: str, corpus: Path, prefix: Path, tokenizer_type: str, model: str, workers: int,
                 documents: int) -> CommandTiming:
    """Megatron-LM's tool; processing seconds (its startup excluded) from the one progress
    line it prints at the last document."""
    command = [sys.executable, str(Path(__file__).with_name("megatron_preprocess.py")), megatron_dir,
               *tool_flags(corpus, prefix, tokenizer_type, model, workers), "--log-interval", str(documents)]
    return run_command(command, r"Processed (?P<documents>\d+) documents \((?P<rate>[0-9.]+) docs/s")


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
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timings")
    parser.add_argument("--work-dir", help="keep the corpus, model and outputs here")
    parser.add_argument("--megatron-lm", help="a Megatron-LM checkout: time its tools/preprocess_data.py too")
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
            prefix = work / f"spm_{args.model_type}_{args.vocab_size}"
            model = train_model(texts, prefix, args.vocab_size, args.model_type)
    tokenizer = build_tokenizer(args.tokenizer_type, model)
    expected = plain_loop(tokenizer, texts)
    megabytes = corpus.stat().st_size / 1e6
    print(f"corpus: {len(texts):,} documents, {megabytes:.1f} MB of JSON lines, {sum(map(len, expected)):,} tokens")
    print(f"tokenizer: {args.tokenizer_type} {model} (vocab {tokenizer.vocab_size:,}); load average "
          f"{os.getloadavg()[0]:.1f} before")
    # interleaved repeats, best wall time of each: other jobs on the machine slow all alike
    best: dict[str, Timing] = {}
    commands: dict[tuple[str, int], CommandTiming] = {}
    for _ in range(args.repeats):
        runs = {"loop": lambda: plain_loop(tokenizer, texts)}
        for workers in args.workers:
            runs[f"w{workers}"] = functools.partial(run_preprocess, corpus, work / f"out_w{workers}",
                                                    args.tokenizer_type, model, workers)
        for name, function in runs.items():
            timing, _ = timed(function)
            if name not in best or timing.wall < best[name].wall:
                best[name] = timing
        for workers in args.workers if args.megatron_lm else []:
            flags = (args.tokenizer_type, model, workers)
            ours = run_ours(corpus, work / f"ours_cmd_w{workers}", *flags)
            theirs = run_megatron(args.megatron_lm, corpus, work / f"megatron_cmd_w{workers}", *flags, len(texts))
            for key, timing in ((("ours", workers), ours), (("megatron", workers), theirs)):
                if key not in commands or timing.command < commands[key].command:
                    commands[key] = timing
    loop = best["loop"]
    print(f"plain whole-document encode loop, 1 thread, texts in memory: {loop.wall:.2f} s ({loop.main_cpu:.2f} CPU s)")
    for workers in args.workers:
        timing = best[f"w{workers}"]
        mismatches = count_mismatches(work / f"out_w{workers}", expected)
        print(f"preprocess --workers {workers}, JSON lines to .bin/.idx: {timing.wall:.2f} s "
              f"({loop.wall / timing.wall:.2f}x the loop's speed; CPU s main {timing.main_cpu:.2f} / workers "
              f"{timing.workers_cpu:.2f}), documents differing from the loop: {mismatches}")
    for (tool, workers), timing in commands.items():
        name = "this tool" if tool == "ours" else "Megatron-LM's tool"
        mismatches = count_mismatches(work / f"{tool}_cmd_w{workers}", expected)
        print(f"{name} as a command, --workers {workers}: {timing.command:.2f} s in all, {timing.processing:.2f} s "
              f"of processing, {timing.cpu:.2f} CPU s; documents differing from the loop: {mismatches}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
