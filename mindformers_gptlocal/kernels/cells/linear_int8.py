"""``CPUInt8Linear``: an int8 model's Linear, y = x W_q^T * scales (+ b) (``cpu_linear_int8.cc``: x quantized per row
on the fly, the int8 product exact in int32: oneDNN's ``dnnl_gemm_s8s8s32`` where oneDNN has VNNI, the library's own
int16-pair dot loop elsewhere), as a Cell. Inference only (no bprop: an int8 model does not train).

``int8_linear_kernel`` returns None where it cannot run: silently for a compute dtype other than float32, after one
warning line per process where the library cannot be built; ``model/quant_cells.py`` then runs the same scheme with
MindSpore ops, the reference.
"""
import functools

from mindspore import nn

from ..abi import build
from ..abi.aot import float32_library, primitive
from ..abi.table import KERNELS, ThreadOptions

_warn_once = functools.partial(build.warn_once, "CPU int8 Linear kernel off, MindSpore ops used instead")


class CPUInt8Linear(nn.Cell):
    """``construct(x [T, K] float32, weight [N, K] int8, scale [N] float32, bias [N] or None)`` -> [T, N] float32."""

    def __init__(self, library_path, threads=None):
        super().__init__()
        self.config = ThreadOptions(threads).tensor()
        self.forward = primitive(library_path, KERNELS["gptlocal_int8_linear_fwd"])
        self.forward_bias = primitive(library_path, KERNELS["gptlocal_int8_linear_fwd"])

    def construct(self, x, weight, scale, bias=None):
        if bias is None:
            return self.forward(x, weight, scale, self.config)
        return self.forward_bias(x, weight, scale, bias, self.config)


def int8_linear_kernel(dtype, **kwargs):
    """A ``CPUInt8Linear`` or None (after one warning) where it cannot run."""
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPUInt8Linear(path, **kwargs)
