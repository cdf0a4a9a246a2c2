"""LoRA's Cells (its settings, shapes, freeze and sharding rules: ``lora.py``): ``LoRALinear`` on gpt_local's own
Linears (what ``pet_config`` asks for: ``lora_layer_spec``) and ``MultiLoRALinear`` (``serve --lora``:
``MultiLoRASpec``).

Our own Cell, not mindpet's ``LoRADense`` that MindFormers' LoraAdapter inserts: that adapter replaces
only ``nn.Dense``, MindFormers' ``Linear`` and the mcore parallel linears (our Linear is none of them),
``LoRADense`` cannot skip the bias for one rank's part of a row-parallel Linear (the CPU tensor-parallel
proof), and the adapter must exist before ``apply_sharding`` so that its matmuls carry our strategies.
The maths and the defaults are PEFT's / LoRADense's: y = x W^T + b + (alpha / r) * B(A(dropout(x))),
A [r, in] HeUniform(sqrt 5) (PEFT's kaiming_uniform(a=sqrt 5)), B [out, r] zero, so a new adapter
leaves the model's outputs unchanged.

Both are Linear subclasses built through ``Linear.__init__`` when the layer is built, chosen per Linear by the
layer spec (``model/layer_spec.py``, Megatron-core's layer-spec shape), never put in afterwards: the base weight is the
one the layer creates, under the plain Linear's name, and no attribute is copied.
"""
import functools
import math

import numpy as np
import mindspore as ms
from mindspore import ops, Parameter, Tensor
from mindspore.common.initializer import initializer, HeUniform

from .dropout import LORA_SITE, CounterDropout, KernelDropout, counter_dropout_build, lora_dropout_site
from .layers import Linear
from ..peft.lora import LINEARS, LORA_A, LORA_B, is_target, targeted_paths


def _init(name):
    return HeUniform(negative_slope=math.sqrt(5)) if name in ("heuniform", "he_uniform") else name


class LoRALinear(Linear):
    """A Linear plus a low-rank update. Built through ``Linear.__init__`` in place of the plain Linear when the
    layer is built (the layer spec, ``model/layer_spec.py``), so its base weight and bias are the ones the layer
    creates, with the plain Linear's names; ``lora``: the LoraSpec (rank, alpha, dropout, initializers);
    ``dropout_site`` and ``dropout_seed``: its input dropout's counter-dropout site (``dropout.lora_dropout_site``)
    and tables' seed (``model_config.dropout_seed``); ``kernels``: the model's ``KernelProvider`` (required), as
    Linear's (and for the input dropout's kernel). ``construct(x, dropout_step)``: the model's forward counter picks
    the mask (``dropout.py``; None: no dropout)."""

    def __init__(self, in_features, out_features, init_std, params_dtype, compute_dtype, has_bias=True,
                 skip_bias_add=False, *, kernels, lora, dropout_site=LORA_SITE, dropout_seed=0):
        super().__init__(in_features, out_features, init_std, params_dtype, compute_dtype, has_bias, skip_bias_add,
                         kernels=kernels)
        self.lora_rank = lora.rank
        self.scaling = lora.alpha / lora.rank
        setattr(self, LORA_A, Parameter(initializer(_init(lora.a_init), (lora.rank, in_features), params_dtype),
                                        name=LORA_A))
        setattr(self, LORA_B, Parameter(initializer(_init(lora.b_init), (out_features, lora.rank), params_dtype),
                                        name=LORA_B))
        self.lora_dropout = _lora_dropout(lora.dropout, self.compute_dtype, dropout_site, dropout_seed, kernels)
        self.lora_a_matmul = ops.MatMul(transpose_b=True)
        self.lora_b_matmul = ops.MatMul(transpose_b=True)
        self.lora_mul = ops.Mul()
        self.lora_add = ops.Add()

    def construct(self, x, dropout_step=None):
        shape = x.shape
        x, y = self.dense(x)
        low = self.lora_a_matmul(self.lora_dropout(x, dropout_step), self.cast(self.lora_a, self.compute_dtype))
        low = self.lora_mul(low, self.scaling)  # on [T, r], not on [T, out]: the same product, r / out the work
        low = self.lora_b_matmul(low, self.cast(self.lora_b, self.compute_dtype))
        y = self.lora_add(y, low)
        return ops.reshape(y, shape[:-1] + (self.out_features,))


