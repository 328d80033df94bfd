#!/usr/bin/env bash
# Llama 3.2 3B at 3M tokens on one 8xH100 node: the 5M recipe with the 3B model and a
# 3 x 2^20-token sequence (flags given later win).
#
#   bash examples/pretrain_llama_3m.sh DATA_PREFIX TOKENIZER_MODEL CHECKPOINT_DIR [extra flags...]
set -euo pipefail
exec bash "$(dirname "$0")/pretrain_llama_5m.sh" "$@" --model llama3-3b --seq-length 3145728
