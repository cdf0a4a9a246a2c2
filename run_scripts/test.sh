#!/usr/bin/env bash
# Install with the test extra and run the whole suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source run_scripts/setup_env.sh test
python -m pytest -q tests "$@"
