#!/usr/bin/env bash
# Create a venv (once) and install this package into it, with the given extra ("" or "test") and MindFormers line
# ("mf19", the default: mindformers 1.9.0 + mindspore 2.9.0 in ./.venv; "mf18", the compatibility pair:
# mindformers 1.8.0 + mindspore 2.7.2 in ./.venv-mf18). The pins are setup.cfg's extras of those names.
# Usage: source run_scripts/setup_env.sh [extra] [mf19|mf18]   (PYTHON=python3.10 picks the interpreter; default python3)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extra="${1:-}"
line="${2:-mf19}"
case "$line" in
  mf19) venv="$repo/.venv"; what="mindspore 2.9.0, mindformers 1.9.0" ;;
  mf18) venv="$repo/.venv-mf18"; what="mindspore 2.7.2, mindformers 1.8.0" ;;
  *)
    echo "setup_env.sh: unknown MindFormers line '$line': use mf19 (mindformers 1.9.0 + mindspore 2.9.0, the" \
         "default) or mf18 (mindformers 1.8.0 + mindspore 2.7.2)" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  # mindspore 2.7.2 and 2.9.0 publish wheels for CPython 3.9, 3.10 and 3.11 only
  version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)"
  case "$version" in
    3.9|3.10|3.11) ;;
    *)
      echo "setup_env.sh: $python is Python ${version:-(not found)}; mindformers-gptlocal needs Python 3.9-3.11" \
           "(mindspore 2.9.0 and 2.7.2 have wheels for those only). Install one and run e.g." \
           "PYTHON=python3.11 bash run_scripts/quickstart.sh" >&2
      return 1 2>/dev/null || exit 1
      ;;
  esac
  echo "setup_env.sh: creating $venv with $python (Python $version)"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
extras="$line"
[ -n "$extra" ] && extras="$extra,$line"
what="$what, oneDNN (onednn-cpu-gomp) and mindformers-gptlocal"
[ "$extra" = "test" ] && what="$what, with the test peers (torch CPU, transformers, peft, lm-eval, openai, fastapi)"
echo "setup_env.sh: installing $what into $venv (about 2 minutes the first time, seconds after)"
# non-editable on purpose: the install puts the .pth hook that registers gpt_local when mindformers is imported
"$venv/bin/python" -m pip install -q "$repo[$extras]"
# shellcheck disable=SC1091
source "$venv/bin/activate"
export GLOG_v="${GLOG_v:-3}"   # MindSpore: errors only on the console
