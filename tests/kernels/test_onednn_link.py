"""The kernels link the declared oneDNN (the onednn-cpu-gomp package, compiled against onednn-devel-cpu-gomp's
headers), found through the installed distributions' file lists; which oneDNN copy they bind to in a MindSpore process
(MindSpore 2.9's own libdnnl.so.3 has the same soname); a missing package is one warning and the plain path."""
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from conftest import TINY, source_env
from mindformers_gptlocal.kernels.abi import build
from mindformers_gptlocal.model import GPTLocalConfig, GPTLocalForCausalLM


def _files(distribution):
    dist = importlib.metadata.distribution(distribution)
    return {os.path.normpath(str(dist.locate_file(entry))) for entry in dist.files}


def test_onednn_is_found_through_the_packages_metadata():
    lib, include, version = build.onednn()
    assert lib is not None, version
    assert os.path.join(lib, "libdnnl.so.3") in _files(build.ONEDNN)
    assert os.path.join(include, "oneapi", "dnnl", "dnnl.h") in _files(build.ONEDNN_DEVEL)
    assert version == (f"{build.ONEDNN} {importlib.metadata.version(build.ONEDNN)}, "
                       f"{build.ONEDNN_DEVEL} {importlib.metadata.version(build.ONEDNN_DEVEL)}")
    assert f"{os.sep}mindspore{os.sep}" not in lib  # not MindSpore's private lib folder


def test_the_library_needs_the_packages_soname_with_a_run_path_to_it(library):
    lib = build.onednn()[0]
    dynamic = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True).stdout
    assert "Shared library: [libdnnl.so.3]" in dynamic, dynamic
    assert f"path: [{lib}]" in dynamic, dynamic  # RUNPATH (or RPATH) = the package's lib folder
    assert "libdnnl.so.2" not in dynamic


def test_the_cache_key_covers_the_onednn_version(monkeypatch):
    source = build.source_bytes()
    key = build.cache_key("g++ 12.2.0", source)
    monkeypatch.setattr(build, "onednn_version", lambda: "onednn-cpu-gomp 2024.0.0, onednn-devel-cpu-gomp 2024.0.0")
    assert build.cache_key("g++ 12.2.0", source) != key


def test_the_cache_key_covers_the_onednn_folders(monkeypatch, tmp_path):
    """The library bakes in a run path to the package's lib folder: another environment with the same versions (a
    second venv) gets its own library, not one that points into the first (which may be gone)."""
    source = build.source_bytes()
    key = build.cache_key("g++ 12.2.0", source)
    lib, include, version = build.onednn()
    monkeypatch.setattr(build, "onednn", lambda: (str(tmp_path / "other-venv" / "lib"), include, version))
    assert build.onednn_version() == version  # same versions, another folder
    assert build.cache_key("g++ 12.2.0", source) != key


BIND = """
import ctypes, json, os, sys
from mindformers_gptlocal.kernels.abi import build
assert "mindspore" not in sys.modules
path = sys.argv[1]
assert build._loads(path)  # imports MindSpore first, then loads ours
lib = ctypes.CDLL(path)
address = ctypes.cast(lib.dnnl_sgemm, ctypes.c_void_p).value  # the definition our library's scope resolves

class DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p)]
info = DlInfo()
assert ctypes.CDLL(None).dladdr(ctypes.c_void_p(address), ctypes.byref(info))
mapped = sorted({os.path.realpath(line.split()[-1]) for line in open("/proc/self/maps") if "libdnnl" in line})
print(json.dumps({"bound": os.path.realpath(info.dli_fname.decode()), "mapped": mapped}))
"""


def test_which_onednn_the_kernels_bind_to_next_to_mindspores(library):
    """MindSpore loads its own oneDNN at import (2.7.2: libdnnl.so.2; 2.9.0: libdnnl.so.3, the package's soname).
    Same soname: the loader hands our library MindSpore's copy, and the package's is never loaded (one oneDNN in
    the process); another soname: ours binds the package's copy, beside MindSpore's. The kernels' exactness tests
    run in that state; this one pins which it is."""
    import mindspore
    ms_lib = os.path.join(os.path.dirname(mindspore.__file__), "lib")
    ours = os.path.realpath(os.path.join(build.onednn()[0], "libdnnl.so.3"))
    proc = subprocess.run([sys.executable, "-c", BIND, library], capture_output=True, text=True, timeout=300,
                          env=source_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if os.path.exists(os.path.join(ms_lib, "libdnnl.so.3")):  # MindSpore 2.9
        theirs = os.path.realpath(os.path.join(ms_lib, "libdnnl.so.3"))
        assert found == {"bound": theirs, "mapped": [theirs]}, found
    else:  # MindSpore 2.7.2
        theirs = os.path.realpath(os.path.join(ms_lib, "libdnnl.so.2"))
        assert found["bound"] == ours and sorted(found["mapped"]) == sorted([ours, theirs]), found


@pytest.fixture
def no_onednn(monkeypatch, tmp_path):
    """The process as if the onednn-cpu-gomp package were not installed (a name no distribution has)."""
    monkeypatch.setattr(build, "ONEDNN", "onednn-cpu-gomp-not-installed")
    monkeypatch.setenv("GPTLOCAL_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_WARNED", set())
    build.onednn.cache_clear()
    yield
    monkeypatch.undo()
    build.onednn.cache_clear()


def test_a_missing_onednn_package_is_one_warning_and_the_plain_path(no_onednn, tmp_path, capfd):
    path, reason = build.library()
    assert path is None and "onednn-cpu-gomp-not-installed package is not installed" in reason, reason
    assert f"pip install onednn-cpu-gomp-not-installed=={build.ONEDNN_PIN}" in reason
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    assert all(layer.attention.core is layer.attention.plain for layer in model.model.layers)
    assert not model.model.fused_prefill()
    warnings = [line for line in capfd.readouterr().err.splitlines() if "CPU attention kernel off" in line]
    assert len(warnings) == 1 and "is not installed" in warnings[0], warnings
    assert not os.path.exists(tmp_path / "cache")