def layer_spec(spec, config):
    """The layer spec of ``spec`` (a LoraSpec) for the model of ``config`` (``model/layer_spec.py``)."""
    return functools.partial(lora_layer_spec, spec, dropout_seed=config.dropout_seed)


def check_built(spec, model):
    """The built model's LoRALinears are the Linears ``spec`` targets."""
    paths = sorted(name for name, cell in model.cells_and_names() if isinstance(cell, LoRALinear))
    assert paths == sorted(targeted_paths(spec, len(model.model.layers), model.config.arch.gated)), paths


def lora_layer_spec(spec, index, dropout_seed=0):
    """Layer ``index``'s part of the layer spec for ``spec`` (a LoraSpec): {Linear path in the block:
    LoRALinear with the spec and its dropout site} for every targeted Linear
    (``model.layers.{index}.attention.linear_qkv``...); ``mlp.linear_gate`` is used only by a gated MLP."""
    return {linear: functools.partial(LoRALinear, lora=spec, dropout_site=lora_dropout_site(index + 1, linear),
                                      dropout_seed=dropout_seed)
            for linear in LINEARS if is_target(spec, f"model.layers.{index}.{linear}")}


def _lora_dropout(p, compute_dtype, site, seed, kernels):
    """lora_dropout's Cell, chosen at build time, called as ``(x, dropout_step)``. For 0 < p < 1 where the build
    draws counter masks (``dropout.counter_dropout_build``: one rank or data parallel): gpt_local's counter dropout
    at ``site`` (``dropout.CounterDropout``, the plain path and reference: the mask a function of the model's forward
    counter, so resume is exact), or its kernel where ``kernels`` (the model's provider) gives it
    (``KernelProvider.lora_dropout``: on CPU in float32, ``kernels/cells/lora_dropout.py``: the same mask in one pass,
    drawn again in the backward, nothing of the input's size kept). Under semi-auto/auto parallel MindSpore's
    Dropout (``KernelDropout``, as the model's other dropouts there; its masks do not resume); for p = 0 the
    identity."""
    if not 0.0 < p < 1.0 or not counter_dropout_build():
        return KernelDropout(p=p)
    plain = CounterDropout(p, site, seed)
    kernel = kernels.lora_dropout(plain, compute_dtype)
    return plain if kernel is None else kernel


class MultiLoRALinear(Linear):
    """A Linear serving several LoRA adapters at once (``gptlocal serve --lora``): the base GEMM once for all
    rows, then each batch row's own low-rank update, picked by the row's adapter index.

    Adapter k's A [r_k, in] and (alpha_k / r_k) B [out, r_k] are stacked into A [K+1, R, in] and B [K+1, out, R]
    (R: the largest rank; a smaller rank's rows of A / columns of B are zeros, so its product is exactly its
    own; the scaling is folded into B at start, one multiply fewer per step); slot 0 is all zeros: "no
    adapter", the base model, as is an adapter's slot on a Linear it does not update. ``scales`` [K+1]: each
    adapter's alpha / r. ``index`` is a Parameter [max_batch] shared by every
    MultiLoRALinear of the model: row b of a call with batch B <= max_batch uses adapter index[b]; the server
    writes it before each compiled call (``MultiLoRA.select``), so the graph never changes with the mix.
    y[b] = x[b] W^T + bias + (x[b] A[i]^T) (scales[i] B[i])^T, i = index[b] (x: [B, S, in]). The stacks are kept
    in the compute dtype (no casts per step)."""

    def __init__(self, in_features, out_features, init_std, params_dtype, compute_dtype, has_bias=True,
                 skip_bias_add=False, *, kernels, stacks, index):
        super().__init__(in_features, out_features, init_std, params_dtype, compute_dtype, has_bias, skip_bias_add,
                         kernels=kernels)
        a_stack, b_stack, scales = stacks
        scaled = np.asarray(b_stack, np.float32) * np.asarray(scales, np.float32).reshape(-1, 1, 1)
        self.multi_lora_a = Parameter(Tensor(a_stack, compute_dtype), name="multi_lora_a", requires_grad=False)
        self.multi_lora_b = Parameter(Tensor(scaled, compute_dtype), name="multi_lora_b", requires_grad=False)
        self.adapter_index = index
        self.gather = ops.Gather()
        self.lora_a_matmul = ops.BatchMatMul(transpose_b=True)
        self.lora_b_matmul = ops.BatchMatMul(transpose_b=True)

    def construct(self, x, dropout_step=None):  # pylint: disable=unused-argument
        shape = x.shape
        batch = shape[0]
        x, y = self.dense(x)  # [T, in], [T, out]: the base GEMM, once
        rows = self.adapter_index[:batch]
        x = ops.reshape(x, (batch, -1, self.in_features))
        a = self.gather(self.multi_lora_a, rows, 0)  # [B, R, in]
        b = self.gather(self.multi_lora_b, rows, 0)  # [B, out, R], scaled
        low = self.lora_b_matmul(self.lora_a_matmul(x, a), b)  # [B, S, out]
        y = y + ops.reshape(low, (-1, self.out_features))
        return ops.reshape(y, shape[:-1] + (self.out_features,))


