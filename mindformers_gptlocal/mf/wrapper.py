"""Train-one-step wrappers whose overflow check runs on every backend.

MindFormers' ``MFTrainOneStepCell`` and ``MFPipelineWithLossScaleCell`` read
overflow from Ascend/GPU float-status kernels that CPU lacks ("Unsupported op
[NPUGetFloatStatusV2] on CPU"). These subclasses keep everything else (gradient
clipping, static or dynamic loss scale, skipping the update on overflow, grad
accumulation and pipeline micro-batches) and, off Ascend, decide overflow with
an ``isfinite`` reduction over the gradients (and their squared norms), all-reduced across
data-parallel ranks. An overflowing step is skipped: weights and optimizer state stay as they were.
"""
import time

from mindspore.ops import functional as F

from ..host_memory import release_freed_heap
from ..kernels.provider import provider_of
from ..training.grad_checks import isfinite_overflow, kernel_non_finite, kernel_square_sum, non_finite, square_sum
from .symbols import (ClipGradNorm, MFTrainOneStepCell, MFPipelineWithLossScaleCell, MindFormerRegister,
                      MindFormerModuleType, apply_global_norm)


class GPTLocalClipGradNorm(ClipGradNorm):
    """MindFormers' ClipGradNorm (same norm, same clipping) with the fast square sums: ``sum_of_squares`` (the CPU
    kernel, ``kernels/cells/train_step.py``), else the two-stage reduction (``training/grad_checks.py``); which one is
    picked here (``square_sums``)."""

    def __init__(self, max_norm=1.0, sum_of_squares=None):
        super().__init__(max_norm=max_norm)
        self.sum_of_squares = sum_of_squares
        self.square_sums = self._two_stage_sums if sum_of_squares is None else self._kernel_sums

    def construct(self, x):
        global_norm = F.sqrt(F.addn(self.square_sums(x)))
        cond = self.greater_equal(global_norm, self.clip_norm)
        global_norm_clip = F.select(cond, global_norm, self.clip_norm)
        clip_x = self.hyper_map(F.partial(apply_global_norm, self.clip_norm, global_norm_clip), x)
        return clip_x, global_norm

    def _two_stage_sums(self, x):
        return self.hyper_map(square_sum, x)

    def _kernel_sums(self, x):
        return self.hyper_map(F.partial(kernel_square_sum, self.sum_of_squares), x)


class TrimAfterCompileMixin:
    """The step's graph through the compile cache (``runner_wrapper.compile_cache``: ``off``, the default here;
    ``on``: ``runtime.graph_cache.default_root()``; or a folder), which the pre-flight turns ``on`` for a
    single-process gpt_local run (``mf/run_yaml.py`` ``configure_compile_cache``): a run of a step graph stored before
    loads it instead of compiling (``runtime/graph_cache.py``: keyed by everything that shapes the graph). Then,
    after the step's first graph compile, the heap the compile freed goes back to the system
    (``host_memory.release_freed_heap``), so the first step's memory does not grow on top of it. ``first_compile``:
    that first compile's (seconds, whether the graph was loaded from the cache), for the progress line to show (None
    before it)."""

    def __init__(self, *args, compile_cache="off", **kwargs):
        super().__init__(*args, **kwargs)
        self.graph_cache = step_cache(compile_cache)
        self.first_compile = None

    def compile(self, *args, **kwargs):
        cache = getattr(self, "graph_cache", None)
        started, hits = time.perf_counter(), cache.hits if cache is not None else 0
        if cache is None:
            compiled = super().compile(*args, **kwargs)
        else:
            compile_graph = super().compile
            compiled = cache.call(self, args, run=lambda: compile_graph(*args, **kwargs))[0]
        if getattr(self, "first_compile", None) is None:  # the step's first compile
            self.first_compile = (time.perf_counter() - started, cache is not None and cache.hits > hits)
            release_freed_heap()
        return compiled


# the auto-parallel context that shapes a rank's step graph beside its Cells (a step cached under msrun)
PARALLEL_CONTEXT = ("parallel_mode", "device_num", "global_rank", "gradients_mean", "full_batch", "pipeline_stages",
                    "enable_parallel_optimizer", "search_mode", "dataset_strategy", "strategy_ckpt_load_file")


