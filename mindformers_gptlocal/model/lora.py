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

from mindspore import nn, ops, Parameter
from mindspore.common.initializer import initializer, HeUniform

from .layers import Linear
from .lora_config import LINEARS, LORA_A, LORA_B, check_trainable, is_frozen, is_target, targeted_paths


def _init(name):
    return HeUniform(negative_slope=math.sqrt(5)) if name in ("heuniform", "he_uniform") else name


class LoRALinear(Linear):
    """A Linear plus a low-rank update; built from an existing Linear, whose Parameters it takes over."""

    def __init__(self, base, spec):  # pylint: disable=super-init-not-called
        nn.Cell.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.has_bias = base.has_bias
        if base.has_bias:
            self.bias = base.bias
            self.bias_add = base.bias_add
        self.skip_bias_add = base.skip_bias_add
        self.broadcast_bias = base.broadcast_bias
        self.compute_dtype = base.compute_dtype
        self.matmul = base.matmul
        self.cast = base.cast
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
