"""What makes MindFormers know gpt_local: ``register()``, run once per process.

It is called by the ``.pth`` hook right after ``import mindformers`` (``mindformers_gptlocal_autoregister``),
by ``import mindformers_gptlocal`` when MindFormers is already loaded, and before the first heavy
name (``GPTLocalForCausalLM`` ...) is handed out. It

1. imports the modules whose classes carry MindFormers' register decorators (config, model,
   train wrappers, optimizer, callbacks, metric, checkpoint monitor, tokenizer, instruction data handler);
   the config and the model also register themselves with AutoConfig / AutoModelForCausalLM where they
   are defined; the handler is also set on ``mindformers.dataset.handler``, where HFDataLoader looks;
2. wraps MindFormers' ``build_context`` so a gpt_local YAML gets our pre-flight checks (and the
   switch to the mcore path) inside MindFormers' own ``run_mindformer.py`` too;
3. keeps a gpt_local runner_wrapper when MindFormers' trainer swaps wrappers for pipeline
   parallel or gradient accumulation;
4. gives MindFormers a barrier on CPU (MindSpore has no Barrier kernel there; MindFormers calls it
   when many ranks load or save a checkpoint, so a data-parallel CPU resume failed);
5. wraps the trainer's ``check_runner_config`` so resuming a run that has no step left is one
   clear error instead of MindSpore's "epoch must bigger than initial_epoch".

No MindFormers file is edited; other models pass through untouched.
"""
import functools
import importlib

from .preflight.checks import is_gpt_local, preflight

# modules whose classes MindFormers finds by name (YAML ``type:`` / ``model_type``)
REGISTERED_MODULES = ("training.wrapper", "training.optim", "training.callbacks", "training.metrics",
                      "checkpoint.monitor", "data.mindformers_tokenizer", "data.mindformers_handler", "model.config",
                      "model.gpt")
_STATE = {"done": False}

_CHECKED = set()


def mark_checked(config):
    """The launcher ran the pre-flight already; do not run it twice."""
    _CHECKED.add(id(config))


def _with_preflight(build_context):
    @functools.wraps(build_context)
    def wrapper(config, *args, **kwargs):
        if id(config) not in _CHECKED:
            preflight(config)
            _CHECKED.add(id(config))
        return build_context(config, *args, **kwargs)
    wrapper.gptlocal_wrapped = True
    return wrapper


GPTLOCAL_WRAPPERS = ("GPTLocalTrainOneStepCell", "GPTLocalPipelineWithLossScaleCell")


def _keeping_gptlocal_wrapper(reset):
    """MindFormers' trainer replaces any runner_wrapper with MFPipelineWithLossScaleCell under pipeline
    parallel or gradient accumulation (base_trainer ``_reset_wrapper_for_pipeline_parallel`` /
    ``_reset_wrapper_for_grad_accu``). Ours is that class with a backend-neutral overflow check, so a
    YAML that chose a gpt_local wrapper gets GPTLocalPipelineWithLossScaleCell instead (same
    micro_batch_num and calculate_per_token_loss the trainer sets); other wrappers are untouched."""
    @functools.wraps(reset)
    def wrapper(self, *args, **kwargs):
        wrapper_config = getattr(self.config, "runner_wrapper", None)
        chosen = getattr(wrapper_config, "type", None) if wrapper_config is not None else None
        result = reset(self, *args, **kwargs)
        if chosen in GPTLOCAL_WRAPPERS:
            self.config.runner_wrapper.type = "GPTLocalPipelineWithLossScaleCell"
        return result
    wrapper.gptlocal_wrapped = True
    return wrapper


def _refusing_finished_runs(check_runner_config):
    """After MindFormers sets epochs, sink size and the resume step: a resumed gpt_local run with no step
    left fails here, before the network is built (``checkpoint.resume.check_steps_left``)."""
    @functools.wraps(check_runner_config)
    def wrapper(config, dataset, *args, **kwargs):
        result = check_runner_config(config, dataset, *args, **kwargs)
        if is_gpt_local(config) and config.get("resume_training"):
            from .checkpoint.resume import check_steps_left
            check_steps_left(config.runner_config, dataset.get_dataset_size(), config.get("load_checkpoint"))
        return result
    wrapper.gptlocal_wrapped = True
    return wrapper


