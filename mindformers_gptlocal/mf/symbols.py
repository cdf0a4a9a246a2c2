"""Every MindFormers name gpt_local uses, in one table, loaded on first use.

``from ..mf.symbols import MindFormerConfig`` imports MindFormers (when not loaded yet) and hands the name over;
importing this module alone loads nothing. A name that moved between the supported MindFormers versions
(``compat.SUPPORTED``) is listed with each place it lives, tried in order; today every name below
sits in the same module on 1.8 and 1.9. Outside ``mf/`` no module of gpt_local imports MindFormers itself
(``tests/test_import_rules.py``).
"""
import importlib
import sys

# name -> the module(s) that define it, the first that has it wins
WHERE = {
    # configuration and registry
    "MindFormerConfig": ("mindformers.tools.register",),
    "MindFormerRegister": ("mindformers.tools.register",),
    "MindFormerModuleType": ("mindformers.tools.register",),
    "ActionDict": ("mindformers.tools.register",),
    "CONFIG_NAME_TO_CLASS": ("mindformers.tools.register.template",),
    "RunnerConfig": ("mindformers.tools.register.template",),
    "TransformerOpParallelConfig": ("mindformers.modules.transformer.transformer",),
    # small helpers of its launcher
    "parse_value": ("mindformers.tools.utils",),
    "str2bool": ("mindformers.tools.utils",),
    "str2bool_or_str": ("mindformers.tools.utils",),
    "get_output_root_path": ("mindformers.tools.utils",),
    "get_real_rank": ("mindformers.tools.utils",),
    "get_real_group_size": ("mindformers.tools.utils",),
    # the run
    "build_context": ("mindformers.core.context",),
    "set_output_path": ("mindformers.utils.file_utils",),
    "Trainer": ("mindformers.trainer",),
    "build_metric": ("mindformers.core.metric",),
    # training: the step and the checkpoint callback gpt_local subclasses
    "MFTrainOneStepCell": ("mindformers.wrapper.wrapper",),
    "MFPipelineWithLossScaleCell": ("mindformers.wrapper.wrapper",),
    "ClipGradNorm": ("mindformers.core.clip_grad",),
    "apply_global_norm": ("mindformers.core.clip_grad",),
    "CheckpointMonitor": ("mindformers.core.callback.callback",),
    # data
    "BaseInstructDataHandler": ("mindformers.dataset.handler.base_handler",),
    "PreTrainedTokenizerFast": ("mindformers.models.tokenization_utils_fast",),
    "IndexedDatasetBuilder": ("mindformers.dataset.blended_datasets.indexed_dataset",),
    "MegatronIndexReader": ("mindformers.dataset.blended_datasets.indexed_dataset:_IndexReader",),
}
__all__ = sorted(WHERE)


def _import(module_name):
    """``importlib.import_module``; the first import of MindFormers without its import-time log (``logs.py
    quiet_import``: gpt_local imports it on the user's behalf)."""
    if "mindformers" in sys.modules:
        return importlib.import_module(module_name)
    from .logs import quiet_import
    with quiet_import():
        return importlib.import_module(module_name)


def _lookup(name):
    problems = []
    for place in WHERE[name]:
        module_name, _, attr = place.partition(":")
        try:
            module = _import(module_name)
        except ModuleNotFoundError as err:
            if not err.name or not (module_name + ".").startswith(err.name + "."):
                raise  # a module it imports is missing: that error, not ours
            problems.append(f"{module_name} ({err})")
            continue
        if hasattr(module, attr or name):
            return getattr(module, attr or name)
        problems.append(f"{module_name} has no {attr or name}")
    raise ImportError(f"MindFormers' {name} is not where gpt_local looks for it: {'; '.join(problems)}. gpt_local "
                      f"supports the MindFormers versions of compat.SUPPORTED.")


def __getattr__(name):
    if name not in WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (gpt_local's MindFormers names are "
                             f"listed in its WHERE table)")
    return _lookup(name)  # looked up each time: a name a patch replaces (build_context) is the patched one
