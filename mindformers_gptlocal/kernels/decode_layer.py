"""``CPUDecodeLayer``: one GPT-2 decoder layer of a decode step (one new token a row) as ONE CPU kernel node
(``cpu_decode_layer.cc``).

The plain decode graph runs some 20-30 small MindSpore ops a layer, and for one token a row their dispatch costs
more than their arithmetic. This node takes the layer's input hidden [B, 1, H], its Parameters (the two LayerNorms',
the four Linears' weights [out, in] and biases, float32, as stored) and its KV-cache Parameters, and returns the new
hidden: LayerNorm, QKV, this token's keys and values written in place into the caches at ``write_index`` (as the
in-place ``kv_write.py`` write: the op is marked ``side_effect_mem``, so MindSpore keeps every later use of the
caches after it), each head's query over its row's cached keys 0..position (plus the additive ``attention_bias``,
``model/kv_cache.py``), the projection, the residual, LayerNorm, fc1 + bias + GeLU (tanh or quick), fc2, the
residual. Inference only (no dropout, no backward).

``KernelProvider.decode_layer_for`` (``provider.py``) decides, from the facts ``model/gpt.py`` ``make_decode_layer``
gathers of a block, whether the block's structure is the one the kernel computes (GPT-2's: LayerNorm, biases, learned
positions, MHA or GQA, no LoRA, adapter, prefix or LayerDrop) and ``KernelProvider.decode_layer`` gives the kernel for
its precision; the block runs it in its decode graphs only (one token a row, a KV cache, not a fresh prefill);
everything else stays the plain graph, the reference it is tested against.
The GEMMs read the weights in their plain [out, in] layout each call (pre-packed weights are not done yet): float32
through oneDNN's sgemm, or in a bf16 model built for inference (``KernelProvider.bf16_weights``) held as bfloat16
(``CPUDecodeLayerBF16``, ``cpu_linear.cc``'s ``gptlocal_linear_bf16w_fwd``: the numbers of that model's plain decode
graph, whose Linears run the same kernel). ``CPUDecodeLayerInt8`` is the same layer of an int8 model
(``model/quant_cells.py`` ``QuantLinear``): each weight int8 followed by its per-channel scales, the GEMMs
``cpu_linear_int8.cc``'s (the input quantized per row), so its numbers are the plain int8 decode graph's with the
int8 kernel.
"""
import functools

from . import build
from .aot import KernelCell, float32_library
from .linear import precision_code
from .norm_gelu import GELU_FORMS
from .table import KERNELS

SYMBOL = "gptlocal_decode_layer_fwd"
INT8_SYMBOL = "gptlocal_decode_layer_int8_fwd"
BF16_SYMBOL = "gptlocal_decode_layer_bf16w_fwd"
_warn_once = functools.partial(build.warn_once, "CPU decode-layer kernel off, the plain decode graph used instead")


class CPUDecodeLayer(KernelCell):
    """``construct(hidden [B, 1, H], ln1 (weight, bias), qkv (weight, bias), proj (weight, bias), ln2 (weight,
    bias), fc1 (weight, bias), fc2 (weight, bias), key_cache, value_cache, write_index [B, G, 1, 3],
    attention_bias [B or 1, 1, 1, L])`` -> the layer's output hidden [B, 1, H]; the caches written in place."""

    symbol = SYMBOL

    def __init__(self, library_path, epsilon, scale, form="tanh", threads=None, precision="float32", emulate=False):
        # side_effect_mem (the table's inout caches): MindSpore keeps every later use of the caches after it
        super().__init__(library_path, KERNELS[self.symbol], epsilon=epsilon, scale=scale, form=GELU_FORMS[form],
                         threads=threads, precision=precision_code(library_path, precision, emulate))

    def construct(self, hidden, ln1_weight, ln1_bias, qkv_weight, qkv_bias, proj_weight, proj_bias, ln2_weight,
                  ln2_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, key_cache, value_cache, write_index,
                  attention_bias):
        return self.op(hidden, ln1_weight, ln1_bias, qkv_weight, qkv_bias, proj_weight, proj_bias, ln2_weight,
                       ln2_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, key_cache, value_cache, write_index,
                       attention_bias, self.config)


class CPUDecodeLayerInt8(CPUDecodeLayer):
    """``CPUDecodeLayer`` of an int8 model: ``construct(hidden, ln1 (weight, bias), qkv (weight int8, scale, bias),
    proj (weight, scale, bias), ln2 (weight, bias), fc1 (weight, scale, bias), fc2 (weight, scale, bias),
    key_cache, value_cache, write_index, attention_bias)``."""

    symbol = INT8_SYMBOL

    def construct(self, hidden, ln1_weight, ln1_bias, qkv_weight, qkv_scale, qkv_bias, proj_weight, proj_scale,
                  proj_bias, ln2_weight, ln2_bias, fc1_weight, fc1_scale, fc1_bias, fc2_weight, fc2_scale, fc2_bias,
                  key_cache, value_cache, write_index, attention_bias):
        return self.op(hidden, ln1_weight, ln1_bias, qkv_weight, qkv_scale, qkv_bias, proj_weight, proj_scale,
                       proj_bias, ln2_weight, ln2_bias, fc1_weight, fc1_scale, fc1_bias, fc2_weight, fc2_scale,
                       fc2_bias, key_cache, value_cache, write_index, attention_bias, self.config)


class CPUDecodeLayerBF16(CPUDecodeLayer):
    """``CPUDecodeLayer`` of a bf16 model built for inference: the same inputs, the four Linear weights bfloat16
    (``precision="bfloat16"``: oneDNN's bf16 GEMM, or its emulation with ``emulate`` or on a CPU without it)."""

    symbol = BF16_SYMBOL


def decode_layer_kernel(epsilon, scale, form, dtype, int8=False, precision="float32", bf16_weights=False, **kwargs):
    """A ``CPUDecodeLayer`` (``int8``: a ``CPUDecodeLayerInt8``; ``bf16_weights``: a ``CPUDecodeLayerBF16``) or None:
    silently for a graph dtype other than float32 or a GeLU form it does not compute, after one warning line where
    the library cannot be built. ``precision``: the GEMMs' ("float32", or "bfloat16" for a bf16 model's)."""
    if form not in GELU_FORMS:
        return None
    path = float32_library(dtype, _warn_once)
    if path is None:
        return None
    if int8:
        return CPUDecodeLayerInt8(path, epsilon, scale, form, **kwargs)
    cls = CPUDecodeLayerBF16 if bf16_weights else CPUDecodeLayer
    return cls(path, epsilon, scale, form, precision=precision, **kwargs)
