"""The Cells of Houlsby bottleneck adapters (``pet_type: adapter``; settings, shapes, freeze and sharding rules:
``adapter.py``): ``BottleneckAdapter``, ``adapter_layer_spec``.

Houlsby et al. 2019 ("Parameter-Efficient Transfer Learning for NLP"): after the attention and after the MLP
of a layer, before each is added to the residual stream, y -> y + up(act(down(y))), down [m, H], up [H, m]
with biases. The up-projection starts at zero, so a new adapter leaves the model's outputs unchanged and
training starts from the base model; the down-projection starts Normal(initializer_range). The settings
(``AdapterSpec``: bottleneck width, non-linearity, which of the two sites, which layers) are read and checked
in ``adapter.py``. The Cells are built with the blocks (``GPTLocalBlock.attention_adapter`` /
``mlp_adapter``), chosen by the layer spec (``adapter_layer_spec``, ``model/layer_spec.py``), so they exist before
the shard strategies are set; their tensor parallel layout (down column-parallel, up row-parallel, like the MLP)
is ``adapter.adapter_rules``.

An adapter cannot be folded into the base weights (its non-linearity sits between the two projections), so
``gptlocal lora merge`` refuses an adapter checkpoint (``checkpoint/lora.py``); a model directory keeps the
adapters and loads back with them (``config.json`` holds the pet_config).
"""
import functools

from mindspore import nn, ops

from .layers import Activation, Linear, SiLU, to_mstype
from ..peft.adapter import adapter_paths, bottleneck_width


class BottleneckAdapter(nn.Cell):
    """y + up(act(down(y))) over the last axis of y [B, S, H]; ``kernels``: the model's ``KernelProvider``
    (required: the block hands it to the layer spec's factory)."""

    def __init__(self, config, width, non_linearity, *, kernels):
        super().__init__()
        params_dtype, compute_dtype = to_mstype(config.params_dtype), to_mstype(config.compute_dtype)
        self.linear_down = Linear(config.hidden_size, width, config.initializer_range, params_dtype, compute_dtype,
                                  kernels=kernels)
        self.linear_up = Linear(width, config.hidden_size, config.initializer_range, params_dtype, compute_dtype,
                                kernels=kernels)
        self.linear_up.weight.set_data(ops.zeros(self.linear_up.weight.shape, params_dtype))
        names = {"gelu": "gelu", "gelu_new": "gelu_new", "relu": "relu", "quick_gelu": "quick_gelu"}
        self.activation = SiLU() if non_linearity in ("silu", "swish") else Activation(names[non_linearity], kernels)
        self.add = ops.Add()

    def construct(self, hidden):
        update = self.linear_up(self.activation(self.linear_down(hidden)))
        return self.add(hidden, ops.cast(update, hidden.dtype))


def layer_spec(spec, config):
    """The layer spec of ``spec`` (an AdapterSpec) for the model of ``config`` (``model/layer_spec.py``)."""
    return functools.partial(adapter_layer_spec, spec, config)


def check_built(spec, model):
    """The built model's BottleneckAdapters are the sites ``spec`` names."""
    paths = adapter_paths(spec, len(model.model.layers))
    assert paths == [name for name, cell in model.cells_and_names() if isinstance(cell, BottleneckAdapter)], paths


def adapter_layer_spec(spec, config, index):
    """Layer ``index``'s part of the layer spec for ``spec`` (an AdapterSpec): {adapter site of the block
    (``attention_adapter`` / ``mlp_adapter``): BottleneckAdapter, to be called with the model's provider
    (``kernels=``)}; empty for a layer not in ``spec.layers``."""
    if index not in spec.layers:
        return {}
    width = bottleneck_width(spec, config.hidden_size)
    return {site: functools.partial(BottleneckAdapter, config, width, spec.non_linearity) for site in spec.sites}
