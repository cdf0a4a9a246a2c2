"""ParallelFeedForward: the MLP. GPT-2's: fc1 (column-parallel) -> activation -> fc2 (row-parallel); with
``gated_linear_unit`` (SwiGLU, Llama's) fc2(silu(gate(x)) * fc1(x)), the gate its own column-parallel Linear."""
from mindspore import nn, ops

from .layers import Linear, Activation, residual_init_std, to_mstype


class ParallelFeedForward(nn.Cell):
    """hidden -> intermediate -> hidden (biases with ``add_bias_linear``); fc1 (and the gate) column-parallel,
    fc2 row-parallel under the ``shard`` strategies (``parallel/sharding.py``)."""

    def __init__(self, config):
        super().__init__()
        arch = config.arch
        params_dtype = to_mstype(config.params_dtype)
        compute_dtype = to_mstype(config.compute_dtype)
        local = arch.inter
        bias = arch.bias
        self.gated = arch.gated
        self.linear_fc1 = Linear(config.hidden_size, local, config.initializer_range, params_dtype, compute_dtype,
                                 has_bias=bias)
        if self.gated:  # SwiGLU: fc1 is the "up" projection, linear_gate the one through silu
            self.linear_gate = Linear(config.hidden_size, local, config.initializer_range, params_dtype,
                                      compute_dtype, has_bias=bias)
            self.activation = SiLU()
            self.gate_mul = ops.Mul()
        else:
            self.activation = Activation(config.hidden_act)
        self.linear_fc2 = Linear(local, config.hidden_size, residual_init_std(config), params_dtype, compute_dtype,
                                 has_bias=bias)

    def construct(self, hidden):
        if self.gated:
            return self.linear_fc2(self.gate_mul(self.activation(self.linear_gate(hidden)), self.linear_fc1(hidden)))
        return self.linear_fc2(self.activation(self.linear_fc1(hidden)))


class SiLU(nn.Cell):
    """x * sigmoid(x), from primitives that can carry shard strategies."""

    def __init__(self):
        super().__init__()
        self.sigmoid = ops.Sigmoid()
        self.mul = ops.Mul()

    def construct(self, x):
        return self.mul(x, self.sigmoid(x))
