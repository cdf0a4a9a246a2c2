"""Compiled graphs kept across processes: MindSpore's compile cache, one stored graph per key (``GraphCache``).

Off unless a caller puts a ``GraphCache`` on a model (``attach(model, setting, model_dir)``, or
``model.graph_cache = GraphCache(root, salt)``): the CLI does, through its ``--compile-cache on|off|DIR`` (default
on): ``gptlocal eval`` for its scoring graphs, and ``gptlocal eval``, ``generate``, ``chat`` and ``serve`` for
``generate``'s and the server's (the runner's prefill, one-token and greedy-steps graphs, through
``cached_call`` in ``runtime/runner.py``). ``model.generate`` in a user's own script is
uncached unless the script attaches one. A loaded graph skips the compile's time and, measured, most of the host
heap the compile leaves behind (docs/performance.md "What holds a compiled graph's host heap").

What MindSpore 2.7.2 does on CPU, as observed (``tests/generation/test_graph_cache.py`` runs a second process on
the stored graphs): with ``enable_compile_cache`` on, the graph of each compile is written to (or loaded from)
``<path>/rank_0/graph_cache/compile_cache_<k>.mindir``, where ``k`` counts the process's compiles with the cache
on (loads included), and ``<path>`` is read at the process's first such compile and never again (an msrun worker
of rank r: ``<path>/rank_<r>/graph_cache/MS_WORKERcompile_cache_<k>.mindir``, measured with MindSpore 2.9:
``_rank_folder``, ``_file_prefix``). A load is
checked only against ``compile_dependency.hash`` (written at ``k`` = 0: a sha256 over the entry script and its
imports outside site-packages), never against the graph it stands for: a process caching graphs in another
order than the one that wrote the folder loads another graph's file (seen: nan, or a shape error). So MindSpore's folder is used here only as a per-process staging folder, and the graphs live in a
store of our own, one folder per key: before the process's ``k``-th cached compile the graph stored under this
call's key (if any) is copied in as ``compile_cache_<k>.mindir``; after a miss the file MindSpore wrote there is
moved into the key's folder. A stored file is only ever handed to a compile of the same key, so the worst case
is a miss (a compile, as without the cache). Also measured: once a cached compile of a process finds no file,
MindSpore loads nothing more in that process ("Check the consistency of dependency files hash failed"); so
compile 0 of every process is a one-op anchor graph that is stored from the first run on (``_anchor``), a process
whose graphs are all stored loads them all, and one with a new graph loads those before it and compiles (and
stores again) those after it: a run repeated loads everything, a changed run converges in the next one.

The key is everything that shapes the graph: gpt_local's own sources (every .py/.cc/.h of the package, hashed once
per process: ``source_digest``; MindSpore's own dependency check does not look into site-packages), MindSpore's
version, mode and device, its ``MS_*`` switches, the caller's ``salt`` (the commands': the model's config.json,
which holds every setting that picks a kernel), the
called Cell's tree (each sub-Cell's class and plain attributes such as ``decode_steps``, ``batch_size``,
``max_length``, and the names of the methods its build bound, such as ``ParallelAttention.rotate``; every Parameter's
name, shape and dtype; the values of its constant Tensors; its primitives' attributes) and the call's arguments (shapes and dtypes of Tensors and numpy arrays, values of constants such as
``fresh_prefill``). Weights are not in a graph: a model of the same config with other weights loads the graph
and computes with its own.

Eviction (``prune``, once per root per process, at the first ``GraphCache``): stored graphs not used for ``days``
(``--compile-cache-days``, ``GraphCache(..., days=)``, default 14) go, then the least recently used until the store
is under ``max_mb`` (``--compile-cache-mb``, default 1024); staging folders of processes gone. A use touches the
key's folder.
"""
import atexit
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import weakref

from ..errors import ConfigError

STORED = "graph.mindir"
TIMING = "first_call_seconds"
DEFAULT_DAYS, DEFAULT_MB = 14.0, 1024.0  # --compile-cache-days / --compile-cache-mb
_PRUNED = set()  # roots pruned in this process
# Cell attributes MindSpore sets per compile or per call (phase names, argument keys): not the graph's
VOLATILE = frozenset(("arguments_key", "phase", "compile_phase", "current_phase", "cell_init_args", "phase_cache",
                      "exist_names", "exist_objs", "is_top_cell", "create_time", "total_instance_count"))
