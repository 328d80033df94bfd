#!/usr/bin/env bash
# Llama 3 8B at 5M tokens on one 8xH100 node: cp=8 Untied Ulysses, FSDP2 over the 8 ranks,
# full checkpointing with block inputs offloaded to host memory, tiled MLP and loss, bf16.
#
#   bash examples/pretrain_llama_5m.sh DATA_PREFIX TOKENIZER_MODEL CHECKPOINT_DIR [extra flags...]
#
# The planner's limit for this node is 6,164,480 tokens with inputs fetched on demand:
#   bash examples/pretrain_llama_5m.sh ... --seq-length 6164480 --no-offload-prefetch
# (check first: python tools/estimate_memory.py --model llama3-8b --bf16 --num-gpus 8 ... --find-max-seq-length)
set -euo pipefail
DATA_PATH=${1:?data prefix (PREFIX of PREFIX.bin/.idx)}
TOKENIZER_MODEL=${2:?Llama 3 tokenizer.model (tiktoken format)}
CHECKPOINT_DIR=${3:?checkpoint directory}
shift 3
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

MODEL_ARGS=(
    --model llama3-8b
)
DATA_ARGS=(
    --data-path "$DATA_PATH"
    --tokenizer-type TikTokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
    --seq-length 5242880            # 5 x 2^20 tokens; divisible by cp
    --micro-batch-size 1
)
PARALLEL_ARGS=(
    --context-parallel-size 8
    --cp-impl untied_ulysses
    --untied-heads-per-stage 8      # one head per GPU per stage
)
MEMORY_ARGS=(
    --recompute-granularity full
    --offload-activations
    --offload-keep-last 1
    --tiled-mlp
    --tiled-loss
)
TRAINING_ARGS=(
    --bf16
    --train-iters 1000
    --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 20
    --weight-decay 0.1 --clip-grad 1.0
)
CHECKPOINT_ARGS=(
    # --load of an empty directory starts from scratch: one command starts and resumes the run.
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 50
    --exit-signal-handler           # SIGTERM / SIGUSR1: save at the next step and exit 0
)
LOGGING_ARGS=(
    --log-interval 1
    --log-dir "$CHECKPOINT_DIR/logs"
    --tensorboard-dir "$CHECKPOINT_DIR/tensorboard"
)

export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
torchrun --nproc-per-node "$GPUS_PER_NODE" -m megatron_lc.train \
    "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${MEMORY_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
