"""The layer-sliced GPT model: config, parameter table, layers, attention, the model (embedding to loss), KV cache.

Light on import: ``params`` (the parameter table) is pure Python; the Cells load MindSpore and
MindFormers when first asked for (``from mindformers_gptlocal.model import GPTLocalForCausalLM``).
"""
import importlib

_LAZY = {"GPTLocalForCausalLM": "gpt", "GPTLocalModel": "gpt", "GPTLocalBlock": "gpt",
         "ParallelAttention": "attention", "ParallelFeedForward": "gpt", "GPTLocalConfig": "config",
         "KVCache": "kv_cache"}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        from ..registration import register
        register()  # MindFormers first, so every registered class is in place before ours load
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
