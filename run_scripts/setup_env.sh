#!/usr/bin/env bash
# Create ./.venv (once) and install this package into it, with the given extra ("" or "test").
# Usage: source run_scripts/setup_env.sh [extra]      (PYTHON=python3.10 picks the interpreter; default python3)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extra="${1:-}"
python="${PYTHON:-python3}"
if [ ! -x "$repo/.venv/bin/python" ]; then
  # mindspore 2.7.2 publishes wheels for CPython 3.9, 3.10 and 3.11 only
  version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)"
  case "$version" in
    3.9|3.10|3.11) ;;
    *)
      echo "setup_env.sh: $python is Python ${version:-(not found)}; mindformers-gptlocal needs Python 3.9-3.11" \
           "(mindspore 2.7.2 has wheels for those only). Install one and run e.g." \
           "PYTHON=python3.11 bash run_scripts/quickstart.sh" >&2
      return 1 2>/dev/null || exit 1
      ;;
  esac
  echo "setup_env.sh: creating $repo/.venv with $python (Python $version)"
  "$python" -m venv "$repo/.venv"
  "$repo/.venv/bin/python" -m pip install -q --upgrade pip
fi
spec="$repo"
[ -n "$extra" ] && spec="$repo[$extra]"
what="mindspore 2.7.2, mindformers 1.8.0 and mindformers-gptlocal"
[ "$extra" = "test" ] && what="$what, with the test peers (torch CPU, transformers, peft, lm-eval, openai, fastapi)"
echo "setup_env.sh: installing $what into $repo/.venv (about 2 minutes the first time, seconds after)"
# non-editable on purpose: the install puts the .pth hook that registers gpt_local when mindformers is imported
"$repo/.venv/bin/python" -m pip install -q "$spec"
# shellcheck disable=SC1091
source "$repo/.venv/bin/activate"
export GLOG_v="${GLOG_v:-3}"   # MindSpore: errors only on the console
