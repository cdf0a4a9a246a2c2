"""The layer-sliced GPT model: config, parameter table, layers, attention, the model (embedding to loss), KV cache.

Light on import: ``params`` (the parameter table) is pure Python; the Cells load MindSpore when first asked for
(``from mindformers_gptlocal.model import GPTLocalForCausalLM``). Nothing here imports MindFormers: these are the
model's own classes; the ones MindFormers builds from a YAML (the same classes on MindFormers' bases) are
``mindformers_gptlocal.GPTLocalConfig`` / ``GPTLocalForCausalLM`` (``mf/model.py``).
"""
import importlib

_LAZY = {"GPTLocalForCausalLM": "gpt", "GPTLocalModel": "gpt", "GPTLocalBlock": "gpt",
         "ParallelAttention": "attention", "ParallelFeedForward": "gpt", "GPTLocalConfig": "config",
         "KVCache": "kv_cache"}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
