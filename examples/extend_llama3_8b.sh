#!/usr/bin/env bash
# Extend a pretrained Llama-3.1-8B (Hugging Face) to 1M tokens on one 8xH100 node: convert, raise the rope base,
# train at growing lengths 128K -> 512K -> 1M (each stage resumes the last, the token stream continuing at the
# first token not yet trained), run the passkey test after each stage, export back to Hugging Face.
#
#   bash examples/extend_llama3_8b.sh HF_DIR DATA_PREFIX TOKENIZER_MODEL WORK_DIR [extra training flags...]
#
# Each stage's memory stack is the default full stack (cp 8 Untied Ulysses, full recompute with block inputs
# offloaded, tiled MLP and loss, bf16). Predicted per GPU of a DGX H100 (planner, not yet measured on a GPU):
#   python tools/estimate_memory.py --model llama3-8b --bf16 --context-parallel-size 8 --cp-impl untied_ulysses \
#       --recompute-granularity full --offload-mode prefetch --tiled-mlp --tiled-loss --num-gpus 8 --seq-length S
#   S = 1,048,576: 28.30 GiB GPU, 248 GiB host per node, 489 s per step at FA2's kernel rates (286 s at FA3's);
#   shorter stages need less of both.
# Everything is an environment variable for a smaller run (the CPU test runs this script on a tiny model):
# STAGES (lengths), STEPS (optimizer steps per stage), GPUS_PER_NODE, CP, LAUNCH ("torchrun" or "python"),
# ROPE_FLAGS, MEMORY_FLAGS, MODEL_FLAGS, TOKENIZER_TYPE, PASSKEY_TRIALS.
set -euo pipefail
HF_DIR=${1:?Hugging Face model directory (e.g. a download of meta-llama/Llama-3.1-8B)}
DATA_PATH=${2:?data prefix (PREFIX of PREFIX.bin/.idx, tokenized with the model tokenizer)}
TOKENIZER_MODEL=${3:?the model tokenizer: tokenizer.model of Llama 3.1, tiktoken format}
WORK=${4:?work directory (checkpoints, logs, passkey plots, the export)}
shift 4
STAGES=${STAGES:-"131072 524288 1048576"}
STEPS=${STEPS:-200}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CP=${CP:-8}
LAUNCH=${LAUNCH:-torchrun}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-TikTokenizer}
PASSKEY_TRIALS=${PASSKEY_TRIALS:-5}
# The rope change of the extension: a 16x higher base over Llama 3.1's llama3 scaling (its factor 8 and its
# 8,192 original positions, read from the checkpoint); max_position_embeddings follows the trained length.
read -r -a ROPE <<< "${ROPE_FLAGS:---rotary-base 8000000}"
read -r -a MEMORY <<< "${MEMORY_FLAGS:---cp-impl untied_ulysses --recompute-granularity full --offload-mode prefetch --tiled-mlp --tiled-loss --bf16}"
read -r -a MODEL <<< "${MODEL_FLAGS:-}"

run() {  # one process per GPU under torchrun, or a single process
    if [ "$LAUNCH" = torchrun ]; then
        torchrun --nproc-per-node "$GPUS_PER_NODE" -m "$@"
    else
        python -m "$@"
    fi
}

python tools/checkpoint/convert_from_hf.py --load "$HF_DIR" --save "$WORK/converted"

read -r -a LENGTHS <<< "$STAGES"
TOTAL=$((STEPS * ${#LENGTHS[@]}))  # one schedule over every stage; each stage stops after its STEPS
LOAD="$WORK/converted"
FIRST=(--finetune)  # the converted weights, a new optimizer, schedule and data position
for S in "${LENGTHS[@]}"; do
    run megatron_lc.train "${MODEL[@]}" --load "$LOAD" --use-checkpoint-args "${FIRST[@]}" "${ROPE[@]}" \
        --data-path "$DATA_PATH" --split 99,1,0 --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL" \
        --reset-attention-mask --reset-position-ids --seq-length "$S" --micro-batch-size 1 --context-parallel-size "$CP" \
        "${MEMORY[@]}" --train-iters "$TOTAL" --lr 2e-5 --min-lr 2e-6 --lr-warmup-fraction 0.05 \
        --exit-interval "$STEPS" --save "$WORK/ckpt" --exit-signal-handler --log-dir "$WORK/logs/stage_$S" "$@"
    LOAD="$WORK/ckpt"
    FIRST=()
    run megatron_lc.evaluate --load "$WORK/ckpt" --passkey --seq-length "$S" --passkey-trials "$PASSKEY_TRIALS" \
        --data-path "$DATA_PATH" --split 99,1,0 --context-parallel-size "$CP" --cp-impl untied_ulysses \
        --passkey-plot "$WORK/passkey_$S.png" | tee "$WORK/passkey_$S.txt"
done

python tools/checkpoint/convert_to_hf.py --load "$WORK/ckpt" --save "$WORK/hf-extended"
