"""The small building Cells of the GPT block: Linear, LayerNorm, activation.

Each holds its primitive ops as attributes so that a sharding strategy can be
attached to them (``linear.matmul.shard(...)``) when the model is built for
semi-auto parallel; on one device the ops run unsharded.
"""
import math

import mindspore as ms
from mindspore import nn, ops, Parameter
from mindspore.common.initializer import initializer, Normal, Zero, One

from ..kernels.provider import KernelProvider, use_gemm
from ..parallel.sharding import is_parallel_build

TANH_GELU_SCALE = 2.0 * math.sqrt(2.0 / math.pi)  # 0.5 * (1 + tanh(u)) == sigmoid(2u)
DTYPE = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


def to_mstype(name):
    """'float32' -> mindspore.float32 (MindSpore dtypes pass through)."""
    return DTYPE[name] if isinstance(name, str) else name


def kernel_provider(config, inference=False):
    """The ``KernelProvider`` (``kernels/provider.py``) of a model built now from ``config`` (its ``cpu_kernels`` and
    ``compute_dtype``), in this build's parallel mode, for ``inference`` only or not. The model asks once and hands
    it to every Cell it builds (``kernels=``, a required argument: no Cell makes a provider of its own)."""
    return KernelProvider.from_config(config, parallel=is_parallel_build(), inference=inference)


def bf16_parameter(shape, name):
    """A bfloat16 weight Parameter of zeros that does not train (``KernelProvider.bf16_weights``: an inference
    build's Linears and untied head; the loader fills it)."""
    return Parameter(initializer(Zero(), shape, ms.bfloat16), name=name, requires_grad=False)


def plain_matmul(kernels):
    """The plain x W^T of a Linear or the head for the model's ``kernels``: ``KernelProvider.plain_matmul``
    (``BF16MatMul`` where its GEMMs run in bfloat16 on a float32 graph, else ``ops.MatMul(transpose_b=True)``, the
    primitive a shard strategy attaches to)."""
    return kernels.plain_matmul()


class LeavesBias:
    """``skip_bias_add`` of a Linear (``Linear``, ``quant_cells.QuantLinear``): True where the caller adds the bias
    (``leaves_bias``); ``adds_bias``: the Linear adds its own. Setting it binds the Linear's products again
    (``_bind_bias``), so what ``construct`` runs is always chosen outside it."""

    @property
    def skip_bias_add(self):
        return self.leaves_bias

    @skip_bias_add.setter
    def skip_bias_add(self, value):
        self.leaves_bias = bool(value)
        self.adds_bias = self.has_bias and not value
        self._bind_bias()