class MultiLoRA:
    """The adapters of a served model (``MultiLoRASpec.handle``): names in index order (0: the base) and the
    shared per-row index Parameter."""

    def __init__(self, names, index, max_batch):
        self.names, self.index, self.max_batch = list(names), index, max_batch
        self._current = np.zeros(max_batch, np.int32)

    def select(self, rows):
        """Adapter index per batch row of the next call (``rows``: ints, at most max_batch; the rest 0)."""
        wanted = np.zeros(self.max_batch, np.int32)
        wanted[:len(rows)] = rows
        if not np.array_equal(wanted, self._current):
            self.index.set_data(Tensor(wanted, ms.int32))
            self._current = wanted


class MultiLoRASpec:
    """The layer spec of a model serving ``adapters`` (``gptlocal serve --lora``), given when the model is built
    (``GPTLocalForCausalLM.from_pretrained(dir, layer_spec=...)``): a MultiLoRALinear on every Linear one of
    them updates, its base weight the layer's own. ``handle``: the MultiLoRA whose ``select`` sets each row's
    adapter before a call.

    ``adapters``: [(name, {Linear path: (A [r, in], B [out, r]) numpy}, alpha / r)], served as indices 1..K
    (0 is the base). Shapes must fit the base Linears (checked by the caller: ``serve/adapters.py``)."""

    def __init__(self, adapters, max_batch):
        index = Parameter(Tensor(np.zeros(max_batch, np.int32), ms.int32), name="multi_lora_index",
                          requires_grad=False)
        self.handle = MultiLoRA([None] + [name for name, _, _ in adapters], index, max_batch)
        self.stacks = {}  # Linear path -> (A stack, B stack, scales)
        for path in sorted({path for _, pairs, _ in adapters for path in pairs}):
            rank = max(pairs[path][0].shape[0] for _, pairs, _ in adapters if path in pairs)
            a_in = next(pairs[path][0].shape[1] for _, pairs, _ in adapters if path in pairs)
            b_out = next(pairs[path][1].shape[0] for _, pairs, _ in adapters if path in pairs)
            a_stack = np.zeros((len(adapters) + 1, rank, a_in), np.float32)
            b_stack = np.zeros((len(adapters) + 1, b_out, rank), np.float32)
            scales = np.zeros(len(adapters) + 1, np.float32)
            for k, (_, pairs, scaling) in enumerate(adapters, start=1):
                if path in pairs:
                    a, b = pairs[path]
                    a_stack[k, :a.shape[0]] = a
                    b_stack[k, :, :b.shape[1]] = b
                    scales[k] = scaling
            self.stacks[path] = (a_stack, b_stack, scales)

    def __call__(self, index):
        """Layer ``index``'s part: {Linear path in the block: MultiLoRALinear with its stacks}."""
        head = f"model.layers.{index}."
        return {path[len(head):]: functools.partial(MultiLoRALinear, stacks=stacks, index=self.handle.index)
                for path, stacks in self.stacks.items() if path.startswith(head)}