def step_cache(setting):
    """The ``GraphCache`` of a training step as ``runner_wrapper.compile_cache`` says, or None: ``off``; or not a
    GRAPH-mode process (PyNative compiles no step graph). Salted with MindFormers' version (its Cells are keyed by
    their code too: ``graph_cache.class_sources``) and, under msrun, the rank and the parallel context: each rank
    stores and loads its own step graph."""
    from importlib.metadata import version
    import mindspore as ms
    from mindspore.communication import GlobalComm
    from ..runtime.graph_cache import GraphCache, store_root
    root = store_root(setting)
    if root is None or ms.get_context("mode") != ms.GRAPH_MODE:
        return None
    salt = {"mindformers": version("mindformers")}
    if GlobalComm.INITED:
        from mindspore.communication import get_group_size, get_rank
        salt.update(rank=get_rank(), ranks=get_group_size(),
                    parallel={key: repr(ms.get_auto_parallel_context(key)) for key in PARALLEL_CONTEXT})
    return GraphCache(root, salt, flag="runner_wrapper.compile_cache")


class IsFiniteOverflowMixin:
    """Overflow = some gradient is not finite; used on CPU and GPU. The gradients' sums of squares (the overflow check's
    and the clip's) and a ``GPTLocalAdamW``'s update run the model's CPU kernels where its provider gives them. The
    model's provider decides each kernel (``provider_of``: ``square_sum``, ``grad_clip``, ``adamw_update``) and
    ``grad_checks.isfinite_overflow`` the check, once here; the overflow check's form is bound here too
    (``overflow_status``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        provider = provider_of(self.network)
        self.use_isfinite_check = isfinite_overflow(provider.device_target)
        # the gradients' sums of squares (overflow check, clip norm): the model's CPU kernel, else None (plain ops)
        self.sum_of_squares = provider.square_sum()
        if getattr(self, "use_clip_grad", False) and provider.grad_clip(self.sum_of_squares):
            self.clip_grad_norm = GPTLocalClipGradNorm(max_norm=float(self.clip_grad_norm.clip_norm.asnumpy()[0]),
                                                       sum_of_squares=self.sum_of_squares)
        if hasattr(self.optimizer, "use_kernels"):  # GPTLocalAdamW: the model's AdamW kernel where it has one
            self.optimizer.use_kernels(provider)
        if not self.use_isfinite_check:
            self.overflow_status = self._float_status_overflow
        else:
            self.overflow_status = self._isfinite_overflow if self.sum_of_squares is None else self._kernel_overflow
        self.across_ranks = self._all_reduce if getattr(self, "is_distributed", False) else self._one_rank

    def get_overflow_status(self, status, compute_output):
        return self.overflow_status(status, compute_output)

    def _float_status_overflow(self, status, compute_output):
        return super().get_overflow_status(status, compute_output)

    def _isfinite_overflow(self, status, compute_output):  # pylint: disable=unused-argument
        return self._get_distributed_overflow_status_on_infnan_mode(non_finite, compute_output)

    def _kernel_overflow(self, status, compute_output):  # pylint: disable=unused-argument
        # as MindSpore's _get_distributed_overflow_status_on_infnan_mode, which cannot take a partial function
        flag_sum = F.reshape(F.addn(self.hyper_map(F.partial(kernel_non_finite, self.sum_of_squares),
                                                   compute_output)), ())
        return self.less_equal(self.base, self.across_ranks(flag_sum))

    def _all_reduce(self, flag_sum):
        return self.allreduce(flag_sum)

    def _one_rank(self, flag_sum):
        return flag_sum


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class GPTLocalTrainOneStepCell(TrimAfterCompileMixin, IsFiniteOverflowMixin, MFTrainOneStepCell):
    """``MFTrainOneStepCell`` that also runs on CPU (set ``runner_wrapper.type: GPTLocalTrainOneStepCell``): its
    step is MindFormers' own, with the overflow check and clip Cell of ``IsFiniteOverflowMixin``."""


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class GPTLocalPipelineWithLossScaleCell(TrimAfterCompileMixin, IsFiniteOverflowMixin,
                                        MFPipelineWithLossScaleCell):
    """``MFPipelineWithLossScaleCell`` with the backend-neutral overflow check, for pipeline parallel."""
