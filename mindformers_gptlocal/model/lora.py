"""LoRA adapters on gpt_local's own Linears: ``LoRALinear`` and ``add_lora`` (what ``pet_config`` asks for).

Our own Cell, not mindpet's ``LoRADense`` that MindFormers' LoraAdapter inserts: that adapter replaces
only ``nn.Dense``, MindFormers' ``Linear`` and the mcore parallel linears (our Linear is none of them),
``LoRADense`` cannot skip the bias for one rank's part of a row-parallel Linear (the CPU tensor-parallel
proof), and the adapter must exist before ``apply_sharding`` so that its matmuls carry our strategies.
The maths and the defaults are PEFT's / LoRADense's: y = x W^T + b + (alpha / r) * B(A(dropout(x))),
A [r, in] HeUniform(sqrt 5) (PEFT's kaiming_uniform(a=sqrt 5)), B [out, r] zero, so a new adapter
leaves the model's outputs unchanged. The base weight and bias stay the same Parameter objects.
"""
import math

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common.initializer import initializer, HeUniform

from .layers import Linear
from .lora_config import LINEARS, LORA_A, LORA_B, check_trainable, is_frozen, is_target, targeted_paths


def _init(name):
    return HeUniform(negative_slope=math.sqrt(5)) if name in ("heuniform", "he_uniform") else name


def _take_over(cell, base):
    """``cell`` (a Linear subclass built without ``Linear.__init__``) takes over ``base``'s Parameters and ops, so
    checkpoint names and the shard strategies set on them stay the same. One list for LoRALinear and
    MultiLoRALinear."""
    cell.in_features, cell.out_features = base.in_features, base.out_features
    cell.weight = base.weight
    cell.has_bias = base.has_bias
    if base.has_bias:
        cell.bias = base.bias
        cell.bias_add = base.bias_add
    cell.skip_bias_add = base.skip_bias_add
    cell.broadcast_bias = base.broadcast_bias
    cell.compute_dtype = base.compute_dtype
    cell.matmul = base.matmul
    cell.gemm = base.gemm  # the CPU GEMM kernel or None (layers.py Linear)
    cell.cast = base.cast


class LoRALinear(Linear):
    """A Linear plus a low-rank update; built from an existing Linear, whose Parameters it takes over."""

    def __init__(self, base, spec):  # pylint: disable=super-init-not-called
        nn.Cell.__init__(self)
        _take_over(self, base)
        dtype = base.weight.dtype
        self.lora_rank = spec.rank
        self.scaling = spec.alpha / spec.rank
        setattr(self, LORA_A, Parameter(initializer(_init(spec.a_init), (spec.rank, self.in_features), dtype),
                                        name=LORA_A))
        setattr(self, LORA_B, Parameter(initializer(_init(spec.b_init), (self.out_features, spec.rank), dtype),
                                        name=LORA_B))
        self.lora_dropout = nn.Dropout(p=spec.dropout)
        self.lora_a_matmul = ops.MatMul(transpose_b=True)
        self.lora_b_matmul = ops.MatMul(transpose_b=True)
        self.lora_mul = ops.Mul()
        self.lora_add = ops.Add()

    def construct(self, x):
        shape = x.shape
        x, y = self.dense(x)
        low = self.lora_a_matmul(self.lora_dropout(x), self.cast(self.lora_a, self.compute_dtype))
        low = self.lora_b_matmul(low, self.cast(self.lora_b, self.compute_dtype))
        y = self.lora_add(y, self.lora_mul(low, self.scaling))
        return ops.reshape(y, shape[:-1] + (self.out_features,))


def add_lora_to_block(block, spec, prefix="model.layers.0."):
    """Replace the targeted Linears of one GPTLocalBlock (``prefix``: its path in the model). Returns the paths."""
    done = []
    for linear in LINEARS:
        if not is_target(spec, prefix + linear):
            continue
        parent_name, leaf = linear.split(".")
        parent = getattr(block, parent_name)
        base = getattr(parent, leaf, None)
        if base is None:  # mlp.linear_gate of a model without a gated MLP
            continue
        if not isinstance(base, LoRALinear):
            setattr(parent, leaf, LoRALinear(base, spec))
        done.append(prefix + linear)
    return done


