"""Which implementation each op of a gpt_local model runs: decided here, once, when the model is built.

After Megatron-core's ``BackendSpecProvider``: a layer does not decide whether it runs a kernel; it asks the
model's ``KernelProvider`` (a required argument of every Cell that has a kernel form: the model makes one and hands
it down) for its op when it is built and keeps what it gets (a kernel Cell, or None: the plain MindSpore ops, the
reference every kernel is tested against). Eligibility is decided here too: where it depends on the layer (its
architecture, its Linears' classes, its dtypes, a prefix or an adapter), the layer passes those facts and the provider
decides (``decode_layer_for``, ``fused_attention``, ``gemm_epilogue``, ``epilogue_residual``, ...); so are the train
step's kernels (``adamw_update``, ``grad_clip``) and whether a prefill runs the fused kernel (``fresh_prefill``). It
holds kernel choices only: the runtime's choices are the runtime's (``runtime/runner.py`` ``runner_kind``,
``buckets.greedy_steps``), the train step's overflow check the train step's (``training/grad_checks.py``), and what
was measured to set a default is in docs/performance.md. The choice is made from

- ``model_config.cpu_kernels`` (the same key in ``config.json`` and ``from_pretrained(..., cpu_kernels=...)``):
  ``auto`` (the default), ``plain``, ``kernel``, or a mapping ``{op: auto|kernel|plain}`` (ops left out: ``auto``;
  ``isa``: the kernel library's CPU-ISA cap, ``build.apply_isa``, which the provider applies when it is made);
- the device (MindSpore's ``device_target``: the kernels are CPU kernels; every other backend runs the plain ops);
- the parallel mode (a semi-auto/auto parallel build keeps MindSpore's primitives, which carry the shard
  strategies; the caller says whether the build is one);
- the dtypes (the kernels compute in float32; asked with another dtype an op gets the plain path), and the
  config's ``compute_dtype``: on CPU, where MindSpore's kernels and gpt_local's compute in float32, a
  ``bfloat16`` model computes in float32 between ops (``graph_dtype``) and runs its GEMMs (every Linear, forward and
  both backward GEMMs, and the head) bf16 x bf16 with float32 accumulation (``gemm_dtype``: the GEMM kernel in
  bf16 in every graph, or ``kernels/cells/linear.py``'s ``BF16MatMul``, the same numbers from MindSpore's ops, where the
  kernel is not used); every other backend computes in the config's dtypes, as MindSpore's own kernels do. A build
  for inference (``inference``: ``model/loader.py`` ``load_model``, what generate, chat, serve and eval build)
  with those bf16 GEMMs through the GEMM kernel holds the Linears', the head's and the token table's weights as
  bfloat16 once (``bf16_weights``; a tied head the table itself; the kernel takes them as they are), the same
  numbers as the float32 weights rounded at every GEMM (the token lookup reads the rounded rows); training builds
  and the plain path keep float32 weights.

A kernel that cannot be built here (no compiler, MindSpore refusing the library) gives the plain path after one
warning line (``build.warn_once``). Nothing here or in the layers reads the environment to choose a kernel.
"""
import collections
import functools
import sys
import warnings

import mindspore as ms
from mindspore import ops

from ..errors import ConfigError
from .abi.table import TABLE

