#!/usr/bin/env bash
# Install with the test extra (the default line: mindformers 1.9.0 + mindspore 2.9.0) and run the whole suite.
# Extra args go to pytest. run_scripts/test_compat.sh runs the compatibility set on 1.8.0 + 2.7.2.
set -euo pipefail
cd "$(dirname "$0")/.."
source run_scripts/setup_env.sh test
python -m pytest -q tests "$@"
