"""Whether gpt_local replaces MindSpore kernels that are slow on CPU, decided when a Cell is built.

On CPU the tanh GeLU (``model/layers.py`` TanhGeLU) and gradient clipping (``training/grad_checks.py``) use
forms several times faster than MindSpore 2.7.2's kernels (`python benchmarks/reduce_kernels.py`), and
Linear's bias and attention's mask are broadcast explicitly before their Add (less peak memory than the
broadcasting Add).
The attention of training, eval and uncached prefill runs gpt_local's fused C++ kernel
(``kernels/``, chosen in ``ParallelAttention.__init__``); with ``GPTLOCAL_HEAD_LOSS_KERNEL=1`` (opt-in) the
training loss runs the fused head + cross-entropy (``kernels/head_loss.py``, chosen in ``GPTLocalForCausalLM``).
``GPTLOCAL_PLAIN_KERNELS=1`` keeps the plain matmul + softmax attention, MindSpore's GeLU kernel, the broadcasting Add and MindFormers' ClipGradNorm, to compare
against the plain path when debugging; other backends always use them.
"""
import os

import mindspore as ms


def replace_slow_cpu_kernels():
    """True on CPU unless GPTLOCAL_PLAIN_KERNELS is set to something other than 0."""
    return ms.get_context("device_target") == "CPU" and os.environ.get("GPTLOCAL_PLAIN_KERNELS", "0") in ("", "0")
