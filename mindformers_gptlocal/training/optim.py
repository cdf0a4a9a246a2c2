"""GPTLocalAdamW: MindFormers' AdamW update, run as one fused kernel per parameter.

MindFormers' ``AdamW`` writes the update as ~10 element-wise ops per parameter; on CPU each makes a
parameter-sized temporary, and for GPT-2 small that lifts peak memory from 5.0 to 9.3 GB. Its
``use_fused: True`` path calls the ``AdamW`` primitive, which has no CPU kernel. MindSpore's
``AdamWeightDecay`` primitive has kernels on CPU, GPU and Ascend and updates the parameter and both
moments in place, but knows no bias correction. Folding the correction into its scalar inputs gives
MindFormers' AdamW exactly (up to rounding), with b1 = 1 - beta1^t and b2 = 1 - beta2^t:

    w - lr*wd*w - lr/b1 * m / (sqrt(v/b2) + eps)
      = w - lr' * (m / (sqrt(v) + eps') + wd' * w)
    with lr' = lr*sqrt(b2)/b1,  eps' = eps*sqrt(b2),  wd' = wd*b1/sqrt(b2).

Same constructor arguments and state names (``adam_m.*``, ``adam_v.*``) as MindFormers' AdamW, so a
YAML switches with ``optimizer.type`` alone and checkpoints carry over.

On CPU, in gpt_local's train step (``GPTLocalTrainOneStepCell``), the kernel is gpt_local's own
(``kernels/cells/train_step.py``: the same formula and inputs, one pass a parameter on the library's threads; the model's
``cpu_kernels`` op ``adamw``), as MindSpore's CPU ``AdamWeightDecay`` runs ~3x slower than the memory it touches.
"""

import numpy as np
import mindspore as ms
from mindspore import ops, Tensor, Parameter, ParameterTuple
from mindspore.common import dtype as mstype
from mindspore.common.initializer import initializer
from mindspore.nn.optim.optimizer import Optimizer

from ..errors import ConfigError

_fused_step = ops.MultitypeFuncGraph("gptlocal_fused_adamw")


@_fused_step.register("Function", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                      "Tensor", "Tensor", "Tensor", "Tensor", "Bool")
def _step(kernel, beta1, beta2, eps, correction1, root_correction2, lr, weight_decay, param, exp_avg,
          exp_avg_sq, grad, optim_filter):
    """One parameter's bias-corrected AdamW step through the in-place AdamWeightDecay kernel."""
    if optim_filter:
        kernel(param, exp_avg, exp_avg_sq, lr * root_correction2 / correction1, beta1, beta2,
               eps * root_correction2, weight_decay * correction1 / root_correction2,
               ops.cast(grad, param.dtype))
    return True


class GPTLocalAdamW(Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) as in MindFormers, fused per parameter.

    Use it from a YAML with ``optimizer: {type: GPTLocalAdamW, betas: [...], eps: ..., weight_decay: ...}``;
    ``type: AdamW`` stays available as the plain reference path.
    """

    _support_parallel_optimizer = True

    def __init__(self, params, learning_rate=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(learning_rate, params, weight_decay=weight_decay)
        if len(betas) != 2 or not all(0.0 < float(b) < 1.0 for b in betas):
            raise ConfigError(f"optimizer.betas must be two numbers in (0, 1), got {betas!r}; set e.g. "
                              f"betas: [0.9, 0.95].")
        if float(eps) <= 0.0:
            raise ConfigError(f"optimizer.eps must be > 0, got {eps!r}; set e.g. eps: 1.e-8.")
        self.beta1 = Tensor(np.array([betas[0]], np.float32))
        self.beta2 = Tensor(np.array([betas[1]], np.float32))
        self.eps = Tensor(np.array([eps], np.float32))
        self.exp_avg = self._moments("adam_m")
        self.exp_avg_sq = self._moments("adam_v")
        self.kernel = ops.AdamWeightDecay()  # the train step may give it the CPU kernel (use_kernels)
        # the step over the parameters, by how the learning rate and weight decay come (per group or one), and the
        # parallel optimizer's broadcast after it: MindSpore's Optimizer fixes them at build; picked here once
        if self.is_group and self.is_group_lr:
            self.update = self._group_lr_update
        else:
            self.update = self._group_update if self.is_group else self._one_update
        self.share = self._broadcast if self.use_parallel else self._kept

    def use_kernels(self, provider):
        """Runs the update through ``provider``'s choice (``KernelProvider.adamw_update``: on CPU the AdamW kernel,
        one in-place pass a parameter, the same formula; else ``AdamWeightDecay``). Called by the train step
        (``mf/wrapper.py``) with its model's provider, before the step compiles."""
        self.kernel = provider.adamw_update([param.dtype for param in self._parameters])

    def _moments(self, prefix):
        """fp32 zeros shaped like each parameter, sharing its parallel layout (for optimizer sharding)."""
        states = []
        for param in self._parameters:
            state = Parameter(initializer("zeros", param.shape, mstype.float32), name=f"{prefix}.{param.name}")
            state.param_info = param.param_info.clone()
            state.name = f"{prefix}.{param.name}"
            states.append(state)
        return ParameterTuple(states)

    def construct(self, gradients):
        """One step over ``gradients`` (already clipped by the train step)."""
        weight_decay = self.get_weight_decay()
        lr = self.get_lr()
        self.assignadd(self.global_step, self.global_step_increase_tensor)
        step = ops.cast(self.global_step, mstype.float32)
        correction1 = 1.0 - ops.pow(self.beta1, step)
        root_correction2 = ops.sqrt(1.0 - ops.pow(self.beta2, step))
        return self.share(self.update(correction1, root_correction2, lr, weight_decay, gradients))

    def _group_lr_update(self, correction1, root_correction2, lr, weight_decay, gradients):
        """Per-group learning rates and weight decays."""
        return self.hyper_map(ops.partial(_fused_step, self.kernel, self.beta1, self.beta2, self.eps, correction1,
                                          root_correction2), lr, weight_decay, self._parameters, self.exp_avg,
                              self.exp_avg_sq, gradients, self.optim_filter)

    def _group_update(self, correction1, root_correction2, lr, weight_decay, gradients):
        """One learning rate, per-group weight decays."""
        return self.hyper_map(ops.partial(_fused_step, self.kernel, self.beta1, self.beta2, self.eps, correction1,
                                          root_correction2, lr), weight_decay, self._parameters, self.exp_avg,
                              self.exp_avg_sq, gradients, self.optim_filter)

    def _one_update(self, correction1, root_correction2, lr, weight_decay, gradients):
        """One learning rate and weight decay."""
        return self.hyper_map(ops.partial(_fused_step, self.kernel, self.beta1, self.beta2, self.eps, correction1,
                                          root_correction2, lr, weight_decay), self._parameters, self.exp_avg,
                              self.exp_avg_sq, gradients, self.optim_filter)

    def _broadcast(self, result):
        self.broadcast_params(result)
        return result

    def _kept(self, result):
        return result
