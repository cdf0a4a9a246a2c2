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

The kernel is built into the same library as the fused attention kernel (``build.py``: one per-user cache, one
lock, one key). The model's ``KernelProvider.kv_write`` (``provider.py``) chooses it; without a compiler, on other
backends, or with ``model_config.cpu_kernels`` ``plain`` (or ``{kv_write: plain}``) the write is
``ops.ScatterNdUpdate``.
"""
import functools
import logging

import mindspore as ms
from mindspore import ops

from ..abi import build

log = logging.getLogger("gptlocal")
SYMBOL = "InPlaceScatterNdUpdate"


@functools.lru_cache(maxsize=None)
def kernel_library():
    """Path of gpt_local's kernel library (built now if absent), or None when it cannot be built here."""
    path, reason = build.library()
    if path is None:
        log.warning("gptlocal: the in-place KV-cache write cannot be built (%s); decoding uses ScatterNdUpdate, "
                    "which copies the whole cache every step.", reason)
    return path


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

