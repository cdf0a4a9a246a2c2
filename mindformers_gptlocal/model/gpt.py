"""The GPT forward, top to bottom: the embedding, the MLP, the block (norm -> attention -> residual -> norm -> MLP ->
residual), GPTLocalModel (embeddings + CellList of blocks + final norm) and GPTLocalForCausalLM (head + loss).
Attention is ``attention.py``; Linear, the norms and the activations ``layers.py``; dropout ``dropout.py``.

The layer choices (GPT-2, Llama-style, NeoX-style) come from ``config.arch`` (``arch.py``); the KV cache's storage
is ``kv_cache.py``; what runs decoding (``generate``, the compiled prefill/decode graphs) is the inference runtime,
``runtime/``. The classes are plain MindSpore Cells (MindFormers never imported); MindFormers builds
``mf/model.py``'s ``GPTLocalForCausalLM``, this one on its ``PreTrainedModel`` with what it calls besides
``construct``.

Training returns the loss first, then as many zeros as ``train_outputs`` asks (MindFormers' mcore wrappers unpack
``(lm_loss, mtp_loss, aux_loss, indexer_loss)`` on 1.9, the first three on 1.8: ``mf/model.py``); eval with labels
returns ``(logits, labels, mask)`` laid out for a perplexity metric; predict returns logits ``[batch, seq, vocab]``.
Decoding runs the same ``GPTLocalModel.construct`` with per-layer caches (``kv_cache.py``, ``runtime/runner.py``).
The parallel layout is read once (``config.layout``) and handed to placement, recompute and sharding.
"""
import math
import os

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor, Parameter
from mindspore.common.initializer import initializer, Normal

from ..errors import CheckpointError
from ..parallel.recompute import RecomputePlan
from ..tokenizer_id import check_model_dir as check_tokenizer_id
from ..parallel.sharding import apply_sharding, is_parallel_build
from .attention import (MASK_VALUE, BlockwiseCore, FlashCore, FusedCPUAttention, MatmulSoftmaxAttention,
                        ParallelAttention, RotaryEmbedding)
from .config import GPTLocalConfig, GenerationOptions, graph_config
from .dropout import (CounterDropout, DropoutCounter, counter_dropout_enabled, dropout_site, make_dropout,
                      make_layerdrop)
from .layers import (Activation, KernelLayerNorm, KernelRMSNorm, LayerNorm, Linear, RMSNorm, SiLU, bf16_parameter,
                     kernel_provider, make_norm, residual_init_std, to_mstype, use_gemm)
from ..kernels.provider import DecodeLayerFacts, TrainLayerFacts, dtype_name
from .layer_spec import freeze_pet, model_layer_spec
from .quant_cells import QuantLinear, int8_lookup, int8_matmul, int8_parameter, scale_parameter
from .quantization import read_quantization
from .params import DROPOUT_STEP, OUTPUT_LAYER, WORD_EMBEDDINGS
from .weights import load_weights, save_model_dir, WEIGHTS_NAME


def use_flash_attention(config, kernels):
    """Ascend's fused kernel when asked for and on Ascend; matmul + softmax everywhere else (and with a
    prefix-tuning prefix, whose key rows the square-mask kernel does not take): the model's provider ``kernels``
    decides (``KernelProvider.flash_attention``)."""
    return kernels.flash_attention(config.use_flash_attention, config.prefix_spec() is not None)


def missing_weights(model_dir):
    """Why ``model_dir`` (a folder) cannot give a trained model: the one line naming it and what it lacks, or None
    (it has its weights, or is not a folder: ``GPTLocalConfig.from_model_dir`` says that)."""
    if not os.path.isdir(model_dir) or os.path.isfile(os.path.join(model_dir, WEIGHTS_NAME)):
        return None
    return (f"{model_dir} has no weights ({WEIGHTS_NAME}): it holds a config and a tokenizer only (e.g. "
            f"prepare-data's model folder, the start of a pretraining); give a trained model directory (a run's "
            f"output/model, `gptlocal convert hf2ms`, save_pretrained), or random_init=True in "
            f"GPTLocalForCausalLM.from_pretrained for a randomly initialised model.")


class GPTLocalEmbedding(nn.Cell):
    """Token embeddings + learned absolute position embeddings (none with rope: positions turn q and k instead),
    then dropout. The token lookup (``words``: a float table, an int8 one times its scales, or a bfloat16 one widened
    by ``kernels``' ``bf16_rows`` in a bf16 inference build) and whether positions are added (``add_positions``) are
    picked here, never in ``construct``."""

    def __init__(self, config, counter_dropout=False, kernels=None):
        super().__init__()
        params_dtype = to_mstype(config.params_dtype)
        self.int8 = read_quantization(config.quantization) is not None  # build-time flag (words)
        # a bf16 inference build (kernels.bf16_weights): the table held once, as bfloat16 (the tied head's too)
        self.bf16_rows = None if self.int8 or kernels is None else kernels.bf16_rows()
        if self.int8:  # an int8 model (quant_cells.py): the table int8, one scale per row
            self.word_embeddings = int8_parameter((config.vocab_size, config.hidden_size), "word_embeddings")
            self.word_embeddings_scale = scale_parameter(config.vocab_size, "word_embeddings_scale")
        elif self.bf16_rows is not None:
            self.word_embeddings = bf16_parameter((config.vocab_size, config.hidden_size), "word_embeddings")
        else:
            self.word_embeddings = Parameter(initializer(Normal(config.initializer_range),
                                                         (config.vocab_size, config.hidden_size), params_dtype),
                                             name="word_embeddings")
        self.learned_positions = config.arch.learned_positions
        if self.learned_positions:
            self.position_embeddings = Parameter(initializer(Normal(config.initializer_range),
                                                             (config.max_position_embeddings, config.hidden_size),
                                                             params_dtype), name="position_embeddings")
            self.position_gather = ops.Gather()  # its own primitive: its shard strategy differs from gather's
        self.gather = ops.Gather()
        self.dropout = make_dropout(config.embedding_dropout, dropout_site(), config, counter_dropout)
        self.compute_dtype = to_mstype(config.compute_dtype)
        # input_ids -> the token rows
        self.words = self._int8_words if self.int8 else self._table_words if self.bf16_rows is None else \
            self._bf16_words
        self.add_positions = self._learned_positions if self.learned_positions else self._no_positions

    def construct(self, input_ids, position_ids, dropout_step=None):
        hidden = self.add_positions(self.words(input_ids), position_ids)
        return self.dropout(ops.cast(hidden, self.compute_dtype), dropout_step)

    def _table_words(self, input_ids):
        return self.gather(self.word_embeddings, input_ids, 0)

    def _bf16_words(self, input_ids):
        """A bfloat16 table's rows, widened to float32 (``kernels/embedding.py``)."""
        return self.bf16_rows(self.word_embeddings, input_ids)

    def _int8_words(self, input_ids):
        """An int8 table's rows times their scales."""
        return int8_lookup(self.gather, self.word_embeddings, self.word_embeddings_scale, input_ids)

    def _learned_positions(self, words, position_ids):
        return words + self.position_gather(self.position_embeddings, position_ids, 0)

    def _no_positions(self, words, position_ids):  # pylint: disable=unused-argument
        return words


