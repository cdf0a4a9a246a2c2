#!/usr/bin/env bash
# Finetune on your instructions, offline, end to end on CPU:
#   1. an instruction data set from this machine's Python standard library (a function's signature as the
#      prompt, the first line of its docstring as the response), Alpaca JSONL, some records held out;
#   2. prepare-data --format alpaca: the prompt masked out of the loss, records packed into rows;
#   3. the base model's response-only loss on the held-out records;
#   4. LoRA finetune through MindFormers' trainer (model_configs/finetune_gpt_local_tiny_sft_lora_cpu.yaml:
#      pet_config, only the adapters train);
#   5. the held-out loss again, `gptlocal lora merge`, and the merged model's answers to three held-out prompts.
# The base model: BASE (default: the quickstart's tiny model, trained first if absent; or a converted GPT-2
# directory from `gptlocal convert hf2ms`). Environment: WORK (runs/sft_example), EPOCHS (3), SEQ (256),
# QUICKSTART_STEPS (240).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then source run_scripts/setup_env.sh; fi
export GLOG_v="${GLOG_v:-3}"
WORK="${WORK:-runs/sft_example}"
BASE="${BASE:-runs/quickstart/train/model}"
EPOCHS="${EPOCHS:-3}"
export SEQ="${SEQ:-256}"
mkdir -p "$WORK"
started=$(date +%s)

if [ ! -f "$BASE/model.safetensors" ]; then
  echo "== 0/5 no base model at $BASE: training the quickstart's tiny model first"
  gptlocal quickstart --steps "${QUICKSTART_STEPS:-240}"
fi

echo "== 1/5 instruction records from the standard library"
python run_scripts/sft_example.py data --out "$WORK/records"

echo "== 2/5 tokenize with the base model's tokenizer: prompts masked out of the loss"
gptlocal prepare-data --format alpaca --input "$WORK/records/train.jsonl" --tokenizer "$BASE/tokenizer.json" \
  --seq-length "$SEQ" --eval-fraction 0 --out "$WORK/data/train" --overwrite > "$WORK/prepare_train.json"
gptlocal prepare-data --format alpaca --no-pack --input "$WORK/records/heldout.jsonl" \
  --tokenizer "$BASE/tokenizer.json" --seq-length "$SEQ" --eval-fraction 0 --out "$WORK/data/heldout" \
  --overwrite > "$WORK/prepare_heldout.json"

echo "== 3/5 held-out response-only loss of the base model"
python run_scripts/sft_example.py loss --model "$BASE" --data "$WORK/data/heldout/train.mindrecord" \
  --label "before" 2> "$WORK/loss_before.json"

echo "== 4/5 LoRA finetune, $EPOCHS epochs, through MindFormers' trainer"
python run_scripts/sft_example.py yaml --base "$BASE" --data "$WORK/data/train/train.mindrecord" \
  --out-dir "$WORK/lora" --epochs "$EPOCHS" --path "$WORK/lora.yaml"
gptlocal run --config "$WORK/lora.yaml" > "$WORK/train.log" 2>&1 || { tail -30 "$WORK/train.log"; exit 1; }
grep -E "\[gptlocal\] LoRA" "$WORK/train.log" | head -1
grep -E "\[gptlocal\] step" "$WORK/train.log" | sed -n '1p;$p'
grep -E "\[gptlocal\] training done" "$WORK/train.log"

echo "== 5/5 held-out loss after, merge, answers"
python run_scripts/sft_example.py loss --model "$WORK/lora/model" --data "$WORK/data/heldout/train.mindrecord" \
  --label "after " 2> "$WORK/loss_after.json"
rm -rf "$WORK/merged"
gptlocal lora merge --base "$BASE" --adapter "$WORK/lora/model" --out "$WORK/merged"
python run_scripts/sft_example.py answer --model "$WORK/merged" --records "$WORK/records/heldout.jsonl" --count 3
echo "done in $(( $(date +%s) - started )) s; the LoRA run's model directory (base + adapters): $WORK/lora/model;"
echo "merged: $WORK/merged; PEFT adapter: gptlocal convert ms2hf --ms-dir $WORK/lora/model --out DIR --lora-only"
