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
from ..kernels.abi.layer_table import LINEARS, Linear as LayerLinear, cells, parameter_slots, pointer_fields
from ..kernels.abi.table import DecoderLayer
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


# The parts. A Cell here is composed of the parts its config asks for (CTranslate2's nullable members, nanoGPT's
# modules chosen in ``__init__``): each choice the build makes is one small parameter-free Cell picked in
# ``__init__`` (``GPTLocalEmbedding.words``, ``GPTLocalBlock.residuals`` and ``.layer``,
# ``GPTLocalForCausalLM.head``, ``.train_loss``, ``.dropout_steps``), whose ``construct`` runs that choice with no
# branch on the build. A part holds no Parameter and no Cell of the model (a Cell held twice would take a second
# name): it is handed its owner (``embedding``, ``block``, ``lm``) and reads the owner's sub-Cells, so every
# Parameter keeps its one name; a kernel's argument list is declared as data (``DECODE_WEIGHTS``) and read with
# ``parameters_at``.
def parameters_at(owner, paths):
    """The values at ``paths`` (tuples of attribute names) under ``owner``, in order: what a part hands a kernel,
    read from its declarative list (runs in the compiled graph: the loops unroll over constant tuples)."""
    values = ()
    for path in paths:
        value = owner
        for name in path:
            value = getattr(value, name)
        values = values + (value,)
    return values


class GPTLocalEmbedding(nn.Cell):
    """Token embeddings + learned absolute position embeddings (none with rope: positions turn q and k instead),
    then dropout. The token lookup (``words``: a float table, an int8 one times its scales, or a bfloat16 one widened
    by ``kernels``' ``bf16_rows`` in a bf16 inference build) and whether positions are added (``positions``) are
    parts picked here, never in ``construct``."""

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
        # the parts: input_ids -> the token rows; the rows plus the positions' (or as they are)
        self.words = Int8Words() if self.int8 else TableWords() if self.bf16_rows is None else BF16Words()
        self.positions = LearnedPositions() if self.learned_positions else NoPositions()

    def construct(self, input_ids, position_ids, dropout_step=None):
        hidden = self.positions(self, self.words(self, input_ids), position_ids)
        return self.dropout(ops.cast(hidden, self.compute_dtype), dropout_step)


class TableWords(nn.Cell):
    """A float table's rows."""

    def construct(self, embedding, input_ids):
        return embedding.gather(embedding.word_embeddings, input_ids, 0)


class BF16Words(nn.Cell):
    """A bfloat16 table's rows, widened to float32 (``kernels/cells/embedding.py``)."""

    def construct(self, embedding, input_ids):
        return embedding.bf16_rows(embedding.word_embeddings, input_ids)


class Int8Words(nn.Cell):
    """An int8 table's rows times their scales."""

    def construct(self, embedding, input_ids):
        return int8_lookup(embedding.gather, embedding.word_embeddings, embedding.word_embeddings_scale, input_ids)


class LearnedPositions(nn.Cell):
    """The token rows plus the learned position embeddings' rows (GPT-2's)."""

    def construct(self, embedding, words, position_ids):
        return words + embedding.position_gather(embedding.position_embeddings, position_ids, 0)


class NoPositions(nn.Cell):
    """The token rows as they are (rope turns q and k instead)."""

    def construct(self, embedding, words, position_ids):  # pylint: disable=unused-argument
        return words