# The MLP. GPT-2's: fc1 (column-parallel) -> activation -> fc2 (row-parallel); with ``gated_linear_unit`` (SwiGLU,
# Llama's) fc2(silu(gate(x)) * fc1(x)), the gate its own column-parallel Linear. ``make_mlp`` picks the class, i.e.
# the forward, once at build from the model's ``KernelProvider``: the plain ops, or a CPU kernel for bias + GeLU
# (``kernels/norm_gelu.py``) or silu(gate) * up (``kernels/rms_swiglu.py``), or with the bias + GeLU kernel the GEMM
# epilogues (``kernels/linear.py`` CPULinearEpilogue: fc1's GEMM with the bias + GeLU, fc2's with the block's
# residual) in the graphs where the Linears run the GEMM kernel.
def make_mlp(config, layer_spec=None, *, kernels):
    """The MLP of one block: ``ParallelFeedForward`` (plain, not gated), ``GatedFeedForward``, or their kernel forms
    ``BiasGeLUFeedForward`` (biased fc1, tanh or quick GeLU; ``EpilogueFeedForward`` where ``kernels`` gives the
    GEMM epilogues too) and ``SwiGLUFeedForward`` where ``kernels`` (the model's ``KernelProvider``) gives the
    kernel: the class is what the provider answered."""
    compute_dtype = to_mstype(config.compute_dtype)
    arch = config.arch
    if arch.gated:
        kernel = kernels.swiglu(compute_dtype)
        cls = GatedFeedForward if kernel is None else SwiGLUFeedForward
        return cls(config, layer_spec, kernel, kernels=kernels)
    form = gelu_form(config.hidden_act)
    kernel = kernels.bias_gelu(form, compute_dtype, bias=arch.bias)
    if kernel is None:
        return ParallelFeedForward(config, layer_spec, kernels=kernels)
    linear = (layer_spec or {}).get  # the Linear classes fc1 and fc2 get: the epilogues take the base one only
    epilogue = kernels.gemm_epilogue(form, compute_dtype, bias=arch.bias, plain_linears=all(
        linear(path, Linear) is Linear for path in ("mlp.linear_fc1", "mlp.linear_fc2")))
    if epilogue is None:
        return BiasGeLUFeedForward(config, layer_spec, kernel, kernels=kernels)
    return EpilogueFeedForward(config, layer_spec, kernel, epilogue, kernels=kernels)


def gelu_form(hidden_act):
    """The GeLU form the CPU kernels compute for ``hidden_act`` ("tanh" or "quick", as ``Activation`` reads the
    names), or None (the erf GeLU, ReLU)."""
    return {"quick_gelu": "quick", "gelu": None, "relu": None}.get(hidden_act, "tanh")


def mlp_form(arch):
    """The MLP's form as the decoder's C++ layer names it (``kernels/decode_layer.py`` ``MLP_FORMS``): "swiglu" for
    the gated MLP, else ``Activation``'s reading of ``hidden_act``: "quick", "erf" (``gelu``), "relu" or "tanh"."""
    if arch.gated:
        return "swiglu"
    return {"quick_gelu": "quick", "gelu": "erf", "relu": "relu"}.get(arch.hidden_act, "tanh")


class ParallelFeedForward(nn.Cell):
    """hidden -> intermediate -> hidden (biases with ``add_bias_linear``); fc1 (and the gate) column-parallel,
    fc2 row-parallel under the ``shard`` strategies (``parallel/sharding.py``). This class's forward is the plain,
    not gated one; ``kernel``: the CPU kernel of the subclass that runs it (``make_mlp``), else None; ``kernels``:
    the model's ``KernelProvider`` (required)."""

    def __init__(self, config, layer_spec=None, kernel=None, *, kernels):
        super().__init__()
        arch = config.arch
        linear = (layer_spec or {}).get  # the layer spec's Linear class per path (layer_spec.py), else Linear
        params_dtype = to_mstype(config.params_dtype)
        compute_dtype = to_mstype(config.compute_dtype)
        local = arch.inter
        bias = arch.bias
        # fc1 returns x W^T where the bias + GeLU kernel adds the bias (fc1's own Parameter)
        self.linear_fc1 = linear("mlp.linear_fc1", Linear)(config.hidden_size, local, config.initializer_range,
                                                           params_dtype, compute_dtype, has_bias=bias,
                                                           skip_bias_add=kernel is not None and not arch.gated,
                                                           kernels=kernels)
        if arch.gated:  # SwiGLU: fc1 is the "up" projection, linear_gate the one through silu
            self.linear_gate = linear("mlp.linear_gate", Linear)(config.hidden_size, local, config.initializer_range,
                                                                 params_dtype, compute_dtype, has_bias=bias,
                                                                 kernels=kernels)
            self.activation = SiLU()  # the plain path (and the ops the shard strategies name)
            self.gate_mul = ops.Mul()
        else:
            self.activation = Activation(config.hidden_act, kernels)
        self.linear_fc2 = linear("mlp.linear_fc2", Linear)(local, config.hidden_size, residual_init_std(config),
                                                           params_dtype, compute_dtype, has_bias=bias,
                                                           kernels=kernels)
        self.swiglu = kernel if arch.gated else None  # silu(gate) * up, or None
        self.bias_gelu = None if arch.gated else kernel  # fc1's bias + GeLU, or None

    def construct(self, hidden, dropout_step=None):
        """``dropout_step``: the model's forward counter, for LoRA's input dropout on the Linears (``lora.py``)."""
        return self.linear_fc2(self.activation(self.linear_fc1(hidden, dropout_step)), dropout_step)


class BiasGeLUFeedForward(ParallelFeedForward):
    """fc1 without its bias, then the CPU kernel adds the bias and applies the GeLU (one pass)."""

    def construct(self, hidden, dropout_step=None):
        y = self.linear_fc1(hidden, dropout_step)  # with LoRA on fc1: its low-rank update included
        return self.linear_fc2(self.bias_gelu(y, ops.cast(self.linear_fc1.bias, y.dtype)), dropout_step)


