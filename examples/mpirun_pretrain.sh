#!/usr/bin/env bash
# The 5M-token run launched by mpirun (Open MPI) instead of torchrun. Rank 0's address is
# shared through mpi4py when MASTER_ADDR is unset (pip install 'megatron_lc[mpi]').
#
#   bash examples/mpirun_pretrain.sh HOSTFILE DATA_PREFIX TOKENIZER_MODEL CHECKPOINT_DIR
set -euo pipefail
HOSTFILE=${1:?hostfile}; DATA_PATH=${2:?data prefix}; TOKENIZER_MODEL=${3:?tokenizer}; CHECKPOINT_DIR=${4:?dir}
NP=${NP:-8}
# NVLS (NVLink SHARP) off: the memory plan does not model its buffers; these steps are all-to-all/p2p bound.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
mpirun -np "$NP" --hostfile "$HOSTFILE" --bind-to none -x PATH -x LD_LIBRARY_PATH \
    -x PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -x NCCL_NVLS_ENABLE \
    python -m megatron_lc.train \
    --model llama3-8b --bf16 \
    --data-path "$DATA_PATH" --tokenizer-type TikTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --reset-attention-mask \
    --seq-length 5242880 --context-parallel-size 8 --cp-impl untied_ulysses \
    --recompute-granularity full --offload-activations --tiled-mlp --tiled-loss \
    --train-iters 1000 --lr 1e-5 --min-lr 1e-6 --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" \
    --save-interval 50 --exit-signal-handler