# The MLP. GPT-2's: fc1 (column-parallel) -> activation -> fc2 (row-parallel); with ``gated_linear_unit`` (SwiGLU,
# Llama's) fc2(silu(gate(x)) * fc1(x)), the gate its own column-parallel Linear. ``make_mlp`` picks the class, i.e.
# the forward, once at build from the model's ``KernelProvider``: the plain ops, or a CPU kernel for bias + GeLU
# (``kernels/cells/norm_gelu.py``) or silu(gate) * up (``kernels/cells/rms_swiglu.py``), or with the bias + GeLU kernel the GEMM
# epilogues (``kernels/cells/linear.py`` CPULinearEpilogue: fc1's GEMM with the bias + GeLU, fc2's with the block's
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
    """The MLP's form as the decoder's C++ layer names it (``kernels/abi/codes.py`` ``MlpForm``, lower case): "swiglu" for
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
    """The decode step's one-node CPU kernel for ``block`` (``kernels/cells/decode_layer.py``), or None: the block's plain
    decode graph. The model's ``KernelProvider`` decides (``decode_layer_for``) from the built block's facts
    (``layer_facts``)."""
    return kernels.decode_layer_for(layer_facts(config, block))


NORM_NAMES = {LayerNorm: "LayerNorm", KernelLayerNorm: "LayerNorm", RMSNorm: "RMSNorm", KernelRMSNorm: "RMSNorm"}


def layer_facts(config, block):
    """What the provider weighs of one built decoder layer (``DecodeLayerFacts``: the decode-layer node,
    ``decode_layer_for``, and the native runner, ``runner``): its architecture and MLP form, its Linears' classes
    and weight dtypes (the gate's too: SwiGLU), its norms' classes and weight dtypes, its compute dtypes, and whether
    it has a prefix, an adapter or LayerDrop. ``config``: the config the block was built from (``graph_config``'s)."""
    attention = block.attention
    linears = tuple(cell for part, cell in cells(block, LINEARS)  # layer_table.py's Linears this layout has
                    if part.when is None or getattr(config.arch, part.when))
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
        adapters=block.has_adapters, layerdrop=block.has_layerdrop, absent=DecoderLayer.pointer_mask(
            [field for field, path in zip(pointer_fields(), weight_paths(block, DECODE_WEIGHTS)) if len(path) == 1]))


# the attention core a layer built (ParallelAttention._choose_core), as TrainLayerFacts names it
ATTENTION_CORES = {MatmulSoftmaxAttention: "plain", FusedCPUAttention: "fused", BlockwiseCore: "blockwise",
                   FlashCore: "flash"}


def make_train_layer(config, block, kernels, recomputed=False):
    """The training step's one-node CPU kernel for ``block`` (``kernels/cells/train_layer.py``: the whole layer forward and
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
        adapters=block.has_adapters, layerdrop=block.has_layerdrop, recomputed=recomputed))


# One decoder layer: norm -> ParallelAttention -> residual -> norm -> ParallelFeedForward -> residual; with
# ``use_parallel_residual`` (GPT-NeoX/Pythia) x + attention(norm1(x)) + mlp(norm2(x)). The norm is LayerNorm or RMSNorm
# (``normalization``), chosen when the block is built. Each part's residual update passes its bottleneck adapter
# (``pet_type: adapter``, ``model/adapter_cells.py``; built when the layer spec has one, else ``Unchanged``) and
# LayerDrop's 0/1 (``model_config.layerdrop``, ``dropout.LayerDrop``; else ``Kept``). Its Linears and adapter sites
# are built with the Cells the layer spec (``layer_spec.py``) picks: LoRA and adapters live outside these classes.
# Where the layer runs (pipeline stage) and whether it recomputes are set on the Cell when it is built
# (``GPTLocalModel`` from the ``Layout``, ``parallel/``), never decided in ``construct``; nor is any of the above: the
# build picks the parts (``residuals``: ``SequentialResiduals``, ``ResidualInMLP``, ``ParallelResiduals``; ``layer``:
# ``LayerOps``, ``TrainKernelPath``, ``DecodeKernelPath``). In training graphs the whole layer may run as one kernel
# node each way (``train_kernel``, ``make_train_layer``), the per-op forward everywhere else.
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
        # pet_type: adapter's BottleneckAdapters (model/adapter_cells.py) when the layer spec has them (the factory takes
        # the model's provider), else Unchanged; LayerDrop scales both updates by 0/1, else Kept
        self.has_adapters = "attention_adapter" in layer_spec or "mlp_adapter" in layer_spec
        self.attention_adapter = layer_spec["attention_adapter"](kernels=kernels) \
            if "attention_adapter" in layer_spec else Unchanged()
        self.mlp_adapter = layer_spec["mlp_adapter"](kernels=kernels) if "mlp_adapter" in layer_spec else Unchanged()
        layerdrop = make_layerdrop(config, layer_number, counter_dropout)
        self.has_layerdrop = layerdrop is not None
        self.layerdrop = Kept() if layerdrop is None else layerdrop
        # the provider's: the MLP adds the residual in fc2's GEMM (EpilogueFeedForward) where nothing comes between
        # the MLP's output and that Add (no dropout, adapter, LayerDrop; the sequential residual)
        self.mlp_residual = kernels.epilogue_residual(
            self.mlp.epilogue if isinstance(self.mlp, EpilogueFeedForward) else None, config.hidden_dropout,
            "mlp_adapter" in layer_spec, self.has_layerdrop, self.parallel_residual)
        if self.parallel_residual:
            self.residuals = ParallelResiduals()
        else:
            self.residuals = ResidualInMLP() if self.mlp_residual else SequentialResiduals()
        # the decode step (one token a row over the KV cache) as one CPU kernel node where it fits, else None; the
        # training step's layer as one CPU kernel node each way where it fits (make_train_layer), else None
        self.decode_kernel = make_decode_layer(config, self, kernels)
        self.train_kernel = make_train_layer(config, self, kernels, recomputed)
        # where each graph's layer runs: the ops; or in training graphs the training kernel; or in decode graphs the
        # decode kernel, each handed its Parameters from a declared list (None, or a placeholder, where absent)
        self.no_parameter = None
        self.layer = LayerOps() if self.train_kernel is None else \
            TrainKernelPath(weight_paths(self, TRAIN_WEIGHTS))
        if self.decode_kernel is not None:
            self.decode_none = Tensor(np.zeros((1,), np.float32))
            self.decode_no_weight = Tensor(np.zeros((1, 1), np.float32), self.mlp.linear_fc1.weight.dtype)
            self.decode_no_rotary = Tensor(np.zeros((1, 1, 1, 1), np.float32))
            self.layer = DecodeKernelPath(weight_paths(self, DECODE_WEIGHTS), self.layer)

    def construct(self, hidden, attention_bias, key_cache=None, value_cache=None, write_index=None,
                  seq_ends=None, dropout_step=None, rotary=None, prefix=None, fresh_prefill=False):
        """hidden [B, S, H]. The optional KV cache arguments are this layer's (see ParallelAttention);
        ``prefix``: this layer's prefix (keys, values) with prefix tuning (``model/prefix_cells.py``);
        ``seq_ends``: packed rows' document ends for flash attention's variable-length form;
        ``dropout_step``: the forward counter that picks the dropout masks (``dropout.py``);
        ``rotary``: (cos, sin) of the positions with rope (``attention.RotaryEmbedding``);
        ``fresh_prefill``: a KV-cache prefill at positions 0..S-1 (see ParallelAttention).

        A decode step (a KV cache, one token a row, not a fresh prefill, inference) runs ``decode_kernel`` where
        the block has one (``make_decode_layer``; ``layer``: ``DecodeKernelPath``): shapes and flags are
        constants of the compiled graph, so each graph holds one of the two paths."""
        return self.layer(self, hidden, attention_bias, key_cache, value_cache, write_index, seq_ends, dropout_step,
                          rotary, prefix, fresh_prefill)

    def layer_ops(self, hidden, attention_bias, key_cache, value_cache, write_index, seq_ends, dropout_step, rotary,
                  prefix, fresh_prefill):
        """The layer's ops: attention, then each residual update (dropout, its adapter and LayerDrop's 0/1) and the
        residuals' form (``residuals``)."""
        dtype = hidden.dtype
        attn = self.attention(self.input_layernorm(hidden), attention_bias, key_cache=key_cache,
                              value_cache=value_cache, write_index=write_index, seq_ends=seq_ends,
                              dropout_step=dropout_step, rotary=rotary, prefix=prefix,
                              fresh_prefill=fresh_prefill)
        attn = ops.cast(self.attention_output_dropout(attn, dropout_step), dtype)
        attn = self.layerdrop(self.attention_adapter(attn), dropout_step)
        return self.residuals(self, hidden, attn, dropout_step, dtype)

    def mlp_update(self, mlp, dropout_step, dtype):
        """The MLP's output as its residual takes it: dropout, cast, its adapter, LayerDrop's 0/1."""
        mlp = ops.cast(self.mlp_output_dropout(mlp, dropout_step), dtype)
        return self.layerdrop(self.mlp_adapter(mlp), dropout_step)


