"""Builds the CPU kernels' shared library at first use, into a per-user cache, and finds it again.

``library()`` returns the path of ``libgptlocal_kernels.so`` built from ``SOURCES`` (package data: the kernels'
``.cc`` files, each one kernel or one small family of typed cores, as the kernel table ``table.py`` lists them)
and the files ``codegen.py`` generates from that table (``cores.h``: the options structs and the cores'
declarations; ``entries.cc``: the MindSpore AOT entry points) with the system compiler (``$CXX``, default ``g++``):
``-O3 -fPIC -shared -fopenmp`` (each source to an object, as many at once as the process has CPUs, then one link),
compiled against the headers of the
``onednn-devel-cpu-gomp`` package and linked to the ``libdnnl.so.3`` of the ``onednn-cpu-gomp`` package (both in
install_requires; oneDNN 3.2, GNU OpenMP runtime, for ``dnnl_sgemm``, ``dnnl_gemm_bf16bf16f32`` and
``dnnl_gemm_s8s8s32``), with a run path to that library. Both are found through the installed distributions' file
lists (``importlib.metadata``), never by guessing a folder.
Or None, with the reason, when it cannot be built or loaded: no compiler, no oneDNN package, a failed build.

Two oneDNN copies in one process: MindSpore loads its own at ``import mindspore`` (2.7.2: ``libdnnl.so.2``,
oneDNN 2.2; 2.9.0: ``libdnnl.so.3``, oneDNN 3.10, both the threadpool runtime, private to MindSpore). The
loader matches a library by its soname before it looks at run paths, so where MindSpore's copy has the same
soname (2.9.0), our library binds to that already-loaded copy, not the package's; where it has another (2.7.2),
ours loads the package's. Either way ``dnnl_sgemm`` is oneDNN's stable C API of the same major version, and the
kernels are tested against the plain path on both (tests/kernels/test_onednn_link.py). ``_loads`` imports
MindSpore before it loads our library, so the package's copy never takes MindSpore's place: MindSpore's own
oneDNN is newer and it may need what 3.2 lacks.

The library is compiled for the baseline of the machine's architecture (x86-64) with AVX2 and AVX-512 versions of
the vectorised loops (common.h ``VEC_FN``), not with ``-march=native``: a cache on a shared home directory may be
read from machines with other CPUs, and a ``-march=native`` build would crash there with an illegal instruction.
Which versions run is the library's one ISA decision (common.h ``IsaTier``: the CPU's flags and oneDNN's view),
capped by ``apply_isa`` (``model_config.cpu_kernels.isa``); ``isa_decision`` / ``describe_isa`` read it back.

Cache: ``$GPTLOCAL_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/mindformers_gptlocal/kernels``, else
``~/.cache/mindformers_gptlocal/kernels``; one folder per key, the key a hash of the sources (the generated files
included), the MindSpore
version, the oneDNN packages' versions, the compiler's version line, the flags and the architecture, so any of
them changing builds anew.
Each source's object is kept in the cache's ``objects`` folder under the hash of what it is compiled from, so a
build after one kernel changed compiles that kernel only, then links.
Concurrent builders (msrun's workers) take an exclusive ``flock`` on the key's folder, and the library is
written to a temporary name and renamed into place: no process ever loads a half-written file. A cached file
whose sha256 differs from the one its build saved next to it (truncated, overwritten) is rebuilt.
"""
import concurrent.futures
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile

from . import codegen
from .codes import Status
from .table import TABLE

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")  # kernels/csrc/: the C++
SOURCES = tuple(os.path.join(CSRC, name) for name in TABLE.sources)  # the kernels' cores, in the table's order
# included: part of the cache key
HEADERS = tuple(os.path.join(CSRC, name) for name in ("common.h", "aot.h", "cpu_decoder.h"))
LIBRARY_NAME = "libgptlocal_kernels.so"
OBJECTS = "objects"  # the cache's compiled sources, by content (``_objects``)
SYMBOLS = TABLE.symbols  # every entry point, export and typed core: a library without one of them is not ours
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-std=c++17")

_FOUND = {}  # (cache dir, compiler) -> (path or None, reason)
_WARNED = set()  # (off, reason) pairs warned about in this process


def warn_once(off, reason):
    """One stderr line per kernel and reason and process, for every kernel: ``off`` says which kernel is off and
    what runs instead ("CPU attention kernel off, plain attention used instead"), ``reason`` why and how to fix it."""
    if (off, reason) in _WARNED:
        return
    _WARNED.add((off, reason))
    sys.stderr.write(f"gptlocal: {off}: {reason}. model_config.cpu_kernels: plain silences this by choosing "
                     "the plain path.\n")
    sys.stderr.flush()


