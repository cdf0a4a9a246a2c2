"""The decode KV cache's write: an in-place ScatterNdUpdate on CPU, MindSpore's ScatterNdUpdate elsewhere.

MindSpore 2.7.2's CPU ``ScatterNdUpdate`` copies the whole cache Parameter on every call, so a decode
step's writes cost O(cache length): for one token of batch 8 x 12 heads x 64 channels, 0.39 / 1.01 / 4.70 ms
a write at 64 / 512 / 2,048 cached rows, 24 writes a step for a 12-layer model. Layouts that ``ScatterUpdate``
writes in place (the written axis first, or a flat [B*G*L, D] cache) need a Reshape or Transpose to be read
by attention, and on CPU that Reshape copies the cache too (measured: no saving). So the cache keeps its
[B, G, L, D] layout and is written by ``kv_write.cc``: an AOT ``ops.Custom`` kernel with ScatterNdUpdate's
inputs and values that copies only the updated rows into the Parameter's own buffer (marked
``side_effect_mem`` so MindSpore orders later reads of the cache after it). Its output is a status token;
the caller reads the cache Parameter itself after an ``ops.depend`` on it, exactly as with ScatterNdUpdate.

The kernel is compiled once per machine with g++ into ``$XDG_CACHE_HOME/mindformers_gptlocal`` (or
``~/.cache/...``; a temporary directory if that is not writable), named by the source's hash. Without a
compiler, on other backends, or with ``GPTLOCAL_PLAIN_KERNELS=1`` (the plain reference path) the write is
``ops.ScatterNdUpdate``.
"""
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import mindspore as ms
from mindspore import ops

from .cpu_kernels import replace_slow_cpu_kernels

log = logging.getLogger("gptlocal")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kv_write.cc")
SYMBOL = "InPlaceScatterNdUpdate"


def _cache_dirs():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(base, "mindformers_gptlocal"), os.path.join(tempfile.gettempdir(), "mindformers_gptlocal")]


@functools.lru_cache(maxsize=None)
def kernel_library():
    """Path of the compiled kernel (built now if absent), or None when it cannot be built here."""
    with open(SOURCE, "rb") as source:
        digest = hashlib.sha256(source.read()).hexdigest()[:16]
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    for directory in _cache_dirs():
        library = os.path.join(directory, f"kv_write-{digest}.so")
        if os.path.exists(library):
            return library
        if compiler is None:
            continue
        try:
            os.makedirs(directory, exist_ok=True)
            partial = f"{library}.{os.getpid()}.tmp"
            subprocess.run([compiler, "-O2", "-fPIC", "-shared", "-o", partial, SOURCE], check=True,
                           capture_output=True, timeout=120)
            os.replace(partial, library)  # atomic: concurrent builders each finish one whole file
            return library
        except (OSError, subprocess.SubprocessError) as err:
            log.debug("gpt_local: could not build %s in %s: %s", SOURCE, directory, err)
    log.warning("gpt_local: no C++ compiler could build the in-place KV-cache write (%s); decoding uses "
                "ScatterNdUpdate, which copies the whole cache every step.", SOURCE)
    return None


def _status_shape(*_shapes):
    return [1]


def _status_dtype(*_dtypes):
    return ms.int32


def in_place_scatter_nd_update(library=None):
    """The AOT kernel as a primitive: ``op(cache, index, updates)`` writes ``updates`` at ``index`` (as
    ScatterNdUpdate) into ``cache``'s own memory and returns a status token [1]."""
    library = library or kernel_library()
    op = ops.Custom(f"{library}:{SYMBOL}", out_shape=_status_shape, out_dtype=_status_dtype, func_type="aot")
    op.add_prim_attr("side_effect_mem", True)
    return op


def cache_write_op():
    """The write the KV cache uses here: in place on CPU when the kernel builds, else ScatterNdUpdate."""
    if replace_slow_cpu_kernels():
        library = kernel_library()
        if library is not None:
            return in_place_scatter_nd_update(library)
    return ops.ScatterNdUpdate()