class EpilogueFeedForward(BiasGeLUFeedForward):
    """``BiasGeLUFeedForward`` with the GEMM epilogues (``cpu_kernels.gemm_epilogue``; built where the provider gives
    them: fc1 and fc2 the plain Linear, with their biases): in the graphs where its Linears run the GEMM kernel
    (``use_gemm``: their static rows and the train flag, fixed at compile time) fc1 + bias + GeLU is one node, and
    fc2 + bias one more, with the block's residual added in it when the block hands it over (``residual``,
    ``GPTLocalBlock.mlp_residual``); in the other graphs ``BiasGeLUFeedForward``'s forward, then the residual's
    Add."""

    def __init__(self, config, layer_spec=None, kernel=None, epilogue=None, *, kernels):
        super().__init__(config, layer_spec, kernel, kernels=kernels)
        self.epilogue = epilogue
        self.add = ops.Add()

    def construct(self, hidden, dropout_step=None, residual=None):
        """``residual``: None, or the block's hidden [..., H], returned plus the MLP's output."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if not use_gemm(fc1.gemm_rule, self.training, math.prod(hidden.shape[:-1])):
            y = fc1(hidden, dropout_step)
            y = fc2(self.bias_gelu(y, ops.cast(fc1.bias, y.dtype)), dropout_step)
            return y if residual is None else self.add(residual, ops.cast(y, residual.dtype))
        dtype = fc1.compute_dtype
        x = ops.reshape(ops.cast(hidden, dtype), (-1, hidden.shape[-1]))
        inner = self.epilogue.gelu(x, ops.cast(fc1.weight, dtype), ops.cast(fc1.bias, dtype))
        if residual is None:
            return fc2(ops.reshape(inner, hidden.shape[:-1] + (inner.shape[-1],)), dropout_step)
        weight, bias = ops.cast(fc2.weight, dtype), ops.cast(fc2.bias, dtype)
        rows = ops.reshape(residual, (-1, residual.shape[-1]))
        return ops.reshape(self.epilogue.residual(inner, weight, bias, rows), residual.shape)


class GatedFeedForward(ParallelFeedForward):
    """SwiGLU: fc2(silu(gate(x)) * fc1(x))."""

    def construct(self, hidden, dropout_step=None):
        gate = self.activation(self.linear_gate(hidden, dropout_step))
        return self.linear_fc2(self.gate_mul(gate, self.linear_fc1(hidden, dropout_step)), dropout_step)


class SwiGLUFeedForward(ParallelFeedForward):
    """SwiGLU with silu(gate) * up in the CPU kernel."""

    def construct(self, hidden, dropout_step=None):
        step = dropout_step
        return self.linear_fc2(self.swiglu(self.linear_gate(hidden, step), self.linear_fc1(hidden, step)), step)


def make_decode_layer(config, block, kernels):
    """The decode step's one-node CPU kernel for ``block`` (``kernels/decode_layer.py``), or None: the block's plain
    decode graph. The model's ``KernelProvider`` decides (``decode_layer_for``) from the built block's facts
    (``layer_facts``)."""
    return kernels.decode_layer_for(layer_facts(config, block))


NORM_NAMES = {LayerNorm: "LayerNorm", KernelLayerNorm: "LayerNorm", RMSNorm: "RMSNorm", KernelRMSNorm: "RMSNorm"}


def layer_facts(config, block):
    """What the provider weighs of one built decoder layer (``DecodeLayerFacts``: the decode-layer node,
    ``decode_layer_for``, and the native runner, ``runner``): its architecture and MLP form, its Linears' classes
    and weight dtypes (the gate's too: SwiGLU), its norms' classes and weight dtypes, its compute dtypes, and whether
    it has a prefix, an adapter or LayerDrop. ``config``: the config the block was built from (``graph_config``'s)."""
    attention, mlp = block.attention, block.mlp
    linears = (attention.linear_qkv, attention.linear_proj, mlp.linear_fc1, mlp.linear_fc2)
    linears += (mlp.linear_gate,) if config.arch.gated else ()
    norms = (block.input_layernorm, block.post_attention_layernorm)
    weights = {linear.weight.dtype for linear in linears}
    if all(type(linear) is QuantLinear for linear in linears):
        kind = "int8"  # an int8 model's Linears
    elif all(type(linear) is Linear for linear in linears) and len(weights) == 1:
        kind = dtype_name(next(iter(weights)))  # the base Linear, one weight dtype
    else:
        kind = None  # LoRA, a mix
    norm_kinds = {NORM_NAMES.get(type(norm)) for norm in norms}
    norm_weights = {norm.weight.dtype for norm in norms}
    return DecodeLayerFacts(
        epsilon=config.layernorm_epsilon, scale=attention.plain.scale, form=mlp_form(config.arch),
        compute_dtype=to_mstype(config.compute_dtype), arch=config.arch, linears=kind,
        norm=next(iter(norm_kinds)) if len(norm_kinds) == 1 else None,
        norm_weights=next(iter(norm_weights)) if len(norm_weights) == 1 else None,
        norm_dtype=to_mstype(config.layernorm_compute_dtype), softmax_dtype=attention.plain.softmax_dtype,
        prefix=attention.prefix_concat is not None,
        adapters=block.attention_adapter is not None or block.mlp_adapter is not None,
        layerdrop=block.layerdrop is not None)


# the attention core a layer built (ParallelAttention._choose_core), as TrainLayerFacts names it
ATTENTION_CORES = {MatmulSoftmaxAttention: "plain", FusedCPUAttention: "fused", BlockwiseCore: "blockwise",
                   FlashCore: "flash"}


def make_train_layer(config, block, kernels, recomputed=False):
    """The training step's one-node CPU kernel for ``block`` (``kernels/train_layer.py``: the whole layer forward and
    backward), or None: the block's per-op graph. The model's ``KernelProvider`` decides (``train_layer_for``) from
    the built block's facts (``TrainLayerFacts``): its layout, its Linears' and norms' classes and weight dtypes, its
    compute dtypes, its attention core, its dropouts, whether it has a prefix, an adapter or LayerDrop, and whether
    MindSpore recomputes it (``recomputed``)."""
    arch = config.arch
    attention, mlp = block.attention, block.mlp
    linears = [attention.linear_qkv, attention.linear_proj, mlp.linear_fc1, mlp.linear_fc2]
    linears += [mlp.linear_gate] if arch.gated else []
    plain = all(type(linear) is Linear and linear.weight.dtype == ms.float32 for linear in linears)
    kinds = (RMSNorm, KernelRMSNorm) if arch.rmsnorm else (LayerNorm, KernelLayerNorm)
    norms = (block.input_layernorm, block.post_attention_layernorm)
    dropouts = (attention.plain.attention_dropout, block.attention_output_dropout, block.mlp_output_dropout)
    return kernels.train_layer_for(TrainLayerFacts(
        arch=arch, epsilon=config.layernorm_epsilon, scale=attention.plain.scale,
        form="swiglu" if arch.gated else gelu_form(config.hidden_act), compute_dtype=to_mstype(config.compute_dtype),
        linears="float32" if plain else None,
        norms=all(type(norm) in kinds and norm.weight.dtype == ms.float32 for norm in norms),
        norm_dtype=to_mstype(config.layernorm_compute_dtype), softmax_dtype=attention.plain.softmax_dtype,
        core=ATTENTION_CORES.get(type(attention.core)),
        dropouts=dropouts if all(isinstance(dropout, CounterDropout) for dropout in dropouts) else None,
        rates=(config.attention_dropout, config.hidden_dropout), prefix=attention.prefix_concat is not None,
        adapters=block.attention_adapter is not None or block.mlp_adapter is not None,
        layerdrop=block.layerdrop is not None, recomputed=recomputed))


# One decoder layer: norm -> ParallelAttention -> residual -> norm -> ParallelFeedForward -> residual; with
# ``use_parallel_residual`` (GPT-NeoX/Pythia) x + attention(norm1(x)) + mlp(norm2(x)). The norm is LayerNorm or RMSNorm
# (``normalization``), chosen when the block is built. Each part's residual update passes its bottleneck adapter
# (``pet_type: adapter``, ``model/adapter_cells.py``; built when the layer spec has one, else None) and LayerDrop's 0/1
# (``model_config.layerdrop``, ``dropout.LayerDrop``) when they exist. Its Linears and adapter sites are built with the
# Cells the layer spec (``layer_spec.py``) picks: LoRA and adapters live outside these classes. Where the layer runs
# (pipeline stage) and whether it recomputes are set on the Cell when it is built (``GPTLocalModel`` from the
# ``Layout``, ``parallel/``), never decided in ``construct``; nor is any of the above: the build binds the forward's
# steps (``layer``, ``adapt_attention``, ``adapt_mlp``, ``drop_layer``, ``residuals``, the decode node's arguments). In
# training graphs the whole layer may run as one kernel node each way (``train_kernel``, ``make_train_layer``;
# ``full_layer``), the per-op forward everywhere else.
class GPTLocalBlock(nn.Cell):
    """A pre-norm decoder layer (GPT-2's, or Llama/NeoX-style by ``config.arch``). ``layer_number`` counts from 1.
    Under tensor parallel the ``shard`` strategies (``parallel/sharding.py``) split the whole Cell. ``kernels``: the
    model's ``KernelProvider`` (required), handed to every part."""

    def __init__(self, config, layer_number, use_flash_attention=False, counter_dropout=False, layer_spec=None, *,
                 kernels, recomputed=False):
        """``recomputed``: MindSpore recomputes the whole layer (``recompute_config.recompute``; the training kernel
        then keeps its activations in the buffers every recomputed layer shares)."""
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = make_norm(config, kernels=kernels)
        layer_spec = layer_spec or {}  # which Cell each replaceable part is built with (layer_spec.py)
        self.attention = ParallelAttention(config, layer_number, use_flash_attention, counter_dropout=counter_dropout,
                                           layer_spec=layer_spec, kernels=kernels)
        self.post_attention_layernorm = make_norm(config, kernels=kernels)
        self.parallel_residual = config.arch.parallel_residual
        self.mlp = make_mlp(config, layer_spec=layer_spec, kernels=kernels)
        self.attention_output_dropout = make_dropout(config.hidden_dropout,
                                                     dropout_site(layer_number, "attention_output"), config,
                                                     counter_dropout)
        self.mlp_output_dropout = make_dropout(config.hidden_dropout, dropout_site(layer_number, "mlp_output"), config,
                                               counter_dropout)
        self.add = ops.Add()
        # pet_type: adapter's BottleneckAdapters (model/adapter_cells.py) when the layer spec has them (the factory
        # takes the model's provider); LayerDrop scales both updates by 0/1
        self.attention_adapter = layer_spec["attention_adapter"](kernels=kernels) \
            if "attention_adapter" in layer_spec else None
        self.mlp_adapter = layer_spec["mlp_adapter"](kernels=kernels) if "mlp_adapter" in layer_spec else None
        self.layerdrop = make_layerdrop(config, layer_number, counter_dropout)
        # the provider's: the MLP adds the residual in fc2's GEMM (EpilogueFeedForward) where nothing comes between
        # the MLP's output and that Add (no dropout, adapter, LayerDrop; the sequential residual)
        self.mlp_residual = kernels.epilogue_residual(
            self.mlp.epilogue if isinstance(self.mlp, EpilogueFeedForward) else None, config.hidden_dropout,
            self.mlp_adapter is not None, self.layerdrop is not None, self.parallel_residual)
        # the forward's steps, bound here once
        self.adapt_attention = self._attention_adapter if self.attention_adapter is not None else self._as_is
        self.adapt_mlp = self._mlp_adapter if self.mlp_adapter is not None else self._as_is
        self.drop_layer = self._layerdrop if self.layerdrop is not None else self._kept
        if self.parallel_residual:
            self.residuals = self._parallel_residuals
        else:
            self.residuals = self._residual_in_mlp if self.mlp_residual else self._sequential_residuals
        # the decode step (one token a row over the KV cache) as one CPU kernel node where it fits, else None
        self.decode_kernel = make_decode_layer(config, self, kernels)
        # the training step's layer as one CPU kernel node each way where it fits (make_train_layer), else None; the
        # whole layer's forward outside the decode step (full_layer): that kernel in training graphs, else the ops
        self.train_kernel = make_train_layer(config, self, kernels, recomputed)
        self.gate_parameters = self._gate_parameters if config.arch.gated else self._no_gate_parameters
        self.full_layer = self._layer if self.train_kernel is None else self._train_kernel_or_layer
        self.layer = self.full_layer if self.decode_kernel is None else self._layer_or_decode_kernel
        if self.decode_kernel is not None:
            self._bind_decode_arguments(config.arch)

    def _bind_decode_arguments(self, arch):
        """What the decode node is handed (``_decode``), bound once: each norm's weight and (LayerNorm) bias, each
        Linear's weight, its scales (an int8 model's) and its bias where the layer has them, SwiGLU's gate, the
        rope's cos and sin; a placeholder (``decode_none``...) wherever the layer has no such tensor."""
        int8 = isinstance(self.attention.linear_qkv, QuantLinear)
        self.decode_none = Tensor(np.zeros((1,), np.float32))
        self.decode_norm = self._decode_norm_and_bias if not arch.rmsnorm else self._decode_norm_weight
        linear_args = {(False, False): self._decode_weight, (False, True): self._decode_weight_and_bias,
                       (True, False): self._decode_int8_weight, (True, True): self._decode_int8_weight_and_bias}
        self.decode_qkv = linear_args[(int8, arch.qkv_bias)]
        self.decode_linear = linear_args[(int8, arch.bias)]
        self.decode_gate = self._decode_gate if arch.gated else self._decode_no_gate
        if not arch.gated:  # a placeholder gate weight of the Linears' dtype
            self.decode_no_gate = Tensor(np.zeros((1, 1), np.float32), self.mlp.linear_fc1.weight.dtype)
        self.decode_rotary = self._decode_rotary if arch.rope else self._decode_no_rotary
        self.decode_no_rotary = Tensor(np.zeros((1, 1, 1, 1), np.float32))

    def construct(self, hidden, attention_bias, key_cache=None, value_cache=None, write_index=None,
                  seq_ends=None, dropout_step=None, rotary=None, prefix=None, fresh_prefill=False):
        """hidden [B, S, H]. The optional KV cache arguments are this layer's (see ParallelAttention);
        ``prefix``: this layer's prefix (keys, values) with prefix tuning (``model/prefix_cells.py``);
        ``seq_ends``: packed rows' document ends for flash attention's variable-length form;
        ``dropout_step``: the forward counter that picks the dropout masks (``dropout.py``);
        ``rotary``: (cos, sin) of the positions with rope (``attention.RotaryEmbedding``);
        ``fresh_prefill``: a KV-cache prefill at positions 0..S-1 (see ParallelAttention).

        A decode step (a KV cache, one token a row, not a fresh prefill, inference) runs ``decode_kernel`` where
        the block has one (``make_decode_layer``; ``layer``: ``_layer_or_decode_kernel``): shapes and flags are
        constants of the compiled graph, so each graph holds one of the two paths."""
        return self.layer(hidden, attention_bias, key_cache, value_cache, write_index, seq_ends, dropout_step, rotary,
                          prefix, fresh_prefill)

    def _layer_or_decode_kernel(self, hidden, attention_bias, key_cache, value_cache, write_index, seq_ends,
                                dropout_step, rotary, prefix, fresh_prefill):
        if key_cache is not None and hidden.shape[1] == 1 and not fresh_prefill and not self.training:
            return self._decode(hidden, attention_bias, key_cache, value_cache, write_index, rotary)
        return self.full_layer(hidden, attention_bias, key_cache, value_cache, write_index, seq_ends, dropout_step,
                               rotary, prefix, fresh_prefill)

    def _train_kernel_or_layer(self, hidden, attention_bias, key_cache, value_cache, write_index, seq_ends,
                               dropout_step, rotary, prefix, fresh_prefill):
        """A training graph (the train flag, no KV cache) runs ``train_kernel``; every other the layer's ops. The
        flag and the cache's presence are constants of a compiled graph: each graph holds one of the two."""
        if self.training and key_cache is None:
            return self._train_layer(hidden, attention_bias, dropout_step, rotary)
        return self._layer(hidden, attention_bias, key_cache, value_cache, write_index, seq_ends, dropout_step,
                           rotary, prefix, fresh_prefill)

    def _train_layer(self, hidden, attention_bias, dropout_step, rotary):
        """The whole layer through ``train_kernel``: its Parameters as stored (None where the layer has none: an
        absent bias, RMSNorm's shift, a GeLU MLP's gate), the counter dropouts' step, rope's angles."""
        attention, mlp = self.attention, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv, proj, fc1, fc2 = attention.linear_qkv, attention.linear_proj, mlp.linear_fc1, mlp.linear_fc2
        gate_weight, gate_bias = self.gate_parameters()
        return self.train_kernel(hidden, attention_bias, dropout_step, rotary, norm1.weight, norm1.shift(),
                                 qkv.weight, qkv.shift(), proj.weight, proj.shift(), norm2.weight, norm2.shift(),
                                 fc1.weight, fc1.shift(), gate_weight, gate_bias, fc2.weight, fc2.shift())

    def _gate_parameters(self):
        gate = self.mlp.linear_gate
        return gate.weight, gate.shift()

    def _no_gate_parameters(self):
        return None, None

    def _layer(self, hidden, attention_bias, key_cache, value_cache, write_index, seq_ends, dropout_step, rotary,
               prefix, fresh_prefill):
        """The layer's ops: attention, then each residual update (dropout, then its adapter and LayerDrop's 0/1 where
        they exist) and the residuals' form (``residuals``)."""
        dtype = hidden.dtype
        attn = self.attention(self.input_layernorm(hidden), attention_bias, key_cache=key_cache,
                              value_cache=value_cache, write_index=write_index, seq_ends=seq_ends,
                              dropout_step=dropout_step, rotary=rotary, prefix=prefix,
                              fresh_prefill=fresh_prefill)
        attn = ops.cast(self.attention_output_dropout(attn, dropout_step), dtype)
        attn = self.drop_layer(self.adapt_attention(attn), dropout_step)
        return self.residuals(hidden, attn, dropout_step, dtype)

    def _mlp_update(self, mlp, dropout_step, dtype):
        mlp = ops.cast(self.mlp_output_dropout(mlp, dropout_step), dtype)
        return self.drop_layer(self.adapt_mlp(mlp), dropout_step)

    def _sequential_residuals(self, hidden, attn, dropout_step, dtype):
        hidden = self.add(hidden, attn)
        mlp = self.mlp(self.post_attention_layernorm(hidden), dropout_step)
        return self.add(hidden, self._mlp_update(mlp, dropout_step, dtype))

    def _residual_in_mlp(self, hidden, attn, dropout_step, dtype):  # pylint: disable=unused-argument
        """hidden + the MLP's output, added by the MLP (EpilogueFeedForward, ``mlp_residual``)."""
        hidden = self.add(hidden, attn)
        return self.mlp(self.post_attention_layernorm(hidden), dropout_step, hidden)

    def _parallel_residuals(self, hidden, attn, dropout_step, dtype):
        mlp = self.mlp(self.post_attention_layernorm(hidden), dropout_step)
        hidden = self.add(hidden, attn)
        return self.add(hidden, self._mlp_update(mlp, dropout_step, dtype))

    def _as_is(self, update):
        return update

    def _attention_adapter(self, update):
        return self.attention_adapter(update)

    def _mlp_adapter(self, update):
        return self.mlp_adapter(update)

    def _kept(self, update, dropout_step):  # pylint: disable=unused-argument
        return update

    def _layerdrop(self, update, dropout_step):
        return self.layerdrop(update, dropout_step)

    def _decode(self, hidden, attention_bias, key_cache, value_cache, write_index, rotary):
        """The whole layer for one token a row through ``decode_kernel``: its Parameters as stored (and placeholders
        where the layer has none: ``_bind_decode_arguments``), the caches written in place at ``write_index``,
        attention over each row's cached positions (``attention_bias``), rope from ``rotary``'s cos and sin."""
        attention, mlp = self.attention, self.mlp
        norm1_weight, norm1_bias = self.decode_norm(self.input_layernorm)
        norm2_weight, norm2_bias = self.decode_norm(self.post_attention_layernorm)
        qkv_weight, qkv_scale, qkv_bias = self.decode_qkv(attention.linear_qkv)
        proj_weight, proj_scale, proj_bias = self.decode_linear(attention.linear_proj)
        fc1_weight, fc1_scale, fc1_bias = self.decode_linear(mlp.linear_fc1)
        gate_weight, gate_scale, gate_bias = self.decode_gate(mlp)
        fc2_weight, fc2_scale, fc2_bias = self.decode_linear(mlp.linear_fc2)
        cos, sin = self.decode_rotary(rotary)
        return self.decode_kernel(hidden, norm1_weight, norm1_bias, qkv_weight, qkv_scale, qkv_bias, proj_weight,
                                  proj_scale, proj_bias, norm2_weight, norm2_bias, fc1_weight, fc1_scale, fc1_bias,
                                  gate_weight, gate_scale, gate_bias, fc2_weight, fc2_scale, fc2_bias, key_cache,
                                  value_cache, write_index, attention_bias, cos, sin)

    def _decode_norm_and_bias(self, norm):
        return norm.weight, norm.bias

    def _decode_norm_weight(self, norm):
        return norm.weight, self.decode_none

    def _decode_weight(self, linear):
        return linear.weight, self.decode_none, self.decode_none

    def _decode_weight_and_bias(self, linear):
        return linear.weight, self.decode_none, linear.bias

    def _decode_int8_weight(self, linear):
        return linear.weight, linear.weight_scale, self.decode_none

    def _decode_int8_weight_and_bias(self, linear):
        return linear.weight, linear.weight_scale, linear.bias

    def _decode_gate(self, mlp):
        return self.decode_linear(mlp.linear_gate)

    def _decode_no_gate(self, mlp):  # pylint: disable=unused-argument
        return self.decode_no_gate, self.decode_none, self.decode_none

    def _decode_rotary(self, rotary):
        return rotary

    def _decode_no_rotary(self, rotary):  # pylint: disable=unused-argument
        return self.decode_no_rotary, self.decode_no_rotary


def prefix_encoder(config, counter_dropout=False):
    """The PrefixEncoder of a prefix-tuning pet_config (``model/prefix_cells.py``), or None. Under semi_auto/auto
    parallel its tensors are replicated and each rank reads its key/value groups (``peft/prefix.py`` prefix_rules,
    PREFIX_BLOCK_RULES)."""
    spec = config.prefix_spec()
    if spec is None:
        return None
    from .prefix_cells import PrefixEncoder
    dropout = None
    if spec.dropout > 0:  # counter-based when the build is (dropout.counter_dropout_enabled): resume is exact
        dropout = make_dropout(spec.dropout, dropout_site(part="prefix"), config, counter_dropout)
    return PrefixEncoder(spec, config.num_hidden_layers, config.num_query_groups,
                         config.hidden_size // config.num_attention_heads, to_mstype(config.compute_dtype),
                         to_mstype(config.params_dtype), dropout)


class GPTLocalModel(nn.Cell):
    """The decoder stack. Each layer is a GPTLocalBlock whose stage and recompute are set here, once.

    Placement: the embedding on stage 0, each block on its stage (``Layout.stage_of_layers``), the final norm
    (and, in GPTLocalForCausalLM, the head) on the last. The token embedding is used on stage 0
    (lookup) and on the last stage (tied head); no copy is made here. MindSpore's pipeline pass
    (PipelineTransformer::HandleSharedParameter) makes the lowest stage that reads a shared
    Parameter its owner: the owner Sends its slice of the table to the later stage, which Receives
    it in place of its own copy; the backward of that Receive sends the head's gradient back and
    the owner adds it to the lookup's gradient, so only stage 0's table is updated.
    """

    def __init__(self, config, layout=None, layer_spec=None, *, kernels):
        super().__init__()
        self.config = config
        # which implementation each op runs (kernels/provider.py: the model's, required), handed to every layer
        self.kernels = kernels
        config = graph_config(config, self.kernels)  # the dtypes this device runs (CPU: bf16 -> fp32, bf16 GEMMs)
        layout = config.layout if layout is None else layout
        stage_ids = layout.stage_of_layers(config.num_hidden_layers)
        recompute = RecomputePlan(layout, config.num_hidden_layers)
        flash = use_flash_attention(config, kernels)
        # dropout masks from a step counter (dropout.py), so a resumed run draws the same ones
        self.counter_dropout = counter_dropout_enabled(config)
        self.embedding = GPTLocalEmbedding(config, self.counter_dropout, kernels=self.kernels)
        blocks = []
        for index in range(config.num_hidden_layers):
            block = GPTLocalBlock(config, index + 1, flash, counter_dropout=self.counter_dropout,
                                  layer_spec=None if layer_spec is None else layer_spec(index), kernels=self.kernels,
                                  recomputed=bool(recompute.full[index]))
            block.pipeline_stage = stage_ids[index]
            block.recompute_mode = recompute.apply(block, index)
            blocks.append(block)
        self.layers = nn.CellList(blocks)
        self.final_layernorm = make_norm(config, kernels=self.kernels)
        arch = config.arch
        self.rotary = RotaryEmbedding(arch.rotary_dim, arch.rotary_base) if arch.rope else None
        self.rotary_angles = self._no_rotary if self.rotary is None else self._rotary  # position_ids -> (cos, sin)
        self.embedding.pipeline_stage = 0
        self.final_layernorm.pipeline_stage = stage_ids[-1]
        # the masks' form the attention takes: flash attention's uint8 ones, else additive float32 ones
        self.masks = FlashMasks() if flash else AdditiveMasks()
        # the causal mask is built per call from the token index (one [S, S] comparison), not kept as a
        # [max_position_embeddings]^2 constant: a converted Qwen2 (32,768 positions) would hold 4 GiB of it
        self.token_index = Tensor(np.arange(config.max_position_embeddings, dtype=np.int32)[None])
        self.use_flash = flash
        self.stage_ids = stage_ids
        self.num_layers = config.num_hidden_layers
        # pet_config prefix tuning / P-Tuning v2, else None
        self.prefix_encoder = prefix_encoder(config, self.counter_dropout)
        self.prefix_tokens = 0 if self.prefix_encoder is None else self.prefix_encoder.tokens
        # what construct calls, chosen here once: the layers' prefixes (and the positions after them); without a
        # prefix each layer's is None (a constant of the graph)
        self.layer_prefixes = self._no_prefix if self.prefix_encoder is None else self._prefix
        self.no_prefixes = (None,) * self.num_layers

    def construct(self, input_ids, position_ids, attention_bias=None, key_caches=None, value_caches=None,
                  write_index=None, actual_seq_len=None, dropout_step=None, fresh_prefill=False):
        """input_ids/position_ids [B, S] -> hidden [B, S, H]. The causal mask is built here unless given.

        Decoding (``kv_cache.py``) passes per-layer caches (``key_caches``/``value_caches``: tuples of
        [B, N, L, D] Parameters), ``write_index`` [B, N, S, 3] and an ``attention_bias`` over the L
        cached rows; each layer writes its keys and values there (see ParallelAttention). ``fresh_prefill``: the
        call fills positions 0..S-1 of an empty cache (``attention_bias`` then the causal [1, 1, S, S]).
        ``actual_seq_len`` (packed rows, see ``document_mask``) replaces position_ids and the mask.
        ``dropout_step`` (training): the forward counter that picks every dropout mask (``dropout.py``)."""
        seq = input_ids.shape[1]
        seq_ends = None
        if actual_seq_len is not None:
            position_ids, attention_bias, seq_ends = self.document_mask(actual_seq_len, input_ids.shape[0], seq)
        if attention_bias is None:
            attention_bias = self.causal_mask(seq)
        prefixes, position_ids = self.layer_prefixes(position_ids, dropout_step)
        hidden = self.embedding(input_ids, position_ids, dropout_step)
        rotary = self.rotary_angles(position_ids)  # per-row positions, ragged or packed
        if key_caches is None:
            for index in range(self.num_layers):
                hidden = self.layers[index](hidden, attention_bias, seq_ends=seq_ends, dropout_step=dropout_step,
                                            rotary=rotary, prefix=prefixes[index])
        else:
            for index in range(self.num_layers):
                hidden = self.layers[index](hidden, attention_bias, key_cache=key_caches[index],
                                            value_cache=value_caches[index], write_index=write_index, rotary=rotary,
                                            prefix=prefixes[index], fresh_prefill=fresh_prefill)
        return self.final_layernorm(hidden)

    def _no_prefix(self, position_ids, dropout_step):  # pylint: disable=unused-argument
        return self.no_prefixes, position_ids

    def _no_rotary(self, position_ids):  # pylint: disable=unused-argument
        return None

    def _rotary(self, position_ids):
        return self.rotary(position_ids)

    def _prefix(self, position_ids, dropout_step):
        """Each layer's prefix (keys, values) of prefix tuning; the real tokens' positions follow the prefix (as
        peft's)."""
        prefix = self.prefix_encoder(dropout_step)
        pairs = ()
        for index in range(self.num_layers):
            pairs = pairs + ((prefix[2 * index], prefix[2 * index + 1]),)
        return pairs, position_ids + self.prefix_tokens

    def fused_prefill(self):
        """True where a KV-cache prefill into empty rows (``fresh_prefill``) runs the fused CPU attention kernel in
        every layer: the provider's ``fresh_prefill``, from whether it gave the kernel to each layer
        (``ParallelAttention.fused_prefill``) and whether there is a prefix-tuning prefix (whose rows come before
        the prompt). The inference runtime asks this (``runtime/runner.py``)."""
        return self.kernels.fresh_prefill(all(layer.attention.fused_prefill() for layer in self.layers),
                                          self.prefix_encoder is not None)

    def runner_facts(self):
        """Each layer's ``layer_facts``, what the runtime's ``runner_kind`` weighs (``describe.py``: once per model)."""
        config = graph_config(self.config, self.kernels)
        return tuple(layer_facts(config, layer) for layer in self.layers)

    def document_mask(self, actual_seq_len, batch, seq):
        """Packed rows: several documents in one row of ``seq`` tokens, as MindFormers' PackingHandler and
        Megatron's compressed EOD mask describe them: ``actual_seq_len`` [B, L] holds each row's cumulative
        document ends, padded with ``seq`` (after MindFormers' batch map, row b's ends are offset by b * seq;
        both forms are read). Returns position_ids [B, S] restarting at every document, the mask, and
        the ends over the flattened batch for flash attention (else None).

        The mask keeps token i -> j where j <= i and both lie in one document: additive [B, 1, S, S] for
        matmul attention (CPU/GPU); for flash attention the varlen kernel takes the ends themselves.
        All tensor arithmetic on static shapes, no control flow on values."""
        ends = ops.reshape(ops.cast(actual_seq_len, ms.int32), (batch, -1))
        ends = ops.floor_mod(ends - 1, seq) + 1  # row-local ends in (0, seq]
        index = self.token_index[:, :seq]  # [1, S]
        passed = ops.cast(ops.less_equal(ops.expand_dims(ends, 2), ops.expand_dims(index, 1)), ms.int32)
        doc = ops.reduce_sum(passed, 1)  # [B, S]: documents ended at or before token i = its document number
        start = ops.reduce_max(ops.expand_dims(ends, 2) * passed, 1)  # [B, S]: where token i's document starts
        positions = ops.broadcast_to(index, (batch, seq)) - start
        mask, seq_ends = self.masks.documents(ends, doc, self.causal_keep(seq), batch, seq)
        return positions, mask, seq_ends

    def causal_keep(self, seq):
        """[S, S] bool: query i may attend to key j where j <= i."""
        index = self.token_index[:, :seq]  # [1, S]
        return ops.less_equal(index, ops.reshape(index, (seq, 1)))

    def causal_mask(self, seq):
        """The causal mask of ``seq`` tokens as the attention takes it: additive [1, 1, S, S] (0 or
        MASK_VALUE above the diagonal), or uint8 [S, S] with 1 = masked for flash attention."""
        return self.masks.causal(ops.logical_not(self.causal_keep(seq)), seq)

    def mask_bias(self, attention_mask, batch, seq):
        """MindFormers' ``attention_mask`` column ([B, 1, S, S] or [B, S, S], 1 = masked: Megatron's reset
        mask, HFDataLoader's packed mask) as this model's mask: additive bias, or uint8 for flash."""
        return self.masks.given(attention_mask, batch, seq)


class AdditiveMasks(nn.Cell):
    """The masks of matmul + softmax attention (and the fused CPU kernel, blockwise): additive float32, 0 where a
    query may attend, ``MASK_VALUE`` where it may not (``GPTLocalModel.masks`` without flash attention)."""

    def causal(self, masked, seq):
        """[S, S] bool (True: masked) -> [1, 1, S, S]."""
        return ops.reshape(ops.cast(masked, ms.float32) * MASK_VALUE, (1, 1, seq, seq))

    def given(self, attention_mask, batch, seq):
        """A 1 = masked column -> [B, 1, S, S]."""
        return ops.reshape(ops.cast(attention_mask, ms.float32) * MASK_VALUE, (batch, 1, seq, seq))

    def documents(self, ends, doc, causal_keep, batch, seq):  # pylint: disable=unused-argument
        """Packed rows: each token's document number ``doc`` [B, S] -> (the [B, 1, S, S] mask keeping attention
        causal and inside each document, None: no document ends for the kernel)."""
        same = ops.equal(ops.expand_dims(doc, 2), ops.expand_dims(doc, 1))  # [B, S, S]
        keep = ops.logical_and(same, causal_keep)
        bias = ops.cast(ops.logical_not(keep), ms.float32) * MASK_VALUE
        return ops.reshape(bias, (batch, 1, seq, seq)), None


class FlashMasks(nn.Cell):
    """The masks of Ascend's FlashAttentionScore (``GPTLocalModel.masks`` with flash attention): uint8, 1 = masked;
    packed rows take sparse_mode 3's compressed mask and the document ends."""

    def __init__(self):
        super().__init__()
        self.varlen_mask = Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1))  # sparse_mode 3's compressed mask

    def causal(self, masked, seq):  # pylint: disable=unused-argument
        return ops.cast(masked, ms.uint8)

    def given(self, attention_mask, batch, seq):
        return ops.reshape(ops.cast(attention_mask, ms.uint8), (batch, 1, seq, seq))

    def documents(self, ends, doc, causal_keep, batch, seq):  # pylint: disable=unused-argument
        """(the compressed mask, the row-local document ends ``ends`` [B, L] over the flattened batch)."""
        offsets = ops.reshape(ops.arange(batch, dtype=ms.int32) * seq, (batch, 1))
        return self.varlen_mask, ops.reshape(ends + offsets, (-1,))


