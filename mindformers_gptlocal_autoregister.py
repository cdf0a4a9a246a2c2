"""Register gpt_local whenever ``mindformers`` is imported, with no flag or YAML change.

A ``.pth`` file installed next to the package (also by ``pip install -e .``) runs ``install()`` at
interpreter start; ``import mindformers_gptlocal`` runs it too. It only adds a meta-path finder (no
heavy import): when ``mindformers`` finishes importing, the finder calls
``mindformers_gptlocal.registration.register()``, which registers the config, model, wrappers,
callbacks and tokenizer. Set ``GPTLOCAL_NO_AUTOREGISTER=1`` to switch it off.
"""
import importlib
import importlib.abc
import importlib.util
import os
import sys

TARGET = "mindformers"
REGISTRATION = "mindformers_gptlocal.registration"


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``mindformers`` so the plugin is imported right after it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            importlib.import_module(REGISTRATION).register()

        spec.loader.exec_module = exec_module
        return spec


def install():
    """Called from the .pth file at interpreter start."""
    if os.environ.get("GPTLOCAL_NO_AUTOREGISTER") == "1" or TARGET in sys.modules:
        return
    if not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
