"""``CPUDecodeLayer``: one decoder layer of a decode step (one new token a row) as ONE CPU kernel node, for every layout
the model builds (``cpu_decode_layer.cc``, a thin caller of the native runner's layer function, ``cpu_decoder.cc``).

The plain decode graph runs some 20-30 small MindSpore ops a layer, and for one token a row their dispatch costs
more than their arithmetic. This node takes the layer's input hidden [B, 1, H], its Parameters (the two norms' weights
and, LayerNorm, biases; each Linear's weight [out, in] as stored, an int8 model's per-channel scales, its bias; SwiGLU's
gate Linear) and its KV-cache Parameters, and returns the new hidden: norm, QKV, rope (rotate_half on the first
``rotary_dim`` channels of each query and key head, from the row's cos and sin), this token's keys and values written
in place into the caches at ``write_index`` (as the in-place ``kv_write.py`` write: the op is marked
``side_effect_mem``, so MindSpore keeps every later use of the caches after it), each head's query over its row's
cached keys 0..position (plus the additive ``attention_bias``, ``model/kv_cache.py``), the projection, the residual
(sequential, or NeoX's parallel one), norm, the MLP (GeLU tanh / quick / erf, ReLU, or SwiGLU), the residual.
Inference only (no dropout, no backward). Where a layer has no such tensor (a bias, a LayerNorm's bias under RMSNorm,
an int8 weight's scales, the gate, rope's cos and sin) the call passes a placeholder the options say to ignore.

``KernelProvider.decode_layer_for`` (``provider.py``) chooses it from the built layer's facts (``model/gpt.py``
``make_decode_layer``: its Linears all the base Linear of one weight dtype or all an int8 model's; LayerNorm or
RMSNorm of float32 weights; no LoRA, adapter, prefix or LayerDrop) and the block runs it in its decode graphs only
(one token a row, a KV cache, not a fresh prefill); everything else stays the plain graph, the reference it is tested
against. The GEMMs: float32 weights through oneDNN's sgemm (a bf16 model built for training rounds them at each call:
``precision``), bfloat16 weights (``CPUDecodeLayerBF16``: an inference build's ``bf16_weights``) and int8 weights with
their scales (``CPUDecodeLayerInt8``: ``model/quant_cells.py`` ``QuantLinear``'s scheme, exact in int32) as
``cpu_decoder.cc`` says.
"""
import functools

from ..abi import build
from ..abi.aot import KernelCell, float32_library
from ..abi.codes import MlpForm, NormKind, name_of
from ..abi.precision import precision_code
from ..abi.table import KERNELS

SYMBOL = "gptlocal_decode_layer_fwd"
INT8_SYMBOL = "gptlocal_decode_layer_int8_fwd"
BF16_SYMBOL = "gptlocal_decode_layer_bf16w_fwd"
_warn_once = functools.partial(build.warn_once, "CPU decode-layer kernel off, the plain decode graph used instead")


class CPUDecodeLayer(KernelCell):
    """``construct(hidden [B, 1, H], *parameters, key_cache, value_cache, write_index [B, G, 1, 3], attention_bias
    [B or 1, 1, 1, L], cos, sin [B, 1, 1, R])`` (``KernelCell``'s, the table's inputs in order) -> the layer's output
    hidden [B, 1, H]; the caches written in place. ``parameters``: the layer's in ``kernels/layer_table.py``
    ``LAYER``'s order (``decode_layer_parameters``: a norm's weight, bias; a Linear's weight, scales, bias), a
    placeholder where the layer has none. ``form``: an
    ``MlpForm``'s name (``model/gpt.py`` ``mlp_form``); ``norm``: a ``NormKind``'s ("LayerNorm", "RMSNorm");
    ``qkv_bias``, ``bias``: whether qkv and the other Linears add their
    biases (else their bias arguments are placeholders); ``absent``: the parameters handed a placeholder, as
    ``table.py`` ``DecoderLayer.pointer_mask`` gives them (the model's: ``model/gpt.py`` ``layer_facts``), which the
    kernel nulls (cores.h ``drop_absent``) whatever the part."""

    symbol = SYMBOL

    # pylint: disable-next=too-many-arguments
    def __init__(self, library_path, epsilon, scale, form="tanh", threads=None, precision="float32", emulate=False,
                 norm="LayerNorm", rotary_dim=0, parallel_residual=False, qkv_bias=True, bias=True, absent=0):
        # side_effect_mem (the table's inout caches): MindSpore keeps every later use of the caches after it
        super().__init__(library_path, KERNELS[self.symbol], epsilon=epsilon, scale=scale, form=name_of(MlpForm, form),
                         threads=threads, precision=precision_code(library_path, precision, emulate),
                         norm=name_of(NormKind, norm), rotary_dim=int(rotary_dim),
                         parallel_residual=int(bool(parallel_residual)),
                         qkv_bias=int(bool(qkv_bias)), bias=int(bool(bias)), absent=int(absent))


class CPUDecodeLayerInt8(CPUDecodeLayer):
    """``CPUDecodeLayer`` of an int8 model: each weight int8 followed by its float32 per-channel scales (the plain
    int8 scheme's numbers: ``model/quant_cells.py``)."""

    symbol = INT8_SYMBOL


class CPUDecodeLayerBF16(CPUDecodeLayer):
    """``CPUDecodeLayer`` of a bf16 model built for inference: the Linear weights bfloat16 (``precision="bfloat16"``:
    oneDNN's bf16 GEMM, or its emulation with ``emulate`` or on a CPU without it)."""

    symbol = BF16_SYMBOL


def decode_layer_kernel(epsilon, scale, form, dtype, int8=False, precision="float32", bf16_weights=False, **kwargs):
    """A ``CPUDecodeLayer`` (``int8``: a ``CPUDecodeLayerInt8``; ``bf16_weights``: a ``CPUDecodeLayerBF16``) or None:
    silently for a graph dtype other than float32 or an MLP form it does not compute, after one warning line where
    the library cannot be built. ``precision``: the GEMMs' ("float32", or "bfloat16" for a bf16 model's);
    ``kwargs``: the layout (``CPUDecodeLayer``'s ``norm``, ``rotary_dim``, ``parallel_residual``, ``qkv_bias``,
    ``bias``) and ``threads``."""
    if form not in {f.name.lower() for f in MlpForm}:
        return None
    path = float32_library(dtype, _warn_once)
    if path is None:
        return None
    if int8:
        return CPUDecodeLayerInt8(path, epsilon, scale, form, **kwargs)
    cls = CPUDecodeLayerBF16 if bf16_weights else CPUDecodeLayer
    return cls(path, epsilon, scale, form, precision=precision, **kwargs)
