"""``CPUTrainLayer``: one whole decoder layer of a training step (``cpu_train_layer.cc``) as a MindSpore Cell.

Two AOT ``ops.Custom`` primitives, the layer's forward (its output and a ticket) and its backward (the input's and
every parameter's gradient), the second called from the first's ``bprop``: one node each way in the compiled
training graph, so MindFormers' trainer, recompute, gradient accumulation, clip and loss scale see an ordinary op.
``KernelProvider.train_layer_for`` (``provider.py``: ``cpu_kernels.train_layer``) chooses it for a block whose
layout it computes; ``model/gpt.py`` ``GPTLocalBlock`` runs it in its training graphs (the train flag set, no KV
cache) and its per-op forward everywhere else (eval, predict, decode), the reference it is tested against.

The layouts (``TrainLayerLayout``, read from the model's ``Arch``): LayerNorm or RMSNorm, the tanh or quick GeLU MLP
or SwiGLU's, biases on every Linear, on the QKV projection only or on none, rope on all or the first ``rotary_dim``
channels of each head or none (learned positions are added before the layers), multi-head or grouped-query
attention, the sequential or NeoX's parallel residual. Dropout: the counter masks of ``model/dropout.py`` at the
layer's three sites (the attention probabilities, the attention's and the MLP's outputs), drawn inside from the same
tables and offsets, so the masks are the per-op graph's and a resumed run draws the uninterrupted run's.

What the kernel keeps between the forward and the backward lives in buffers it owns (one slot a layer, kept across
steps; ``shared``: the slot the layers MindSpore recomputes share); the forward's ticket output pairs a backward with
its forward's activations, and a backward that finds its slot holding another forward's runs the forward again from
its inputs first (the kernel's comment says how; ``stats`` counts it). The slot is freed when the Cell goes.
"""
import collections
import ctypes
import functools
import itertools
import weakref

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from ..abi import build
from ..abi.aot import float32_library, primitive
from .attention import KEY_BLOCK, QUERY_BLOCK
from ..abi.codes import MlpForm, NormKind, name_of
from ..abi.precision import precision_code
from ..abi.layer_table import train_layer_parameters
from ..abi.table import KERNELS, TrainLayerOptions

FORWARD = "gptlocal_train_layer_fwd"
STATS = ("forwards", "backwards", "recomputed", "slot_bytes", "workspace_bytes", "slots")
SHARED_SLOT = 0
_SLOTS = itertools.count(1)  # each layer's own slot; 0 is the shared one
_warn_once = functools.partial(build.warn_once, "CPU training-layer kernel off, the layer's per-op graph used instead")

# A layer's layout as the kernel computes it: ``norm`` "LayerNorm" / "RMSNorm"; ``mlp`` "tanh" / "quick" (GeLU) or
# "swiglu"; ``bias``: the projection's and the MLP's Linears have biases; ``qkv_bias``; ``rope``; ``parallel_residual``;
# ``heads``, ``groups`` (key/value heads); ``hidden`` (the width, for a GeLU layer's stand-in gate)
TrainLayerLayout = collections.namedtuple(
    "TrainLayerLayout", "norm mlp bias qkv_bias rope parallel_residual heads groups hidden")


def dropout_mode(dropout):
    """The kernel's mode of a ``CounterDropout`` (or None): 0 none, 1 keep where the bits agree, 2 where they
    differ."""
    if dropout is None or not 0.0 < dropout.p < 1.0:
        return 0
    return 2 if dropout.keep_when_differ else 1


def stats(library_path):
    """The kernel's counts in this process (``STATS``: forwards, backwards, backwards that ran their forward again,
    bytes held by the slots and by the workspace, slots held)."""
    values = (ctypes.c_int64 * len(STATS))()
    ctypes.CDLL(library_path).gptlocal_train_layer_stats(values)
    return dict(zip(STATS, (int(v) for v in values)))


def _release(library_path, slot):
    """Frees ``slot``'s buffers (a finalizer: the Cell is gone)."""
    ctypes.CDLL(library_path).gptlocal_train_layer_release(ctypes.c_int32(slot))


