#!/usr/bin/env bash
# Fine-tune Llama-3.1-8B-Instruct on chat data in 1M-token packed samples on one 8xH100 node: tokenize the
# conversations with the model's own chat template (a loss mask beside the ids: only the assistant's tokens are
# trained on), convert the model, fine-tune on whole conversations packed into samples (--packing documents),
# evaluate the validation part with the same loss, export back to Hugging Face.
#
#   bash examples/sft_llama3_8b_long.sh HF_DIR CHAT_JSONL WORK_DIR [extra training flags...]
#
# CHAT_JSONL: one {"messages": [{"role": ..., "content": ...}, ...]} per line (docs/sft.md for the other formats).
# The stack is the planner's auto-fit answer for one 1M-token sample a step (predicted on a DGX H100, not yet
# measured on a GPU; searched when the planner still counted a sample as one document): cp 8 ring attention, full
# recompute with each block's input and attention output offloaded early (the recompute runs no attention
# forward), tiled MLP and loss, bf16: 34.0 GiB GPU, 500 GiB host per node. Counted from the documents (the
# planner's packed clock, on bench/bench_packing.py's assumed chat mix; with --data-path, the data's own), the
# ring's document layouts rank split (each document cut head-tail over the ring: every ring rank the same work)
# at 20.2 s a step at FA3's kernel rates, 1.33x its floor of 15.1 s, local the same (20.2 s), and the plain 2R
# chunks (sequence) at 30.6 s, their slowest rank 2.3x the mean rank's pairs; the default full stack (Untied
# Ulysses, input-only offload) 24.1 s (docs/sft.md, docs/time_model.md). Auto-fit now ranks the document layouts
# too and prints --cp-document-layout; rerun it on your data to re-plan the stack:
#   python tools/estimate_memory.py --model llama3-8b --bf16 --num-gpus 8 --machine dgx-h100 \
#       --seq-length 1048576 --packing documents --data-path DATA --with-fa3 --auto-fit
# Environment variables for another run: SEQ_LENGTH, STEPS, GPUS_PER_NODE, CP, LAUNCH ("torchrun" or "python"),
# MEMORY_FLAGS, LONG_DOCUMENTS (stop, truncate or drop: conversations longer than a sample), WORKERS.
set -euo pipefail
HF_DIR=${1:?Hugging Face model directory (e.g. a download of meta-llama/Llama-3.1-8B-Instruct)}
CHAT=${2:?chat data: JSONL, one messages list per line}
WORK=${3:?work directory (data, checkpoints, logs, the export)}
shift 3
SEQ_LENGTH=${SEQ_LENGTH:-1048576}
STEPS=${STEPS:-500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CP=${CP:-8}
LAUNCH=${LAUNCH:-torchrun}
LONG_DOCUMENTS=${LONG_DOCUMENTS:-stop}
WORKERS=${WORKERS:-16}
read -r -a MEMORY <<< "${MEMORY_FLAGS:---cp-comm-type p2p --cp-document-layout split --recompute-granularity full --offload-mode early --keep-attention-output --tiled-mlp --tiled-loss --bf16}"

source "$(dirname "$0")/run_module.sh"
source "$(dirname "$0")/nccl_settings.sh"
source "$(dirname "$0")/resume_status.sh"

# Re-runnable: run it again after any interruption; the preprocessing and the conversion are not redone, and
# training goes on from WORK/ckpt once it holds a checkpoint (--finetune only starts it from the converted
# weights). When training stops to be resumed (a signal, a time limit: exit status 3), the script stops with 3.
mkdir -p "$WORK/data"
DATA="$WORK/data/sft_messages_document"
if [ ! -f "$DATA.idx" ]; then
    # Each conversation's ids are exactly the tokenizer's apply_chat_template(messages); the loss mask beside
    # them (DATA_loss_mask) keeps the assistant's turns only.
    python tools/preprocess_data.py --input "$CHAT" --output-prefix "$WORK/data/sft" --json-keys messages \
        --chat-template hf --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_DIR" --workers "$WORKERS"
fi
if [ ! -f "$WORK/converted/latest_checkpointed_iteration.txt" ]; then
    python tools/checkpoint/convert_from_hf.py --load "$HF_DIR" --save "$WORK/converted"
fi
if [ -f "$WORK/ckpt/latest_checkpointed_iteration.txt" ]; then
    FROM=(--load "$WORK/ckpt")  # this run's own progress
else
    FROM=(--load "$WORK/converted" --finetune)  # the converted weights, a new optimizer, schedule, data position
fi

COMMON=(--data-path "$DATA" --split 98,2,0 --seq-length "$SEQ_LENGTH" --packing documents
        --long-documents "$LONG_DOCUMENTS" --context-parallel-size "$CP")
before_launch "$WORK/ckpt"
status=0
run megatron_lc.train "${FROM[@]}" --use-checkpoint-args "${COMMON[@]}" \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_DIR" --micro-batch-size 1 "${MEMORY[@]}" \
    --train-iters "$STEPS" --lr 1e-5 --min-lr 1e-6 --lr-warmup-fraction 0.03 --weight-decay 0.0 --clip-grad 1.0 \
    --eval-interval 100 --eval-iters 10 --save "$WORK/ckpt" --save-interval 100 --save-interval-minutes 120 \
    --exit-signal-handler --data-cache-path "$WORK/data/cache" --log-dir "$WORK/logs" "$@" || status=$?
if stopped_to_resume "$status" "$WORK/ckpt"; then
    echo "fine-tuning stopped to be resumed: run this script again to go on"
    exit "$RESUME_STATUS"
fi
[ "$status" -eq 0 ] || exit "$status"
# The validation part's assistant-only loss, as training computed it (one JSON line).
run megatron_lc.evaluate --load "$WORK/ckpt" "${COMMON[@]}" --split-part valid --cp-impl untied_ulysses \
    | tee "$WORK/eval_valid.json"
python tools/checkpoint/convert_to_hf.py --load "$WORK/ckpt" --save "$WORK/hf-sft" --tokenizer-model "$HF_DIR"
