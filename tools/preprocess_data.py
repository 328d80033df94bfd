#!/usr/bin/env python3
"""Tokenize corpora into Megatron indexed datasets: PREFIX_{key}_document.{bin,idx}.

Example:
    python tools/preprocess_data.py --input 'corpus/*.jsonl' --output-prefix data/books \
        --tokenizer-type TikTokenizer --tokenizer-model llama3/tokenizer.model \
        --append-eod --workers 8

Conversations (OpenAI messages, ShareGPT, prompt/completion), with a loss mask beside the ids:
    python tools/preprocess_data.py --input 'chats/*.jsonl' --output-prefix data/chat \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model Llama-3.1-8B-Instruct/ \
        --json-keys messages --chat-template hf --workers 8

See docs/data.md for the inputs read, the handling of bad input, and the output; docs/sft.md for chat data.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron_lc.data.preprocess_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
