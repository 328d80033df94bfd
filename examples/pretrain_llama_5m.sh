#!/usr/bin/env bash
# Llama 3 8B at 5M tokens on one 8xH100 node: cp=8 Untied Ulysses, FSDP2 over the 8 ranks,
# full checkpointing with block inputs offloaded to host memory, tiled MLP and loss, bf16.
#
#   bash examples/pretrain_llama_5m.sh DATA_PREFIX TOKENIZER_MODEL CHECKPOINT_DIR [extra flags...]
#
# Predicted (not yet measured on a GPU) at 56.88 GiB per GPU of a DGX H100's 79.11 GiB cards (2.83 GiB
# itemized reserve), torch's own kernels or flash-attn alike, and 1,240 GiB of page-locked host memory
# per node of the 1,703 GiB its 1,907 GiB leave after the itemized host reserve:
#   python tools/estimate_memory.py --model llama3-8b --bf16 --context-parallel-size 8 \
#       --cp-impl untied_ulysses --untied-heads-per-stage 8 --recompute-granularity full \
#       --offload-activations --tiled-mlp --tiled-loss --num-gpus 8 \
#       --seq-length 5242880 --nccl-channels 16 --nccl-p2p-channels-per-peer 16 [--with-flash-attn]
# The same stack reaches 7M tokens: examples/pretrain_llama_7m.sh.
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
    --reset-attention-mask          # attend within each document (Megatron's default attends across EODs)
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
    # the offload prefetch (default) starts after each block's backward peak: it costs no GPU memory
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
    --save-interval-minutes 240     # a step takes hours at 5M tokens: 50 steps would be days between saves
    --exit-signal-handler           # SIGTERM / SIGUSR1: save at the next step and exit 3 (resume me)
)
LOGGING_ARGS=(
    --log-interval 1
    --log-dir "$CHECKPOINT_DIR/logs"
    --tensorboard-dir "$CHECKPOINT_DIR/tensorboard"
)

source "$(dirname "$0")/memory_plan.sh"
# The planner's estimate of this run, made once (seconds): each step's peak is logged beside it.
memory_plan "$CHECKPOINT_DIR/memory_plan.json" "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    "${MEMORY_ARGS[@]}" "${TRAINING_ARGS[@]}" --num-gpus "$GPUS_PER_NODE" --machine dgx-h100 \
    --nccl-channels 16 --nccl-p2p-channels-per-peer 16 "$@"

export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
source "$(dirname "$0")/nccl_settings.sh"  # the NCCL settings the memory plan assumes, the same for every launcher
# Exit status 3 (torchrun: 1, with CHECKPOINT_DIR/stopped_to_resume.json): saved and stopped to be resumed;
# run the same command again.
torchrun --nproc-per-node "$GPUS_PER_NODE" -m megatron_lc.train \
    "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${MEMORY_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}" "${PLAN_FLAGS[@]}" "$@"
