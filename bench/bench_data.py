#!/usr/bin/env python3
"""Data pipeline benchmark: preprocessing throughput, and host memory of a sliced sample.

1. Generates a JSON-lines corpus of long synthetic documents (`--corpus-mb`, default 200),
   trains a SentencePiece tokenizer on part of it (or uses `--tokenizer-type/-model`),
   and runs preprocessing with each `--workers` count: tokens/s and MB/s.
2. Writes an int32 dataset of long documents and measures, with tracemalloc, the host
   memory of building one `--seq-length` (default 1M) token sample for one rank with
   context parallelism `--cp-size` (default 8) against the unsliced sample.

Example:
    python bench/bench_data.py --corpus-mb 200 --workers 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from megatron_lc.data.indexed_dataset import IndexedDataset, write_dataset  # noqa: E402
from megatron_lc.data.preprocess import PreprocessOptions, preprocess  # noqa: E402
from megatron_lc.data.samples import LongSequenceSamples  # noqa: E402
from megatron_lc.data.tokenizers import train_sentencepiece  # noqa: E402


def synthetic_vocabulary(rng: np.random.Generator, size: int = 20_000) -> np.ndarray:
    """Pronounceable made-up words of 1-12 letters."""
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    weights = np.linspace(2.0, 0.1, len(letters))
    weights /= weights.sum()
    lengths = rng.integers(1, 13, size=size)
    return np.array(["".join(rng.choice(letters, size=n, p=weights)) for n in lengths])


def synthetic_document(rng: np.random.Generator, words: np.ndarray, chars: int) -> str:
    """About `chars` characters of Zipf-distributed words in sentences, lines and paragraphs."""
    count = max(1, chars // 6)
    indices = np.minimum(rng.zipf(1.2, size=count) - 1, len(words) - 1)
    tokens = words[indices].astype(object)
    tokens[rng.random(count) < 0.08] += "."
    tokens[rng.random(count) < 0.04] += ","
    tokens[rng.random(count) < 0.02] += "\n"
    return " ".join(tokens.tolist())


def generate_corpus(directory: Path, megabytes: int, seed: int) -> list[Path]:
    """Four JSON-lines files of long documents (10K-400K characters each)."""
    rng = np.random.default_rng(seed)
    words = synthetic_vocabulary(rng)
    paths = [directory / f"corpus_{i}.jsonl" for i in range(4)]
    streams = [open(path, "w") for path in paths]
    written, target, document = 0, megabytes * 1_000_000, 0
    while written < target:
        text = synthetic_document(rng, words, int(rng.integers(10_000, 400_000)))
        line = json.dumps({"text": text}) + "\n"
        streams[document % len(streams)].write(line)
        written += len(line)
        document += 1
    for stream in streams:
        stream.close()
    return paths


def train_bench_tokenizer(corpus: Path, output: Path, vocab_size: int) -> str:
    """A SentencePiece model trained on the first lines of one corpus file."""

    def lines():
        with open(corpus) as stream:
            for count, record in enumerate(stream):
                if count >= 200:
                    return
                yield from (line for line in json.loads(record)["text"].split("\n") if line.strip())

    return train_sentencepiece(lines(), output, vocab_size, max_sentences=100_000)


def bench_preprocess(inputs: list[Path], output: Path, tokenizer_type: str, tokenizer_model: str, workers: int) -> dict:
    """One preprocessing run: seconds, tokens/s, input MB/s."""
    options = PreprocessOptions(
        inputs=tuple(map(str, inputs)),
        output_prefix=str(output),
        tokenizer_type=tokenizer_type,
        tokenizer_model=tokenizer_model,
        workers=workers,
        append_eod=True,
        show_progress=False,
    )
    load = os.getloadavg()[0]
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    summary = preprocess(options)
    seconds = time.perf_counter() - start
    own_after, children_after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    megabytes = sum(path.stat().st_size for path in inputs) / 1e6
    return {
        "workers": workers,
        "documents": summary.documents,
        "tokens": summary.total_tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(summary.total_tokens / seconds),
        "input_mb_per_s": round(megabytes / seconds, 2),
        # CPU seconds of the reading/writing process and of the tokenizer workers: their
        # sum over `seconds` shows how many cores the run actually got
        "cpu_s_main": round(_cpu_seconds(own_after) - _cpu_seconds(own), 1),
        "cpu_s_workers": round(_cpu_seconds(children_after) - _cpu_seconds(children), 1),
        "load_average_before": round(load, 2),
    }


def _cpu_seconds(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def peak_bytes_of(function) -> int:
    """Peak bytes tracemalloc sees while `function` runs (numpy reports its buffers)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        function()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def bench_sample_memory(directory: Path, seq_length: int, cp_size: int, seed: int) -> dict:
    """Host memory of one sample: a cp rank's slice vs the whole sample."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1_000, 300_000, size=40)  # about 6M tokens, int32 as for Llama 3
    write_dataset(directory / "long", (rng.integers(0, 128_256, size=n, dtype=np.int32) for n in lengths), np.int32)
    samples = LongSequenceSamples(IndexedDataset(directory / "long"), seq_length, seed=seed)
    index_bytes = peak_bytes_of(lambda: samples.get(0, cp_rank=0, cp_size=cp_size))  # includes the epoch layout
    sliced = peak_bytes_of(lambda: samples.get(1, cp_rank=cp_size - 1, cp_size=cp_size))
    whole = peak_bytes_of(lambda: samples.get(1))
    return {
        "seq_length": seq_length,
        "cp_size": cp_size,
        "sliced_peak_mb": round(sliced / 2**20, 2),
        "unsliced_peak_mb": round(whole / 2**20, 2),
        "ratio": round(whole / max(sliced, 1), 2),
        "first_call_with_epoch_layout_mb": round(index_bytes / 2**20, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-mb", type=int, default=200, help="size of the generated corpus")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokenizer-type", default="SentencePieceTokenizer")
    parser.add_argument("--tokenizer-model", help="default: a SentencePiece model trained on the corpus")
    parser.add_argument("--vocab-size", type=int, default=8000, help="of the trained SentencePiece model")
    parser.add_argument("--seq-length", type=int, default=1 << 20)
    parser.add_argument("--cp-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", help="keep the corpus and outputs here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)

    directory = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_data_"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        corpus = generate_corpus(directory, args.corpus_mb, args.seed)
        generate_s = time.perf_counter() - start
        model = args.tokenizer_model
        if model is None and args.tokenizer_type == "SentencePieceTokenizer":
            model = train_bench_tokenizer(corpus[0], directory / "spm", args.vocab_size)
        runs = [bench_preprocess(corpus, directory / f"out_w{w}", args.tokenizer_type, model, w) for w in args.workers]
        memory = bench_sample_memory(directory, args.seq_length, args.cp_size, args.seed)
    finally:
        if args.work_dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    report = {
        "corpus_mb": args.corpus_mb,
        "generate_s": round(generate_s, 1),
        "cpus": os.cpu_count(),
        "tokenizer": args.tokenizer_type,
        "preprocess": runs,
        "sample_memory": memory,
    }
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def format_report(report: dict) -> str:
    """The figures as a small text table."""
    lines = [
        f"corpus: {report['corpus_mb']} MB of JSON lines ({report['cpus']} CPUs), tokenizer {report['tokenizer']}",
        "workers  documents  tokens       seconds  tokens/s    input MB/s  CPU s main/workers  load before",
    ]
    for run in report["preprocess"]:
        lines.append(
            f"{run['workers']:>7}  {run['documents']:>9}  {run['tokens']:>11}  {run['seconds']:>7}  "
            f"{run['tokens_per_s']:>10}  {run['input_mb_per_s']:>10}  "
            f"{run['cpu_s_main']:>8} / {run['cpu_s_workers']:<8}  {run['load_average_before']:>11}"
        )
    memory = report["sample_memory"]
    lines.append(
        f"one {memory['seq_length']}-token sample: cp={memory['cp_size']} slice peaks at "
        f"{memory['sliced_peak_mb']} MiB, unsliced at {memory['unsliced_peak_mb']} MiB "
        f"({memory['ratio']}x); first call incl. epoch layout {memory['first_call_with_epoch_layout_mb']} MiB"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
