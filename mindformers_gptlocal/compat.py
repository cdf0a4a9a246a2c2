"""Run gpt_local's pre-flight checks inside MindFormers' own ``run_mindformer.py`` too, and keep a
gpt_local runner_wrapper when MindFormers' trainer swaps wrappers for pipeline parallel.

``run_mindformer.py`` calls ``build_context(config)`` before it builds anything.
At registration we wrap that function (no MindFormers file is edited) so a
gpt_local YAML gets the same early, clear errors, and the switch to the mcore
path, as with our launcher. Other models pass through untouched.
"""
import functools

_CHECKED = set()


def mark_checked(config):
    """The launcher ran the pre-flight already; do not run it twice."""
    _CHECKED.add(id(config))


def _with_preflight(build_context):
    @functools.wraps(build_context)
    def wrapper(config, *args, **kwargs):
        from .preflight import preflight
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


def install():
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
    from mindformers.trainer.base_trainer import BaseTrainer
    for name in ("_reset_wrapper_for_pipeline_parallel", "_reset_wrapper_for_grad_accu"):
        reset = getattr(BaseTrainer, name, None)
        if reset is not None and not getattr(reset, "gptlocal_wrapped", False):
            setattr(BaseTrainer, name, _keeping_gptlocal_wrapper(reset))


def register_auto_classes():
    """MindFormers' AutoConfig / AutoModelForCausalLM resolve model_type gpt_local to our classes."""
    from mindformers import AutoConfig, AutoModelForCausalLM
    from .configuration_gpt_local import GPTLocalConfig
    from .model import GPTLocalForCausalLM
    AutoConfig.register(GPTLocalConfig.model_type, GPTLocalConfig, exist_ok=True)
    AutoModelForCausalLM.register(GPTLocalConfig, GPTLocalForCausalLM, exist_ok=True)
