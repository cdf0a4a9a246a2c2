"""mindformers-gptlocal: GPT-2-family causal LMs for MindFormers' mcore path (``model_type: gpt_local``).

Importing this package registers the config, model, CPU-safe train wrapper and
tokenizer with MindFormers' registries.
"""
from .configuration_gpt_local import GPTLocalConfig
from .model import GPTLocalForCausalLM
from .wrapper import GPTLocalTrainOneStepCell
from .errors import GPTLocalError, ConfigError, DataError, CheckpointError
from . import callbacks, checkpoint_monitor, metrics, optim, tokenizer_registry, compat

compat.install()
compat.register_auto_classes()

__version__ = "0.1.0"

__all__ = ["GPTLocalConfig", "GPTLocalForCausalLM", "GPTLocalTrainOneStepCell", "GPTLocalError",
           "ConfigError", "DataError", "CheckpointError"]