# MindSpore's switches that are not a graph's: where msrun's scheduler listens (a free port per launch)
CLUSTER_ADDRESS = frozenset(("MS_SCHED_HOST", "MS_SCHED_PORT"))
_PROCESS = {}  # the one staging folder of this process, and the count of its cached compiles


def default_root():
    """The store's default folder: ``$XDG_CACHE_HOME/mindformers_gptlocal/compile`` (else ``~/.cache/...``),
    beside the kernels' builds."""
    from ..kernels.abi.build import user_cache
    return user_cache("compile")


def staging_base():
    """Where the processes' staging folders live (one each, removed at exit): ``$TMPDIR/gptlocal-graph-staging``."""
    return os.path.join(tempfile.gettempdir(), "gptlocal-graph-staging")


OFF = ("off", "false", "0", "no", "none", "")


def store_root(setting):
    """The store a compile-cache setting names: None for ``off`` (and None, false, 0, no, none, empty),
    ``default_root()`` for ``on`` (true, 1, yes), else the setting as a folder. Every setting of it reads it here
    (``--compile-cache``, ``runner_wrapper.compile_cache``)."""
    text = "off" if setting is None else str(setting)
    if text.lower() in OFF:
        return None
    return default_root() if text.lower() in ("on", "true", "1", "yes") else text


def attach(model, setting, model_dir, flag="--compile-cache", days=None, max_mb=None):
    """Put a ``GraphCache`` on ``model`` as a ``--compile-cache`` value says (``off``: none; ``on``:
    ``default_root()``; else a folder), salted with the digest of ``model_dir``'s config.json, kept within ``days``
    / ``max_mb`` (``--compile-cache-days`` / ``--compile-cache-mb``; None: the defaults); returns it (or None).
    Every ``gptlocal`` command that takes the flags reads them here."""
    cache = None
    root = store_root(setting)
    if root is not None:
        with open(os.path.join(model_dir, "config.json"), "rb") as handle:
            cache = GraphCache(root, {"config.json": hashlib.sha256(handle.read()).hexdigest()}, flag=flag,
                               days=days, max_mb=max_mb)
    model.graph_cache = cache
    return cache


def cached_call(lm, cell, *args):
    """``cell(*args)``, through ``lm.graph_cache`` where the model has one (``GraphCache.call``), else plainly."""
    cache = getattr(lm, "graph_cache", None)
    if cache is None:
        return cell(*args)
    return cache.call(cell, args)[0]


def package_root():
    """The folder of gpt_local's package (whose sources ``source_digest`` hashes)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_digest(root=None):
    """sha256 of gpt_local's own sources (every .py and kernel .cc/.h/.c/.cpp under the package folder, by relative
    path and content), once per process: a cached graph is only reused by the same code. ``root``: another copy
    of the package (tests)."""
    root = package_root() if root is None else os.path.abspath(root)
    memo = _PROCESS.setdefault("sources", {})
    if root not in memo:
        digest = hashlib.sha256()
        for folder, dirs, files in sorted(os.walk(root)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".cc", ".h", ".c", ".cpp")):
                    path = os.path.join(folder, name)
                    digest.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as handle:
                        digest.update(handle.read())
        memo[root] = digest.hexdigest()
    return memo[root]


def bound(value, default, flag):
    """``value`` (None: ``default``) as a number >= 0, else one gpt_local error naming ``flag``."""
    if value is None:
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if number < 0:
        raise ConfigError(f"{flag} {value!r} must be a number >= 0 (days / MB of the compile cache to keep; leave it "
                          f"out for the default {default:g}).")
    return number


def bounds(days=None, max_mb=None):
    """(days, max_mb) as numbers, their defaults where None; one error naming the flag of a bad one."""
    return bound(days, DEFAULT_DAYS, "--compile-cache-days"), bound(max_mb, DEFAULT_MB, "--compile-cache-mb")


def _folder_bytes(folder):
    total = 0
    for name in os.listdir(folder):
        try:
            total += os.stat(os.path.join(folder, name)).st_size
        except OSError:
            pass
    return total


def prune(root, days=DEFAULT_DAYS, max_mb=DEFAULT_MB, now=None):
    """Remove stored graphs unused for ``days``, then the least recently used until the store holds at most
    ``max_mb`` MB, and staging folders whose process is gone. Returns the names removed. One ``listdir`` and a few
    ``stat`` per folder: cheap at startup."""
    now = time.time() if now is None else now
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    folders = []
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        try:
            used = os.stat(path).st_mtime
            folders.append((used, name, _folder_bytes(path)))
        except OSError:
            continue
    folders.sort(reverse=True)  # most recently used first
    kept_bytes = 0
    for used, name, size in folders:
        if now - used > days * 86400 or kept_bytes + size > max_mb * 2 ** 20:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
        else:
            kept_bytes += size
    staging = staging_base()
    for name in os.listdir(staging) if os.path.isdir(staging) else ():
        pid = name.split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(staging, name), ignore_errors=True)
            removed.append(os.path.join(staging, name))
    return removed


def _describe(value):
    """A value's part of a key: plain values as they are, Tensors by shape and dtype."""
    from mindspore import Tensor
    if isinstance(value, Tensor):
        return ["tensor", list(value.shape), str(value.dtype)]
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # a numpy array (or scalar)
        return ["array", list(value.shape), str(value.dtype)]
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, (tuple, list)):
        return [_describe(v) for v in value]
    return ["object", type(value).__name__]


