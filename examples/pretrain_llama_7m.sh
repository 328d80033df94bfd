#!/usr/bin/env bash
# Llama 3 8B at 7M tokens (7,077,888 = 6.75 x 2^20) on one 8xH100 node: the 5M recipe's stack
# (cp=8 Untied Ulysses, full checkpointing with block inputs offloaded and prefetched, tiled MLP
# and loss, bf16) at a longer sequence (flags given later win).
#
#   bash examples/pretrain_llama_7m.sh DATA_PREFIX TOKENIZER_MODEL CHECKPOINT_DIR [extra flags...]
#
# Predicted (not yet measured on a GPU) at 70.15 GiB per GPU of a DGX H100's 79.11 GiB cards (2.93 GiB
# itemized reserve), torch's own kernels or flash-attn alike. The host side is the bound: 1,674 GiB of
# page-locked block inputs per node of the 1,701 GiB a DGX H100's 1,907 GiB leave after the itemized
# host reserve (struct page, page-locking bookkeeping, 8 processes, checkpoint staging, the OS):
#   python tools/estimate_memory.py --model llama3-8b --bf16 --context-parallel-size 8 \
#       --cp-impl untied_ulysses --untied-heads-per-stage 8 --recompute-granularity full \
#       --offload-activations --tiled-mlp --tiled-loss --num-gpus 8 \
#       --seq-length 7077888 --nccl-channels 16 --nccl-p2p-channels-per-peer 16 [--with-flash-attn]
set -euo pipefail
exec bash "$(dirname "$0")/pretrain_llama_5m.sh" "$@" --seq-length 7077888
