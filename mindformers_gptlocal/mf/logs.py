"""MindFormers' logger and config dump during ``gptlocal run``: held until the checks pass, then quiet on the terminal.

MindFormers' logger opens ``./output/log`` at its first call, and MindFormers 1.9 logs while ``import mindformers``
runs (its PyNative models' import warnings). ``HeldLog`` holds every call from the moment MindFormers' logger module
is loaded: when MindFormers is not imported yet, a one-shot import hook replaces the module's ``get_logger`` right
after the module runs, before the rest of ``import mindformers`` logs anything. A refused run drops what was held
and writes nothing; a run that passed its checks replays it into MindFormers' log under its output folder.
``config_dump_to_log`` sends the trainer's ~300-line pprint of the config to that log instead of the terminal.
``quiet_import`` is the same hold for a process that is not a run (``from mindformers_gptlocal import
GPTLocalForCausalLM``, ``gptlocal prepare-data``), where gpt_local imports MindFormers on the user's behalf: its
import-time warnings (optional PyNative models, MindSpore's deprecated-module notice) are dropped and no
``./output/log`` is created.

Both are run-time patches of MindFormers, listed in ``PATCHES`` (``compat.Patch``) and checked against
the installed MindFormers before use; neither is required: a moved target leaves MindFormers' logging as it is.
"""
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import logging
import pprint
import sys

from .compat import Patch, Target, check_patch

LOGGER = "mindformers.tools.logger"
CONFIG_DUMPERS = ("mindformers.trainer.base_trainer",
                  "mindformers.trainer.causal_language_modeling.causal_language_modeling")


def _every_log_call_asks_get_logger(import_module):
    """MindFormers' ``logger`` (a class of classmethods) must look ``get_logger()`` up at each call, so that
    replacing the module's ``get_logger`` holds every call."""
    import inspect
    try:
        source = inspect.getsource(import_module(LOGGER).logger)
    except (ImportError, AttributeError, OSError, TypeError) as err:
        return [f"cannot read {LOGGER}.logger ({err.__class__.__name__}: {err})"]
    calls = source.count("get_logger().")
    return [] if calls >= 4 else [f"{LOGGER}.logger calls get_logger() {calls} time(s), not at each log call"]


PATCHES = (
    Patch("MindFormers' log held until the checks pass", "mf/logs.py HeldLog",
          "MindFormers' logger creates ./output/log at its first call, and 1.9 logs during `import mindformers`; "
          "a refused `gptlocal run` must write nothing. get_logger is replaced while the config is read and "
          "checked (from the moment its module is loaded), and the held records are replayed once the run's output "
          "path is set.",
          (Target(LOGGER, "get_logger", ("logger_name", "kwargs")), Target(LOGGER, "logger")), False,
          _every_log_call_asks_get_logger),
    Patch("config dump to the log", "mf/logs.py config_dump_to_log",
          "The trainer pprints the whole config (~300 lines) to stdout before it compiles; without --verbose the "
          "module-level pprint its trainer modules imported is replaced, for the run's call only, by a write to "
          "MindFormers' log.",
          tuple(Target(module, "pprint") for module in CONFIG_DUMPERS), False),
)
BY_NAME = {patch.name: patch for patch in PATCHES}
_CHECKED = {}


def patch_ok(name):
    """Whether the patch ``name`` checks out on the installed MindFormers (checked once per process)."""
    if name not in _CHECKED:
        _CHECKED[name] = not check_patch(BY_NAME[name])
    return _CHECKED[name]


class _ListHandler(logging.Handler):
    """A logging handler that keeps the records, no I/O."""

    def __init__(self, records):
        super().__init__()
        self.records = records

    def emit(self, record):
        self.records.append(record)