class Unchanged(nn.Cell):
    """An adapter site without a bottleneck adapter: the update as it is."""

    def construct(self, update):
        return update


class Kept(nn.Cell):
    """A layer without LayerDrop: every update kept."""

    def construct(self, update, dropout_step=None):  # pylint: disable=unused-argument
        return update


class SequentialResiduals(nn.Cell):
    """x + attn, then that plus the MLP's update of its norm (GPT-2's, Llama's)."""

    def construct(self, block, hidden, attn, dropout_step, dtype):
        hidden = block.add(hidden, attn)
        mlp = block.mlp(block.post_attention_layernorm(hidden), dropout_step)
        return block.add(hidden, block.mlp_update(mlp, dropout_step, dtype))


class ResidualInMLP(nn.Cell):
    """x + attn, then that plus the MLP's output added by the MLP (EpilogueFeedForward, ``mlp_residual``)."""

    def construct(self, block, hidden, attn, dropout_step, dtype):  # pylint: disable=unused-argument
        hidden = block.add(hidden, attn)
        return block.mlp(block.post_attention_layernorm(hidden), dropout_step, hidden)


class ParallelResiduals(nn.Cell):
    """x + attn + the MLP's update of norm2(x) (GPT-NeoX's ``use_parallel_residual``)."""

    def construct(self, block, hidden, attn, dropout_step, dtype):
        mlp = block.mlp(block.post_attention_layernorm(hidden), dropout_step)
        hidden = block.add(hidden, attn)
        return block.add(hidden, block.mlp_update(mlp, dropout_step, dtype))