# op -> what its kernel is (docs/configuration.md lists the same), then where its kernels are: the sources of the
# kernel table's entries of that op (table.py: each entry's op)
OPS = {op: text + TABLE.where(op) for op, text in {
    "attention": "fused causal attention of training, eval and a KV-cache prefill (Cell: kernels/cells/attention.py)",
    "layer_norm": "LayerNorm (Cell: kernels/cells/norm_gelu.py)",
    "bias_gelu": "the MLP's fc1 bias + tanh or quick GeLU (Cell: kernels/cells/norm_gelu.py)",
    "rms_norm": "RMSNorm (Cell: kernels/cells/rms_swiglu.py)",
    "swiglu": "SwiGLU's silu(gate) * up (Cell: kernels/cells/rms_swiglu.py)",
    "linear": "the Linears' and the head's x W^T (+ b), oneDNN's sgemm, or its bf16 GEMM with compute_dtype "
              "bfloat16 (Cell: kernels/cells/linear.py)",
    "lora_dropout": "LoRA's input dropout (Cell: kernels/cells/lora_dropout.py)",
    "kv_write": "the KV cache's in-place write (kernels/cells/kv_write.py)",
    "composed_ops": "faster forms of MindSpore ops: the tanh GeLU from sigmoid, explicit broadcasts before Add, "
                    "the two-stage gradient norm of clipping (training/grad_checks.py, mf/wrapper.py)",
    "decode_layer": "a layer of the decode step (one new token a row) as one kernel node in the compiled decode graph "
                    "(Cell: kernels/cells/decode_layer.py; every layout the model builds); float32, int8 and (built for "
                    "inference) bf16 models",
    "runner": "the inference runtime's runner on CPU: the native runner (runtime/native.py: the model's forward over "
              "its KV cache as one C++ call a step, no MindSpore graph) or the compiled graphs (runtime/runner.py)",
    "adamw": "GPTLocalAdamW's update of each float32 parameter and its moments in place, one pass (Cell: "
             "kernels/cells/train_step.py; AdamWeightDecay's formula), in gpt_local's train step (GPTLocalTrainOneStepCell)",
    "square_sum": "each gradient's sum of squares, one read-only pass, for the train step's overflow check and the "
                  "clip's global norm (Cell: kernels/cells/train_step.py; GPTLocalTrainOneStepCell)",
    "head_loss": "the LM head and its cross-entropy in a training graph as one node each way, over chunks of rows "
                 "(no [tokens, vocab] tensor kept; Cell: kernels/cells/head_loss.py); float32 GEMMs, a head that trains; "
                 "kernel only (auto: off, measured leaner at long sequences only, not faster)",
    "int8_linear": "an int8 model's Linears and head: x quantized per row, oneDNN's s8 x s8 -> s32 GEMM (Cell: "
                   "kernels/cells/linear_int8.py)",
    "train_layer": "a whole decoder layer of a training step as one node each way, forward and backward (norm, QKV, "
                   "rope, attention, projection, residual, norm, MLP, residual; its activations in buffers it owns, "
                   "bf16 under compute_dtype bfloat16) for every layout the model builds, in training graphs (Cell: "
                   "kernels/cells/train_layer.py); kernel only (auto: off, not measured faster yet)",
    "gemm_epilogue": "the MLP's GEMMs with what follows them fused in, where the linear and bias_gelu kernels run: "
                     "fc1 + bias + GeLU, fc2 + bias + the residual (Cell: kernels/cells/linear.py CPULinearEpilogue); "
                     "kernel only (auto: off, not measured faster yet)",
}.items()}
MODES = ("auto", "kernel", "plain")
# The weights under which cpu_kernels decode_layer: auto runs the decode-layer kernel (faster than the plain decode
# graph at each of them: docs/performance.md "The CPU kernels", the decoder)
DECODE_LAYER_AUTO = ("int8", "float32", "bfloat16")
# From 16 rows of a graph's [T, in] input the GEMM kernel beat MatMul at all of GPT-2 small's Linear shapes and the
# head, wall and CPU (MindSpore's CPU MatMul steps up there); below, its wall time was not reliably shorter
# (docs/performance.md "Linear's GEMM kernel by row count"). ``linear: auto`` uses it from there in inference graphs.
LINEAR_GEMM_ROWS = 16
HEAD_GEMM_ROWS = 16
# The head's GEMM at one or two rows: the kernel faster than MatMul there (docs/performance.md "Linear's GEMM kernel
# by row count"), so ``linear: auto`` runs the head's kernel in inference graphs of at most this many rows too.
HEAD_GEMM_FEW_ROWS = 2


# Which compiled graphs run the GEMM kernel, a rule (from_rows, up_to_rows) that ``KernelProvider.linear_gemm`` hands
# each Linear and the head: every graph, training too, when from_rows is 0; else inference graphs of at least
# from_rows or at most up_to_rows static rows (``use_gemm``). A plain tuple of ints: the graph compiler reads it as
# a constant.
EVERY_GRAPH = (0, 0)
LINEAR_RULE = (LINEAR_GEMM_ROWS, 0)
HEAD_RULE = (HEAD_GEMM_ROWS, HEAD_GEMM_FEW_ROWS)
# What ``KernelProvider.decode_layer_for`` and ``runner`` weigh of one built decoder layer (``model/gpt.py``
# ``layer_facts`` gathers it): the layer's ``epsilon``, attention ``scale``, MLP ``form`` (``model/gpt.py``
# ``mlp_form``: "tanh", "quick", "erf", "relu", "swiglu"), ``compute_dtype``; ``arch`` (the model's ``Arch``:
# ``bias``, ``qkv_bias``, ``rotary_dim``, ``parallel_residual``); ``linears``: "float32" / "bfloat16" where the
# Linears (SwiGLU's gate too) are all the base Linear holding weights of that dtype, "int8" where all are an int8
# model's, None for anything else (LoRA, a mix); ``norm``: "LayerNorm" or "RMSNorm" where both norms are that one
# (or its kernel form), else None; ``norm_weights``: their weights' dtype (None: differing); ``norm_dtype``,
# ``softmax_dtype``: the norms' and the softmax's compute dtypes; ``prefix``, ``adapters``, ``layerdrop``: the layer
# has a prefix-tuning prefix, a bottleneck adapter, LayerDrop.
DecodeLayerFacts = collections.namedtuple("DecodeLayerFacts", (
    "epsilon", "scale", "form", "compute_dtype", "arch", "linears", "norm", "norm_weights",
    "norm_dtype", "softmax_dtype", "prefix", "adapters", "layerdrop", "absent"), defaults=(0,))
# The MLP forms and norms the decoder's C++ layer computes (kernels/abi/codes.py MlpForm, NormKind)
LAYER_FORMS = ("tanh", "quick", "erf", "relu", "swiglu")
LAYER_NORMS = ("LayerNorm", "RMSNorm")

