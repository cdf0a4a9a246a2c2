"""The one MindFormers boundary: every import of MindFormers, every base class and mixin taken from it, every
adapter answering what MindFormers calls on a model, every registry hook, every run-time patch and every rewrite
of its run YAML lives in this package; the rest of gpt_local takes MindFormers' names only from here. The model
(``model/``) and the inference runtime (``runtime/``, ``generation/``, ``serve/``, ``evaluation/``'s model) import
nothing of it and no MindFormers: a ``gptlocal generate``/``chat``/``serve``/``eval`` process never loads
MindFormers. ``tests/test_import_rules.py`` holds both rules.

- ``symbols.py``: every MindFormers name the rest of gpt_local uses, loaded on first use.
- ``model.py``: the classes MindFormers builds from a YAML, registered by name: ``GPTLocalConfig`` (MindFormers'
  ``PretrainedConfig`` + the model's own config) and ``GPTLocalForCausalLM`` (``PreTrainedModel`` and its mixins
  + the model's own Cells), and ``MindFormersAdapter``, what MindFormers' trainer and pipelines call besides
  ``construct``; ``transformer_config.py``: the model's config as MindFormers' ``TransformerConfig``.
- ``registry.py``: the classes registered by name (optimizer, metric, callbacks); ``wrapper.py``: the train-step
  Cells (subclasses of MindFormers' step); ``checkpoint_monitor.py``: the crash-safe ``CheckpointMonitor``;
  ``data_handler.py`` / ``tokenizer.py``: the instruction handler and tokenizer MindFormers builds by name.
- ``registration.py``: ``register()``, what the ``.pth`` hook and ``import mindformers_gptlocal`` run once
  MindFormers is loaded: the registered modules, then ``compat.apply`` (handed what the patches call above it).
- ``compat.py``: every run-time patch of MindFormers / MindSpore, each checked against the installed version (the
  boundary's lowest floor: the pre-flight calls it, it imports only ``errors``);
  ``logs.py``: MindFormers' logger and config dump held or quieted for a ``gptlocal run``; ``run_yaml.py``: the
  keys the pre-flight sets in the run YAML for MindFormers' trainer.

Importing this package alone loads nothing; each module imports MindFormers when it is imported.
"""
