"""The inference runtime of ``generate``, ``chat``, ``eval`` and ``serve`` (and of ``model.generate``).

* ``loader.py`` -- the one loader of a model directory (checks, ``from_pretrained``, the compile cache);
* ``runner.py`` -- ``ModelRunner``: a ``model/kv_cache.py`` KV cache (storage plus its in-place write) and the
  compiled prefill / decode / greedy-steps graphs over it; ``RunnerPool``, the shapes a model keeps; ``runner_for``,
  which runner a model gets (its provider's ``runner`` choice);
* ``native.py`` -- ``NativeRunner``: the same interface on CPU with no graph: the forward over a numpy KV cache as one
  C++ call a step (``kernels/cpu_decoder.cc``), on zero-copy views of the model's Parameters;
* ``generate.py`` -- ``generate`` (what ``GPTLocalForCausalLM.generate`` is): prompts -> token lists over a runner,
  with ``generation/``'s options, sampling and decode loop;
* ``detokenizer.py`` -- tokens -> text incrementally, stop strings with a hold-back (OpenAI / vLLM behaviour);
* ``graph_cache.py`` -- compiled graphs kept across processes (``--compile-cache``), keyed by everything that
  shapes a graph, gpt_local's own sources included;
* ``buckets.py`` -- the few widths and batch sizes compiled.

Imported lazily: importing the package loads nothing heavy; ``runner.py`` and ``loader.load_model`` load
MindSpore. Above ``model/`` (it runs the model); the model reaches it only through its ``kv_cache`` and
``generate`` methods. The server's scheduler (``serve/scheduler.py``) decides which tokens each call runs; the
runner runs them.
"""