class Linear(LeavesBias, nn.Cell):
    """y = x W^T + b, W stored [out, in] like MindSpore's Dense and Megatron.

    The matmul runs in ``compute_dtype``; the output is in ``compute_dtype``.
    ``skip_bias_add``: return the bare matmul and leave the bias to the caller: fc1 when the CPU bias + GeLU
    kernel adds it (gpt.py ParallelFeedForward), and one rank's part of a row-parallel Linear in the CPU proofs
    (tests/references.py ``rank_block``: the bias belongs after the sum over ranks). ``LoRALinear`` and
    ``MultiLoRALinear`` (lora.py) are subclasses built through this ``__init__`` (the layer spec picks them).
    ``kernels``: the model's ``KernelProvider`` (required). Where it gives the GEMM kernel (``kernels/cells/linear.py``,
    ``gemm``; CPU, float32 compute) x W^T (+ b, in the same node) runs it in the graphs its ``gemm_rule`` picks by
    static row count (``cpu_kernels.linear``: ``auto``, inference graphs of 16 rows or more; ``kernel``, every
    graph; ``use_gemm``), fixed when the graph compiles; else ``matmul``, the reference, which also carries the
    shard strategies (then BroadcastTo + Add for the bias). With bfloat16 GEMMs on a float32 graph
    (``KernelProvider.gemm_dtype``: CPU, ``compute_dtype: bfloat16``) the kernel runs them in every graph, and
    ``matmul`` is ``BF16MatMul`` (``KernelProvider.plain_matmul``). In an inference build with those GEMMs through
    the kernel (``KernelProvider.bf16_weights``) the weight is held as bfloat16 (``bf16_weight``, not trained) and
    the kernel takes it as it is.

    What runs is chosen here, never in ``construct``: parts (parameter-free Cells handed the Linear, as
    ``model/gpt.py``'s): ``graph_weight`` (``HeldWeight``: the weight as held, or ``CastWeight``: cast to the compute
    dtype), ``product`` (``MatMulProduct``, or ``GemmByRows``: per graph the GEMM kernel or MatMul) and ``bias_form``
    (``Bare``, ``Biased``, ``BroadcastBiased``: the products with or without the bias), picked again when
    ``skip_bias_add`` is set.
    """

    def __init__(self, in_features, out_features, init_std, params_dtype, compute_dtype, has_bias=True,
                 skip_bias_add=False, *, kernels):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bf16_weight = kernels.bf16_weights
        if self.bf16_weight:
            self.weight = bf16_parameter((out_features, in_features), "weight")
        else:
            self.weight = Parameter(initializer(Normal(sigma=init_std), (out_features, in_features), params_dtype),
                                    name="weight")
        self.has_bias = has_bias
        if has_bias:
            self.bias = Parameter(initializer(Zero(), (out_features,), params_dtype), name="bias")
            self.bias_add = ops.Add()
        # CPU: broadcast the bias to [T, out] before the Add; MindSpore 2.7.2's CPU Add that broadcasts it
        # itself holds more memory (GPT-2 small, bare training step at 2 x 256: peak RSS 3,978 -> 3,328 MB)
        self.broadcast_bias = kernels.composed_ops()
        self.compute_dtype = compute_dtype
        self.matmul = kernels.plain_matmul()
        self.cast = ops.Cast()
        # the CPU GEMM kernel Cell and its rule (provider.use_gemm), or (None, None)
        self.gemm, self.gemm_rule = kernels.linear_gemm(compute_dtype, bf16_weights=self.bf16_weight)
        # a bf16 weight as held: the kernel runs every graph then (EVERY_GRAPH, provider.bf16_weights)
        self.graph_weight = HeldWeight() if self.bf16_weight else CastWeight()
        self.product = MatMulProduct() if self.gemm is None else GemmByRows()
        self.skip_bias_add = skip_bias_add

    def _bind_bias(self):
        """The GEMM kernel's and MatMul's products with or without the bias (``LeavesBias``)."""
        if not self.adds_bias:
            self.bias_form = Bare()
        else:
            self.bias_form = BroadcastBiased() if self.broadcast_bias else Biased()

    def construct(self, x, dropout_step=None):  # pylint: disable=unused-argument
        """x [..., in] -> [..., out]; ``dropout_step``: the model's forward counter, for ``LoRALinear``'s input
        dropout (unused here)."""
        shape = x.shape
        _, y = self.dense(x)
        return ops.reshape(y, shape[:-1] + (self.out_features,))

    def dense(self, x):
        """x [..., in] -> (x as [T, in] in compute dtype, x W^T (+ b) as [T, out]); LoRALinear adds to it. The GEMM
        kernel or MatMul per graph (its static rows and the train flag, ``use_gemm``)."""
        rows = math.prod(x.shape[:-1])
        x = ops.reshape(self.cast(x, self.compute_dtype), (-1, x.shape[-1]))
        return x, self.product(self, x, self.graph_weight(self), rows)


# Linear's parts: each handed the Linear (``linear``), none holding a Parameter.
class HeldWeight(nn.Cell):
    """The weight as held (a bf16 weight for the bf16 GEMM kernel)."""

    def construct(self, linear):
        return linear.weight


class CastWeight(nn.Cell):
    """The weight in the compute dtype."""

    def construct(self, linear):
        return linear.cast(linear.weight, linear.compute_dtype)


class MatMulProduct(nn.Cell):
    """x W^T (+ b) through MatMul in every graph."""

    def construct(self, linear, x, weight, rows):  # pylint: disable=unused-argument
        return linear.bias_form.by_matmul(linear, x, weight)


class GemmByRows(nn.Cell):
    """x W^T (+ b) through the GEMM kernel in the graphs its rule picks (static rows and the train flag: fixed per
    graph, ``use_gemm``), MatMul in the others."""

    def construct(self, linear, x, weight, rows):
        if use_gemm(linear.gemm_rule, self.training, rows):
            return linear.bias_form.by_gemm(linear, x, weight)
        return linear.bias_form.by_matmul(linear, x, weight)


class Bare(nn.Cell):
    """The products without the bias (none, or the caller adds it: ``skip_bias_add``)."""

    def by_gemm(self, linear, x, weight):
        return linear.gemm(x, weight)

    def by_matmul(self, linear, x, weight):
        return linear.matmul(x, weight)


class Biased(Bare):
    """The products with the bias: in the GEMM kernel's node, or MatMul then Add."""

    def by_gemm(self, linear, x, weight):
        return linear.gemm(x, weight, linear.cast(linear.bias, linear.compute_dtype))

    def by_matmul(self, linear, x, weight):
        return linear.bias_add(linear.matmul(x, weight), linear.cast(linear.bias, linear.compute_dtype))