def add_lora(model, spec, log=print):
    """Adapters into ``model`` (GPTLocalForCausalLM) as ``spec`` says, then the freeze lists applied
    (mindpet's freeze_modules semantics, the same MindFormers' PetModel applies after us). Logs and
    returns (trainable, total) parameter counts; refuses a freeze that leaves nothing to train."""
    paths = []
    for index, block in enumerate(model.model.layers):
        paths += add_lora_to_block(block, spec, f"model.layers.{index}.")
    model.update_parameters_name()  # the new Parameters get their full paths
    params = dict(model.parameters_and_names())
    check_trainable(spec, list(params))
    for name, param in params.items():
        param.requires_grad = not is_frozen(spec, name)
    assert paths == targeted_paths(spec, len(model.model.layers), model.config.gated)
    total = sum(p.size for p in params.values())
    trainable = sum(p.size for p in params.values() if p.requires_grad)
    log(f"[gpt_local] LoRA: {trainable:,} trainable parameters ({100.0 * trainable / total:.2g}% of "
        f"{_short(total)}), rank {spec.rank}, alpha {spec.alpha:g}, in {len(paths)} Linears")
    return trainable, total


def _short(count):
    return f"{count / 1e6:.0f}M" if count >= 1e7 else f"{count / 1e6:.2f}M" if count >= 1e5 else f"{count:,}"


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

    def __init__(self, base, a_stack, b_stack, scales, index):  # pylint: disable=super-init-not-called
        nn.Cell.__init__(self)
        _take_over(self, base)
        dtype = self.compute_dtype
        scaled = np.asarray(b_stack, np.float32) * np.asarray(scales, np.float32).reshape(-1, 1, 1)
        self.multi_lora_a = Parameter(Tensor(a_stack, dtype), name="multi_lora_a", requires_grad=False)
        self.multi_lora_b = Parameter(Tensor(scaled, dtype), name="multi_lora_b", requires_grad=False)
        self.adapter_index = index
        self.gather = ops.Gather()
        self.lora_a_matmul = ops.BatchMatMul(transpose_b=True)
        self.lora_b_matmul = ops.BatchMatMul(transpose_b=True)

    def construct(self, x):
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
    """The adapters of a served model (``add_multi_lora``): names in index order (0: the base) and the
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


def add_multi_lora(model, adapters, max_batch):
    """Put a MultiLoRALinear on every Linear of ``model`` that one of ``adapters`` updates.

    ``adapters``: [(name, {Linear path: (A [r, in], B [out, r]) numpy}, alpha / r)], served as indices
    1..K (0 is the base). Shapes must fit the base Linears (checked by the caller: ``serve/adapters.py``).
    Returns the MultiLoRA handle whose ``select`` sets each row's adapter before a call."""
    index = Parameter(Tensor(np.zeros(max_batch, np.int32), ms.int32), name="multi_lora_index",
                      requires_grad=False)
    paths = sorted({path for _, pairs, _ in adapters for path in pairs})
    for path in paths:
        _, _, layer, parent_name, leaf = path.split(".")
        parent = getattr(model.model.layers[int(layer)], parent_name)
        base = getattr(parent, leaf)
        rank = max(pairs[path][0].shape[0] for _, pairs, _ in adapters if path in pairs)
        a_stack = np.zeros((len(adapters) + 1, rank, base.in_features), np.float32)
        b_stack = np.zeros((len(adapters) + 1, base.out_features, rank), np.float32)
        scales = np.zeros(len(adapters) + 1, np.float32)
        for k, (_, pairs, scaling) in enumerate(adapters, start=1):
            if path in pairs:
                a, b = pairs[path]
                a_stack[k, :a.shape[0]] = a
                b_stack[k, :, :b.shape[1]] = b
                scales[k] = scaling
        setattr(parent, leaf, MultiLoRALinear(base, a_stack, b_stack, scales, index))
    model.update_parameters_name()
    return MultiLoRA([None] + [name for name, _, _ in adapters], index, max_batch)
