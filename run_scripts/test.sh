#!/usr/bin/env bash
# Install with the test extra (the default line: mindformers 1.9.0 + mindspore 2.9.0) and run the whole suite on
# two pytest-xdist workers (-n 2), a whole test file per worker at a time (--dist loadfile: a file's module fixtures
# are made once), in collection order (--no-loadscope-reorder) with tests/conftest.py's LONGEST_FIRST files first.
# Extra args go to pytest (-n 0: one process). run_scripts/test_compat.sh runs the compatibility set
# on 1.8.0 + 2.7.2.
set -euo pipefail
cd "$(dirname "$0")/.."
source run_scripts/setup_env.sh test
python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests "$@"
