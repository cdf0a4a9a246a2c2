"""Migration from MindFormers' own GPT-2 of the 1.x line: ``mf_yaml.py`` (``gptlocal migrate-yaml``).
The checkpoint converter is ``checkpoint/mf_gpt2.py``, the data rewrite ``data/mf_mindrecord.py``."""
