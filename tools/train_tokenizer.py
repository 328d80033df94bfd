#!/usr/bin/env python3
"""Train a small SentencePiece model (Llama-style: BPE, byte fallback) from a corpus.

The command line of `megatron_lc.data.train_tokenizer` (its docstring has the details).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron_lc.data.train_tokenizer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