def cell_description(cell):
    """Everything of a Cell tree that shapes its graph, as JSON-able data: per sub-Cell its class, plain
    attributes (``add_flags`` and ``recompute()`` set theirs there), constant Tensors (shape, dtype, content digest),
    primitives (name and attributes); every Parameter by name, shape, dtype and whether it trains (weights are bound
    by name at load, not baked in); the code of its classes outside gpt_local (``class_sources``)."""
    from mindspore import Parameter, Tensor
    from mindspore.ops import Primitive
    cells = []
    for name, sub in cell.cells_and_names():
        plain, consts, prims = {}, {}, {}
        for attr, value in sorted(vars(sub).items()):
            if attr.startswith("_") or attr in VOLATILE:
                continue
            if isinstance(value, Parameter):
                continue
            if isinstance(value, Tensor):
                if value.has_init:  # an initializer not run yet: its description, no bytes
                    consts[attr] = [list(value.shape), str(value.dtype), str(value.init)]
                else:
                    consts[attr] = [list(value.shape), str(value.dtype),
                                    hashlib.sha256(value.asnumpy().tobytes()).hexdigest()]
            elif isinstance(value, Primitive):
                prims[attr] = [value.name, sorted((k, repr(v)) for k, v in value.attrs.items())]
            elif isinstance(value, (bool, int, float, str, type(None), tuple, list)):
                plain[attr] = _describe(value)
            elif getattr(value, "__self__", None) is sub and hasattr(value, "__func__"):
                plain[attr] = ["method", value.__func__.__name__]  # a step the build bound (ParallelAttention.rotate)
        cells.append([name, type(sub).__module__ + "." + type(sub).__qualname__, plain, consts, prims])
    params = [[p.name, list(p.shape), str(p.dtype), p.requires_grad] for p in cell.get_parameters()]
    return {"cells": cells, "parameters": params, "classes": class_sources(cell)}


def class_sources(cell):
    """sha256 over the source files of every class of ``cell``'s tree and their bases outside gpt_local (whose
    sources ``source_digest`` covers): MindFormers' and MindSpore's Cells (a training step's wrapper, optimizer,
    learning-rate schedule) are keyed by their code, not only their version. Each file hashed once a process."""
    memo = _PROCESS.setdefault("class_files", {})
    ours = package_root()
    files = set()
    for _, sub in cell.cells_and_names():
        for klass in type(sub).__mro__:
            module = sys.modules.get(klass.__module__)
            path = getattr(module, "__file__", None)
            if path and not os.path.abspath(path).startswith(ours + os.sep):
                files.add(os.path.abspath(path))
    digest = hashlib.sha256()
    for path in sorted(files):
        if path not in memo:
            try:
                with open(path, "rb") as handle:
                    memo[path] = hashlib.sha256(handle.read()).hexdigest()
            except OSError:
                memo[path] = "unreadable"
        digest.update(f"{path}:{memo[path]}\n".encode())
    return digest.hexdigest()


