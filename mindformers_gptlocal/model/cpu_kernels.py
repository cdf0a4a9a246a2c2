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
``kernels/linear.py`` (oneDNN's sgemm) where ``linear_gemm_kernel()`` says so (by default in inference graphs of
at least ``LINEAR_GEMM_ROWS`` rows; ``GPTLOCAL_LINEAR_KERNEL=1`` every graph, ``=0`` none).
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


# From 16 rows of a graph's [T, in] input the GEMM kernel beat MatMul at all of GPT-2 small's Linear shapes and the
# head, wall and CPU (MindSpore's CPU MatMul steps up there); below, its wall time was not reliably shorter
# (benchmarks/linear_rows.py, docs/performance.md "Linear's GEMM kernel by row count")
LINEAR_GEMM_ROWS = 16
HEAD_GEMM_ROWS = 16


def linear_gemm_kernel(head=False):
    """From how many rows (of a compiled graph's static [T, in] input) Linear's x W^T (``head``: the output head's)
    uses gpt_local's CPU GEMM kernel: ``LINEAR_GEMM_ROWS`` (``HEAD_GEMM_ROWS``) in inference graphs by default,
    where it measured faster (docs/performance.md "Linear's GEMM kernel by row count"): prefill and eval graphs,
    not the few-row decode step, not training (issue 24 kept MatMul there); 0 in every graph, training too, with
    GPTLOCAL_LINEAR_KERNEL=1; None (MatMul always) with GPTLOCAL_LINEAR_KERNEL=0, off CPU, with
    GPTLOCAL_PLAIN_KERNELS, in a semi-auto/auto parallel build."""
    mode = os.environ.get("GPTLOCAL_LINEAR_KERNEL", "")
    if mode not in ("", "auto", "0", "1"):
        from ..errors import ConfigError  # pylint: disable=import-outside-toplevel
        raise ConfigError(f"GPTLOCAL_LINEAR_KERNEL={mode!r} is not a setting: leave it unset or auto (the GEMM kernel "
                          "in inference graphs of many rows), 1 (every graph, training too) or 0 (MatMul only)")
    if mode == "0" or not replace_slow_cpu_kernels():
        return None
    from ..parallel.sharding import is_parallel_build  # pylint: disable=import-outside-toplevel
    if is_parallel_build():
        return None
    if mode == "1":
        return 0
    return HEAD_GEMM_ROWS if head else LINEAR_GEMM_ROWS
