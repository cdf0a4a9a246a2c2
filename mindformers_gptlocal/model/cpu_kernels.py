"""Whether gpt_local replaces MindSpore kernels that are slow on CPU, decided when a Cell is built.

On CPU the tanh GeLU (``model/layers.py`` TanhGeLU) and gradient clipping (``training/grad_checks.py``) use
forms several times faster than MindSpore 2.7.2's kernels (`python benchmarks/reduce_kernels.py`), and
Linear's bias and attention's mask are broadcast explicitly before their Add (less peak memory than the
broadcasting Add).
The attention of training, eval and uncached prefill runs gpt_local's fused C++ kernel
(``kernels/``, chosen in ``ParallelAttention.__init__``); LayerNorm and the MLP's bias + GeLU run its C++
kernels (``kernels/norm_gelu.py``, chosen in ``LayerNorm`` and ``ParallelFeedForward``) where
``norm_gelu_kernels()`` says so (``GPTLOCAL_NORM_GELU_KERNELS=0`` keeps MindSpore's ops for these two only); the
Llama-style RMSNorm and SwiGLU's silu(gate) * up run ``kernels/rms_swiglu.py`` where ``rms_swiglu_kernels()``
says so (``GPTLOCAL_RMS_SWIGLU_KERNELS=0`` keeps MindSpore's ops for these two only); Linear's GEMM runs
``kernels/linear.py`` (oneDNN's sgemm) where ``linear_gemm_kernel()`` says so (opt-in: ``GPTLOCAL_LINEAR_KERNEL=1``).
With
``GPTLOCAL_HEAD_LOSS_KERNEL=1`` (opt-in) the training loss runs the fused head + cross-entropy
(``kernels/head_loss.py``, chosen in ``GPTLocalForCausalLM``).
``GPTLOCAL_PLAIN_KERNELS=1`` keeps the plain matmul + softmax attention, MindSpore's GeLU kernel, the broadcasting Add and MindFormers' ClipGradNorm, to compare
against the plain path when debugging; other backends always use them.
"""
import os

import mindspore as ms


def replace_slow_cpu_kernels():
    """True on CPU unless GPTLOCAL_PLAIN_KERNELS is set to something other than 0."""
    return ms.get_context("device_target") == "CPU" and os.environ.get("GPTLOCAL_PLAIN_KERNELS", "0") in ("", "0")


def norm_gelu_kernels():
    """True where LayerNorm and bias + GeLU use gpt_local's CPU kernels: ``replace_slow_cpu_kernels()``, not a
    semi-auto/auto parallel build (its strategies live on MindSpore's primitives) and GPTLOCAL_NORM_GELU_KERNELS
    not 0."""
    if not replace_slow_cpu_kernels() or os.environ.get("GPTLOCAL_NORM_GELU_KERNELS", "1") == "0":
        return False
    from ..parallel.sharding import is_parallel_build  # pylint: disable=import-outside-toplevel
    return not is_parallel_build()


def rms_swiglu_kernels():
    """True where RMSNorm and SwiGLU's silu(gate) * up use gpt_local's CPU kernels: as ``norm_gelu_kernels()``
    (CPU, not GPTLOCAL_PLAIN_KERNELS, not a semi-auto/auto parallel build), with GPTLOCAL_RMS_SWIGLU_KERNELS not 0."""
    if not replace_slow_cpu_kernels() or os.environ.get("GPTLOCAL_RMS_SWIGLU_KERNELS", "1") == "0":
        return False
    from ..parallel.sharding import is_parallel_build  # pylint: disable=import-outside-toplevel
    return not is_parallel_build()


def linear_gemm_kernel():
    """True where Linear's x W^T uses gpt_local's CPU GEMM kernel: opt-in, GPTLOCAL_LINEAR_KERNEL=1 (a busy-machine
    comparison found Llama-style generation 0.82-0.92x with it, a tiny training step 1.85x: off until measured
    quietly, docs/performance.md), on CPU, not GPTLOCAL_PLAIN_KERNELS, not a semi-auto/auto parallel build."""
    if not replace_slow_cpu_kernels() or os.environ.get("GPTLOCAL_LINEAR_KERNEL", "0") != "1":
        return False
    from ..parallel.sharding import is_parallel_build  # pylint: disable=import-outside-toplevel
    return not is_parallel_build()
