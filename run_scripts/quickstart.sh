#!/usr/bin/env bash
# The main job on a fresh machine: install, then prepare the stdlib corpus, train the tiny GPT-2 on CPU,
# report perplexity before/after and print a generated sample. Extra args go to `gptlocal quickstart`.
set -euo pipefail
cd "$(dirname "$0")/.."
source run_scripts/setup_env.sh
gptlocal quickstart "$@"