class BroadcastBiased(Biased):
    """``Biased``, the bias broadcast to [T, out] before MatMul's Add (CPU: ``Linear.broadcast_bias``)."""

    def by_matmul(self, linear, x, weight):
        y = linear.matmul(x, weight)
        return linear.bias_add(y, ops.broadcast_to(linear.cast(linear.bias, linear.compute_dtype), y.shape))


class LayerNorm(nn.Cell):
    """LayerNorm over the last axis, computed in ``compute_dtype``, returned in the input's dtype.

    ``ops.LayerNorm``, the reference; ``KernelLayerNorm`` runs the CPU kernel instead (``make_norm``)."""

    def __init__(self, hidden_size, eps, params_dtype, compute_dtype, kernel=None):
        super().__init__()
        self.weight = Parameter(initializer(One(), (hidden_size,), params_dtype), name="weight")
        self.bias = Parameter(initializer(Zero(), (hidden_size,), params_dtype), name="bias")
        self.layer_norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=eps)
        self.compute_dtype = compute_dtype
        self.cast = ops.Cast()
        self.kernel = kernel  # KernelLayerNorm's, else None

    def construct(self, x):
        dtype = x.dtype
        y, _, _ = self.layer_norm(self.cast(x, self.compute_dtype), self.cast(self.weight, self.compute_dtype),
                                  self.cast(self.bias, self.compute_dtype))
        return self.cast(y, dtype)


class KernelLayerNorm(LayerNorm):
    """LayerNorm through gpt_local's C++ kernel (``kernels/cells/norm_gelu.py``; MindSpore 2.7.2's CPU LayerNormGrad is
    the slow part), in float32."""

    def construct(self, x):
        y = self.kernel(self.cast(x, ms.float32), self.cast(self.weight, ms.float32), self.cast(self.bias, ms.float32))
        return self.cast(y, x.dtype)


class RMSNorm(nn.Cell):
    """RMSNorm over the last axis (``normalization: RMSNorm``, Llama's): x * rsqrt(mean(x^2) + eps) * weight,
    computed in ``compute_dtype``, returned in the input's dtype; the weight multiplies after the cast back,
    as Hugging Face's LlamaRMSNorm does.

    The ops below are the reference; ``KernelRMSNorm`` runs the CPU kernel instead (``make_norm``)."""

    def __init__(self, hidden_size, eps, params_dtype, compute_dtype, kernel=None):
        super().__init__()
        self.weight = Parameter(initializer(One(), (hidden_size,), params_dtype), name="weight")
        self.eps = eps
        self.square = ops.Square()
        self.mean = ops.ReduceMean(keep_dims=True)
        self.rsqrt = ops.Rsqrt()
        self.normalize = ops.Mul()
        self.weight_mul = ops.Mul()
        self.compute_dtype = compute_dtype
        self.cast = ops.Cast()
        self.kernel = kernel  # KernelRMSNorm's, else None

    def construct(self, x):
        dtype = x.dtype
        x = self.cast(x, self.compute_dtype)
        y = self.normalize(x, self.rsqrt(self.mean(self.square(x), -1) + self.eps))
        return self.weight_mul(self.cast(y, dtype), self.cast(self.weight, dtype))


class KernelRMSNorm(RMSNorm):
    """RMSNorm through gpt_local's one-pass CPU kernel (``kernels/cells/rms_swiglu.py``; float32 compute and weight)."""

    def construct(self, x):
        return self.cast(self.kernel(self.cast(x, ms.float32), self.weight), x.dtype)


def make_norm(config, params_dtype=None, *, kernels):
    """The block's normalization, chosen at build time: LayerNorm (GPT-2, NeoX) or RMSNorm (Llama), through the CPU
    kernel where ``kernels`` (the model's ``KernelProvider``) gives it."""
    eps = config.layernorm_epsilon
    params_dtype = to_mstype(params_dtype or config.params_dtype)
    compute_dtype = to_mstype(config.layernorm_compute_dtype)
    if config.normalization == "RMSNorm":
        kernel = kernels.rms_norm(eps, compute_dtype, params_dtype)
        cls = RMSNorm if kernel is None else KernelRMSNorm
    else:
        kernel = kernels.layer_norm(eps, compute_dtype)
        cls = LayerNorm if kernel is None else KernelLayerNorm
    return cls(config.hidden_size, eps, params_dtype, compute_dtype, kernel)


def tanh_gelu_by_sigmoid(x, sigmoid):
    """0.5 x (1 + tanh(c(x + 0.044715 x^3))) written as x * sigmoid(2c(...)), c = sqrt(2/pi)."""
    return x * sigmoid(TANH_GELU_SCALE * (x + 0.044715 * x * x * x))