# The kernels' Parameters, in their argument order (``kernels/abi/layer_table.py`` ``LAYER``, ``parameter_slots``): (the
# sub-Cell under the block, its Parameter, the block's placeholder where the layer has none: an absent bias, RMSNorm's
# shift, an int8 model's scales elsewhere, an optional Linear's weight such as a GeLU MLP's gate). The decode node's
# (``kernels/cells/decode_layer.py``) takes a placeholder tensor there, the training layer's (``kernels/cells/train_layer.py``)
# None (it puts its own stand-in).
DECODE_WEIGHTS = tuple(
    (cell, name, "decode_no_weight" if isinstance(part, LayerLinear) and part.when and name == "weight"
     else "decode_none") for part, cell, name in parameter_slots(scales=True))
TRAIN_WEIGHTS = tuple((cell, name, "no_parameter") for _, cell, name in parameter_slots())


def weight_paths(block, slots):
    """``slots`` (``DECODE_WEIGHTS``, ``TRAIN_WEIGHTS``) as the paths under ``block`` that ``parameters_at`` reads:
    each Parameter's where the built layer has it, else its placeholder's."""
    paths = []
    for cell, name, placeholder in slots:
        owner = block
        for part in cell.split("."):
            owner = getattr(owner, part, None)
        held = getattr(owner, name, None) is not None
        paths.append(tuple(cell.split(".")) + (name,) if held else (placeholder,))
    return tuple(paths)


class LayerOps(nn.Cell):
    """The layer's ops in every graph (``GPTLocalBlock.layer_ops``)."""

    def construct(self, block, hidden, attention_bias, key_cache, value_cache, write_index, seq_ends, dropout_step,
                  rotary, prefix, fresh_prefill):
        return block.layer_ops(hidden, attention_bias, key_cache, value_cache, write_index, seq_ends, dropout_step,
                               rotary, prefix, fresh_prefill)