class OutputLayer(nn.Cell):
    """The untied output head's table [vocab, hidden] (``untie_embeddings_and_output_weights``): bfloat16 where
    ``kernels`` (the model's provider) says ``bf16_weights``, like the Linears'."""

    def __init__(self, config, kernels):
        super().__init__()
        if read_quantization(config.quantization) is not None:  # an int8 model: int8 rows and their scales
            self.weight = int8_parameter((config.vocab_size, config.hidden_size), "weight")
            self.weight_scale = scale_parameter(config.vocab_size, "weight_scale")
            return
        if kernels.bf16_weights:
            self.weight = bf16_parameter((config.vocab_size, config.hidden_size), "weight")
            return
        self.weight = Parameter(initializer(Normal(config.initializer_range), (config.vocab_size, config.hidden_size),
                                            to_mstype(config.params_dtype)), name="weight")


class GPTLocalForCausalLM(nn.Cell):
    """A causal LM (GPT-2, Llama-style or NeoX-style, ``config.arch``): its output head tied to the token embedding
    or its own (``untie_embeddings_and_output_weights``); ``generate`` and ``kv_cache`` hand over to the inference
    runtime (``runtime/``). The class MindFormers builds from a YAML is ``mf/model.py``'s: this one on MindFormers'
    ``PreTrainedModel``, with what MindFormers' trainer and pipelines call besides ``construct``."""

    config_class = GPTLocalConfig
    # how many values the training forward returns: the loss, then zeros for the further losses a trainer's step
    # unpacks (MindFormers' mcore steps: 3 or 4, mf/model.py); 1: the loss alone, in a tuple
    train_outputs = 1

    def __init__(self, config: GPTLocalConfig, layer_spec=None, inference=False):
        self._init_base(config)
        layout = config.layout
        # which Cell each layer's Linears and adapter sites are built with (layer_spec.py): pet_config's LoRA or
        # adapters unless ``layer_spec`` is given (serve --lora's MultiLoRASpec); None: the base Cells.
        # ``inference``: built for inference only (model/loader.py): a bf16 model's weights then bf16 on CPU
        kernels = kernel_provider(config, inference=inference)
        graph = graph_config(config, kernels)  # the dtypes this device runs (GPTLocalModel's too: adapters, head)
        # an int8 model's QuantLinears (model_layer_spec)
        self.model = GPTLocalModel(config, layout, model_layer_spec(graph, layer_spec), kernels=kernels)
        self.untied = config.arch.untied
        if self.untied:  # its own head table, on the last stage
            self.output_layer = OutputLayer(graph, kernels)
            self.output_layer.pipeline_stage = self.model.stage_ids[-1]
        if self.model.counter_dropout:  # training state, not a weight (params.DROPOUT_STEP); checkpoints keep it
            self.dropout_step = DropoutCounter.new_counter(DROPOUT_STEP)
            self.dropout_counter = DropoutCounter()
        self.compute_dtype = to_mstype(graph.compute_dtype)
        self.head_matmul = kernels.plain_matmul()
        # the CPU GEMM kernel and its rows (kernels/provider.py), or (None, None): head_matmul
        # bf16 weights (kernels.bf16_weights): the kernel takes the head's table as held, an untied head's own or,
        # for a tied head, the token table (held as bfloat16 too, GPTLocalEmbedding)
        self.head_bf16 = kernels.bf16_weights
        self.head_gemm, self.head_gemm_rule = kernels.linear_gemm(self.compute_dtype, head=True,
                                                                  bf16_weights=self.head_bf16)
        # an int8 model's head: the int8 GEMM over the int8 table (quant_cells.py), else None
        self.head_int8 = int8_matmul(kernels) if self.model.embedding.int8 else None
        # the training loss's head + cross-entropy as one kernel (kernels/head_loss.py), or None: the head and lm_loss
        held = "int8" if self.head_int8 is not None else ("bfloat16" if self.head_bf16 else "float32")
        self.head_loss = kernels.head_loss(self.compute_dtype, trains=self._head_trains(config), weights=held)
        self._bind_head()
        self.log_softmax = ops.LogSoftmax(axis=-1)
        self.gather_d = ops.GatherD()
        self.ignore_token_id = config.ignore_token_id
        self.vocab_size = config.vocab_size
        self.position_ids = Tensor(np.arange(config.max_position_embeddings, dtype=np.int32)[None])
        freeze_pet(self)  # its freeze lists (prefix tuning: only the prefix trains), before the strategies are set
        self.sharding = apply_sharding(self, config, config.arch) if is_parallel_build() else {}

    def _head_trains(self, config):
        """False where the pet_config freezes the head's table (LoRA, adapters, prefix tuning: ``freeze_pet``)."""
        spec = config.pet_spec()
        return spec is None or not spec.is_frozen(OUTPUT_LAYER if self.untied else WORD_EMBEDDINGS)

    def _init_base(self, config):
        """The Cell and what the inference runtime reads of a model: ``config``, ``name_or_path`` and the default
        generation options (``generation_config``). MindFormers' class (``mf/model.py``) sets them through its
        ``PreTrainedModel.__init__`` instead."""
        nn.Cell.__init__(self)
        self.config = config
        self.name_or_path = config.name_or_path
        self.generation_config = GenerationOptions.from_model_config(config)

    # --- weights ---------------------------------------------------------------------------------
    def load_weights(self, path):
        """Load safetensors weights: a file, a model directory or a MindFormers checkpoint folder. The model's
        runners are dropped (a native runner points at the Parameters' buffers, which loading may replace)."""
        path = load_weights(self, path)
        pool = self.__dict__.get("_kv_caches")
        if pool is not None:
            pool.clear()
        return path

    @classmethod
    def from_pretrained(cls, model_dir, layer_spec=None, random_init=False, inference=False, **overrides):
        """Build from ``model_dir/config.json`` (``layer_spec``, ``inference``: as for ``__init__``) and load its
        weights (model.safetensors). A folder without weights is refused (``CheckpointError`` naming it) unless
        ``random_init=True`` asks for a randomly initialised model on purpose. The folder's tokenizer files must be
        those its weights were trained with (``tokenizer_id``)."""
        lacking = None if random_init else missing_weights(model_dir)
        if lacking:
            raise CheckpointError(lacking)
        check_tokenizer_id(model_dir)
        model = cls(cls.config_class.from_model_dir(model_dir, **overrides), layer_spec=layer_spec,
                    inference=inference)
        if not random_init:
            model.load_weights(model_dir)
        return model

    def save_pretrained(self, save_directory, tokenizer_dir=None, **kwargs):
        """Write config.json + model.safetensors (+ tokenizer files) to ``save_directory``."""
        return save_model_dir(self, save_directory, tokenizer_dir)

    @property
    def token_positions(self):
        """Positions a sequence may use: max_position_embeddings less a prefix-tuning prefix (the real tokens'
        positions follow it). Generation, serve and eval bound their lengths by it."""
        return self.config.max_position_embeddings - self.model.prefix_tokens

    # --- KV cache ----------------------------------------------------------------------------------
    def kv_cache(self, batch_size, needed_length):
        """The inference runtime's runner for ``batch_size`` sequences of up to ``needed_length`` tokens (rounded up
        to a bucket), built once per shape and kept (the most recently used shapes): on CPU the native runner
        (``runtime/native.py``: the forward over a KV cache as one C++ call a step), else ``runtime/runner.py``'s
        ``ModelRunner`` (a KV cache and its compiled prefill / decode / greedy graphs, so no call recompiles); the
        runtime decides (``runner_kind``) from what it reads of the model, its ``Description`` (``describe.py``)."""
        from ..runtime.runner import runner_for  # the runtime runs the model: imported when first asked
        from .describe import describe
        return runner_for(self, batch_size, needed_length, describe)

    def generate(self, input_ids, generation_config=None, streamer=None, seed=None, stop_when=None, **kwargs):
        """MindFormers-style generate (its predict pipeline calls it on MindFormers' class): ``runtime/generate.py``
        ``generate``."""
        from ..runtime.generate import generate
        return generate(self, input_ids, generation_config, streamer=streamer, seed=seed, stop_when=stop_when,
                        **kwargs)

    # --- forward ---------------------------------------------------------------------------------
    def logits(self, hidden):
        """The head (tied to the token table, or ``output_layer``): hidden [B, S, H] -> fp32 logits [B*S, V]."""
        return self.head(self._head_rows(hidden))

    def _head_rows(self, hidden):
        """hidden [B, S, H] as the head takes it: [B*S, H] in the compute dtype."""
        batch, seq, width = hidden.shape
        return ops.reshape(ops.cast(hidden, self.compute_dtype), (batch * seq, width))

    def _bind_head(self):
        """What ``logits`` and the training forward run, chosen once: the head's GEMM (``head``: an int8 model's,
        MatMul, or per graph the GEMM kernel or MatMul), its table as that GEMM takes it (``head_weights``: the
        untied head's own or the token table, the tied head's bf16 copy under bf16 weights; cast to the compute dtype
        unless held as the kernel takes it) and the dropout counter's steps (``forward_step``, ``count_forward``)."""
        if self.head_int8 is not None:  # an int8 table and its per-row scales (float32 compute)
            self.head = self._int8_head
            self.head_weights = self._untied_int8_table if self.untied else self._int8_table
        else:
            self.head = self._matmul_head if self.head_gemm is None else self._gemm_head
            if self.head_bf16:  # a bf16 table as held, for the kernel (every graph runs it then)
                self.head_weights = self._untied_table if self.untied else self._table_as_held
            else:
                self.head_weights = self._untied_table_cast if self.untied else self._table_cast
        self.train_loss = self._plain_loss if self.head_loss is None else self._fused_loss
        counter = self.model.counter_dropout
        self.forward_step = self._read_counter if counter else self._no_counter
        self.count_forward = self._advance_counter if counter else self._as_counted

    def _int8_head(self, hidden):
        weight, scale = self.head_weights()
        return self.head_int8(hidden, weight, scale)

    def _matmul_head(self, hidden):
        return ops.cast(self.head_matmul(hidden, self.head_weights()), ms.float32)

    def _gemm_head(self, hidden):
        weight = self.head_weights()
        # fixed at compile time (layers.py); the head's rule (provider.HEAD_RULE) takes 1-2 rows too: decode, batch 1-2
        if use_gemm(self.head_gemm_rule, self.training, hidden.shape[0]):
            return ops.cast(self.head_gemm(hidden, weight), ms.float32)
        return ops.cast(self.head_matmul(hidden, weight), ms.float32)

    def _int8_table(self):
        return self.model.embedding.word_embeddings, self.model.embedding.word_embeddings_scale

    def _untied_int8_table(self):
        return self.output_layer.weight, self.output_layer.weight_scale

    def _table_as_held(self):
        return self.model.embedding.word_embeddings

    def _untied_table(self):
        return self.output_layer.weight

    def _table_cast(self):
        return ops.cast(self.model.embedding.word_embeddings, self.compute_dtype)

    def _untied_table_cast(self):
        return ops.cast(self.output_layer.weight, self.compute_dtype)

    def _read_counter(self):
        return self.dropout_counter.read(self.dropout_step)

    def _no_counter(self):
        return None

    def _advance_counter(self, loss):
        return self.dropout_counter.advance(loss, self.dropout_step)

    def _as_counted(self, loss):
        return loss

    def last_logits(self, hidden, last_index):
        """Logits [B, V] of one position per sequence: hidden [B, S, H], last_index [B]."""
        batch, _, width = hidden.shape
        index = ops.broadcast_to(ops.reshape(last_index, (batch, 1, 1)), (batch, 1, width))
        return self.logits(self.gather_d(hidden, 1, index))

    def construct(self, input_ids, labels=None, loss_mask=None, position_ids=None, attention_mask=None,
                  actual_seq_len=None):
        """input_ids [B, S]. With ``labels`` None in training, input_ids holds S+1 tokens and is shifted.

        Packed rows (several documents a row): ``actual_seq_len`` (cumulative document ends, MindFormers'
        PackingHandler / compressed EOD mask) or ``attention_mask`` (MindFormers' convention, 1 = masked,
        e.g. Megatron's reset_attention_mask) keep attention inside each document; with actual_seq_len
        the positions restart at each document too (``GPTLocalModel.document_mask``)."""
        if labels is None and self.training:
            labels = input_ids[:, 1:]
            input_ids = input_ids[:, :-1]
        batch, seq = input_ids.shape
        if position_ids is None:
            position_ids = ops.broadcast_to(self.position_ids[:, :seq], (batch, seq))
        attention_bias = None
        if attention_mask is not None:
            attention_bias = self.model.mask_bias(attention_mask, batch, seq)
        step = None
        if self.training:
            step = self.forward_step()  # the counter, read before this forward's increment below; or None
        hidden = self.model(input_ids, position_ids, attention_bias, actual_seq_len=actual_seq_len, dropout_step=step)
        if not self.training:
            logits = ops.reshape(self.logits(hidden), (batch, seq, self.vocab_size))
            if labels is None:
                return logits
            return self._perplexity_layout(logits, labels, loss_mask)
        loss = self.count_forward(self.train_loss(hidden, labels, loss_mask))
        zero = ops.zeros((), ms.float32)
        return (loss,) + (zero, zero, zero)[:self.train_outputs - 1]  # train_outputs: fixed at build

    def _perplexity_layout(self, logits, labels, loss_mask):
        """Eval with labels, laid out for a perplexity metric (MindFormers' PerplexityMetric, gpt_local's): it
        scores logits[:, t] against labels[:, t + 1]; our labels are already shifted, so pad one position on each
        to keep every token."""
        if loss_mask is None:
            loss_mask = ops.ones_like(labels)
        mask = ops.cast(loss_mask, ms.int32) * ops.cast(ops.not_equal(labels, self.ignore_token_id), ms.int32)
        logits = ops.concat((logits, logits[:, -1:]), axis=1)
        labels = ops.concat((labels[:, :1], ops.maximum(labels, 0)), axis=1)
        mask = ops.concat((mask[:, :1], mask), axis=1)
        return logits, labels, mask

    def lm_loss(self, logits, labels, loss_mask):
        """Mean token cross-entropy over positions where loss_mask is set and labels are not ignored."""
        labels, keep = self._loss_rows(labels, loss_mask)
        safe_labels = ops.maximum(labels, 0)
        log_probs = self.log_softmax(logits)
        picked = self.gather_d(log_probs, 1, ops.reshape(safe_labels, (-1, 1)))
        nll = -ops.reshape(picked, (-1,))
        return ops.reduce_sum(nll * keep) / ops.maximum(ops.reduce_sum(keep), 1.0)

    def _plain_loss(self, hidden, labels, loss_mask):
        return self.lm_loss(self.logits(hidden), labels, loss_mask)

    def _fused_loss(self, hidden, labels, loss_mask):
        """``_plain_loss``'s value from the head + loss kernel: each kept row weighted 1 / the kept rows."""
        labels, keep = self._loss_rows(labels, loss_mask)
        row_weight = keep / ops.maximum(ops.reduce_sum(keep), 1.0)
        return ops.reshape(self.head_loss(self._head_rows(hidden), self.head_weights(), labels, row_weight), ())

    def _loss_rows(self, labels, loss_mask):
        """Labels flattened to [B*S] and each row's weight: 1 where loss_mask is set and the label not ignored."""
        labels = ops.reshape(labels, (-1,))
        keep = ops.cast(ops.not_equal(labels, self.ignore_token_id), ms.float32)
        if loss_mask is not None:
            keep = keep * ops.cast(ops.reshape(loss_mask, (-1,)), ms.float32)
        return labels, keep

