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
#
# The terminal shows this node's first worker without MindSpore's [WARNING]/[INFO] lines; every worker's whole output
# is LOG_DIR/worker_<rank>.log, msrun's own report LOG_DIR/msrun.log. Ctrl-C (SIGINT) or SIGTERM here is passed to
# this node's workers, which finish their step, save a checkpoint (every rank the same step) and end; this script
# then exits 130 / 143. A second one stops them at once.
set -euo pipefail
workers="${1:?usage: run_msrun.sh WORKERS CONFIG.yaml [flags...]}"; config="${2:?config}"; shift 2
local_workers="${LOCAL_WORKERS:-$workers}"
if (( workers % local_workers )); then
  echo "run_msrun.sh: WORKERS ($workers) must be a multiple of LOCAL_WORKERS ($local_workers)" >&2; exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
log_dir="${LOG_DIR:-output/msrun_log}"
first=$(( ${NODE_RANK:-0} * local_workers ))  # this node's first rank, shown on the terminal
mkdir -p "$log_dir"
rm -f "$log_dir/worker_$first.log"
echo "[gptlocal] run_msrun.sh: $local_workers of $workers workers here, showing rank $first; each rank's output:" \
     "$log_dir/worker_<rank>.log"

# msrun in a session of its own: the terminal's Ctrl-C reaches this script only, which passes it on to the workers
# (msrun would kill them at once: its own SIGINT handler SIGKILLs every worker).
setsid msrun --worker_num="$workers" --local_worker_num="$local_workers" \
  --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-8118}" --node_rank="${NODE_RANK:-0}" \
  --log_dir="$log_dir" --join="${JOIN:-True}" --cluster_time_out="${CLUSTER_TIME_OUT:-300}" \
  --tail_worker_log=-2 \
  "$here/run_mindformer.py" --config "$config" --use_parallel True "$@" >>"$log_dir/msrun.log" 2>&1 &
msrun_pid=$!
got=0
(  # the terminal's view, to msrun's end; not stopped by the Ctrl-C it passes on
  trap '' INT TERM
  tail -n +1 -F --pid="$msrun_pid" "$log_dir/worker_$first.log" 2>/dev/null \
    | grep --line-buffered -v -E '^\[(WARNING|INFO|DEBUG)\] ' || true
) &
tail_pid=$!

worker_pids() {  # msrun's children that are workers (the scheduler and the log tail are not)
  local pid
  for pid in $(ps -o pid= --ppid "$msrun_pid" 2>/dev/null); do
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx 'MS_ROLE=MS_WORKER'; then echo "$pid"; fi
  done
}

on_signal() {  # $1: the signal's number
  if (( got )); then  # the second: at once
    echo "[gptlocal] run_msrun.sh: signal again: stopping every worker now" >&2
    for pid in $(worker_pids); do kill -KILL -- "-$pid" 2>/dev/null || true; done  # each in a session of its own
    kill -KILL -- "-$msrun_pid" 2>/dev/null || true  # msrun's session: msrun, its scheduler, the log tail
    exit $((128 + $1))
  fi
  got=$1
  local name=INT; (( $1 == 15 )) && name=TERM
  for pid in $(worker_pids); do kill "-$name" "$pid" 2>/dev/null || true; done
}
trap 'on_signal 2' INT
trap 'on_signal 15' TERM

status=0
while true; do
  wait "$msrun_pid" && status=0 || status=$?
  kill -0 "$msrun_pid" 2>/dev/null || break  # wait returned for a trapped signal: msrun still runs
  if (( got )); then  # stopping: once every worker has saved and ended, msrun's scheduler is not waited for (it
    while [[ -n "$(worker_pids)" ]]; do sleep 0.2; done  # would wait out its heartbeat timeout first, ~30 s)
    kill -KILL -- "-$msrun_pid" 2>/dev/null || true
    break
  fi
done
wait "$tail_pid" 2>/dev/null || true
if (( got )); then
  exit $((128 + got))
fi
if (( status )); then
  echo "[gptlocal] run_msrun.sh: msrun failed (exit $status); each rank's output: $log_dir/worker_<rank>.log, msrun's" \
       "report: $log_dir/msrun.log" >&2
fi
exit "$status"
