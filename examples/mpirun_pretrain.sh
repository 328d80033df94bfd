#!/usr/bin/env bash
# The 5M-token run launched by mpirun (Open MPI) instead of torchrun, with the same NCCL settings
# (examples/nccl_settings.sh, forwarded to every rank with -x). Rank 0's address is shared through
# mpi4py when MASTER_ADDR is unset (pip install 'megatron_lc[mpi]').
#
#   bash examples/mpirun_pretrain.sh HOSTFILE DATA_PREFIX TOKENIZER_MODEL CHECKPOINT_DIR [extra flags...]
#
# Exit status 3: saved and stopped to be resumed (a signal, or a time limit): run the same command again.
set -euo pipefail
HOSTFILE=${1:?hostfile}; DATA_PATH=${2:?data prefix}; TOKENIZER_MODEL=${3:?tokenizer}; CHECKPOINT_DIR=${4:?dir}
shift 4
NP=${NP:-8}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
source "$(dirname "$0")/nccl_settings.sh"
FORWARD=(-x PATH -x LD_LIBRARY_PATH -x PYTORCH_CUDA_ALLOC_CONF)
for name in "${NCCL_VARIABLES[@]}"; do
    FORWARD+=(-x "$name")
done
mpirun -np "$NP" --hostfile "$HOSTFILE" --bind-to none "${FORWARD[@]}" \
    python -m megatron_lc.train \
    --model llama3-8b --bf16 \
    --data-path "$DATA_PATH" --tokenizer-type TikTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --reset-attention-mask \
    --seq-length 5242880 --context-parallel-size 8 --cp-impl untied_ulysses --untied-heads-per-stage 8 \
    --recompute-granularity full --offload-activations --offload-keep-last 1 --tiled-mlp --tiled-loss \
    --train-iters 1000 --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 \
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 50 --save-interval-minutes 240 \
    --exit-signal-handler --log-dir "$CHECKPOINT_DIR/logs" "$@"
