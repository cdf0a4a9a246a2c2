"""ParallelFeedForward: GPT-2's MLP, fc1 (column-parallel) -> activation -> fc2 (row-parallel)."""
from mindspore import nn

from .layers import Linear, Activation, residual_init_std, to_mstype


class ParallelFeedForward(nn.Cell):
    """hidden -> intermediate -> hidden, with biases on both linears."""

    def __init__(self, config):
        super().__init__()
        params_dtype = to_mstype(config.params_dtype)
        compute_dtype = to_mstype(config.compute_dtype)
        self.linear_fc1 = Linear(config.hidden_size, config.intermediate_size, config.initializer_range,
                                 params_dtype, compute_dtype)
        self.activation = Activation(config.hidden_act)
        self.linear_fc2 = Linear(config.intermediate_size, config.hidden_size, residual_init_std(config),
                                 params_dtype, compute_dtype)

    def construct(self, hidden):
        return self.linear_fc2(self.activation(self.linear_fc1(hidden)))
