"""Register gpt_local whenever ``mindformers`` is imported, with no flag or YAML change.

A ``.pth`` file installed next to the package (also by ``pip install -e .``) runs ``install()`` at
interpreter start; ``import mindformers_gptlocal`` runs it too. It only adds a meta-path finder (no
heavy import): when ``mindformers`` finishes importing, the finder calls
``mindformers_gptlocal.mf.registration.register()``, which registers the config, model, wrappers,
callbacks and tokenizer. A second finder does the same for ``lm_eval`` (lm-evaluation-harness): when
it finishes importing, ``mindformers_gptlocal.evaluation.harness`` registers the ``gptlocal`` model, so
``lm_eval --model gptlocal`` works. Set ``GPTLOCAL_NO_AUTOREGISTER=1`` to switch both off.

Right before ``mindformers`` runs, the hook imports ``tensorboardX`` with ``torch`` hidden: MindFormers
imports tensorboardX at start-up, whose writer tries ``import torch`` (only to accept torch tensors) and
so loads PyTorch into every MindFormers process of an environment that has it: RSS after ``import
mindformers`` 944 -> 716 MB; peak RSS of a LoRA finetune of GPT-2 small through ``gptlocal run`` 3,402-3,409
-> 3,171-3,177 MB (3,020-3,030 in a venv without torch). torch stays importable afterwards; a process that
imports tensorboardX itself (after mindspore) before mindformers keeps its full import. It also loads the one nltk module MindFormers
imports at start-up (BLEU) without nltk's package ``__init__`` (``import_bleu_without_nltk``; about a fifth of
``import mindformers``); nltk imported before mindformers is left whole. Each falls back to MindFormers' own import
by itself on any failure.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

TARGET = "mindformers"
REGISTRATION = "mindformers_gptlocal.mf.registration"
HARNESS_TARGET = "lm_eval"
HARNESS = "mindformers_gptlocal.evaluation.harness"


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``mindformers`` so the plugin is imported right after it."""

    target = TARGET

    def before(self):
        import_tensorboardx_without_torch()
        self.bleu = import_bleu_without_nltk()

    def after(self):
        forget_bare_nltk(getattr(self, "bleu", ()))
        importlib.import_module(REGISTRATION).register()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.target:
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
            self.before()
            original(module)
            self.after()

        spec.loader.exec_module = exec_module
        return spec


class _RegisterHarnessAfterImport(_RegisterAfterImport):
    """Wraps the loader of ``lm_eval`` so the ``gptlocal`` lm-eval model is registered right after it."""

    target = HARNESS_TARGET

    def before(self):
        pass

    def after(self):
        register_harness()


def register_harness():
    """Register ``gptlocal`` with lm-eval as a lazy "module:Class" entry (nothing heavy is imported until a
    run asks for it). Never breaks ``import lm_eval``: on an lm-eval without lazy entries the harness
    module is imported instead, and a failure there only leaves ``gptlocal`` unregistered."""
    try:
        import lm_eval.models  # noqa: F401  lm-eval's own models first: it fills only an empty registry itself
        from lm_eval.api.registry import model_registry
        if "gptlocal" not in model_registry:
            model_registry.register("gptlocal", target=HARNESS + ":GPTLocalLM")
    except Exception:  # pylint: disable=broad-except
        try:
            importlib.import_module(HARNESS)
        except Exception:  # pylint: disable=broad-except
            pass


def import_tensorboardx_without_torch():
    """Import tensorboardX while ``import torch`` fails (its writer catches the ImportError), then make torch
    importable again. Nothing happens when torch or tensorboardX is already loaded. Never breaks the import of mindformers: on any failure it only restores
    ``sys.modules`` and MindFormers imports tensorboardX itself."""
    if "tensorboardX" in sys.modules:
        return
    try:  # MindSpore first, as MindFormers imports it: its protobuf files must load before tensorboardX's
        importlib.import_module("mindspore")
    except Exception:  # pylint: disable=broad-except
        return  # MindFormers' own import reports it
    if "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # a None entry makes `import torch` raise ImportError
    try:
        importlib.import_module("tensorboardX")
    except Exception:  # pylint: disable=broad-except
        for name in [m for m in sys.modules if m == "tensorboardX" or m.startswith("tensorboardX.")]:
            del sys.modules[name]
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


BLEU = "nltk.translate.bleu_score"


def import_bleu_without_nltk():
    """MindFormers' metric module imports ``nltk.translate.bleu_score`` at start-up, and importing it runs nltk's
    package ``__init__`` (every corpus reader, tagger and chunker of nltk, with scipy and scikit-learn): about a
    fifth of ``import mindformers``. The module itself needs only ``nltk.util``, so it is loaded here under bare
    ``nltk`` and ``nltk.translate`` packages (their folders, not their ``__init__``). Returns the names this loaded;
    ``forget_bare_nltk`` drops them once MindFormers holds its two functions, so a later ``import nltk`` is the whole
    package, as before. Nothing happens when nltk is already loaded; any failure restores ``sys.modules`` and
    MindFormers imports nltk itself."""
    if any(m == "nltk" or m.startswith("nltk.") for m in sys.modules):
        return ()
    try:
        spec = importlib.util.find_spec("nltk")
    except Exception:  # pylint: disable=broad-except
        return ()
    if spec is None or not spec.submodule_search_locations:
        return ()
    bare = {}
    for name, folders in (("nltk", list(spec.submodule_search_locations)),
                          ("nltk.translate", [os.path.join(p, "translate") for p in spec.submodule_search_locations])):
        module = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, None, is_package=True))
        module.__path__ = folders
        bare[name] = module
    before = set(sys.modules)
    sys.modules.update(bare)
    try:
        importlib.import_module(BLEU)
        return tuple(sorted(set(sys.modules) - before))
    except Exception:  # pylint: disable=broad-except
        forget_bare_nltk(tuple(sorted(set(sys.modules) - before)))
        return ()
    finally:
        for name, module in bare.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


def forget_bare_nltk(names):
    """Drop the nltk modules ``import_bleu_without_nltk`` loaded (MindFormers keeps the functions it imported)."""
    for name in names:
        if name == "nltk" or name.startswith("nltk."):
            sys.modules.pop(name, None)


def install():
    """Called from the .pth file at interpreter start."""
    if os.environ.get("GPTLOCAL_NO_AUTOREGISTER") == "1":
        return
    if HARNESS_TARGET in sys.modules:
        register_harness()
    elif not any(type(f) is _RegisterHarnessAfterImport for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterHarnessAfterImport())
    if TARGET in sys.modules:
        return
    if not any(type(f) is _RegisterAfterImport for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