def user_cache(name):
    """gpt_local's per-user cache folder ``name``: ``$XDG_CACHE_HOME/mindformers_gptlocal/<name>`` (else
    ``~/.cache/...``); the kernels' builds and the eval compile cache live there."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mindformers_gptlocal", name)


def cache_root():
    """The folder the per-key builds live under."""
    explicit = os.environ.get("GPTLOCAL_KERNEL_CACHE")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    return user_cache("kernels")


def compiler():
    """The C++ compiler command: ``$CXX`` or ``g++``."""
    return os.environ.get("CXX") or "g++"


def mindspore_version():
    try:
        return importlib.metadata.version("mindspore")
    except importlib.metadata.PackageNotFoundError:
        return "none"


ONEDNN = "onednn-cpu-gomp"  # the library: lib/libdnnl.so.3
ONEDNN_DEVEL = "onednn-devel-cpu-gomp"  # its headers: include/oneapi/dnnl/dnnl.h
ONEDNN_SONAME = "libdnnl.so.3"
ONEDNN_HEADER = "oneapi/dnnl/dnnl.h"
ONEDNN_PIN = "2023.2.0"  # setup.cfg's pin, named in the fix of a missing package


def _distribution_file(distribution, suffix):
    """(absolute path of the file of the installed ``distribution`` whose path ends with ``suffix``, version),
    or (None, why not): read from the distribution's own file list, wherever pip put it."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None, f"the {distribution} package is not installed"
    for entry in dist.files or ():  # entries are relative to site-packages ("../../libdnnl.so.3"): resolve first
        path = os.path.normpath(str(dist.locate_file(entry)))
        if path.replace(os.sep, "/").endswith("/" + suffix):
            if os.path.isfile(path):
                return path, dist.version
            return None, f"the {distribution} package lists {suffix} but {path} is missing"
    return None, f"the {distribution} package has no {suffix}"


@functools.lru_cache(maxsize=None)
def onednn():
    """(lib folder, include folder, version text) of the declared oneDNN packages, or (None, None, reason)."""
    library_file, lib_version = _distribution_file(ONEDNN, "lib/" + ONEDNN_SONAME)
    header, devel_version = _distribution_file(ONEDNN_DEVEL, "include/" + ONEDNN_HEADER)
    for found, why in ((library_file, lib_version), (header, devel_version)):
        if found is None:
            return None, None, (f"{why} (pip install {ONEDNN}=={ONEDNN_PIN} {ONEDNN_DEVEL}=={ONEDNN_PIN}, "
                                "as setup.cfg pins)")
    include = header[:-len(ONEDNN_HEADER)].rstrip("/")
    return os.path.dirname(library_file), include, f"{ONEDNN} {lib_version}, {ONEDNN_DEVEL} {devel_version}"


def onednn_version():
    """The oneDNN packages' versions (part of the cache key), or "none"."""
    return onednn()[2] if onednn()[0] else "none"


def onednn_dir():
    """The lib folder of the ``onednn-cpu-gomp`` package, or None."""
    return onednn()[0]


def _compiler_version(cxx):
    """The compiler's first ``--version`` line, or None when it cannot be run."""
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return (done.stdout.splitlines() or [""])[0].strip()


def _flags():
    extra = () if platform.machine() in ("x86_64", "AMD64") else ("-DGPTLOCAL_NO_CLONES",)
    return FLAGS + extra


def source_bytes():
    """Every source file's bytes, in build order, then the shared headers', then the generated files' (what the cache
    key hashes: the table's every entry is in the generated text)."""
    parts = [_read(path) for path in SOURCES + HEADERS]
    parts += [text.encode() for text in codegen.generated().values()]
    return b"\0".join(parts)


