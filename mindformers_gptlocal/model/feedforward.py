"""ParallelFeedForward: the MLP. GPT-2's: fc1 (column-parallel) -> activation -> fc2 (row-parallel); with
``gated_linear_unit`` (SwiGLU, Llama's) fc2(silu(gate(x)) * fc1(x)), the gate its own column-parallel Linear."""
from mindspore import nn, ops

from .layers import Linear, Activation, kernel_provider, residual_init_std, to_mstype


class ParallelFeedForward(nn.Cell):
    """hidden -> intermediate -> hidden (biases with ``add_bias_linear``); fc1 (and the gate) column-parallel,
    fc2 row-parallel under the ``shard`` strategies (``parallel/sharding.py``). ``kernels``: the model's
    ``KernelProvider`` (None: ``kernel_provider(config)``): the bias + GeLU or SwiGLU kernel, or the plain ops."""

    def __init__(self, config, layer_spec=None, kernels=None):
        super().__init__()
        kernels = kernels or kernel_provider(config)
        arch = config.arch
        linear = (layer_spec or {}).get  # the layer spec's Linear class per path (layer_spec.py), else Linear
        params_dtype = to_mstype(config.params_dtype)
        compute_dtype = to_mstype(config.compute_dtype)
        local = arch.inter
        bias = arch.bias
        self.gated = arch.gated
        self.linear_fc1 = linear("mlp.linear_fc1", Linear)(config.hidden_size, local, config.initializer_range,
                                                           params_dtype, compute_dtype, has_bias=bias,
                                                           kernels=kernels)
        if self.gated:  # SwiGLU: fc1 is the "up" projection, linear_gate the one through silu
            self.linear_gate = linear("mlp.linear_gate", Linear)(config.hidden_size, local, config.initializer_range,
                                                                 params_dtype, compute_dtype, has_bias=bias,
                                                                 kernels=kernels)
            self.activation = SiLU()  # the plain path (and the ops the shard strategies name)
            self.gate_mul = ops.Mul()
            # gpt_local's CPU silu(gate) * up kernel (kernels/rms_swiglu.py): fp32, CPU, one rank; or None
            self.swiglu = kernels.swiglu(compute_dtype)
        else:
            self.activation = Activation(config.hidden_act, kernels)
        self.linear_fc2 = linear("mlp.linear_fc2", Linear)(local, config.hidden_size, residual_init_std(config),
                                                           params_dtype, compute_dtype, has_bias=bias,
                                                           kernels=kernels)
        self.bias_gelu = self._bias_gelu_kernel(config, bias, compute_dtype, kernels)
        if self.bias_gelu is not None:  # fc1 returns x W^T; the kernel adds the bias (fc1's own Parameter)
            self.linear_fc1.skip_bias_add = True

    def _bias_gelu_kernel(self, config, bias, compute_dtype, kernels):
        """gpt_local's CPU bias + GeLU kernel (``kernels/norm_gelu.py``) for fc1's bias and the tanh or quick GeLU,
        or None (the plain Add + ``Activation``): where ``kernels`` gives it (CPU, float32, one rank), not gated,
        biased fc1."""
        form = {"quick_gelu": "quick", "gelu": None, "relu": None}.get(config.hidden_act, "tanh")
        if self.gated or not bias or form is None:
            return None
        return kernels.bias_gelu(form, compute_dtype)

    def construct(self, hidden, dropout_step=None):
        """``dropout_step``: the model's forward counter, for LoRA's input dropout on the Linears (``lora.py``)."""
        step = dropout_step
        if self.bias_gelu is not None:
            y = self.linear_fc1(hidden, step)  # with LoRA on fc1: its low-rank update included
            return self.linear_fc2(self.bias_gelu(y, ops.cast(self.linear_fc1.bias, y.dtype)), step)
        if self.gated and self.swiglu is not None:
            return self.linear_fc2(self.swiglu(self.linear_gate(hidden, step), self.linear_fc1(hidden, step)), step)
        if self.gated:
            gate = self.activation(self.linear_gate(hidden, step))
            return self.linear_fc2(self.gate_mul(gate, self.linear_fc1(hidden, step)), step)
        return self.linear_fc2(self.activation(self.linear_fc1(hidden, step)), step)


class SiLU(nn.Cell):
    """x * sigmoid(x), from primitives that can carry shard strategies."""

    def __init__(self):
        super().__init__()
        self.sigmoid = ops.Sigmoid()
        self.mul = ops.Mul()

    def construct(self, x):
        return self.mul(x, self.sigmoid(x))
