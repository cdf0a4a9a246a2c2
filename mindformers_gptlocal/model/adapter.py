"""Houlsby bottleneck adapters (``pet_type: adapter``): ``BottleneckAdapter`` and ``add_adapters``.

Houlsby et al. 2019 ("Parameter-Efficient Transfer Learning for NLP"): after the attention and after the MLP
of a layer, before each is added to the residual stream, y -> y + up(act(down(y))), down [m, H], up [H, m]
with biases. The up-projection starts at zero, so a new adapter leaves the model's outputs unchanged and
training starts from the base model; the down-projection starts Normal(initializer_range). The settings
(``AdapterSpec``: bottleneck width, non-linearity, which of the two sites, which layers) are read and checked
in ``lora_config.py``. The Cells are put on the blocks (``GPTLocalBlock.attention_adapter`` /
``mlp_adapter``) when ``GPTLocalForCausalLM`` is built, before the shard strategies are set; their tensor
parallel layout (down column-parallel, up row-parallel, like the MLP) is in ``parallel/sharding.py``.

An adapter cannot be folded into the base weights (its non-linearity sits between the two projections), so
``gptlocal lora merge`` refuses an adapter checkpoint (``checkpoint/lora.py``); a model directory keeps the
adapters and loads back with them (``config.json`` holds the pet_config).
"""
from mindspore import nn, ops

from .feedforward import SiLU
from .layers import Activation, Linear, to_mstype
from .lora_config import adapter_paths, bottleneck_width, check_trainable, is_frozen


class BottleneckAdapter(nn.Cell):
    """y + up(act(down(y))) over the last axis of y [B, S, H]."""

    def __init__(self, config, width, non_linearity):
        super().__init__()
        params_dtype, compute_dtype = to_mstype(config.params_dtype), to_mstype(config.compute_dtype)
        self.linear_down = Linear(config.hidden_size, width, config.initializer_range, params_dtype, compute_dtype)
        self.linear_up = Linear(width, config.hidden_size, config.initializer_range, params_dtype, compute_dtype)
        self.linear_up.weight.set_data(ops.zeros(self.linear_up.weight.shape, params_dtype))
        self.activation = SiLU() if non_linearity in ("silu", "swish") else Activation(
            {"gelu": "gelu", "gelu_new": "gelu_new", "relu": "relu", "quick_gelu": "quick_gelu"}[non_linearity])
        self.add = ops.Add()

    def construct(self, hidden):
        update = self.linear_up(self.activation(self.linear_down(hidden)))
        return self.add(hidden, ops.cast(update, hidden.dtype))


def add_adapters(model, spec, log=print):
    """Adapters into ``model`` (GPTLocalForCausalLM) as ``spec`` (an AdapterSpec) says, then the freeze lists
    applied (mindpet's semantics, as for LoRA). Logs and returns (trainable, total) parameter counts."""
    config = model.config
    width = bottleneck_width(spec, config.hidden_size)
    paths = adapter_paths(spec, len(model.model.layers))
    for path in paths:
        index, site = path.split(".")[2:]
        setattr(model.model.layers[int(index)], site, BottleneckAdapter(config, width, spec.non_linearity))
    model.update_parameters_name()  # the new Parameters get their full paths
    params = dict(model.parameters_and_names())
    check_trainable(spec, list(params))
    for name, param in params.items():
        param.requires_grad = not is_frozen(spec, name)
    total = sum(p.size for p in params.values())
    trainable = sum(p.size for p in params.values() if p.requires_grad)
    log(f"[gpt_local] adapters: {trainable:,} trainable parameters ({100.0 * trainable / total:.2g}% of "
        f"{total:,}), bottleneck {width}, {spec.non_linearity}, {len(paths)} adapters in "
        f"{len(spec.layers)} layers")
    return trainable, total