# What ``KernelProvider.train_layer_for`` weighs of one built decoder layer (``model/gpt.py`` ``make_train_layer``
# gathers it): ``arch`` (the model's ``Arch``: its layout, ``kernels/cells/train_layer.py`` ``layout_of``); ``epsilon``,
# ``scale``: the norms' and attention's; ``form``: the MLP's activation as the kernel computes it ("tanh", "quick",
# "swiglu"; None: another, the erf GeLU or ReLU); ``compute_dtype``: the config's; ``linears``: "float32" where every
# Linear of the layer is the base Linear holding float32 weights, else None (LoRA, an int8 model's, bf16 weights);
# ``norms``: both norms the layer's normalization (or its kernel form) with float32 weights; ``norm_dtype``,
# ``softmax_dtype``: their compute dtypes; ``core``: the attention core without a KV cache ("plain", "fused",
# "blockwise", "flash"); ``dropouts``: the layer's three dropouts (attention probabilities, attention output, MLP output)
# where all are the counter masks, else None; ``rates``: (attention_dropout, hidden_dropout); ``prefix``,
# ``adapters``, ``layerdrop``: the layer has a prefix-tuning prefix, a bottleneck adapter, LayerDrop; ``recomputed``:
# MindSpore recomputes the layer (full recompute).
TrainLayerFacts = collections.namedtuple("TrainLayerFacts", (
    "arch", "epsilon", "scale", "form", "compute_dtype", "linears", "norms", "norm_dtype", "softmax_dtype", "core",
    "dropouts", "rates", "prefix", "adapters", "layerdrop", "recomputed"))
TRAIN_LAYER_FORMS = ("tanh", "quick", "swiglu")

_TOLD = set()  # the lines _tell_once wrote
DTYPE_NAMES = {ms.float32: "float32", ms.float16: "float16", ms.bfloat16: "bfloat16"}


def dtype_name(dtype):
    """A config dtype (its name, or a MindSpore dtype) as its name: "bfloat16"."""
    return dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype, str(dtype))


def read_cpu_kernels(value):
    """``model_config.cpu_kernels`` -> {op: mode} for every op in ``OPS`` (a mapping's ``isa``, not an op:
    ``read_cpu_isa``); one ConfigError naming the key and the allowed values for anything else."""
    allowed = ", ".join(MODES)
    if value is None:
        value = "auto"
    if isinstance(value, str):
        if value not in MODES:
            raise ConfigError(f"model_config.cpu_kernels is {value!r}; set one of {allowed}, or a mapping "
                              f"{{op: mode}} of the ops {', '.join(OPS)}.")
        return dict.fromkeys(OPS, value)
    if not hasattr(value, "items"):
        raise ConfigError(f"model_config.cpu_kernels is {value!r}; set one of {allowed}, or a mapping {{op: mode}} "
                          f"of the ops {', '.join(OPS)}.")
    modes = dict.fromkeys(OPS, "auto")
    for op, mode in value.items():
        if op == "isa":  # not an op: the CPU ISA cap (read_cpu_isa)
            continue
        if op not in OPS:
            raise ConfigError(f"model_config.cpu_kernels.{op} is not an op; the ops are {', '.join(OPS)}.")
        if mode not in MODES:
            raise ConfigError(f"model_config.cpu_kernels.{op} is {mode!r}; set one of {allowed}.")
        modes[op] = mode
    return modes


def read_cpu_isa(value):
    """``model_config.cpu_kernels.isa``: the instruction sets every CPU kernel path may use (``build.ISAS``: auto, the
    default, or scalar, avx2, avx512, avx512_bf16, amx: at most that, and at most what the CPU has), as its name;
    one ConfigError for another value."""
    isa = value.get("isa", "auto") if hasattr(value, "items") else "auto"
    from .abi.build import ISAS  # pylint: disable=import-outside-toplevel
    if isa not in ISAS:
        raise ConfigError(f"model_config.cpu_kernels.isa is {isa!r}; set one of auto, {', '.join(ISAS[:-1])}.")
    return isa


def plain_cpu_kernels(value):
    """``cpu_kernels`` as config.json keeps it: a mode name, or a plain {op: mode} dict (MindFormers hands a
    DictConfig); checked."""
    read_cpu_kernels(value)
    read_cpu_isa(value)
    if value is None or isinstance(value, str):
        return value or "auto"
    return {op: mode for op, mode in value.items()}