class TrainKernelPath(LayerOps):
    """A training graph (the train flag, no KV cache) runs the block's ``train_kernel`` over its Parameters as
    stored (``weights``: their paths, ``weight_paths``), the counter dropouts' step and rope's angles; every other
    graph the layer's ops. The flag and the cache's presence are constants of a compiled graph: each holds one."""

    def __init__(self, weights):
        super().__init__()
        self.weights = weights

    def construct(self, block, hidden, attention_bias, key_cache, value_cache, write_index, seq_ends, dropout_step,
                  rotary, prefix, fresh_prefill):
        if self.training and key_cache is None:
            args = (hidden, attention_bias, dropout_step, rotary) + parameters_at(block, self.weights)
            return block.train_kernel(*args)
        return block.layer_ops(hidden, attention_bias, key_cache, value_cache, write_index, seq_ends, dropout_step,
                               rotary, prefix, fresh_prefill)


class DecodeKernelPath(nn.Cell):
    """A decode step (a KV cache, one token a row, not a fresh prefill, inference) runs the block's ``decode_kernel``:
    its Parameters as stored (``weights``, placeholders where the layer has none), the caches written in place at
    ``write_index``, attention over each row's cached positions (``attention_bias``), rope from ``rotary``'s cos and
    sin (a placeholder without rope); every other graph ``otherwise`` (``LayerOps`` or ``TrainKernelPath``)."""

    def __init__(self, weights, otherwise):
        super().__init__()
        self.weights = weights
        self.otherwise = otherwise

    def construct(self, block, hidden, attention_bias, key_cache, value_cache, write_index, seq_ends, dropout_step,
                  rotary, prefix, fresh_prefill):
        if key_cache is not None and hidden.shape[1] == 1 and not fresh_prefill and not self.training:
            cos, sin = (block.decode_no_rotary, block.decode_no_rotary) if rotary is None else rotary
            args = (hidden,) + parameters_at(block, self.weights) + (key_cache, value_cache, write_index,
                                                                      attention_bias, cos, sin)
            return block.decode_kernel(*args)
        return self.otherwise(block, hidden, attention_bias, key_cache, value_cache, write_index, seq_ends,
                              dropout_step, rotary, prefix, fresh_prefill)


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
        self.rotary_angles = NoRotary() if self.rotary is None else RotaryAngles()  # position_ids -> (cos, sin)
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
        # a part, chosen here once: the layers' prefixes (and the positions after them); without a prefix each
        # layer's is None (a constant of the graph)
        self.layer_prefixes = NoPrefixes() if self.prefix_encoder is None else LayerPrefixes()
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
        prefixes, position_ids = self.layer_prefixes(self, position_ids, dropout_step)
        hidden = self.embedding(input_ids, position_ids, dropout_step)
        rotary = self.rotary_angles(self, position_ids)  # per-row positions, ragged or packed
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


class NoPrefixes(nn.Cell):
    """No prefix tuning: each layer's prefix None, the positions as they are."""

    def construct(self, model, position_ids, dropout_step):  # pylint: disable=unused-argument
        return model.no_prefixes, position_ids


class LayerPrefixes(nn.Cell):
    """Each layer's prefix (keys, values) of prefix tuning (``model.prefix_encoder``); the real tokens' positions
    follow the prefix (as peft's)."""

    def construct(self, model, position_ids, dropout_step):
        prefix = model.prefix_encoder(dropout_step)
        pairs = ()
        for index in range(model.num_layers):
            pairs = pairs + ((prefix[2 * index], prefix[2 * index + 1]),)
        return pairs, position_ids + model.prefix_tokens


class NoRotary(nn.Cell):
    """No rope: no angles."""

    def construct(self, model, position_ids):  # pylint: disable=unused-argument
        return None


