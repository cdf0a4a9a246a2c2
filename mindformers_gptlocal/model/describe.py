"""What the inference runtime reads of a built model: one ``Description``, so ``runtime/`` imports nothing of
``model/``.

``describe(causal_lm)`` is called once per model, when the runtime first asks for a runner
(``GPTLocalForCausalLM.kv_cache`` hands this function to ``runtime/runner.py`` ``runner_for``). It names, without
copying anything:

- the layout: sizes, the norm (LayerNorm / RMSNorm), the MLP form as the C++ decoder names it, the rope, the
  residual, the learned positions' table length;
- the Parameters, per layer (``LayerParams``: each part of ``kernels/layer_table.py`` ``LAYER`` by name, its norms,
  its Linears with an int8 model's scales and the biases it has, None where it has none) and around the layers (the
  token and position tables, the final norm, the head: the token table where tied), as the model holds them (the
  runner takes its views of their buffers, again after a ``set_data``);
- the model's choices the runtime reads: its ``KernelProvider`` (``kernels``), each layer's ``DecodeLayerFacts``
  (``layer_facts``, what the runner choice weighs), whether a prefill into empty rows runs the fused kernel
  (``fresh_prefill``), the KV cache's storage (``new_cache(batch, length)``, ``kv_cache.py``) and the rope's cos and
  sin tables (``rope(length)``: ``attention.py`` ``rope_tables``, the angles ``RotaryEmbedding`` computes).
"""
import functools
from dataclasses import dataclass

import mindspore as ms

from ..kernels.abi.layer_table import Linear, Norm, cells
from .attention import rope_tables
from .gpt import mlp_form
from .kv_cache import KVCache


@dataclass(frozen=True)
class LinearParams:
    """A Linear's Parameters: ``weight`` [out, in], ``scale`` (an int8 model's per-row scales, else None) and
    ``bias`` (None without)."""
    weight: object
    scale: object
    bias: object


@dataclass(frozen=True)
class NormParams:
    """A norm's Parameters: ``weight`` and ``bias`` (None for RMSNorm)."""
    weight: object
    bias: object


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer: ``parts``, each part of ``kernels/layer_table.py`` ``LAYER`` by name (a norm's
    ``NormParams``, a Linear's ``LinearParams``, another tensor's Parameter; None where the layer has none, e.g. a
    GeLU MLP's gate), and attention's score scale."""
    parts: dict
    scale: float


@dataclass(frozen=True)
class Description:  # pylint: disable=too-many-instance-attributes
    """A built causal LM as the runtime reads it (see the module's docstring)."""
    hidden: int
    heads: int
    groups: int
    head_dim: int
    inter: int
    vocab: int
    rmsnorm: bool
    mlp_form: str  # kernels/abi/codes.py MlpForm's name (name_of)
    parallel_residual: bool
    rotary_dim: int  # 0: learned positions
    rotary_base: float
    max_positions: int  # the learned positions' table length, 0 with rope
    epsilon: float
    words: object  # the token table (float32, bfloat16 or int8 Parameter)
    words_scale: object  # an int8 table's per-row scales, else None
    positions: object  # the learned positions' table, else None
    final_norm: NormParams
    head: object  # the head's table: the untied output layer's, else the token table
    head_scale: object
    layers: tuple  # of LayerParams
    kernels: object  # the model's KernelProvider
    layer_facts: tuple  # each layer's DecodeLayerFacts
    fresh_prefill: bool
    new_cache: object  # (batch, length) -> KVCache

    def rope(self, length):
        """(cos, sin) float32 [length, rotary_dim] by position, or (None, None) without rope."""
        return rope_tables(self.rotary_dim, self.rotary_base, length) if self.rotary_dim else (None, None)


def _linear(linear, int8):
    return LinearParams(linear.weight, linear.weight_scale if int8 else None, linear.bias if linear.has_bias else None)


def _norm(norm, rmsnorm):
    return NormParams(norm.weight, None if rmsnorm else norm.bias)


def _part(part, cell, arch, int8):
    """The Parameters of one part of ``LAYER`` (``cell``: the block's sub-Cell, or the Parameter, holding it)."""
    if part.when and not getattr(arch, part.when):
        return None
    if isinstance(part, Norm):
        return _norm(cell, arch.rmsnorm)
    return _linear(cell, int8) if isinstance(part, Linear) else cell


def describe(causal_lm):
    """The ``Description`` of ``causal_lm`` (a ``GPTLocalForCausalLM``) as built now."""
    model, arch = causal_lm.model, causal_lm.config.arch
    facts = model.runner_facts()
    int8 = bool(facts) and facts[0].linears == "int8"
    embedding = model.embedding
    words = embedding.word_embeddings
    words_scale = embedding.word_embeddings_scale if words.dtype == ms.int8 else None
    if causal_lm.untied:
        head = causal_lm.output_layer.weight
        head_scale = causal_lm.output_layer.weight_scale if head.dtype == ms.int8 else None
    else:  # a tied head: the token table (int8 with its scales; bfloat16 in a bf16 inference build)
        head, head_scale = words, words_scale
    layers = tuple(LayerParams({part.name: _part(part, cell, arch, int8) for part, cell in cells(block)},
                               block.attention.plain.scale) for block in model.layers)
    return Description(
        hidden=arch.hidden_size, heads=arch.num_attention_heads, groups=arch.groups, head_dim=arch.head_dim,
        inter=arch.inter, vocab=arch.vocab_size, rmsnorm=bool(arch.rmsnorm), mlp_form=mlp_form(arch),
        parallel_residual=bool(arch.parallel_residual), rotary_dim=arch.rotary_dim, rotary_base=arch.rotary_base,
        max_positions=arch.max_position_embeddings if arch.learned_positions else 0,
        epsilon=causal_lm.config.layernorm_epsilon, words=words, words_scale=words_scale,
        positions=embedding.position_embeddings if arch.learned_positions else None,
        final_norm=_norm(model.final_layernorm, arch.rmsnorm), head=head, head_scale=head_scale, layers=layers,
        kernels=model.kernels, layer_facts=facts, fresh_prefill=model.fused_prefill(),
        new_cache=functools.partial(_new_cache, causal_lm.config, causal_lm.compute_dtype))


def _new_cache(config, compute_dtype, batch_size, max_length):
    return KVCache(config, batch_size, max_length, compute_dtype)
