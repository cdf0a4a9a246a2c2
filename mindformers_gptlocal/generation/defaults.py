"""The one table of generation defaults: what each way in picks when the caller gives nothing.

Four entry points, four audiences, so four columns of one table (read by their one user each):

* ``LIBRARY`` -- ``model.generate`` (MindFormers' GenerationConfig names and meanings: greedy unless
  ``do_sample``; read by ``generation/loop.py resolve_options``);
* ``CLI`` -- ``gptlocal generate`` / ``chat`` (litgpt's ``generate`` defaults: sampled at temperature 0.8 among
  the 50 most likely tokens, seeded so a run repeats; read by ``cli/args.py``);
* ``SERVE`` -- the OpenAI-compatible server (the OpenAI API's defaults: temperature 1, top_p 1, no top-k, 16
  new tokens on /v1/completions; read by ``serve/protocol.py`` and ``serve/scheduler.py``);
* ``EVAL`` -- ``gptlocal eval`` / ``lm_eval --model gptlocal`` (lm-eval's ``HFLM``: greedy unless the task's
  gen_kwargs sample, 256 new tokens at most, seed 1234; read by ``evaluation/harness.py``).

``LIBRARY_NEW_TOKENS`` is what ``model.generate`` produces at most when neither max_new_tokens nor max_length is
given (``generation/loop.py new_token_budget``).

``MINDFORMERS`` is MindFormers' own ``GenerationConfig`` defaults (what ``model.generation_config`` holds when
MindFormers builds it); the model's own ``generation_config`` (``model/config.py`` ``GenerationOptions``) mirrors it.
"""

LIBRARY = {"max_new_tokens": None, "max_length": None, "do_sample": False, "temperature": 1.0, "top_k": 0,
           "top_p": 1.0, "repetition_penalty": 1.0, "eos_token_id": None, "pad_token_id": None,
           "use_past": True, "seed": None}
CLI = {"max_new_tokens": 64, "chat_max_new_tokens": 128, "temperature": 0.8, "top_k": 50, "top_p": 1.0,
       "seed": 1234, "repetition_penalty": 1.0, "num_samples": 1}
SERVE = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "completion_max_tokens": 16, "repetition_penalty": 1.0,
         "n": 1}
EVAL = {"max_gen_toks": 256, "temperature": 0.0, "do_sample": False, "seed": 1234}
LIBRARY_NEW_TOKENS = 32
MINDFORMERS = {"max_new_tokens": None, "max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50,
               "top_p": 1.0, "repetition_penalty": 1.0, "eos_token_id": [], "pad_token_id": None,
               "use_past": False, "seed": None}