class RotaryAngles(nn.Cell):
    """Rope's (cos, sin) of each row's positions (``model.rotary``)."""

    def construct(self, model, position_ids):
        return model.rotary(position_ids)


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
        # the training loss's head + cross-entropy as one kernel (kernels/cells/head_loss.py), or None: the head and lm_loss;
        # not where the pet_config freezes the head's table (LoRA, adapters, prefix tuning: freeze_pet)
        held = "int8" if self.head_int8 is not None else ("bfloat16" if self.head_bf16 else "float32")
        spec = config.pet_spec()
        trains = spec is None or not spec.is_frozen(OUTPUT_LAYER if self.untied else WORD_EMBEDDINGS)
        self.head_loss = kernels.head_loss(self.compute_dtype, trains=trains, weights=held)
        # the parts (see parameters_at): the head (make_head), the training loss, the dropout counter's steps
        self.head = make_head(self.untied, self.head_int8 is not None, self.head_bf16, self.head_gemm is not None)
        self.train_loss = PlainLoss() if self.head_loss is None else FusedLoss()
        self.dropout_steps = CountedSteps() if self.model.counter_dropout else UncountedSteps()
        self.log_softmax = ops.LogSoftmax(axis=-1)
        self.gather_d = ops.GatherD()
        self.ignore_token_id = config.ignore_token_id
        self.vocab_size = config.vocab_size
        self.position_ids = Tensor(np.arange(config.max_position_embeddings, dtype=np.int32)[None])
        # positions a sequence may use: max_position_embeddings less a prefix-tuning prefix (the real tokens'
        # positions follow it); generation, serve and eval bound their lengths by it
        self.token_positions = config.max_position_embeddings - self.model.prefix_tokens
        freeze_pet(self)  # its freeze lists (prefix tuning: only the prefix trains), before the strategies are set
        self.sharding = apply_sharding(self, config, config.arch) if is_parallel_build() else {}

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
        return self.head(self, head_rows(hidden, self.compute_dtype))

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
            step = self.dropout_steps.read(self)  # the counter, read before this forward's increment below; or None
        hidden = self.model(input_ids, position_ids, attention_bias, actual_seq_len=actual_seq_len, dropout_step=step)
        if not self.training:
            logits = ops.reshape(self.logits(hidden), (batch, seq, self.vocab_size))
            if labels is None:
                return logits
            return perplexity_layout(logits, labels, loss_mask, self.ignore_token_id)
        loss = self.dropout_steps.advance(self, self.train_loss(self, hidden, labels, loss_mask))
        zero = ops.zeros((), ms.float32)
        return (loss,) + (zero, zero, zero)[:self.train_outputs - 1]  # train_outputs: fixed at build

    def lm_loss(self, logits, labels, loss_mask):
        """Mean token cross-entropy over positions where loss_mask is set and labels are not ignored."""
        labels, keep = loss_rows(labels, loss_mask, self.ignore_token_id)
        safe_labels = ops.maximum(labels, 0)
        log_probs = self.log_softmax(logits)
        picked = self.gather_d(log_probs, 1, ops.reshape(safe_labels, (-1, 1)))
        nll = -ops.reshape(picked, (-1,))
        return ops.reduce_sum(nll * keep) / ops.maximum(ops.reduce_sum(keep), 1.0)


def head_rows(hidden, dtype):
    """hidden [B, S, H] as the head takes it: [B*S, H] in the compute dtype ``dtype``."""
    batch, seq, width = hidden.shape
    return ops.reshape(ops.cast(hidden, dtype), (batch * seq, width))


def loss_rows(labels, loss_mask, ignore_token_id):
    """Labels flattened to [B*S] and each row's weight: 1 where loss_mask is set and the label not ignored."""
    labels = ops.reshape(labels, (-1,))
    keep = ops.cast(ops.not_equal(labels, ignore_token_id), ms.float32)
    if loss_mask is not None:
        keep = keep * ops.cast(ops.reshape(loss_mask, (-1,)), ms.float32)
    return labels, keep


def perplexity_layout(logits, labels, loss_mask, ignore_token_id):
    """Eval with labels, laid out for a perplexity metric (MindFormers' PerplexityMetric, gpt_local's): it scores
    logits[:, t] against labels[:, t + 1]; our labels are already shifted, so pad one position on each to keep every
    token."""
    if loss_mask is None:
        loss_mask = ops.ones_like(labels)
    mask = ops.cast(loss_mask, ms.int32) * ops.cast(ops.not_equal(labels, ignore_token_id), ms.int32)
    logits = ops.concat((logits, logits[:, -1:]), axis=1)
    labels = ops.concat((labels[:, :1], ops.maximum(labels, 0)), axis=1)
    mask = ops.concat((mask[:, :1], mask), axis=1)
    return logits, labels, mask


