#!/usr/bin/env python3
"""Host memory of encoding one long conversation with its loss mask, per character: the rate behind the default
`--max-document-chars` for chat data (a conversation is rendered and encoded whole, its prefixes besides).

Builds a Llama-3-like byte-level BPE with Llama 3 Instruct's template (`megatron_lc.testing.write_chat_tokenizer`),
warms the encoder on a short conversation, then encodes one conversation of `--chars` characters in `--turns`
user/assistant exchanges (words drawn at random, accents and CJK among them) with the assistant-only mask, and
reports the peak RSS growth (ru_maxrss, this process) over the warm state, per character. One measurement per
process: run it once per setting.

Example:
    python bench/bench_chat_memory.py --chars 2000000 --turns 4
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from megatron_lc.data.chat import ChatEncoder  # noqa: E402
from megatron_lc.data.chat_records import ChatSettings, conversation_from_record  # noqa: E402
from megatron_lc.testing import write_chat_tokenizer  # noqa: E402

WORDS = ["token", "context", "book", "long", "the", "of", "north", "blue", "naïve", "数据", "12345", "a"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=2_000_000, help="characters of message text")
    parser.add_argument("--turns", type=int, default=4, help="user/assistant exchanges")
    args = parser.parse_args()
    rng = random.Random(0)

    def text(chars: int) -> str:
        words, size = [], 0
        while size < chars:
            words.append(rng.choice(WORDS))
            size += len(words[-1]) + 1
        return " ".join(words)

    directory = write_chat_tokenizer(tempfile.mkdtemp(), [text(1000) for _ in range(50)], 600)
    encoder = ChatEncoder(directory, ChatSettings("hf"))
    warm = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    encoder.encode_conversations([conversation_from_record({"messages": warm}, ("messages",), "assistant")], [""])
    messages = []
    for _ in range(args.turns):
        messages += [{"role": role, "content": text(args.chars // (2 * args.turns))} for role in ("user", "assistant")]
    conversation = conversation_from_record({"messages": messages}, ("messages",), "assistant")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    (encoded,) = encoder.encode_conversations([conversation], [""])
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    print(f"{conversation.chars:,} characters, {args.turns} exchanges, {len(encoded.ids):,} tokens: peak RSS growth "
          f"{growth / 1e6:.1f} MB, {growth / conversation.chars:.0f} B per character, "
          f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