class TanhGeLU(nn.Cell):
    """GPT-2's tanh GeLU as x * sigmoid(2c(x + 0.044715 x^3)), c = sqrt(2/pi), with its own backward.

    For CPU, where MindSpore's GeLU kernel is slow (measured on [512, 3072]: 33 ms forward against
    4 ms for this form; `python benchmarks/kernels.py reduce`). The hand-written backward keeps only
    ``x`` for the backward pass (autodiff of the composed form would keep x^3, the sigmoid and its
    argument: ~25 MB a layer for GPT-2 small at batch 2 x 256) and recomputes the sigmoid there.
    Its error against float64 is the kernel's.
    """

    def __init__(self):
        super().__init__()
        self.sigmoid = ops.Sigmoid()

    def construct(self, x):
        return tanh_gelu_by_sigmoid(x, self.sigmoid)

    def bprop(self, x, out, dout):
        square = x * x
        gate = self.sigmoid(TANH_GELU_SCALE * (x + 0.044715 * square * x))
        slope = gate + x * gate * (1.0 - gate) * (TANH_GELU_SCALE * (1.0 + 3.0 * 0.044715 * square))
        return (dout * slope,)


class Activation(nn.Cell):
    """The MLP activations (GPT-2's gelu_new and the others of ACTIVATIONS) by their Hugging Face names.

    The tanh GeLU is held as the GeLU primitive (what ``ops.gelu(approximate='tanh')`` calls) so
    that it can carry a shard strategy; on CPU, and only there, it is composed from sigmoid instead
    (decided at build time by ``kernels``, the model's ``KernelProvider``: ``cpu_kernels`` ``plain`` or
    ``{composed_ops: plain}`` keep the GeLU primitive): in training as the
    ``TanhGeLU`` Cell with its own backward, otherwise inline, because a Cell with a custom backward
    stays a separate subgraph call (GPT-2 small greedy decode: 19 tokens/s through it, 35 inline).
    The exact erf form stays functional. ``quick_gelu`` (HF's name for x * sigmoid(1.702 x)) is MindSpore's
    FastGeLU primitive, the ``fast_gelu`` of MindFormers' GPT-2 (its xl/13B/52B YAMLs); held only when chosen.
    """

    def __init__(self, name, kernels):
        super().__init__()
        if name == "quick_gelu":
            self.fast_gelu = ops.FastGeLU()
        self.relu = ops.ReLU()
        self.gelu = ops.GeLU()
        self.composed_tanh_gelu = kernels.composed_ops()
        self.tanh_gelu = TanhGeLU()
        # the forward, a part chosen once here: construct only calls it (every other name is the tanh GeLU)
        tanh = ComposedTanhGeLU if self.composed_tanh_gelu else PrimitiveTanhGeLU
        self.activate = ACTIVATION_FORMS.get(name, tanh)()

    def construct(self, x):
        return self.activate(self, x)


# Activation's parts, each handed the Activation (its primitives carry the shard strategies).
class ReLUForm(nn.Cell):
    def construct(self, act, x):
        return act.relu(x)


class QuickGeLUForm(nn.Cell):
    def construct(self, act, x):
        return act.fast_gelu(x)


class ErfGeLUForm(nn.Cell):
    def construct(self, act, x):  # pylint: disable=unused-argument
        return ops.gelu(x, approximate="none")


class PrimitiveTanhGeLU(nn.Cell):
    def construct(self, act, x):
        return act.gelu(x)


class ComposedTanhGeLU(nn.Cell):
    """The tanh GeLU from sigmoid: the ``TanhGeLU`` Cell (its own backward) in training, inline otherwise."""

    def construct(self, act, x):
        if self.training:  # the train flag: one of the two in each compiled graph
            return act.tanh_gelu(x)
        return tanh_gelu_by_sigmoid(x, act.tanh_gelu.sigmoid)


ACTIVATION_FORMS = {"relu": ReLUForm, "quick_gelu": QuickGeLUForm, "gelu": ErfGeLUForm}


class SiLU(nn.Cell):
    """x * sigmoid(x), from primitives that can carry shard strategies."""

    def __init__(self):
        super().__init__()
        self.sigmoid = ops.Sigmoid()
        self.mul = ops.Mul()

    def construct(self, x):
        return self.mul(x, self.sigmoid(x))


def residual_init_std(config):
    """GPT-2 scales output projections that feed the residual stream by 1/sqrt(2 * layers)."""
    return config.initializer_range / math.sqrt(2.0 * config.num_hidden_layers)