# The causal LM's parts (see ``parameters_at``): the head's table as its GEMM takes it, the head, the training loss,
# the dropout counter's steps; each handed the LM (``lm``).
def make_head(untied, int8, bf16_weights, gemm):
    """The head's part: its GEMM (the int8 one, MatMul, or per graph the GEMM kernel or MatMul: ``gemm``) over its
    table (the untied head's own or the token table: ``untied``) as that GEMM takes it (as held for the int8 GEMM and
    under ``bf16_weights``, else cast to the compute dtype)."""
    table = ("output_layer", "weight") if untied else ("model", "embedding", "word_embeddings")
    if int8:
        return Int8Head(table, table[:-1] + (table[-1] + "_scale",))
    table = HeldTable(table) if bf16_weights else CastTable(table)
    return GemmHead(table) if gemm else MatMulHead(table)


class HeldTable(nn.Cell):
    """The head's table as held (``path`` under the LM: the token table or the untied head's own): bf16 weights'
    GEMM kernel takes it so (every graph runs the kernel then)."""

    def __init__(self, path):
        super().__init__()
        self.paths = (path,)

    def construct(self, lm):
        return parameters_at(lm, self.paths)[0]


class CastTable(HeldTable):
    """The head's table cast to the compute dtype."""

    def construct(self, lm):
        return ops.cast(parameters_at(lm, self.paths)[0], lm.compute_dtype)


class MatMulHead(nn.Cell):
    """rows [T, H] -> float32 logits [T, V]: MatMul (``lm.head_matmul``) over ``table``'s."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def construct(self, lm, rows):
        return ops.cast(lm.head_matmul(rows, self.table(lm)), ms.float32)


class GemmHead(MatMulHead):
    """The head's GEMM kernel or MatMul per graph: its rule (provider.HEAD_RULE, which takes 1-2 rows too: decode,
    batch 1-2), the static rows and the train flag, fixed at compile time (layers.py ``use_gemm``)."""

    def construct(self, lm, rows):
        weight = self.table(lm)
        if use_gemm(lm.head_gemm_rule, self.training, rows.shape[0]):
            return ops.cast(lm.head_gemm(rows, weight), ms.float32)
        return ops.cast(lm.head_matmul(rows, weight), ms.float32)


class Int8Head(nn.Cell):
    """An int8 model's head: the int8 GEMM (``lm.head_int8``) over the int8 table and its per-row scales (float32
    compute)."""

    def __init__(self, table, scale):
        super().__init__()
        self.paths = (table, scale)

    def table(self, lm):
        """(the int8 table, its scales): what the head + loss kernel takes too."""
        return parameters_at(lm, self.paths)

    def construct(self, lm, rows):
        weight, scale = self.table(lm)
        return lm.head_int8(rows, weight, scale)


class PlainLoss(nn.Cell):
    """The training loss: the head's logits, then ``lm_loss``."""

    def construct(self, lm, hidden, labels, loss_mask):
        return lm.lm_loss(lm.logits(hidden), labels, loss_mask)


class FusedLoss(nn.Cell):
    """``PlainLoss``'s value from the head + loss kernel (``lm.head_loss``): each kept row weighted 1 / the kept
    rows."""

    def construct(self, lm, hidden, labels, loss_mask):
        labels, keep = loss_rows(labels, loss_mask, lm.ignore_token_id)
        row_weight = keep / ops.maximum(ops.reduce_sum(keep), 1.0)
        weights = lm.head.table(lm)
        return ops.reshape(lm.head_loss(head_rows(hidden, lm.compute_dtype), weights, labels, row_weight), ())


class CountedSteps(nn.Cell):
    """The dropout counter (``lm.dropout_step``, ``DropoutCounter``): read before the forward, advanced with its
    loss (counter dropout: resume is exact)."""

    def read(self, lm):
        return lm.dropout_counter.read(lm.dropout_step)

    def advance(self, lm, loss):
        return lm.dropout_counter.advance(loss, lm.dropout_step)


class UncountedSteps(nn.Cell):
    """No dropout counter: no step, the loss as it is."""

    def read(self, lm):  # pylint: disable=unused-argument
        return None

    def advance(self, lm, loss):  # pylint: disable=unused-argument
        return loss
