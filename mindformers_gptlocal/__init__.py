"""mindformers-gptlocal: GPT-2-family causal LMs for MindFormers' mcore path (``model_type: gpt_local``).

Importing this package is light: it loads neither MindSpore nor MindFormers. MindFormers learns of
gpt_local (``mf/registration.py`` ``register``) as soon as it is imported itself (the installed ``.pth`` hook,
or the same hook installed here), or right away if it is already loaded. The heavy names below are
loaded on first use: ``GPTLocalConfig`` and ``GPTLocalForCausalLM`` here are the classes MindFormers builds from a
YAML (``mf/model.py``: the model's own classes on MindFormers' bases, so asking for them loads MindFormers); the
model's own, MindFormers-free classes are ``mindformers_gptlocal.model``'s.
"""
import importlib
import sys

from .errors import GPTLocalError, ConfigError, DataError, CheckpointError

__version__ = "0.1.0"

_LAZY = {"GPTLocalConfig": ".mf.model", "GPTLocalForCausalLM": ".mf.model",
         "GPTLocalTrainOneStepCell": ".mf.wrapper"}

__all__ = ["GPTLocalConfig", "GPTLocalForCausalLM", "GPTLocalTrainOneStepCell", "GPTLocalError",
           "ConfigError", "DataError", "CheckpointError"]


def __getattr__(name):
    if name in _LAZY:
        from .mf.logs import quiet_import
        from .mf.registration import register
        with quiet_import():  # MindFormers' import-time warnings are not the caller's (no ./output/log either)
            register()
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register_with_mindformers():
    """Register now if MindFormers is loaded; otherwise when it is (the .pth hook's finder). The same hook
    registers the ``gptlocal`` lm-eval model now or when ``lm_eval`` is imported."""
    try:
        import mindformers_gptlocal_autoregister as hook
    except ImportError:  # a source tree without the hook module on sys.path: register on first heavy use
        hook = None
    if hook is not None:
        hook.install()
    if "mindformers" in sys.modules:
        from .mf.registration import register
        register()


_register_with_mindformers()
