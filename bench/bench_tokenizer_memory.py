#!/usr/bin/env python3
"""Memory per character of one long document, for each tokenizer type, encoded whole and as preprocessing
encodes it.

    python bench/bench_tokenizer_memory.py --chars 8000000 --work-dir /tmp/tokmem

Trains a small tokenizer of each file-based type on text of the same kind (nothing downloaded), then, in
a fresh process per type and way, builds the tokenizer, makes one document of `--chars` characters (words,
digits, punctuation and some non-ASCII: for NullTokenizer, space-separated ids), and encodes it: `whole`,
with one `tokenizer.tokenize` call (what preprocessing did before documents were cut); `preprocess`, with
`encode_documents` as preprocessing does now (in pieces of `PIECE_CHARS` characters, into a token array,
where the tokenizer cuts exactly; else the same whole call). Reported: peak resident memory (VmHWM)
minus the resident memory just before the call (VmRSS, text and tokenizer loaded), per character of the
document, the ids returned included, and a digest of the ids: the same in both ways.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORDS = ("the long context of a book holds many tokens and every token counts in training model data "
         "café naïve Straße 数据 🙂 don't we'll 2024-05-17 http://example.org/a/b?c=1").split()


def document(chars: int, seed: int = 0) -> str:
    """About `chars` characters of words, lines and paragraphs."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < chars:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) + rng.choice([".", ",", "!", "?"])
        line += rng.choice([" ", "\n", "\n\n"])
        parts.append(line)
        size += len(line)
    return "".join(parts)[:chars]


def null_document(chars: int, vocab: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < chars:
        word = str(rng.randrange(vocab))
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:chars].rsplit(" ", 1)[0]


def train_tokenizers(work_dir: str) -> dict[str, dict]:
    """One small tokenizer per file-based type; the build arguments of each type."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megatron_lc.data.tokenizers import train_sentencepiece

    os.makedirs(work_dir, exist_ok=True)
    sample = document(2_000_000, seed=1).splitlines()
    spm = train_sentencepiece([s for s in sample if s.strip()], os.path.join(work_dir, "spm"), vocab_size=8000)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(sample, trainer)
    bpe_json = os.path.join(work_dir, "tokenizer.json")
    bpe.save(bpe_json)
    gpt2_dir = os.path.join(work_dir, "gpt2")
    os.makedirs(gpt2_dir, exist_ok=True)
    vocab_file, merge_file = bpe.model.save(gpt2_dir)
    tiktoken_file = os.path.join(work_dir, "tiktoken.model")
    write_tiktoken_from(bpe_json, tiktoken_file)
    return {
        "SentencePieceTokenizer": {"tokenizer_model": spm},
        "HuggingFaceTokenizer": {"tokenizer_model": bpe_json},
        "TikTokenizer": {"tokenizer_model": tiktoken_file},
        "GPT2BPETokenizer": {"vocab_file": vocab_file, "merge_file": merge_file},
        "NullTokenizer": {"vocab_size": 50000},
        "ByteTokenizer": {},
    }


def write_tiktoken_from(bpe_json: str, path: str) -> None:
    """A tiktoken BPE file of the byte-level BPE's tokens, ranks in id order (bytes first)."""
    import base64

    vocab = json.load(open(bpe_json))["model"]["vocab"]
    symbols = _byte_symbols()
    decode = {char: byte for byte, char in symbols.items()}
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    for token, _ in sorted(vocab.items(), key=lambda item: item[1]):
        if token.startswith("<|"):
            continue
        raw = bytes(decode[c] for c in token)
        if raw not in seen:
            seen.add(raw)
            tokens.append(raw)
    with open(path, "w") as stream:
        stream.writelines(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))


def _byte_symbols() -> dict[int, str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    with open("/proc/self/status") as stream:
        for line in stream:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(tokenizer_type: str, build: dict, chars: int, how: str = "whole") -> dict:
    """In this process: RSS growth of encoding a document of `chars` characters, `how`: `whole` (one
    `tokenize` call) or `preprocess` (`encode_documents`, as preprocessing does)."""
    import numpy as np

    from megatron_lc.data.indexed_dataset import optimal_dtype
    from megatron_lc.data.encode import encode_documents
    from megatron_lc.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(tokenizer_type, build.get("tokenizer_model"), vocab_file=build.get("vocab_file"),
                                merge_file=build.get("merge_file"), vocab_size=build.get("vocab_size"))
    text = null_document(chars, build["vocab_size"]) if tokenizer_type == "NullTokenizer" else document(chars)
    dtype = np.dtype(optimal_dtype(tokenizer.vocab_size)).name
    encode = tokenizer.tokenize if how == "whole" else lambda t: encode_documents(tokenizer, [t], dtype)[0]
    encode("1 2" if tokenizer_type == "NullTokenizer" else "warm up")
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as stream:  # reset VmHWM to the current RSS
        stream.write("5")
    start = time.perf_counter()
    ids = encode(text)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    digest = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:12]
    return {"type": tokenizer_type, "how": how, "cut": tokenizer.cuts_long_documents, "chars": len(text),
            "tokens": len(ids), "seconds": round(seconds, 2), "rss_before_mb": round(before / 1e6, 1),
            "peak_delta_mb": round((peak - before) / 1e6, 1),
            "bytes_per_char": round((peak - before) / len(text), 1), "ids_sha256": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=int, default=8_000_000)
    parser.add_argument("--work-dir", default="/tmp/tokenizer_memory")
    parser.add_argument("--types", nargs="*", default=None)
    parser.add_argument("--how", nargs="*", default=["whole", "preprocess"], choices=["whole", "preprocess"])
    parser.add_argument("--one", help=argparse.SUPPRESS)  # JSON: type, build arguments and how, measured here
    args = parser.parse_args()
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(measure(spec["type"], spec["build"], args.chars, spec["how"])))
        return
    builds = train_tokenizers(args.work_dir)
    rows = []
    for tokenizer_type, build in builds.items():
        for how in args.how if not args.types or tokenizer_type in args.types else ():
            out = subprocess.run([sys.executable, __file__, "--chars", str(args.chars), "--one",
                                  json.dumps({"type": tokenizer_type, "build": build, "how": how})],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    """One markdown row per type and way."""
    print("\n| tokenizer | encoded | characters | tokens | encode s | RSS growth | B per character | ids SHA-256 |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        way = "whole" if row["how"] == "whole" else ("in pieces" if row["cut"] else "whole (cannot cut)")
        print(f"| {row['type']} | {way} | {row['chars']:,} | {row['tokens']:,} | {row['seconds']} | "
              f"{row['peak_delta_mb']:,} MB | {row['bytes_per_char']} | {row['ids_sha256']} |")


if __name__ == "__main__":
    main()
