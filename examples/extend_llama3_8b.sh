#!/usr/bin/env bash
# Extend a pretrained Llama-3.1-8B (Hugging Face) to 1M tokens on one 8xH100 node: convert, raise the rope base,
# train at growing lengths 128K -> 512K -> 1M (each stage resumes the last, the token stream continuing at the
# first token not yet trained), run the passkey test after each stage, export back to Hugging Face.
#
#   bash examples/extend_llama3_8b.sh HF_DIR DATA_PREFIX TOKENIZER_MODEL WORK_DIR [extra training flags...]
#
# Re-runnable: run it again after any interruption and each part resumes its own progress (the conversion
# and finished stages are not redone; a stage goes on from WORK_DIR/ckpt). When a stage stops to be
# resumed (a signal, a time limit: exit status 3), the script stops with status 3 instead of moving on.
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

source "$(dirname "$0")/run_module.sh"
source "$(dirname "$0")/nccl_settings.sh"
source "$(dirname "$0")/resume_status.sh"

step_of() {  # the step of the newest checkpoint in $1 (0 when none)
    cat "$1/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0
}

if [ ! -f "$WORK/converted/latest_checkpointed_iteration.txt" ]; then
    python tools/checkpoint/convert_from_hf.py --load "$HF_DIR" --save "$WORK/converted"
fi

read -r -a LENGTHS <<< "$STAGES"
TOTAL=$((STEPS * ${#LENGTHS[@]}))  # one schedule over every stage; each stage stops after its STEPS
END=0
for S in "${LENGTHS[@]}"; do
    END=$((END + STEPS))
    DONE=$(step_of "$WORK/ckpt")
    if [ "$DONE" -lt "$END" ]; then
        if [ "$DONE" -eq 0 ]; then
            FROM=(--load "$WORK/converted" --finetune)  # the converted weights, a new optimizer, schedule, data position
        else
            FROM=(--load "$WORK/ckpt")  # this stage's own progress, or the previous stage's end
        fi
        before_launch "$WORK/ckpt"
        status=0
        run megatron_lc.train "${MODEL[@]}" "${FROM[@]}" --use-checkpoint-args "${ROPE[@]}" \
            --data-path "$DATA_PATH" --split 99,1,0 --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL" \
            --reset-attention-mask --reset-position-ids --seq-length "$S" --micro-batch-size 1 --context-parallel-size "$CP" \
            "${MEMORY[@]}" --train-iters "$TOTAL" --lr 2e-5 --min-lr 2e-6 --lr-warmup-fraction 0.05 \
            --exit-interval "$STEPS" --save "$WORK/ckpt" --exit-signal-handler --log-dir "$WORK/logs/stage_$S" "$@" \
            || status=$?
        if stopped_to_resume "$status" "$WORK/ckpt"; then
            echo "stage $S stopped to be resumed at step $(step_of "$WORK/ckpt"): run this script again to go on"
            exit "$RESUME_STATUS"
        fi
        [ "$status" -eq 0 ] || exit "$status"
        rm -f "$WORK/passkey_$S.txt"  # trained further: its passkey test is redone
    fi
    if [ ! -s "$WORK/passkey_$S.txt" ]; then
        run megatron_lc.evaluate --load "$WORK/ckpt" --passkey --seq-length "$S" --passkey-trials "$PASSKEY_TRIALS" \
            --data-path "$DATA_PATH" --split 99,1,0 --context-parallel-size "$CP" --cp-impl untied_ulysses \
            --passkey-plot "$WORK/passkey_$S.png" > "$WORK/passkey_$S.txt.part"
        mv "$WORK/passkey_$S.txt.part" "$WORK/passkey_$S.txt"
        cat "$WORK/passkey_$S.txt"
    fi
done

python tools/checkpoint/convert_to_hf.py --load "$WORK/ckpt" --save "$WORK/hf-extended"