class CPUTrainLayer(nn.Cell):
    """``construct(hidden [B, S, H], mask [1 or B, 1, S, S], dropout_step, rotary, *parameters)`` -> the layer's
    output [B, S, H], float32. ``parameters``: the layer's, in ``kernels/layer_table.py`` ``LAYER``'s order
    (``table.py`` ``TRAIN_LAYER_PARAMETERS``: norm1_w, norm1_b, qkv_w, qkv_b, ...); one the layer has not (RMSNorm's
    shift, an absent bias, a GeLU MLP's gate) is None, and the kernel gets its stand-in (``stand_ins``, built here
    from the table). ``rotary``: (cos, sin) [B or 1, 1, S, rotary_dim] with rope, else None; ``dropout_step``: the
    model's forward counter (None: no dropout). ``dropouts``: the layer's ``CounterDropout`` s (attention
    probabilities, attention output, MLP output; None where the model draws none); ``precision``/``emulate`` as
    ``CPULinearGEMM``'s (bfloat16: bf16 GEMMs, and the GEMM operands saved as bf16); ``shared``: the layer is
    recomputed by MindSpore (the shared slot). The backward is the table's generated bprop (``aot.py``
    ``gradient``: one call of the backward kernel)."""

    def __init__(self, library_path, layout, epsilon, scale, dropouts=(None, None, None), threads=None,
                 precision="float32", emulate=False, shared=False, query_block=QUERY_BLOCK, key_block=KEY_BLOCK):
        super().__init__()
        attention_dropout, output_dropout, _ = dropouts
        self.slot = SHARED_SLOT if shared else next(_SLOTS)
        code = precision_code(library_path, precision, emulate)

        def config(attention_mode, hidden_mode):
            return TrainLayerOptions(
                epsilon, scale, 1.0 if attention_dropout is None else attention_dropout.scale,
                1.0 if output_dropout is None else output_dropout.scale, attention_mode, hidden_mode, layout.heads,
                layout.groups, name_of(NormKind, layout.norm), name_of(MlpForm, layout.mlp), int(layout.bias),
                int(layout.qkv_bias), int(layout.rope), int(layout.parallel_residual), code, threads, query_block,
                key_block, self.slot).tensor()

        self.config_plain = config(0, 0)
        self.config_dropout = config(dropout_mode(attention_dropout), dropout_mode(output_dropout))
        no_table = Tensor(np.zeros((1,), np.float32))
        self.attention_t1, self.attention_t2 = (attention_dropout.bits1, attention_dropout.bits2) \
            if dropout_mode(attention_dropout) else (no_table, no_table)
        self.hidden_t1, self.hidden_t2 = (output_dropout.bits1, output_dropout.bits2) \
            if dropout_mode(output_dropout) else (no_table, no_table)
        self.dropouts = nn.CellList([d for d in dropouts if d is not None]) \
            if all(d is not None for d in dropouts) else None
        self.no_offsets = Tensor(np.zeros((6,), np.int32))
        # the offsets of a step: the three sites' (a, b), or none without the counter dropouts; chosen here once
        self.step_offsets = self._no_step_offsets if self.dropouts is None else self._site_offsets
        self.stand_ins = stand_ins(layout)
        self.no_angle = Tensor(np.zeros((1, 1, 1, 2), np.float32))  # rope's cos and sin without rope
        self.forward = primitive(library_path, KERNELS[FORWARD])  # its bprop: the table's (the backward kernel)
        if not shared:
            weakref.finalize(self, _release, library_path, self.slot)

    def construct(self, hidden, mask, dropout_step, rotary, *parameters):
        cos, sin = self._angles(rotary)
        offsets, config = self.no_offsets, self.config_plain
        if dropout_step is not None:
            offsets, config = self.step_offsets(dropout_step), self.config_dropout
        given = ()
        for index in range(len(self.stand_ins)):
            given = given + (_or(parameters[index], self.stand_ins[index]),)
        out = self.forward(hidden, ops.cast(mask, ms.float32), cos, sin, self.attention_t1, self.attention_t2,
                           self.hidden_t1, self.hidden_t2, offsets, *given, config)
        return out[0]

    def _angles(self, rotary):
        if rotary is None:
            return self.no_angle, self.no_angle
        return ops.cast(rotary[0], ms.float32), ops.cast(rotary[1], ms.float32)

    def _no_step_offsets(self, dropout_step):  # pylint: disable=unused-argument
        return self.no_offsets

    def _site_offsets(self, dropout_step):
        """int32 [6]: (a, b) of the attention probabilities', the attention output's and the MLP output's masks."""
        return ops.concat((self.dropouts[0].offsets(dropout_step), self.dropouts[1].offsets(dropout_step),
                           self.dropouts[2].offsets(dropout_step)))


def _or(value, stand_in):
    """``value``, or ``stand_in`` where the layer has no such parameter (None)."""
    if value is None:
        return stand_in
    return value


def stand_ins(layout):
    """What the kernel gets for each parameter of ``TRAIN_LAYER_PARAMETERS`` the layer has not (``construct``'s
    None), in that order: zeros of the parameter's shape in the table (``layer_table.py`` ``train_layer_parameters``),
    each size name a stand-in may take one (``Hn``, ``Qb``, ``Ig``, ...) 1, the layer's width ``H`` itself (a GeLU
    MLP's gate weight [1, H])."""
    sizes = {"H": layout.hidden}
    return tuple(Tensor(np.zeros(tuple(sizes.get(d, 1) for d in dims.split(", ")), np.float32))
                 for _, dims in train_layer_parameters())


def layout_of(arch, form):
    """The ``TrainLayerLayout`` of a model's ``Arch`` whose MLP is ``form`` ("tanh", "quick" or "swiglu")."""
    return TrainLayerLayout("RMSNorm" if arch.rmsnorm else "LayerNorm", form, bool(arch.bias), bool(arch.qkv_bias),
                            bool(arch.rope), bool(arch.parallel_residual), int(arch.num_attention_heads),
                            int(arch.groups), int(arch.hidden_size))


def train_layer_kernel(layout, epsilon, scale, dtype, **kwargs):
    """A ``CPUTrainLayer`` or None (after one warning) where it cannot run: a graph dtype other than float32, no
    library."""
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPUTrainLayer(path, layout, epsilon, scale, **kwargs)
