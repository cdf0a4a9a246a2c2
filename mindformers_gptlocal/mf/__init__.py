"""The one MindFormers boundary: every import of MindFormers, every class that subclasses or registers with it,
every run-time patch of it and every rewrite of its run YAML lives in this package; the rest of gpt_local imports
MindFormers' names only from here (``tests/test_import_rules.py`` enforces it).

``symbols``: every MindFormers name gpt_local uses, loaded on first use; ``registry``: the classes registered by
name (optimizer, metric, callbacks); ``wrapper``: the train-step Cells (subclasses of MindFormers' step);
``checkpoint_monitor``: the crash-safe ``CheckpointMonitor``; ``data_handler`` / ``tokenizer``: the instruction
handler and tokenizer MindFormers builds by name; ``logs``: MindFormers' logger and config dump held or quieted
for a ``gptlocal run``; ``run_yaml``: the keys the pre-flight sets in the run YAML for MindFormers' trainer.
"""
