"""What every kernel module's Cells share: the threads a kernel runs (``kernel_threads``), the AOT ``ops.Custom`` on
CPU, and the library for a float32 model; and the same C entry points called directly on numpy arrays
(``DirectCall``: tests and benchmarks, outside MindSpore)."""
import ctypes
import os

import mindspore as ms
from mindspore import ops

from . import build


def kernel_threads():
    """The threads a kernel runs: MindSpore's ``runtime_num_threads``, at most the CPUs this process may use."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    runtime = ms.get_context("runtime_num_threads") or available
    return max(1, min(int(runtime), available))


def custom_op(path, symbol, shape, dtype, bprop=None):
    """``symbol`` of the library at ``path`` as an AOT ``ops.Custom`` pinned to the CPU."""
    op = ops.Custom(f"{path}:{symbol}", shape, dtype, "aot", bprop=bprop)
    op.add_prim_attr("primitive_target", "CPU")
    return op


def float32_library(dtype, warn):
    """The library path, or None: silently for a dtype other than float32, after ``warn(reason)`` (once per
    reason: ``build.warn_once``) without a library."""
    if dtype != ms.float32:
        return None
    path, reason = build.library()
    if path is None:
        warn(reason)
    return path


class DirectCall:
    """A kernel entry point (a ctypes function of the library: ``ctypes.CDLL(path).gptlocal_...``) bound to numpy
    ``arrays``, its inputs then its outputs, and called with the AOT signature MindSpore uses (nparam, params, ndims,
    shapes, dtypes, stream, extra): the kernel outside MindSpore. ``call()`` returns the kernel's status (0: done).
    The arrays are kept here, so the pointers stay valid while this object lives."""

    def __init__(self, function, arrays):
        self.function = function
        self.arrays = arrays
        count = self.count = len(arrays)
        self.params = (ctypes.c_void_p * count)(*[a.ctypes.data for a in arrays])
        self.ndims = (ctypes.c_int * count)(*[a.ndim for a in arrays])
        self.dims = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
        self.shapes = (ctypes.POINTER(ctypes.c_int64) * count)(
            *[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in self.dims])
        self.dtypes = (ctypes.c_char_p * count)(*[str(a.dtype).encode() for a in arrays])

    def call(self):
        return self.function(self.count, self.params, self.ndims, self.shapes, self.dtypes, None, None)
