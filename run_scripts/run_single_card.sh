#!/usr/bin/env bash
# One card (or CPU): bash run_scripts/run_single_card.sh CONFIG.yaml [run_mindformer.py flags...]
# e.g. bash run_scripts/run_single_card.sh model_configs/pretrain_gpt_local_tiny_cpu.yaml --run_mode train
set -euo pipefail
config="${1:?usage: run_single_card.sh CONFIG.yaml [flags...]}"; shift
exec python "$(dirname "$0")/run_mindformer.py" --config "$config" "$@"
