#!/usr/bin/env python3
"""Chat preprocessing against plain-text preprocessing of the same text: throughput ratio.

1. Builds conversations from the prose files of installed packages (READMEs, licences, changelogs: cut into
   paragraphs), 1 to 4 user/assistant exchanges each, a system message in one of three, up to `--corpus-mb`
   megabytes of message text. Writes them twice: `chat.jsonl` (`{"messages": [...]}`) and `text.jsonl`
   (`{"text": ...}`, each conversation's message texts joined by blank lines): the same text either way.
2. Trains a Llama-3-like byte-level BPE on it (`--vocab-size`) with Llama 3 Instruct's chat template
   (`megatron_lc.testing.write_chat_tokenizer`): one tokenizer for both runs.
3. Runs `preprocess` on `text.jsonl` (plain text, --append-eod) and on `chat.jsonl` (--chat-template hf, the
   default assistant-only mask), alternately, `--repeats` times each, with the same `--workers`, and reports the
   best wall and CPU time of each (CPU: this process and its worker processes, user + system; on a shared,
   loaded machine the steadier measure), the message text's MB/s and the ratio chat / plain (aim: >= 0.5).

The tokenizers library's own threads are off (TOKENIZERS_PARALLELISM=false, RAYON_NUM_THREADS=1) in both runs:
the parallelism compared is `--workers`' processes.

Example:
    python bench/bench_chat_preprocess.py --corpus-mb 4 --workers 1 --work-dir /tmp/chat_bench
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.bench_tokenize import read_text, text_files  # noqa: E402
from megatron_lc.data.chat import ChatSettings  # noqa: E402
from megatron_lc.data.preprocess import PreprocessOptions, preprocess  # noqa: E402
from megatron_lc.testing import write_chat_tokenizer  # noqa: E402


def paragraphs(megabytes: float):
    """Paragraphs (blank-line separated, 40 to 4,000 characters) of installed packages' prose files."""
    roots = [Path(sysconfig.get_paths()["purelib"])]
    total = 0
    for path in text_files(roots):
        try:
            text = read_text(path)
        except (ValueError, OSError, EOFError):
            continue
        for paragraph in text.split("\n\n"):
            paragraph = paragraph.strip()
            if 40 <= len(paragraph) <= 4000:
                yield paragraph
                total += len(paragraph.encode("utf-8"))
                if total >= megabytes * 1e6:
                    return


def build_corpus(work_dir: Path, megabytes: float, seed: int) -> tuple[Path, Path, int, int]:
    """chat.jsonl and text.jsonl of the same message texts; conversations and bytes of message text."""
    rng = random.Random(seed)
    source = paragraphs(megabytes)
    conversations = 0
    text_bytes = 0
    with open(work_dir / "chat.jsonl", "w", encoding="utf-8") as chat, \
            open(work_dir / "text.jsonl", "w", encoding="utf-8") as plain:
        while True:
            roles = (["system"] if rng.random() < 1 / 3 else []) + ["user", "assistant"] * rng.randint(1, 4)
            contents = [next(source, None) for _ in roles]
            if None in contents:
                break
            messages = [{"role": role, "content": content} for role, content in zip(roles, contents)]
            chat.write(json.dumps({"messages": messages}) + "\n")
            plain.write(json.dumps({"text": "\n\n".join(contents)}) + "\n")
            conversations += 1
            text_bytes += sum(len(c.encode("utf-8")) for c in contents)
    return work_dir / "chat.jsonl", work_dir / "text.jsonl", conversations, text_bytes


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (the --workers processes)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(options: PreprocessOptions) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and tokens of one run."""
    start, cpu = time.perf_counter(), cpu_seconds()
    summary = preprocess(options)
    return time.perf_counter() - start, cpu_seconds() - cpu, summary.total_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-mb", type=float, default=4.0, help="megabytes of message text")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args()
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="chat_bench_"))
    work_dir.mkdir(parents=True, exist_ok=True)
    chat_path, text_path, conversations, text_bytes = build_corpus(work_dir, args.corpus_mb, args.seed)
    print(f"corpus: {conversations:,} conversations, {text_bytes / 1e6:.2f} MB of message text "
          f"({chat_path.stat().st_size / 1e6:.2f} MB as messages JSON, {text_path.stat().st_size / 1e6:.2f} MB as text "
          "JSON)", flush=True)
    sample = [json.loads(line)["text"] for line, _ in zip(open(text_path, encoding="utf-8"), range(2000))]
    tokenizer_dir = write_chat_tokenizer(work_dir / "tokenizer", sample, args.vocab_size)
    common = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_dir, workers=args.workers,
                  show_progress=False)
    runs = {
        "plain": PreprocessOptions(inputs=(str(text_path),), output_prefix=str(work_dir / "plain"), append_eod=True,
                                   **common),
        "chat": PreprocessOptions(inputs=(str(chat_path),), output_prefix=str(work_dir / "chat"),
                                  json_keys=("messages",), chat=ChatSettings("hf"), **common),
    }
    best = {name: float("inf") for name in runs}
    best_cpu = dict(best)
    tokens = {}
    for repeat in range(args.repeats):
        for name, options in runs.items():
            seconds, cpu, tokens[name] = timed(options)
            best[name], best_cpu[name] = min(best[name], seconds), min(best_cpu[name], cpu)
            print(f"repeat {repeat + 1}/{args.repeats}: {name}: {seconds:.2f} s wall, {cpu:.2f} CPU s", flush=True)
    for name in runs:
        print(f"{name:>5}: {best[name]:.2f} s wall, {best_cpu[name]:.2f} CPU s, "
              f"{text_bytes / best_cpu[name] / 1e6:.2f} MB/s of message text per CPU s, "
              f"{tokens[name] / best_cpu[name]:,.0f} tokens per CPU s ({tokens[name]:,} tokens)")
    print(f"chat / plain throughput on the same text, --workers {args.workers}: "
          f"{best_cpu['plain'] / best_cpu['chat']:.2f}x by CPU time, {best['plain'] / best['chat']:.2f}x by wall time "
          "(aim: >= 0.5x)")


if __name__ == "__main__":
    main()
