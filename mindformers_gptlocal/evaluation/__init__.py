"""Benchmark evaluation: gpt_local as an lm-evaluation-harness model (``harness.py``, name ``gptlocal``)."""
