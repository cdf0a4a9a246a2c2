"""The inference runtime of ``generate``, ``chat``, ``eval`` and ``serve`` (and of ``model.generate``).

* ``runner.py`` -- ``ModelRunner``: a ``model/kv_cache.py`` KV cache (storage plus its in-place write) and the
  compiled prefill / decode / greedy-steps graphs over it; ``RunnerPool``, the shapes a model keeps; ``runner_for``,
  which runner a model gets (``runner_kind``);
* ``native.py`` -- ``NativeRunner``: the same interface on CPU with no graph: the forward over a numpy KV cache as one
  C++ call a step (``kernels/csrc/cpu_decoder.cc``), on zero-copy views of the model's Parameters;
* ``generate.py`` -- ``generate`` (what ``GPTLocalForCausalLM.generate`` is): prompts -> token lists over a runner,
  with ``generation/``'s options, sampling and decode loop;
* ``detokenizer.py`` -- tokens -> text incrementally, stop strings with a hold-back (OpenAI / vLLM behaviour);
* ``graph_cache.py`` -- compiled graphs kept across processes (``--compile-cache``), keyed by everything that
  shapes a graph, gpt_local's own sources included;
* ``buckets.py`` -- the few widths and batch sizes compiled, the greedy steps a call unrolls.

Imported lazily: importing the package loads nothing heavy; ``runner.py`` loads MindSpore. Below ``model/``: it
imports nothing of it and reads what the model describes (``model/describe.py`` ``Description``: per-layer
Parameters, layout facts, rope tables, the provider, the cache's storage), handed over with the model by
``GPTLocalForCausalLM.kv_cache`` (the model's ``generate`` hands over too); the loader of a model directory is
``model/loader.py``. The server's scheduler (``serve/scheduler.py``) decides which tokens each call runs; the
runner runs them.
"""
