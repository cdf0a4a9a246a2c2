#!/usr/bin/env bash
# The compatibility set on the other supported MindFormers line, mindformers 1.8.0 + mindspore 2.7.2 (installed into
# ./.venv-mf18 by setup_env.sh's mf18): registration and every patch's check, the launcher's training, eval,
# predict, finetune and resume, MindFormers' own --register_path route, LoRA through pet_config, generate, and the
# kernels' exactness tests. About 10 minutes. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source run_scripts/setup_env.sh test mf18
python -m pytest -q \
  tests/mf/test_registration.py \
  tests/mf/test_mindformers_compat.py \
  tests/e2e/test_launcher_runs.py \
  "tests/e2e/test_resume.py::test_resume_mindrecord_shuffled_is_exact_from_stock_rank0_layout" \
  "tests/peft/test_lora.py::test_pet_config_yaml_trains_only_the_adapters_and_resumes_exactly" \
  "tests/generation/test_generation.py::test_cache_gives_the_same_greedy_tokens_as_recomputation" \
  "tests/generation/test_generation.py::test_greedy_matches_transformers_generate" \
  tests/kernels \
  "$@"
