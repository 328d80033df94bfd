#!/usr/bin/env bash
# Llama 3.1 70B at 5M tokens (5,242,880 = 5 x 2^20) on 4 nodes x 8 H100: one sequence over all 32 GPUs,
# hierarchical context parallelism (--cp-comm-type a2a+p2p, --hierarchical-context-parallel-sizes 8 4): Untied
# Ulysses all-to-alls inside each node, ring attention across the 4 nodes; FSDP2 over the 32 ranks; full
# checkpointing with block inputs offloaded to host memory, tiled MLP and loss, bf16.
#
# Run it on every node (torchrun's c10d rendezvous; MASTER_ADDR: the first node's address):
#   MASTER_ADDR=node0 bash examples/pretrain_llama_70b.sh DATA_PREFIX TOKENIZER_MODEL CHECKPOINT_DIR [extra flags...]
#
# Predicted (not yet measured on a GPU) on four DGX H100 nodes (79.11 GiB cards, itemized reserves): 63.52 GiB
# per GPU (3.04 GiB reserve), 1,580 GiB of page-locked block inputs per node of the 1,594 GiB its 1,907 GiB
# leave after the itemized host reserve; a predicted step of 14,981 s at FA2's rates, 8,643 s at FA3's:
#   python tools/estimate_memory.py --model llama3-70b --bf16 --num-gpus 32 --context-parallel-size 32 \
#       --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 8 4 --cp-impl untied_ulysses \
#       --recompute-granularity full --offload-activations --tiled-mlp --tiled-loss --seq-length 5242880
set -euo pipefail
DATA_PATH=${1:?data prefix (PREFIX of PREFIX.bin/.idx)}
TOKENIZER_MODEL=${2:?Llama 3 tokenizer.model (tiktoken format)}
CHECKPOINT_DIR=${3:?checkpoint directory}
shift 3
NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}

export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
source "$(dirname "$0")/nccl_settings.sh"  # the NCCL settings the memory plan assumes, the same for every launcher
# Exit status 3 (torchrun: 1, with CHECKPOINT_DIR/stopped_to_resume.json): saved and stopped to be resumed;
# run the same command again.
torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" -m megatron_lc.train \
    --model llama3-70b --bf16 \
    --data-path "$DATA_PATH" --tokenizer-type TikTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --reset-attention-mask \
    --seq-length 5242880 --micro-batch-size 1 \
    --context-parallel-size 32 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 8 4 \
    --cp-impl untied_ulysses \
    --recompute-granularity full --offload-activations --tiled-mlp --tiled-loss \
    --train-iters 1000 --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 \
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 10 --save-interval-minutes 240 --exit-signal-handler \
    --log-interval 1 --log-dir "$CHECKPOINT_DIR/logs" --tensorboard-dir "$CHECKPOINT_DIR/tensorboard" "$@"