def dependency_hash():
    """The ``compile_dependency.hash`` MindSpore 2.7.2 writes and checks: sha256 over the concatenated sha256 hex
    digests of the entry script and its imports outside site-packages, in path order (measured equal to the file
    it writes); None where it cannot be made (no entry script on disk: ``python -c``)."""
    try:
        from mindspore.graph import api  # MindSpore 2.9 (its mindspore.common.api is a deprecated alias that warns)
    except ImportError:
        from mindspore.common import api
    entry = getattr(api, "entry_script_path", None)
    if entry is None or not os.path.isfile(entry) or not hasattr(api, "_get_compile_cache_dep_files"):
        return None
    digests = []
    for path in sorted(api._get_compile_cache_dep_files()):  # pylint: disable=protected-access
        with open(path, "rb") as handle:
            digests.append(hashlib.sha256(handle.read()).hexdigest())
    return hashlib.sha256("".join(digests).encode()).hexdigest()


class GraphCache:
    """Compiled graphs of one model through MindSpore's compile cache, a stored graph per key (module doc).

    ``root``: the store (``kernels/abi/build.user_cache("compile")`` for ``gptlocal eval``); ``salt``: anything else
    the caller knows shapes the graphs (JSON-able; the eval's: its config.json digest). ``call(cell, args)`` runs
    one call; only a call whose (Cell, argument signature) this process has not run yet goes through the cache."""

    def __init__(self, root, salt=None, flag="compile cache", days=None, max_mb=None):
        self.root = os.path.abspath(os.path.expanduser(str(root)))
        if os.path.exists(self.root) and not os.path.isdir(self.root):  # ``flag``: the setting the error names
            raise ConfigError(f"{flag}{'' if flag.endswith('=') else ' '}{root!r} is a file; give on, off or a "
                              f"folder for the cached graphs.")
        self.salt = salt
        self.days, self.max_mb = bounds(days, max_mb)
        self._seen = weakref.WeakKeyDictionary()  # Cell -> argument signatures it has run
        self.hits = self.misses = 0
        if self.root not in _PRUNED:
            _PRUNED.add(self.root)
            prune(self.root, self.days, self.max_mb)

    def key(self, cell, args):
        """The key of ``cell(*args)``'s graph: a folder name under ``root``."""
        import mindspore as ms
        switches = {k: v for k, v in sorted(os.environ.items())
                    if k.startswith("MS_") and not k.startswith("MS_COMPILER_CACHE") and k not in CLUSTER_ADDRESS}
        text = json.dumps({"source": source_digest(), "mindspore": ms.__version__, "mode": ms.get_context("mode"),
                           "device": ms.get_context("device_target"), "switches": switches, "salt": self.salt,
                           "cell": cell_description(cell), "args": _describe(list(args))}, sort_keys=True)
        kind = type(cell).__name__.lower()
        return f"{kind}-" + hashlib.sha256(text.encode()).hexdigest()[:32]

    def call(self, cell, args, run=None):
        """(``cell(*args)``, the seconds this graph's first-ever call took, kept in its folder, or None where the
        call was not a new graph through the cache). A loaded graph's first call is fast, so callers that plan by
        compile costs (``WidthPlan``) are given the kept first call instead. ``run``: what compiles ``cell`` for
        ``args`` if not ``cell(*args)`` (a training step's wrapper passes its own ``compile``)."""
        run = run or (lambda: cell(*args))
        signature = json.dumps(_describe(list(args)))
        seen = self._seen.setdefault(cell, set())
        if signature in seen:
            return run(), None
        seen.add(signature)
        if _why_not():
            return run(), None
        return self._through_cache(cell, args, run)

    @property
    def disabled(self):
        """Why caching stopped in this process, or None."""
        return _PROCESS.get("why")

    def _through_cache(self, cell, args, run):
        _staging(self.root)
        if _PROCESS.get("why"):
            return run(), None
        folder = os.path.join(self.root, self.key(cell, args))
        result, seconds, hit = _cached_compile(cell, args, folder, run)
        if seconds is None:  # not a compile of ours (or caching just stopped)
            return result, None
        if hit:
            self.hits += 1
            return result, _read_seconds(os.path.join(folder, TIMING))
        self.misses += 1
        return result, seconds