def cache_key(cxx_version, sources=None):
    """Hash of what the library depends on: sources, MindSpore and oneDNN versions, the oneDNN folders (the run path
    baked into the library: two environments with the same versions must not share a library that points into the
    other), compiler, flags, architecture."""
    source_bytes_ = source_bytes() if sources is None else sources
    folders = "|".join(os.path.realpath(folder) if folder else "none" for folder in onednn()[:2])
    digest = hashlib.sha256()
    for part in (source_bytes_, mindspore_version().encode(), onednn_version().encode(), folders.encode(),
                 cxx_version.encode(), " ".join(_flags()).encode(), platform.machine().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _digest(path):
    return hashlib.sha256(_read(path)).hexdigest()


def _complete(path):
    """True when ``path`` is the whole file its build wrote: its sha256 equals the one saved next to it.
    (Checked without loading it: loading a truncated library can kill the process with SIGBUS.)"""
    try:
        with open(path + ".sha256", encoding="ascii") as handle:
            return handle.read().strip() == _digest(path)
    except OSError:
        return False


def _loads(path):
    """True when ``path`` loads and exports every kernel in ``SYMBOLS``. MindSpore is imported first (where it is
    installed): its oneDNN is then the one in the process, as where the kernels run (module docstring)."""
    if importlib.util.find_spec("mindspore") is not None:
        import mindspore  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    try:
        lib = ctypes.CDLL(path)
        return all(hasattr(lib, name) for name in SYMBOLS)
    except OSError:
        return False


# model_config.cpu_kernels.isa's values, each the library's tier of its index (common.h IsaTier): every path we own
# and oneDNN capped at that tier (on a CPU below it, the CPU's); "auto" no cap
ISAS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx", "auto")
_APPLIED = {}  # library path -> the ISA cap last applied to it in this process


def _isa_library(path):
    lib = ctypes.CDLL(path)
    lib.gptlocal_set_isa.argtypes = lib.gptlocal_isa.argtypes = [ctypes.c_int]
    return lib


def apply_isa(name, path=None):
    """Cap every path of the library at ``name`` (an ``ISAS`` value) from now on, in this process: its loops' and
    intrinsics' versions, its GEMM choices, and oneDNN's own kernels through ``dnnl_set_max_cpu_isa`` where oneDNN
    still takes it (before its first use in the process, once). Does nothing where ``name`` is what the library
    already has (at first: ``auto``) or where there is no library. Returns ``isa_decision``'s dict, or None."""
    path = path or library()[0]
    if path is None:
        return None
    if _APPLIED.get(path, "auto") != name:
        if _isa_library(path).gptlocal_set_isa(ISAS.index(name)) != Status.OK:
            raise ValueError(f"cpu_kernels isa {name!r}: one of {', '.join(ISAS)}")
        _APPLIED[path] = name
    return isa_decision(path)


def applied_isas():
    """The ISA caps ``apply_isa`` set in this process, one per library."""
    return tuple(_APPLIED.values())


def isa_decision(path=None):
    """The library's ISA decision: ``cap`` (``ISAS`` value), ``loops`` (the tier our loops and intrinsics run:
    scalar, avx2 or avx512), ``onednn`` (oneDNN's tier as our GEMM choices read it, capped), ``cpu`` (the tier the
    CPU's flags give our loops), ``onednn_cpu`` (oneDNN's own, where it took a cap that one); None without a
    library. Reading oneDNN's ISA fixes it: ``apply_isa`` first."""
    path = path or library()[0]
    if path is None:
        return None
    lib = _isa_library(path)
    return dict(zip(("cap", "loops", "onednn", "cpu", "onednn_cpu"), (ISAS[lib.gptlocal_isa(part)] for part in
                                                                        range(5))))


def describe_isa(path=None):
    """``isa_decision`` as one line: "isa auto: loops avx2, oneDNN avx2 (CPU: avx2, oneDNN's avx2)"."""
    decision = isa_decision(path)
    if decision is None:
        return "isa: no kernel library"
    return (f"isa {decision['cap']}: loops {decision['loops']}, oneDNN {decision['onednn']} (CPU: {decision['cpu']}, "
            f"oneDNN's {decision['onednn_cpu']})")


def _compile(cxx, version, folder, dnnl, include):
    """Compile into ``folder`` under a temporary name, then rename into place. Returns (path, reason). The generated
    files (``codegen.py``) are written into a temporary folder beside it, removed after the build."""
    final = os.path.join(folder, LIBRARY_NAME)
    generated = tempfile.mkdtemp(prefix=".generated-", dir=folder)
    try:
        for name, text in codegen.generated().items():
            with open(os.path.join(generated, name), "w", encoding="utf-8") as handle:
                handle.write(text)
        return _link(cxx, version, folder, final, generated, dnnl, include)
    finally:
        shutil.rmtree(generated, ignore_errors=True)


def _link(cxx, version, folder, final, generated, dnnl, include):
    objects, reason = _objects(cxx, version, os.path.join(os.path.dirname(folder), OBJECTS), generated, include)
    if objects is None:
        return None, reason
    handle, temporary = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(handle)
    command = [cxx, *_flags(), *objects, "-o", temporary, "-L" + dnnl, "-l:" + ONEDNN_SONAME, "-Wl,-rpath," + dnnl]
    reason = _run(cxx, command)
    if reason is None and not _loads(temporary):
        reason = f"the library built by {cxx} does not load"
    if reason is not None:
        for obj in [temporary, *objects]:  # the objects in case one is the cause: the next build compiles them all
            with contextlib.suppress(OSError):  # (the linker removes its output when it fails)
                os.unlink(obj)
        return None, reason
    with open(temporary + ".sha256", "w", encoding="ascii") as handle:
        handle.write(_digest(temporary))
    os.replace(temporary, final)  # atomic: readers see the old file or the whole new one
    os.replace(temporary + ".sha256", final + ".sha256")
    return final, "built"


def _objects(cxx, version, store, generated, include):
    """Each source compiled to an object, as many at once as this process may use CPUs (a build on 2 cores takes
    half the time of one g++ call over every source), or found in ``store`` (the cache's ``objects`` folder) under
    the hash of what it is compiled from: its source, every shared and generated header, the compiler's version,
    the flags, oneDNN's headers and the architecture. So a changed kernel recompiles its own file only. Returns
    (objects, None) or (None, reason)."""
    flags = [flag for flag in _flags() if flag != "-shared"]
    sources = [*SOURCES, os.path.join(generated, codegen.ENTRIES)]
    common = hashlib.sha256()  # what every source is compiled with: the headers, ours and the ones written for it
    headers = [*HEADERS, *[os.path.join(generated, name) for name in sorted(os.listdir(generated))]]
    for part in (*[_read(path) for path in headers], version.encode(), " ".join(flags).encode(),
                 os.path.realpath(include).encode(), onednn_version().encode(), platform.machine().encode()):
        common.update(part)
        common.update(b"\0")
    os.makedirs(store, exist_ok=True)
    objects = [os.path.join(store, f"{os.path.basename(source)[:-3]}-{_object_key(common, source)}.o")
               for source in sources]

    def compile_one(source, obj):
        if os.path.isfile(obj):
            return None
        handle, temporary = tempfile.mkstemp(prefix=".object-", suffix=".o", dir=store)
        os.close(handle)
        reason = _run(cxx, [cxx, *flags, "-c", "-I" + generated, "-I" + CSRC, "-I" + include, source,
                            "-o", temporary])
        if reason is None:
            os.replace(temporary, obj)  # atomic: another builder sees no object or the whole one
        else:
            os.unlink(temporary)
        return reason

    with concurrent.futures.ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
        reasons = list(pool.map(compile_one, sources, objects))
    failed = [reason for reason in reasons if reason is not None]
    return (None, failed[0]) if failed else (objects, None)


def _read(path):
    with open(path, "rb") as handle:
        return handle.read()


def _object_key(common, source):
    digest = common.copy()
    digest.update(_read(source))
    return digest.hexdigest()[:20]


_ERROR_LINE = re.compile(r":\d+(:\d+)?: (fatal )?error: ")  # gcc / clang: file:line:column: error: message


def _run(cxx, command):
    """Run one compiler command: None, or the reason it failed (its first error line: the file, line and message;
    else its last line of output)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        return f"running {cxx} failed ({error})"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        first = next((line for line in lines if _ERROR_LINE.search(line)), lines[-1])
        return f"{cxx} failed: {first.strip()}"
    return None


def library(cache_dir=None, cxx=None):
    """The path of the built library, building it if needed, or None; and a reason string.

    Computed once per process for each (cache, compiler)."""
    cache_dir = cache_dir or cache_root()
    cxx = cxx or compiler()
    memo = (cache_dir, cxx)
    if memo not in _FOUND:
        _FOUND[memo] = _find_or_build(cache_dir, cxx)
    return _FOUND[memo]


def _find_or_build(cache_dir, cxx):
    if shutil.which(cxx) is None:
        return None, f"no C++ compiler: {cxx!r} not found (install g++ or set CXX)"
    version = _compiler_version(cxx)
    if version is None:
        return None, f"the C++ compiler {cxx!r} does not run"
    dnnl, include, why = onednn()
    if dnnl is None:
        return None, why
    folder = os.path.join(cache_dir, cache_key(version))
    final = os.path.join(folder, LIBRARY_NAME)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, ".lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per key; the others wait, then find its library
            try:
                if os.path.isfile(final) and _complete(final):
                    return final, "cached"
                return _compile(cxx, version, folder, dnnl, include)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    except OSError as error:
        return None, f"cannot write the kernel cache {cache_dir} ({error}; set GPTLOCAL_KERNEL_CACHE)"
