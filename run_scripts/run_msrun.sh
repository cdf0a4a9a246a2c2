#!/usr/bin/env bash
# Many cards (or CPU processes) with MindSpore's msrun:
#   bash run_scripts/run_msrun.sh WORKERS CONFIG.yaml [run_mindformer.py flags...]
# e.g. 8 Ascend cards:   bash run_scripts/run_msrun.sh 8 model_configs/pretrain_gpt2_small_8p.yaml
#      2 CPU processes (data parallel): bash run_scripts/run_msrun.sh 2 model_configs/pretrain_gpt_local_tiny_cpu_dp2.yaml
# Set MASTER_PORT, LOG_DIR or JOIN (True/False) to change the defaults.
set -euo pipefail
workers="${1:?usage: run_msrun.sh WORKERS CONFIG.yaml [flags...]}"; config="${2:?config}"; shift 2
here="$(cd "$(dirname "$0")" && pwd)"
exec msrun --worker_num="$workers" --local_worker_num="$workers" --master_port="${MASTER_PORT:-8118}" \
  --log_dir="${LOG_DIR:-output/msrun_log}" --join="${JOIN:-True}" --cluster_time_out=300 \
  "$here/run_mindformer.py" --config "$config" --use_parallel True "$@"
