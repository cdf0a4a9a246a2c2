#!/usr/bin/env bash
# Many cards (or CPU processes) with MindSpore's msrun, on one node or several:
#   bash run_scripts/run_msrun.sh WORKERS CONFIG.yaml [run_mindformer.py flags...]
# WORKERS is the total over all nodes. One node (the defaults):
#   bash run_scripts/run_msrun.sh 8 model_configs/pretrain_gpt2_small_8p.yaml
#   bash run_scripts/run_msrun.sh 2 model_configs/pretrain_gpt_local_tiny_cpu_dp2.yaml   # 2 CPU processes
# Several nodes: run the same line on every node, each with its NODE_RANK, all with node 0's address:
#   MASTER_ADDR=10.0.0.1 NODE_RANK=0 LOCAL_WORKERS=8 bash run_scripts/run_msrun.sh 64 model_configs/pretrain_gpt3_6.7b_64p.yaml
#   MASTER_ADDR=10.0.0.1 NODE_RANK=1 LOCAL_WORKERS=8 bash run_scripts/run_msrun.sh 64 model_configs/pretrain_gpt3_6.7b_64p.yaml  ...
# Environment: MASTER_ADDR (default 127.0.0.1), MASTER_PORT (8118), NODE_RANK (0), LOCAL_WORKERS (workers on
# this node; default WORKERS), LOG_DIR (output/msrun_log), JOIN (True: wait for the workers),
# CLUSTER_TIME_OUT (seconds to wait for all nodes; 300).
set -euo pipefail
workers="${1:?usage: run_msrun.sh WORKERS CONFIG.yaml [flags...]}"; config="${2:?config}"; shift 2
local_workers="${LOCAL_WORKERS:-$workers}"
if (( workers % local_workers )); then
  echo "run_msrun.sh: WORKERS ($workers) must be a multiple of LOCAL_WORKERS ($local_workers)" >&2; exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
exec msrun --worker_num="$workers" --local_worker_num="$local_workers" \
  --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-8118}" --node_rank="${NODE_RANK:-0}" \
  --log_dir="${LOG_DIR:-output/msrun_log}" --join="${JOIN:-True}" --cluster_time_out="${CLUSTER_TIME_OUT:-300}" \
  "$here/run_mindformer.py" --config "$config" --use_parallel True "$@"
