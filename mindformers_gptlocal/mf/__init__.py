"""The one MindFormers boundary: every import of MindFormers, every base class and mixin taken from it, every
adapter answering what MindFormers calls on a model, every registry hook and every run-time patch lives in this
package. The model (``model/``) and the inference runtime (``runtime/``, ``generation/``, ``serve/``,
``evaluation/``'s model) import nothing of it and no MindFormers: a ``gptlocal generate``/``chat``/``serve``/``eval``
process never loads MindFormers. ``tests/test_import_rules.py`` holds both rules.

- ``model.py``: the classes MindFormers builds from a YAML, registered by name: ``GPTLocalConfig`` (MindFormers'
  ``PretrainedConfig`` + the model's own config) and ``GPTLocalForCausalLM`` (``PreTrainedModel`` and its mixins
  + the model's own Cells), and ``MindFormersAdapter``, what MindFormers' trainer and pipelines call besides
  ``construct``; ``transformer_config.py``: the model's config as MindFormers' ``TransformerConfig``.
- ``registration.py``: ``register()``, what the ``.pth`` hook and ``import mindformers_gptlocal`` run once
  MindFormers is loaded: the registered modules, then ``compat.apply()``.
- ``compat.py``: every run-time patch of MindFormers / MindSpore, each checked against the installed version.

Importing this package alone loads nothing; each module imports MindFormers when it is imported.
"""
