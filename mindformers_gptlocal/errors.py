"""The errors gpt_local raises for bad input: one class per kind, each message names the key or file and the fix."""


class GPTLocalError(ValueError):
    """Base of every user-facing gpt_local error."""


class ConfigError(GPTLocalError):
    """A YAML/config key has a bad name, type or value."""


class DataError(GPTLocalError):
    """A data file is missing, empty, or holds tokens the model cannot embed."""


class CheckpointError(GPTLocalError):
    """A weights file is missing, corrupt, or belongs to another architecture or size."""


class CompatError(GPTLocalError):
    """The installed MindFormers/MindSpore moved or changed something a gpt_local patch relies on
    (``mf/compat.py``): the message names the patch, the target and the versions."""


class GPTLocalCompatWarning(UserWarning):
    """A gpt_local patch of MindFormers/MindSpore found its target moved (``mf/compat.py`` ``verify``)."""
