"""ParallelFeedForward: GPT-2's MLP, fc1 (column-parallel) -> activation -> fc2 (row-parallel)."""
from mindspore import nn

from ..errors import ConfigError
from .layers import Linear, Activation, residual_init_std, to_mstype


class ParallelFeedForward(nn.Cell):
    """hidden -> intermediate -> hidden, with biases on both linears.

    ``tp_size`` > 1 builds one tensor-parallel rank's part (intermediate / tp_size columns of fc1,
    the matching rows of fc2, fc2's partial sum returned without its bias); see ParallelAttention.
    """

    def __init__(self, config, tp_size=1):
        super().__init__()
        if config.intermediate_size % tp_size:
            raise ConfigError(f"model_config.intermediate_size ({config.intermediate_size}) is not divisible by "
                              f"parallel_config.model_parallel ({tp_size}); choose a model_parallel that divides it.")
        params_dtype = to_mstype(config.params_dtype)
        compute_dtype = to_mstype(config.compute_dtype)
        local = config.intermediate_size // tp_size
        self.linear_fc1 = Linear(config.hidden_size, local, config.initializer_range, params_dtype, compute_dtype)
        self.activation = Activation(config.hidden_act)
        self.linear_fc2 = Linear(local, config.hidden_size, residual_init_std(config), params_dtype, compute_dtype,
                                 skip_bias_add=tp_size > 1)

    def construct(self, hidden):
        return self.linear_fc2(self.activation(self.linear_fc1(hidden)))