def _cached_compile(cell, args, folder, run=None):
    """``cell(*args)`` as the process's next cached compile k: the graph stored in ``folder`` copied in as file
    k first, or (a miss) the file MindSpore writes moved into ``folder`` after. Returns (result, the call's
    seconds or None where it compiled nothing or caching stopped, whether MindSpore loaded the stored graph: the
    copy is dated 1970 and a compile rewrites it)."""
    import mindspore as ms
    run = run or (lambda: cell(*args))
    index = _PROCESS["count"]
    graphs = _PROCESS["graphs"]
    staged = os.path.join(graphs, f"{_PROCESS['prefix']}compile_cache_{index}.mindir")
    if os.path.exists(staged):  # a cached compile this process did not make through here: stop trusting k
        _disable(f"{staged} exists before compile {index}")
        return run(), None, False
    stored = os.path.join(folder, STORED)
    copied = os.path.isfile(stored)
    if copied:
        try:
            shutil.copyfile(stored, staged)
            os.utime(staged, (0, 0))
        except OSError:  # pruned by another process meanwhile: a miss
            copied = False
            if os.path.exists(staged):
                os.remove(staged)
    before = len(cell.compile_cache)
    _set_cache(ms, True, _PROCESS["staging"])
    started = time.perf_counter()
    try:
        result = run()
    finally:
        _set_cache(ms, False, ".")
    seconds = time.perf_counter() - started
    compiled = len(cell.compile_cache) - before
    if compiled != 1:  # no compile (the graph existed already) or more than one: k is not ours to know
        if copied:
            os.remove(staged)
        if compiled > 1:
            _disable(f"{compiled} compiles in one call")
        return result, None, False
    _PROCESS["count"] = index + 1
    written = _written_hash(graphs)
    if written is not None and written != _PROCESS["hash"]:
        _disable("MindSpore's dependency hash differs from ours")
    if not os.path.isfile(staged):  # MindSpore wrote it elsewhere (or not at all): the index is not ours
        _disable(f"compile {index} was not written to {staged}")
        return result, None, False
    hit = copied and os.stat(staged).st_mtime == 0
    if hit:
        _touch(folder)
    elif not _PROCESS.get("why"):
        _store(folder, staged, seconds)
    os.remove(staged)
    return result, seconds, hit


def _set_cache(ms, enabled, path):
    """MindSpore's compile cache on or off, without its Python deprecation warning for ``enable_compile_cache``
    on every call (MindSpore 2.7.2's env replacement, MS_COMPILER_CACHE_*, is read once a process)."""
    import logging
    from mindspore import log
    logger = log._get_logger()  # pylint: disable=protected-access
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        ms.set_context(enable_compile_cache=enabled, compile_cache_path=path)
    finally:
        logger.setLevel(level)


def _why_not():
    """Why this process cannot cache through the store, or None: the cache turned on by someone else (its
    index would not be ours), or no entry script on disk (MindSpore hashes it)."""
    import mindspore as ms
    if "hash" not in _PROCESS:
        outside = ms.get_context("enable_compile_cache") or os.environ.get("MS_COMPILER_CACHE_ENABLE") == "1"
        if outside or os.environ.get("MS_COMPILER_CACHE_PATH"):
            _PROCESS["hash"] = None
            _PROCESS["why"] = "MindSpore's compile cache is set in this process already (MS_COMPILER_CACHE_*)"
        else:
            _PROCESS["hash"] = dependency_hash()
            _PROCESS["why"] = None if _PROCESS["hash"] else "no entry script on disk (python -c)"
    return _PROCESS["why"]


def _disable(why):
    """Stop caching in this process (every GraphCache: they share MindSpore's one count), saying why once."""
    if not _PROCESS.get("why"):
        _PROCESS["why"] = why
        sys.stderr.write(f"gptlocal: compile cache off for the rest of this process: {why}; graphs compile as "
                         "without it.\n")
    return _PROCESS["why"]


