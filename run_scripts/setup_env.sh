#!/usr/bin/env bash
# Create ./.venv (once) and install this package into it, with the given extra ("" or "test").
# Usage: source run_scripts/setup_env.sh [extra]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extra="${1:-}"
if [ ! -x "$repo/.venv/bin/python" ]; then
  python3 -m venv "$repo/.venv"
  "$repo/.venv/bin/python" -m pip install -q --upgrade pip
fi
spec="$repo"
[ -n "$extra" ] && spec="$repo[$extra]"
# non-editable on purpose: the install puts the .pth hook that registers gpt_local when mindformers is imported
"$repo/.venv/bin/python" -m pip install -q "$spec"
# shellcheck disable=SC1091
source "$repo/.venv/bin/activate"
export GLOG_v="${GLOG_v:-3}"   # MindSpore: errors only on the console
