"""Run gpt_local's pre-flight checks inside MindFormers' own ``run_mindformer.py`` too.

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


def register_auto_classes():
    """MindFormers' AutoConfig / AutoModelForCausalLM resolve model_type gpt_local to our classes."""
    from mindformers import AutoConfig, AutoModelForCausalLM
    from .configuration_gpt_local import GPTLocalConfig
    from .model import GPTLocalForCausalLM
    AutoConfig.register(GPTLocalConfig.model_type, GPTLocalConfig, exist_ok=True)
    AutoModelForCausalLM.register(GPTLocalConfig, GPTLocalForCausalLM, exist_ok=True)