class _AfterLoad(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """One-shot import hook: loads the module ``name`` as usual, then calls ``then(module)``."""

    def __init__(self, name, then):
        self.name, self.then, self.loader = name, then, None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        self.remove()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader  # the module's own loader again
        self.then(module)

    def remove(self):
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _hold_pending():
    return any(isinstance(finder, _AfterLoad) for finder in sys.meta_path)


@contextlib.contextmanager
def quiet_import():
    """Import MindFormers inside this block without its import-time log: nothing printed (MindFormers logs to
    stdout), no ``./output/log``. A no-op when MindFormers is loaded (or loading) already, or when a run's
    ``HeldLog`` holds its log."""
    if "mindformers" in sys.modules or _hold_pending():
        yield
        return
    held = HeldLog()
    try:
        yield
    finally:
        held.drop()


def _quiet_mindspore():
    """MindSpore's own Python logger at ERROR while MindFormers imports (its notice about a deprecated module
    MindFormers imports is no reader's business); returns (logger, level before) or None."""
    try:
        from mindspore import log as ms_log
        logger = ms_log._get_logger()  # pylint: disable=protected-access
    except (ImportError, AttributeError):
        return None
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    return logger, level


class HeldLog:
    """MindFormers' log calls while the config is read and checked, held in memory (``records``). Build it before
    anything imports MindFormers to hold its import-time calls too. ``release()`` (once the checks passed and the
    output path is set) hands them to MindFormers' logger; ``drop()`` (a refused run) forgets them."""

    def __init__(self):
        self.records = []
        self._logger = logging.Logger("gptlocal.held-mindformers-log")
        self._logger.addHandler(_ListHandler(self.records))
        self._module = self._original = self._hook = None
        self._mindspore = None if "mindformers" in sys.modules else _quiet_mindspore()
        if LOGGER in sys.modules:
            self._hold(sys.modules[LOGGER])
        elif "mindformers" not in sys.modules:  # held from the moment the module runs, inside `import mindformers`
            self._hook = _AfterLoad(LOGGER, self._hold)
            sys.meta_path.insert(0, self._hook)
        if self._module is None:  # mindformers half-imported, or the hook must wait: loaded now, held from here
            self._hold(importlib.import_module(LOGGER))  # the module (its package exports a class of that name)

    def _hold(self, module):
        if self._module is not None:
            return
        self._module = module
        self._original = module.get_logger
        if patch_ok("MindFormers' log held until the checks pass"):
            module.get_logger = lambda *args, **kwargs: self._logger

    def _restore(self):
        if self._mindspore is not None:
            logger, level = self._mindspore
            logger.setLevel(level)
            self._mindspore = None
        if self._hook is not None:
            self._hook.remove()
        if self._module is not None and self._module.get_logger is not self._original:
            self._module.get_logger = self._original

    def release(self, verbose=False):
        """Restore MindFormers' logger, quieted (``quiet_mindformers``), and replay the held records into it."""
        self._restore()
        real = quiet_mindformers(verbose)
        for record in self.records:
            real.handle(record)
        self.records.clear()

    def drop(self):
        self._restore()
        self.records.clear()


def quiet_mindformers(verbose=False):
    """MindFormers' logger writes everything to ``<output_dir>/log``; on the terminal it keeps errors only (the
    run's progress is gpt_local's own lines), unless ``verbose``. Returns the logger."""
    real = importlib.import_module(LOGGER).get_logger()
    for handler in real.handlers:
        if not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.INFO if verbose else logging.ERROR)
    return real


@contextlib.contextmanager
def config_dump_to_log(verbose=False):
    """MindFormers' trainer pprints the whole config (~300 lines) to stdout before it compiles; without
    ``verbose`` that dump goes to its log file (``<output_dir>/log``) instead. For this call only."""
    if verbose or not patch_ok("config dump to the log"):
        yield
        return
    mf_logger = importlib.import_module(LOGGER).logger
    modules = [importlib.import_module(name) for name in CONFIG_DUMPERS]
    saved = [(module, module.__dict__.get("pprint")) for module in modules]

    def to_log(value, *args, **kwargs):  # pylint: disable=unused-argument
        mf_logger.info("the run's config:\n%s", pprint.pformat(value))
    for module, original in saved:
        if original is not None:
            module.pprint = to_log
    try:
        yield
    finally:
        for module, original in saved:
            if original is not None:
                module.pprint = original