# modules that bound MindSpore's ``barrier`` at import (``from mindspore.communication.comm_func import barrier``)
BARRIER_USERS = ("mindformers.trainer.utils", "mindformers.version_control", "mindformers.core.callback.callback",
                 "mindformers.utils.load_checkpoint_utils")


def _barrier_on_cpu(barrier):
    """MindSpore 2.7 has no CPU kernel for Barrier ("Unsupported op [Barrier] on CPU"); an all-reduce of one
    number over the world group waits for every rank just the same. CPU collectives run it only inside a
    compiled graph (the functional ``all_reduce`` fails there too), hence the one-op Cell."""
    state = {}

    @functools.wraps(barrier)
    def wrapper(*args, **kwargs):
        import mindspore as ms
        if ms.get_context("device_target") != "CPU":
            return barrier(*args, **kwargs)
        if "cell" not in state:
            from mindspore import nn, ops

            class AllReduceOne(nn.Cell):
                def __init__(self):
                    super().__init__()
                    self.all_reduce = ops.AllReduce()

                def construct(self, x):
                    return self.all_reduce(x)
            state["cell"] = AllReduceOne()
        return state["cell"](ms.Tensor([1.0], ms.float32)).asnumpy()
    wrapper.gptlocal_wrapped = True
    return wrapper


def _patch_barriers():
    import sys
    from mindspore.communication import comm_func
    if getattr(comm_func.barrier, "gptlocal_wrapped", False):
        return
    original = comm_func.barrier
    wrapped = _barrier_on_cpu(original)
    comm_func.barrier = wrapped  # barrier_world calls comm_func.barrier()
    for name in BARRIER_USERS:
        module = sys.modules.get(name) or importlib.import_module(name)
        if getattr(module, "barrier", None) is original:
            module.barrier = wrapped


def register():
    """Register gpt_local with MindFormers (idempotent). Imports MindFormers if it is not loaded yet."""
    if _STATE["done"]:
        return
    _STATE["done"] = True
    import mindformers  # noqa: F401  (with the .pth hook installed, this may re-enter register(): it returns)
    for name in REGISTERED_MODULES:
        # a module of ours may be importing right now (it imported mindformers first, which fired the hook):
        # import_module then returns it half-built, and its decorators run when it finishes
        importlib.import_module(f"{__package__}.{name}")
    _patch_mindformers()


def _patch_mindformers():
    import mindformers
    import mindformers.core
    import mindformers.core.context
    original = mindformers.core.context.build_context
    if getattr(original, "gptlocal_wrapped", False):
        return
    wrapped = _with_preflight(original)
    for module in (mindformers, mindformers.core, mindformers.core.context):
        if getattr(module, "build_context", None) is original:
            module.build_context = wrapped
    # HFDataLoader looks a YAML handler's `type` up as a name in this module, not in the registry
    import mindformers.dataset.handler as handlers
    from .data.mindformers_handler import GPTLocalInstructHandler
    handlers.GPTLocalInstructHandler = GPTLocalInstructHandler
    _patch_barriers()
    from mindformers.trainer import base_trainer
    if not getattr(base_trainer.check_runner_config, "gptlocal_wrapped", False):
        base_trainer.check_runner_config = _refusing_finished_runs(base_trainer.check_runner_config)
    from mindformers.trainer.base_trainer import BaseTrainer
    for name in ("_reset_wrapper_for_pipeline_parallel", "_reset_wrapper_for_grad_accu"):
        reset = getattr(BaseTrainer, name, None)
        if reset is not None and not getattr(reset, "gptlocal_wrapped", False):
            setattr(BaseTrainer, name, _keeping_gptlocal_wrapper(reset))