class KernelProvider:
    """The model's kernel choices. ``cpu_kernels``: the config value (``read_cpu_kernels``); ``parallel``: the build
    is semi-auto/auto parallel; ``device_target``: None reads MindSpore's context; ``compute_dtype``: the config's
    (``gemm_dtype``); ``inference``: the model is built for inference only (``bf16_weights``).

    Each op's method returns its kernel Cell (or, for ``linear_gemm``, the Cell and its rows) or None, the plain
    path; ``uses(op)`` says whether the op's kernel is chosen at all (before dtypes and the library)."""

    def __init__(self, cpu_kernels="auto", parallel=False, device_target=None, compute_dtype="float32",
                 inference=False):
        self.modes = read_cpu_kernels(cpu_kernels)
        self.isa = read_cpu_isa(cpu_kernels)
        self.device_target = device_target or ms.get_context("device_target")
        if self.device_target == "CPU":
            self._apply_isa()
        self.parallel = bool(parallel)
        self.gemm_dtype = self._gemm_dtype(dtype_name(compute_dtype))
        self.inference = bool(inference)

    @classmethod
    def from_config(cls, config, parallel=False, inference=False):
        """The provider of a ``GPTLocalConfig`` (its ``cpu_kernels`` and ``compute_dtype``) for a build that is or
        is not ``parallel``, and is or is not for ``inference`` only."""
        return cls(config.cpu_kernels, parallel, compute_dtype=config.compute_dtype, inference=inference)

    def _apply_isa(self):
        """The library's ISA cap, ``isa`` (a process-wide setting of the library: the last model built sets it):
        applied where it is not auto or the library has another (``build.apply_isa``); an auto provider in a process
        that never capped loads nothing."""
        from .abi import build  # pylint: disable=import-outside-toplevel
        if self.isa != "auto" or any(applied != "auto" for applied in build.applied_isas()):
            build.apply_isa(self.isa)

    def __repr__(self):
        return (f"KernelProvider({self.modes!r}, parallel={self.parallel}, device_target={self.device_target!r}, "
                f"gemm_dtype={self.gemm_dtype!r}, inference={self.inference})")

    # --- precision: the one rule of which dtype runs where --------------------------------------------------
    def graph_dtype(self, dtype):
        """The dtype (its name) a graph computes or keeps ``dtype`` in on this device: on CPU bfloat16 -> float32
        (MindSpore's CPU kernels and gpt_local's are float32; the GEMMs still take bfloat16: ``gemm_dtype``); every
        other dtype, and every dtype on GPU and Ascend, unchanged."""
        name = dtype_name(dtype)
        return "float32" if self.device_target == "CPU" and name == "bfloat16" else name

    def _gemm_dtype(self, compute_dtype):
        """"bfloat16" where the GEMMs run bf16 x bf16 -> float32 on a float32 graph (CPU, compute_dtype bfloat16,
        not a parallel build: those keep MindSpore's MatMul primitives, which carry the shard strategies, and run
        them in float32, said once), else None (the GEMMs in the graph's dtype)."""
        if self.device_target != "CPU" or compute_dtype != "bfloat16":
            return None
        if self.parallel:
            _tell_once("gptlocal: compute_dtype bfloat16 on CPU in a semi-auto/auto parallel build: the GEMMs run "
                       "in float32 (bf16 GEMMs on CPU are for single-device builds).")
            return None
        return "bfloat16"

    @functools.cached_property
    def bf16_weights(self):
        """True where the Linears, the head and the token table hold bfloat16 weights (a tied head the table itself,
        its lookup through ``bf16_rows``): an inference build whose GEMMs run in bf16 through the GEMM kernel
        (they round the weight anyway, so holding it rounded changes no GEMM's number; the kernel takes it as held;
        the token lookup then reads the rounded rows, as llama.cpp's and CTranslate2's bf16 models do).
        Training builds keep float32 weights; so does the plain path (``linear: plain`` or no library): MindSpore
        2.9's CPU graphs copy a Parameter with TensorMove before a side effect (the plain KV write, ScatterNdUpdate),
        which has no bfloat16 kernel there."""
        if not (self.inference and self.gemm_dtype == "bfloat16" and self.uses("linear")):
            return False
        from .abi import build  # pylint: disable=import-outside-toplevel
        return build.library()[0] is not None

    def uses(self, op):
        """True where ``op``'s gpt_local form is chosen: on CPU, its mode not ``plain``, and (but for the ops that
        keep MindSpore's primitives or need no strategy: ``composed_ops``, ``kv_write``, ``lora_dropout``) not a
        parallel build."""
        if self.device_target != "CPU" or self.modes[op] == "plain":
            return False
        return op in ("composed_ops", "kv_write", "lora_dropout") or not self.parallel

    # --- the ops -------------------------------------------------------------------------------------------
    def attention(self, scale, dtype, dropout=None):
        """The fused CPU attention (``kernels/cells/attention.py``) for one layer, or None. ``dropout``: the layer's
        ``CounterDropout`` when attention dropout is on (its tables and rule go into the kernel)."""
        if not self.uses("attention"):
            return None
        from .cells.attention import attention_kernel  # pylint: disable=import-outside-toplevel
        if dropout is None:
            return attention_kernel(scale, dtype)
        return attention_kernel(scale, dtype, (dropout.bits1, dropout.bits2), dropout.scale, dropout.keep_when_differ)

    def layer_norm(self, eps, compute_dtype):
        """LayerNorm's CPU kernel (float32 compute), or None."""
        if compute_dtype != ms.float32 or not self.uses("layer_norm"):
            return None
        from .cells.norm_gelu import layernorm_kernel  # pylint: disable=import-outside-toplevel
        return layernorm_kernel(eps, compute_dtype)

    def bias_gelu(self, form, compute_dtype, bias=True):
        """The bias + GeLU kernel for ``form`` ("tanh" or "quick"; None: a GeLU it does not compute, the erf one or
        ReLU) of an MLP whose fc1 has a ``bias``, or None."""
        if form is None or not bias or not self.uses("bias_gelu"):
            return None
        from .cells.norm_gelu import bias_gelu_kernel  # pylint: disable=import-outside-toplevel
        return bias_gelu_kernel(form, compute_dtype)

    def rms_norm(self, eps, compute_dtype, params_dtype):
        """RMSNorm's CPU kernel (float32 compute and weight), or None."""
        if compute_dtype != ms.float32 or params_dtype != ms.float32 or not self.uses("rms_norm"):
            return None
        from .cells.rms_swiglu import rmsnorm_kernel  # pylint: disable=import-outside-toplevel
        return rmsnorm_kernel(eps, compute_dtype)

    def swiglu(self, compute_dtype):
        """SwiGLU's silu(gate) * up kernel (float32 compute), or None."""
        if compute_dtype != ms.float32 or not self.uses("swiglu"):
            return None
        from .cells.rms_swiglu import swiglu_kernel  # pylint: disable=import-outside-toplevel
        return swiglu_kernel(compute_dtype)

    def linear_gemm(self, compute_dtype, head=False, bf16_weights=False):
        """(the GEMM kernel Cell, its rule for ``use_gemm``) or (None, None): float32 compute; ``auto`` runs it in
        inference graphs where it measured faster, from ``LINEAR_GEMM_ROWS`` rows (prefill, eval; not the few-row
        decode step, not training; ``LINEAR_RULE``), the head from ``HEAD_GEMM_ROWS`` rows and at up to
        ``HEAD_GEMM_FEW_ROWS`` (``HEAD_RULE``); ``kernel`` in every graph (``EVERY_GRAPH``, training too). With
        ``gemm_dtype`` bfloat16 the kernel runs bf16 GEMMs, in every graph under ``auto`` too (MindSpore's CPU MatMul
        has no bf16; the emulation, ``BF16MatMul``, is slower). ``bf16_weights``: the caller's weight is held as
        bfloat16 (``self.bf16_weights``), so the Cell takes it so (the inference-only forward of
        ``kernels/cells/linear.py``)."""
        if compute_dtype != ms.float32 or not self.uses("linear"):
            return None, None
        from .cells.linear import linear_gemm_kernel  # pylint: disable=import-outside-toplevel
        gemm = linear_gemm_kernel(compute_dtype, precision=self.gemm_dtype or "float32", bf16_weights=bf16_weights)
        if gemm is None:
            return None, None
        if self.modes["linear"] == "kernel" or self.gemm_dtype == "bfloat16":
            return gemm, EVERY_GRAPH
        return gemm, HEAD_RULE if head else LINEAR_RULE

    def gemm_epilogue(self, form, compute_dtype, bias=True, plain_linears=True):
        """The MLP's GEMM epilogues (``kernels/cells/linear.py`` ``CPULinearEpilogue``: fc1 + bias + GeLU ``form``, fc2 +
        bias + the residual, in ``gemm_dtype``'s precision) or None: under ``kernel``, float32 compute, where the
        ``linear`` and ``bias_gelu`` kernels are chosen as well (``bias``, ``form``: as ``bias_gelu``), and only for
        ``plain_linears``: fc1 and fc2 both the base Linear (not LoRA's subclasses, whose update comes between the
        GEMM and its epilogue, nor an int8 model's). The MLP runs them in the graphs where its Linears run the GEMM
        kernel (``use_gemm`` with ``linear_gemm``'s rows), its unfused kernels elsewhere. ``auto`` leaves them off
        (not measured faster than the unfused kernels yet), ``plain`` too: the unfused graph."""
        if compute_dtype != ms.float32 or self.modes["gemm_epilogue"] == "auto" or not plain_linears or \
                form is None or not bias or \
                not all(self.uses(op) for op in ("gemm_epilogue", "linear", "bias_gelu")):
            return None
        from .cells.linear import linear_epilogue_kernel  # pylint: disable=import-outside-toplevel
        return linear_epilogue_kernel(form, compute_dtype, precision=self.gemm_dtype or "float32")

    def bf16_rows(self):
        """The token lookup of a table held as bfloat16 (``kernels/cells/embedding.py``: a bf16 inference build's, where
        ``bf16_weights``), or None: the table stays float32 and MindSpore's Gather reads it."""
        if not self.bf16_weights:
            return None
        from .abi import build  # pylint: disable=import-outside-toplevel
        from .cells.embedding import CPURowsBF16  # pylint: disable=import-outside-toplevel
        return CPURowsBF16(build.library()[0])

    def lora_dropout(self, plain, compute_dtype):
        """LoRA's input-dropout kernel for the counter dropout ``plain`` (0 < p < 1, float32), or None: also in a
        parallel build, whose dropouts are MindSpore's (the kernel draws the counter dropout's masks)."""
        if self.parallel or not self.uses("lora_dropout"):
            return None
        from .cells.lora_dropout import lora_dropout_kernel  # pylint: disable=import-outside-toplevel
        return lora_dropout_kernel(plain, compute_dtype)

    def kv_write(self):
        """The KV cache's write: the in-place kernel on CPU where it builds, else ``ops.ScatterNdUpdate``."""
        if self.uses("kv_write"):
            from .cells.kv_write import in_place_scatter_nd_update, kernel_library  # pylint: disable=import-outside-toplevel
            library = kernel_library()
            if library is not None:
                return in_place_scatter_nd_update(library)
        return ops.ScatterNdUpdate()

    def composed_ops(self):
        """True where the faster forms of MindSpore ops run (``OPS["composed_ops"]``), on every build mode."""
        return self.uses("composed_ops")

    def decode_layer(self, epsilon, scale, form, compute_dtype, int8=False, bf16_weights=False, **layout):
        """The decode step's layer kernel (``kernels/cells/decode_layer.py``: norm .. MLP .. residual with the KV cache
        written in place, one node a layer) for a layer ``decode_layer_for`` found it computes, with norm ``epsilon``,
        attention ``scale``, MLP ``form`` and ``layout`` (``CPUDecodeLayer``'s ``norm``, ``rotary_dim``,
        ``parallel_residual``, ``qkv_bias``, ``bias``), or None: the plain decode graph. Float32 and int8 models
        (``int8``: the int8 scheme exact in int32, as the ``int8_linear`` kernel and its plain ops compute it) and a
        bf16 model's (``compute_dtype`` bfloat16, a float32 graph with bf16 GEMMs here) where its Linears hold
        bfloat16 weights (``bf16_weights``, an inference build: ``self.bf16_weights``), under ``auto`` and ``kernel``
        (``DECODE_LAYER_AUTO``); one rank."""
        bf16 = self.gemm_dtype == "bfloat16"
        if self.graph_dtype(compute_dtype) != "float32" or not self.uses("decode_layer") or bf16 != bool(bf16_weights):
            return None
        if int8 and bf16:
            return None
        kind = "int8" if int8 else ("bfloat16" if bf16 else "float32")
        if self.modes["decode_layer"] == "auto" and kind not in DECODE_LAYER_AUTO:
            return None
        from .cells.decode_layer import decode_layer_kernel  # pylint: disable=import-outside-toplevel
        return decode_layer_kernel(epsilon, scale, form, ms.float32, int8=int8, precision=self.gemm_dtype or "float32",
                                   bf16_weights=bf16, **layout)

    def train_layer(self, arch, form, epsilon, scale, compute_dtype, dropouts=(None, None, None), recomputed=False):
        """The training layer's kernel (``kernels/cells/train_layer.py`` ``CPUTrainLayer``: the whole layer forward and
        backward, one node each way) for a layer of ``arch``'s layout with MLP ``form`` ("tanh", "quick", "swiglu"),
        norm ``epsilon`` and attention ``scale``, or None: the layer's per-op graph. A float32 graph on CPU
        (``compute_dtype`` bfloat16: bf16 GEMMs, the GEMM operands saved as bf16), a training build (not
        ``inference``), under ``kernel`` only (``auto``: off until measured faster). ``dropouts``: the layer's
        ``CounterDropout`` s (or Nones: no dropout); ``recomputed``: MindSpore recomputes the layer (the kernel's
        shared slot)."""
        if self.inference or self.graph_dtype(compute_dtype) != "float32" or self.modes["train_layer"] != "kernel" or \
                not self.uses("train_layer") or form not in TRAIN_LAYER_FORMS:
            return None
        from .cells.train_layer import layout_of, train_layer_kernel  # pylint: disable=import-outside-toplevel
        return train_layer_kernel(layout_of(arch, form), epsilon, scale, ms.float32, dropouts=dropouts,
                                  precision=self.gemm_dtype or "float32", shared=bool(recomputed))

    def adamw(self, param_dtypes):
        """GPTLocalAdamW's update kernel (``kernels/cells/train_step.py`` ``CPUAdamW``) where every parameter it updates
        is float32 (``param_dtypes``), or None: MindSpore's ``AdamWeightDecay``."""
        if not self.uses("adamw") or any(dtype != ms.float32 for dtype in param_dtypes):
            return None
        from .cells.train_step import adamw_kernel  # pylint: disable=import-outside-toplevel
        return adamw_kernel()

    def square_sum(self):
        """The gradients' sum-of-squares kernel (``kernels/cells/train_step.py`` ``CPUSquareSum``: the train step's
        overflow check and clip norm), or None: Square + ReduceSum (``training/grad_checks.py``)."""
        if not self.uses("square_sum"):
            return None
        from .cells.train_step import square_sum_kernel  # pylint: disable=import-outside-toplevel
        return square_sum_kernel()

    def head_loss(self, compute_dtype, trains=True, weights="float32"):
        """The fused head + loss kernel (``kernels/cells/head_loss.py`` ``CPUHeadLoss``) for a training build's loss, or
        None: the head's GEMM, LogSoftmax and GatherD. A float32 graph whose GEMMs run in float32 (not
        ``gemm_dtype`` bfloat16) on a head table held as float32 (``weights``: "float32", "bfloat16" or "int8"),
        whose weight ``trains`` (a frozen head, under LoRA or prefix tuning, would have its gradient computed for
        nothing), not an inference build; under ``kernel`` only (``auto``: off, its GEMMs are the plain path's and
        it is not faster; it holds less at long sequences: docs/performance.md)."""
        if self.inference or compute_dtype != ms.float32 or self.gemm_dtype is not None or weights != "float32" or \
                not trains or self.modes["head_loss"] != "kernel" or not self.uses("head_loss"):
            return None
        from .cells.head_loss import head_loss_kernel  # pylint: disable=import-outside-toplevel
        return head_loss_kernel()

    def int8_linear(self, compute_dtype):
        """An int8 model's Linear kernel (``kernels/cells/linear_int8.py``: float32 activations, int8 weights and their
        per-channel scales), or None: the same scheme in MindSpore ops (``model/quant_cells.py``). Every graph
        runs it where chosen (inference only: an int8 model does not train)."""
        if compute_dtype != ms.float32 or not self.uses("int8_linear"):
            return None
        from .cells.linear_int8 import int8_linear_kernel  # pylint: disable=import-outside-toplevel
        return int8_linear_kernel(compute_dtype)

    # --- what a layer, the train step or the runner asks once at build: the decision, eligibility included ----------
    def plain_matmul(self):
        """The plain x W^T of a Linear or the head (where the GEMM kernel does not run): ``BF16MatMul`` where the
        GEMMs run in bfloat16 on a float32 graph (``gemm_dtype``), else ``ops.MatMul(transpose_b=True)`` (the
        primitive a shard strategy attaches to)."""
        if self.gemm_dtype != "bfloat16":
            return ops.MatMul(transpose_b=True)
        from .cells.linear import BF16MatMul  # pylint: disable=import-outside-toplevel
        return BF16MatMul()

    def flash_attention(self, asked, prefix=False):
        """True where a model runs Ascend's FlashAttentionScore: ``asked`` (``use_flash_attention``), on Ascend, and
        no prefix-tuning ``prefix`` (whose key rows the square-mask kernel does not take); else matmul + softmax."""
        return bool(asked) and self.device_target == "Ascend" and not prefix

    def fused_attention(self, scale, compute_dtype, softmax_dtype, dropout_rate=0.0, dropout=None,
                        counter_dropout=True, prefix=False):
        """The fused CPU attention kernel for a layer's attention without a KV cache (and a KV-cache prefill), or
        None: the plain core. Not with a prefix-tuning ``prefix`` (the kernel is built for square masks; one warning
        where it would run otherwise), not for ``dropout_rate`` outside [0, 1), and with attention dropout only with
        the counter masks (``counter_dropout``; ``dropout``: the layer's ``CounterDropout``, whose tables and rule
        go into the kernel). It computes in ``compute_dtype`` where the softmax is float32, else asks for the
        softmax's dtype (``attention``: float32 only, one warning otherwise)."""
        if prefix:
            if self.uses("attention"):
                _warn_once("gptlocal: pet_config prefix tuning uses the plain matmul + softmax attention, not the "
                           "fused CPU attention kernel (kernels/cells/attention.py) (built for square masks; the prefix "
                           "adds key rows in front).")
            return None
        if not self.uses("attention") or not 0.0 <= dropout_rate < 1.0 or (dropout_rate > 0 and not counter_dropout):
            return None
        dtype = compute_dtype if softmax_dtype == ms.float32 else softmax_dtype
        return self.attention(scale, dtype, dropout if dropout_rate > 0 else None)

    @staticmethod
    def layer_computes(facts):
        """True where the decoder's C++ layer (``cpu_decoder.cc``) computes the layer of ``facts``: a form and a
        norm it has, float32 norms (weights and compute) and softmax, its Linears all base ones of one weight dtype or
        all an int8 model's, no prefix or adapter."""
        return (facts.form in LAYER_FORMS and facts.norm in LAYER_NORMS and facts.norm_weights == ms.float32 and
                facts.norm_dtype == ms.float32 and facts.softmax_dtype == ms.float32 and
                facts.linears in ("float32", "bfloat16", "int8") and not facts.prefix and not facts.adapters)

    def decode_layer_for(self, facts):
        """The decode-layer kernel for one built decoder layer (``facts``: a ``DecodeLayerFacts``), or None: the
        layer's plain decode graph. Where the C++ layer computes it (``layer_computes``: every layout the model
        builds, LayerNorm or RMSNorm, learned positions or rope, MHA or GQA, any biases, any MLP form, sequential or
        parallel residual; float32, bfloat16 or int8 Linears) and the layer has no LayerDrop (the compiled graph keeps
        its Cell); then as ``decode_layer`` decides for its precision."""
        if not self.layer_computes(facts) or facts.layerdrop:
            return None
        arch = facts.arch
        return self.decode_layer(facts.epsilon, facts.scale, facts.form, facts.compute_dtype,
                                 int8=facts.linears == "int8", bf16_weights=facts.linears == "bfloat16",
                                 norm=facts.norm, rotary_dim=arch.rotary_dim, parallel_residual=arch.parallel_residual,
                                 qkv_bias=arch.qkv_bias, bias=arch.bias, absent=facts.absent)

    def train_layer_for(self, facts):
        """The training-layer kernel for one built decoder layer (``facts``: a ``TrainLayerFacts``), or None: the
        layer's per-op graph. Where the layer is what the kernel computes (every layout the model builds: LayerNorm or
        RMSNorm, the tanh or quick GeLU or SwiGLU, any biases, rope, GQA, the parallel residual) and nothing comes
        between its ops: its Linears all the base Linear with float32 weights (no LoRA), float32 norms and softmax,
        the plain or fused attention core (not blockwise, not Ascend's), dropout rates in [0, 1) drawn with the
        counter masks, no prefix, adapter or LayerDrop; then as ``train_layer`` decides."""
        rates = facts.rates
        fits = (facts.form in TRAIN_LAYER_FORMS and facts.linears == "float32" and facts.norms and
                facts.norm_dtype == ms.float32 and facts.softmax_dtype == ms.float32 and
                facts.core in ("plain", "fused") and all(0.0 <= rate < 1.0 for rate in rates) and
                (facts.dropouts is not None or not any(rates)) and not facts.prefix and not facts.adapters and
                not facts.layerdrop)
        if not fits:
            return None
        return self.train_layer(facts.arch, facts.form, facts.epsilon, facts.scale, facts.compute_dtype,
                                facts.dropouts or (None, None, None), facts.recomputed)

    def epilogue_residual(self, epilogue, hidden_dropout=0.0, adapter=False, layerdrop=False,
                          parallel_residual=False):
        """True where a block's MLP adds the block's residual inside fc2's GEMM epilogue: the MLP runs the
        epilogues (``epilogue``: ``gemm_epilogue``'s Cell, or None) and nothing comes between its output and that
        Add (no ``hidden_dropout``, ``adapter`` or ``layerdrop``; the sequential residual, not
        ``parallel_residual``)."""
        return epilogue is not None and not hidden_dropout and not adapter and not layerdrop and \
            not parallel_residual

    def fresh_prefill(self, fused_layers, prefix=False):
        """True where a KV-cache prefill into empty rows runs as its own graph (``fresh_prefill``: causal attention
        over the prompt's rows only, through the fused CPU kernel): every layer has that kernel (``fused_layers``)
        and there is no prefix-tuning ``prefix`` (whose rows come before the prompt)."""
        return bool(fused_layers) and not prefix

    def adamw_update(self, param_dtypes):
        """GPTLocalAdamW's per-parameter update: the AdamW kernel (``adamw``) where it runs, else MindSpore's
        in-place ``AdamWeightDecay`` (the same formula and inputs)."""
        kernel = self.adamw(param_dtypes)
        return ops.AdamWeightDecay() if kernel is None else kernel

    def grad_clip(self, sum_of_squares):
        """True where gpt_local's clip (``mf/wrapper.py`` ``GPTLocalClipGradNorm``: the same norm from the square-sum
        kernel ``sum_of_squares``, ``square_sum``'s, or from the two-stage reduction of ``composed_ops``) replaces
        MindFormers' ClipGradNorm in the train step."""
        return self.composed_ops() or sum_of_squares is not None



def _warn_once(message):
    """``message`` as a Python warning, once per process."""
    if message not in _TOLD:
        _TOLD.add(message)
        warnings.warn(message, stacklevel=3)


def _tell_once(line):
    """``line`` on stderr, once per process."""
    if line not in _TOLD:
        _TOLD.add(line)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def use_gemm(rule, training, rows):
    """True where a graph of ``rows`` static rows runs the GEMM kernel: ``rule``, ``linear_gemm``'s (from_rows,
    up_to_rows) or None (no kernel); ``training``: the Cell's flag. Shapes and the flag are constants in a compiled
    graph, so this is decided at compile time: the graph holds one of the two paths, never a branch."""
    if rule is None:
        return False
    from_rows, up_to_rows = rule
    return from_rows == 0 or (not training and (rows >= from_rows or rows <= up_to_rows))


def provider_of(network):
    """The ``KernelProvider`` a built network carries (``GPTLocalForCausalLM.kernels``, found among its Cells), or
    the default one (``auto``) for a network without one."""
    for _, cell in network.cells_and_names():
        kernels = cell.__dict__.get("kernels")
        if isinstance(kernels, KernelProvider):
            return kernels
    return KernelProvider()
