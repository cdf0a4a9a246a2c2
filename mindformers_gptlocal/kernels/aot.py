"""What every kernel module's Cells share: the AOT ``ops.Custom`` on CPU, and the library for a float32 model."""
import mindspore as ms
from mindspore import ops

from . import build


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