def _staging(root):
    """This process's one staging folder (MindSpore reads its cache path once a process), with the dependency
    hash MindSpore checks written in, removed at exit; its compile 0 is the anchor (``_anchor``)."""
    if "staging" not in _PROCESS:
        base = staging_base()
        os.makedirs(base, exist_ok=True)
        folder = tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base)
        graphs, prefix = os.path.join(folder, _rank_folder(), "graph_cache"), _file_prefix()
        os.makedirs(graphs)
        with open(os.path.join(graphs, f"{prefix}compile_dependency.hash"), "w", encoding="ascii") as handle:
            handle.write(_PROCESS["hash"])
        _PROCESS.update(staging=folder, graphs=graphs, prefix=prefix, count=0)
        atexit.register(shutil.rmtree, folder, True)
        _anchor(root)
    return _PROCESS["staging"]


def _rank_folder():
    """The folder MindSpore writes this process's graphs to under its cache path: ``rank_<its rank>``, ``rank_0``
    without a communication group (one process)."""
    from mindspore.communication import GlobalComm, get_rank
    return f"rank_{get_rank()}" if GlobalComm.INITED else "rank_0"


def _file_prefix():
    """What MindSpore puts before its file names in that folder: under msrun the process's role (measured with
    MindSpore 2.9: ``MS_WORKERcompile_cache_0.mindir``), else nothing."""
    from mindspore.communication import GlobalComm
    return os.environ.get("MS_ROLE", "") if GlobalComm.INITED else ""


def _anchor(root):
    """Compile 0 of the process: a one-op graph of its own, loaded from the store from the second process on.
    Measured with MindSpore 2.7.2: where a process's first cached compile finds no file, every later one in that
    process compiles too ("Check the consistency of dependency files hash failed"), stored graph or not; so the
    first is one that is always there after the first-ever run, and the real graphs load whatever their order."""
    import numpy as np
    import mindspore as ms
    from mindspore import nn

    class Anchor(nn.Cell):
        def construct(self, x):
            return x + 1

    key = {"mindspore": ms.__version__, "mode": ms.get_context("mode"), "device": ms.get_context("device_target")}
    if _PROCESS["prefix"]:  # a rank of an msrun job: its own anchor (its folder, its parallel context)
        key.update(rank=_rank_folder(), parallel=ms.get_auto_parallel_context("parallel_mode"))
    key = json.dumps(key, sort_keys=True)
    folder = os.path.join(root, "anchor-" + hashlib.sha256(key.encode()).hexdigest()[:32])
    _cached_compile(Anchor(), (ms.Tensor(np.zeros(1, np.float32)),), folder)


def _written_hash(graphs):
    try:
        with open(os.path.join(graphs, f"{_PROCESS['prefix']}compile_dependency.hash"), encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return None


def _read_seconds(path):
    try:
        with open(path, encoding="ascii") as handle:
            return float(handle.read())
    except (OSError, ValueError):
        return None


def _touch(folder):
    try:
        os.utime(folder)
    except OSError:
        pass


def _store(folder, staged, seconds):
    """Move a graph MindSpore wrote into its key's folder: a temporary name, then a rename (readers never see a
    half-written file); its first call's seconds beside it."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:  # a read-only or full cache folder: the graph is used, not kept
        _store_failed(folder, err)
        return
    for name, write in ((TIMING, lambda tmp: _write_text(tmp, f"{seconds:.6f}")),
                        (STORED, lambda tmp: shutil.copyfile(staged, tmp))):
        handle, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        os.close(handle)
        try:
            write(tmp)
            os.replace(tmp, os.path.join(folder, name))
        except OSError as err:
            _store_failed(folder, err)
            try:
                os.remove(tmp)
            except OSError:
                pass
            return
    _touch(folder)


def _store_failed(folder, err):
    """One stderr line a process: the graphs are used, not kept (a read-only or full cache folder)."""
    if not _PROCESS.get("store_failed"):
        _PROCESS["store_failed"] = True
        sys.stderr.write(f"gptlocal: compile cache: could not store {folder}: {err}; graphs are compiled and "
                         f"used, not kept (give --compile-cache a writable folder, or off).\n")


def _write_text(path, text):
    with open(path, "w", encoding="ascii") as handle:
        handle.write(text)
