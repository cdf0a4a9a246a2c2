"""Every run-time patch gpt_local makes to MindFormers / MindSpore, in one place, each with a check.

gpt_local edits no MindFormers file. What it changes at run time (a wrapped function, a replaced
attribute, an overridden private method, a YAML rewrite that works around what the trainer does) is
listed in ``PATCHES``: why, the versions it was written for (``WRITTEN_FOR``) and its ``targets``: the
module, attribute, parameter names and the ``self.x = `` assignments it relies on. ``verify()`` runs
at registration and checks every target on the installed MindFormers: a moved, renamed or re-signed
target gives one ``GPTLocalCompatWarning`` naming the patch (registration never breaks
``import mindformers``), the patch is not applied, and the pre-flight of a gpt_local run stops with a
``CompatError`` naming it (``require()``) unless the patch can fall back (``required=False``: a hand-listed barrier
user that moved is covered by the scan of loaded modules). The run YAML's top-level ``gptlocal_compat: warn`` turns
that error into the warning only.

Patches applied here (``apply()``, called by ``registration.register``): the ``build_context`` wrap,
the instruction handler's name, the CPU barrier, the finished-run refusal, the resume from a checkpoint file
(MindFormers 1.9), prefix tuning kept ours, the gpt_local wrapper kept under pipeline / gradient accumulation. The
others live where they are used, checked here like the rest:
``mf/wrapper.py`` (overflow check), ``mf/checkpoint_monitor.py``
(``defer_checkpoint_rotation``, crash-safe writes, the single-card folder), ``mf/run_yaml.py``
(callbacks told the resume step, ``stop_step``), ``mf/model.py`` (the mcore step's count of losses:
``mcore_train_outputs``), the ``.pth`` hook (tensorboardX without torch, BLEU without nltk's package).

This module is the boundary's lowest floor: it imports only ``errors`` (and, in the patch bodies, MindFormers and
MindSpore). What the patches call of the layers above it (the pre-flight, the resume check, the instruction handler,
the prefix-tuning pet_types) is handed to ``apply`` by ``mf/registration.py`` (``Hooks``); the pre-flight
(``run_yaml.preflight``) calls this module (``require``, ``is_gpt_local``), never the reverse.
"""
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys
import warnings
from collections import namedtuple

from ..errors import CompatError, ConfigError, GPTLocalCompatWarning

# the pairs every patch is checked on: the default install first, then the compatibility pair (setup.cfg's
# ``mf18`` extra, docs/mindformers-versions.md)
SUPPORTED = ({"mindformers": "1.9.0", "mindspore": "2.9.0"}, {"mindformers": "1.8.0", "mindspore": "2.7.2"})
WRITTEN_FOR = SUPPORTED[0]
MODE_KEY = "gptlocal_compat"  # the run YAML's top-level key: strict (the default) or warn
MODES = ("strict", "warn")
MODEL_TYPE = "gpt_local"
ARCHITECTURE = "GPTLocalForCausalLM"

Target = namedtuple("Target", "module attr params includes assigns", defaults=(None, None, None, ()))
Target.__doc__ = """What a patch relies on: ``module`` (dotted), ``attr`` (dotted path inside it, None: the module
itself), ``params`` (the exact parameter names of ``inspect.signature``), ``includes`` (names that must be among
them), ``assigns`` (``self.NAME =`` lines the target's source must hold: instance attributes the patch reads)."""


class Patch(namedtuple("Patch", "name where why targets required extra only", defaults=(True, None, None))):
    """One patch: ``extra`` is a further check, ``extra(import_module) -> [problem, ...]``; ``only``: the MindFormers
    versions (``major.minor`` texts) it is made for, None for every supported one (elsewhere it is neither checked
    nor applied)."""

    def applies(self, version=None):
        """Whether this patch is for the installed MindFormers (or ``version``)."""
        if self.only is None:
            return True
        version = version if version is not None else _mindformers_version()
        return ".".join((version or "").split(".")[:2]) in self.only


Hooks = namedtuple("Hooks", "preflight steps_left instruct_handler prefix_types")
Hooks.__doc__ = """What the patches call of the layers above this module, handed to ``apply`` by ``mf/registration.py``
(which imports them): ``preflight(config)`` (``run_yaml.py``: ``preflight/checks.py`` and the trainer's keys),
``steps_left(runner_config, dataset_size, load_checkpoint)`` (``checkpoint/resume.py`` ``check_steps_left``),
``instruct_handler`` (the class MindFormers' HFDataLoader looks up by name, ``mf/data_handler.py``), ``prefix_types``
(the pet_types whose prefix the model builds itself, ``peft/prefix.py``)."""


def is_gpt_local(config):
    """Whether a run YAML is gpt_local's: model_type gpt_local, or our architecture name next to a mistyped
    model_type (the patches leave every other model alone; the pre-flight checks only these)."""
    model = config.get("model") or {}
    model_config = model.get("model_config") if isinstance(model, dict) else None
    if not isinstance(model_config, dict):
        return False
    return model_config.get("model_type") == MODEL_TYPE or ARCHITECTURE in str(model_config.get("architectures"))


def _mindformers_version():
    try:
        return importlib.metadata.version("mindformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def mcore_train_outputs(version=None):
    """How many losses MindFormers' mcore train steps unpack from a model's training ``construct``: 1.8's
    ``MFTrainOneStepCell.grads_for_mcore`` takes ``(lm_loss, mtp_loss, aux_loss)``; 1.9 adds ``indexer_loss``
    (DeepSeek sparse attention's indexer; the pipeline cell takes ``losses[-1]`` as it), four. MindFormers'
    ``GPTLocalForCausalLM`` (``mf/model.py``) returns its loss and zeros for the others (the patch "mcore training
    outputs" checks this number against the installed ``grads_for_mcore``). No MindFormers installed: 1.8's three."""
    version = version if version is not None else _mindformers_version()
    try:
        major_minor = tuple(int(part) for part in (version or "").split(".")[:2])
    except ValueError:
        major_minor = ()
    return 4 if major_minor >= (1, 9) else 3


# the modules that bound MindSpore's ``barrier`` at import (``from mindspore.communication.comm_func import
# barrier``) in MindFormers 1.8.0; any other loaded mindformers module bound to it is found and patched too
BARRIER_USERS = ("mindformers.trainer.utils", "mindformers.version_control", "mindformers.core.callback.callback",
                 "mindformers.utils.load_checkpoint_utils")

WRAPPER = "mindformers.wrapper.wrapper"
CALLBACK = "mindformers.core.callback.callback"
MS_CHECKPOINT = "mindspore.train.callback._checkpoint"
MS_LOSS_SCALE = "mindspore.nn.wrap.loss_scale"
BASE_TRAINER = "mindformers.trainer.base_trainer"


def _mcore_outputs_match(import_module):
    """The losses ``MFTrainOneStepCell.grads_for_mcore`` unpacks from the network (``lm_loss, mtp_loss, ... =
    self.network(*inputs)``) must be as many as gpt_local's training ``construct`` returns
    (``mcore_train_outputs``): one more or one fewer is MindSpore's "TupleGetItem evaluator index"
    error at the first compile, naming no cause."""
    try:
        source = inspect.getsource(import_module(WRAPPER).MFTrainOneStepCell.grads_for_mcore)
    except (ImportError, AttributeError, OSError, TypeError) as err:
        return [f"cannot read MFTrainOneStepCell.grads_for_mcore ({err.__class__.__name__}: {err})"]
    found = re.findall(r"^\s*(lm_loss\s*,[\w\s,*]*?)=\s*self\.network\(\*inputs\)", source, re.M)
    if len(found) != 1 or "*" in found[0]:
        return ["MFTrainOneStepCell.grads_for_mcore no longer unpacks `lm_loss, ... = self.network(*inputs)` "
                "once with named losses"]
    unpacked = len([name for name in found[0].split(",") if name.strip()])
    returned = mcore_train_outputs(_mindformers_version())
    if unpacked != returned:
        return [f"MFTrainOneStepCell.grads_for_mcore unpacks {unpacked} losses ({found[0].strip()}) from the "
                f"network, gpt_local's training construct returns {returned} (mf/compat.py mcore_train_outputs)"]
    return []


def _bleu_needs_only_nltk_util(import_module, nltk_folder=None):
    """nltk.translate.bleu_score must import no nltk module but nltk.util (read from its file: importing it here
    would run nltk's package __init__, what the patch avoids)."""
    del import_module
    if nltk_folder is None:
        try:
            spec = importlib.util.find_spec("nltk")
        except (ImportError, ValueError) as err:
            return [f"nltk cannot be found ({err})"]
        if spec is None or not spec.submodule_search_locations:
            return ["nltk is not installed"]
        nltk_folder = list(spec.submodule_search_locations)[0]
    path = os.path.join(nltk_folder, "translate", "bleu_score.py")
    try:
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
    except OSError as err:
        return [f"nltk.translate.bleu_score cannot be read ({err})"]
    used = sorted(set(re.findall(r"^\s*(?:from|import)\s+(nltk[\w.]*)", source, re.M)) - {"nltk.util"})
    return [f"nltk.translate.bleu_score now imports {', '.join(used)}, not only nltk.util"] if used else []


PATCHES = (
    Patch("build_context pre-flight", "compat._with_preflight",
          "MindFormers' run_mindformer.py calls build_context(config) first; wrapped, a gpt_local YAML gets the "
          "pre-flight checks (and the switch to the mcore path) there too, not only under `gptlocal run`.",
          (Target("mindformers.core.context", "build_context", ("config",)),
           Target("mindformers", "build_context"), Target("mindformers.core", "build_context"))),
    Patch("instruction handler by name", "compat.apply",
          "HFDataLoader looks a YAML handler's `type` up as a name in mindformers.dataset.handler (hasattr / "
          "getattr on the module it imports as custom_process), not in the registry: "
          "GPTLocalInstructHandler is set there.",
          (Target("mindformers.dataset.handler"),
           Target("mindformers.dataset.dataloader.hf_dataloader", "custom_process"))),
    Patch("CPU barrier", "compat._barrier_on_cpu",
          "MindSpore 2.7 has no CPU Barrier kernel (\"Unsupported op [Barrier] on CPU\"); MindFormers calls "
          "barrier() when many ranks load or save a checkpoint, so a data-parallel CPU resume failed. On CPU the "
          "wrapper all-reduces one number over the world group in a one-op graph instead.",
          (Target("mindspore.communication.comm_func", "barrier", ("group",)),
           Target("mindformers.utils.parallel_utils", "comm_func"))),
    Patch("barrier users", "compat._patch_barriers",
          "The MindFormers modules that bound the original barrier at import get the CPU barrier too. A listed "
          "module that no longer binds it is reported; every loaded mindformers module that binds it is patched.",
          tuple(Target(name, "barrier") for name in BARRIER_USERS), False),
    Patch("finished run refused", "compat._refusing_finished_runs",
          "After the trainer sets epochs, sink size and the resume step, a resumed gpt_local run with no step left "
          "fails with one clear error instead of MindSpore's \"epoch must bigger than initial_epoch\".",
          (Target(BASE_TRAINER, "check_runner_config", ("config", "dataset")),)),
    Patch("gpt_local wrapper kept", "compat._keeping_gptlocal_wrapper",
          "Under pipeline parallel or gradient accumulation the trainer replaces any runner_wrapper with "
          "MFPipelineWithLossScaleCell (no CPU overflow check); a YAML that chose a gpt_local wrapper gets "
          "GPTLocalPipelineWithLossScaleCell instead.",
          (Target(BASE_TRAINER, "BaseTrainer._reset_wrapper_for_pipeline_parallel", ("self",)),
           Target(BASE_TRAINER, "BaseTrainer._reset_wrapper_for_grad_accu", ("self", "gradient_accumulation_steps")),
           Target(BASE_TRAINER, "BaseTrainer.__init__", assigns=("config",)))),
    Patch("isfinite overflow check", "mf/wrapper.py IsFiniteOverflowMixin",
          "MFTrainOneStepCell / MFPipelineWithLossScaleCell read overflow from Ascend/GPU float-status kernels CPU "
          "lacks (\"Unsupported op [NPUGetFloatStatusV2] on CPU\"); off Ascend, overflow is an isfinite reduction "
          "through MindSpore's private _get_distributed_overflow_status_on_infnan_mode (or, with the sum-of-squares "
          "kernel, the same steps on its attributes); the clip Cell is swapped.",
          (Target(WRAPPER, "MFTrainOneStepCell.get_overflow_status", ("self", "status", "compute_output")),
           Target(WRAPPER, "MFPipelineWithLossScaleCell.get_overflow_status", ("self", "status", "compute_output")),
           Target(WRAPPER, "MFTrainOneStepCell._get_distributed_overflow_status_on_infnan_mode",
                  ("self", "grad_overflow_check_func", "compute_output")),
           Target(MS_LOSS_SCALE, "TrainOneStepWithLossScaleCell.__init__",
                  assigns=("hyper_map", "base", "less_equal", "allreduce", "is_distributed")),
           Target(WRAPPER, "MFTrainOneStepCell.__init__", assigns=("use_clip_grad", "clip_grad_norm")))),
    Patch("mcore training outputs", "mf/compat.py mcore_train_outputs, GPTLocalForCausalLM.construct",
          "MindFormers' mcore train steps unpack a fixed tuple of losses from the model (1.8: lm, mtp, aux; 1.9 adds "
          "the sparse-attention indexer loss); gpt_local returns its loss and as many zeros as the installed step "
          "unpacks.",
          (Target(WRAPPER, "MFTrainOneStepCell.grads_for_mcore", ("self", "scaling_sens", "inputs")),),
          True, _mcore_outputs_match),
    Patch("resume from a checkpoint file", "compat._resuming_from_a_file",
          "MindFormers 1.9's Trainer.train migrates load_checkpoint / resume_training into checkpoint_config and asks "
          "is_hf_checkpoint(load_path), which raises for a path that is not a folder (\"checkpoint_path is not a "
          "directory\"); gpt_local's resume names the newest checkpoint file. For a gpt_local config, a file is "
          "answered \"not a HuggingFace checkpoint\" during that check, and the legacy loader reads it as on 1.8.",
          (Target("mindformers.trainer.trainer", "convert_checkpoint_config", ("config",)),
           Target("mindformers.trainer.utils", "is_hf_checkpoint", ("checkpoint_path",)),
           Target("mindformers.trainer.utils", "validate_checkpoint_config", ("ckpt_config",))),
          True, None, ("1.9",)),
    Patch("deferred checkpoint rotation", "mf/checkpoint_monitor.py (defer_checkpoint_rotation)",
          "keep_checkpoint_max: the stock monitor deletes the oldest file in the folder (any run's) before writing "
          "the next; the private CheckpointManager.remove_oldest_ckpoint_file of the monitor's _manager is replaced "
          "so the deletion waits until the new file is whole and takes only this run's oldest (manifest run_id), "
          "and remove_ckpoint_file (keep_checkpoint_per_n_minutes) so it removes only this run's files.",
          (Target(MS_CHECKPOINT, "CheckpointManager.remove_oldest_ckpoint_file", ("self",)),
           Target(MS_CHECKPOINT, "CheckpointManager.remove_ckpoint_file", ("self", "file_name")),
           Target(MS_CHECKPOINT, "ModelCheckpoint.__init__", assigns=("_manager",)))),
    Patch("crash-safe checkpoint writes", "mf/checkpoint_monitor.py GPTLocalCheckpointMonitor",
          "CheckpointMonitor.remove_redundancy is where a checkpoint file is written: overridden to write a temp "
          "name, fsync, rename and record it; record_last_ckpt_to_json names the file actually written; a "
          "single-card run's _directory / meta_json lose the rank_0 level (single-card resume refuses it).",
          (Target(CALLBACK, "CheckpointMonitor.remove_redundancy",
                  ("self", "network", "cur_file", "append_dict", "train_network")),
           Target(CALLBACK, "CheckpointMonitor.record_last_ckpt_to_json", ("self", "epoch", "step", "ckpt_file")),
           Target(CALLBACK, "CheckpointMonitor.__init__", includes=("checkpoint_format", "async_save"),
                  assigns=("meta_json",)),
           Target(MS_CHECKPOINT, "ModelCheckpoint.__init__", assigns=("_directory", "_prefix", "_config")))),
    Patch("callbacks told the resume step", "mf/run_yaml.py _tell_callbacks, configure_checkpoint_monitor",
          "The trainer hands append_info (the resume step) and global_batch_size only to callbacks typed exactly "
          "CheckpointMonitor; the pre-flight writes them into the gpt_local callbacks' YAML entries.",
          (Target(CALLBACK, "CheckpointMonitor.__init__", includes=("append_info", "global_batch_size")),)),
    Patch("stop_step honoured", "mf/run_yaml.py honor_stop_step",
          "MindFormers 1.8.0 reads runner_config.stop_step but never adds the callback that stops; the pre-flight "
          "adds TrainCallBack(stop_step).",
          (Target(CALLBACK, "TrainCallBack.__init__", ("self", "stop_step")),)),
    Patch("prefix tuning kept ours", "compat._keeping_gptlocal_prefix",
          "build_network hands a model with pet_config to mindformers.pet.get_pet_model, whose PrefixTuning / "
          "Ptuning2 models read attributes gpt_local's config lacks and pass prefix_keys_values our model does not "
          "take; a gpt_local model with pet_type prefixtuning / ptuning2 already holds its prefix (peft/prefix.py) "
          "and is returned as it is.",
          (Target("mindformers.pet", "get_pet_model", ("base_model", "config")),
           Target("mindformers.models.build_model", "build_network", ("config", "default_args")))),
    Patch("tensorboardX without torch", "mindformers_gptlocal_autoregister.import_tensorboardx_without_torch",
          "MindFormers imports tensorboardX at start-up, whose writer tries `import torch`: the .pth hook imports "
          "it first with torch hidden (RSS after import mindformers 944 -> 716 MB where torch is installed).",
          (Target("tensorboardX", "SummaryWriter"),), False),
    Patch("BLEU without nltk's package", "mindformers_gptlocal_autoregister.import_bleu_without_nltk",
          "MindFormers' metric module imports nltk.translate.bleu_score at start-up, which runs nltk's package "
          "__init__ (about a fifth of import mindformers); the .pth hook loads that one module under bare nltk "
          "packages, then forgets them, so MindFormers holds sentence_bleu and a later `import nltk` is the whole "
          "package.",
          (Target("mindformers.core.metric.metric", "sentence_bleu"),
           Target("mindformers.core.metric.metric", "SmoothingFunction")), False, _bleu_needs_only_nltk_util),
)
BY_NAME = {patch.name: patch for patch in PATCHES}
_STATE = {"problems": None, "warned": False}


def _resolve(target, import_module):
    """(object, None) or (None, problem)."""
    try:
        obj = import_module(target.module)
    except ImportError as err:
        return None, f"module {target.module} cannot be imported ({err})"
    for part in (target.attr or "").split(".") if target.attr else ():
        if not hasattr(obj, part):
            return None, f"{target.module}.{target.attr} is gone ({part!r} not found)"
        obj = getattr(obj, part)
    return obj, None


def check_target(target, import_module=importlib.import_module):
    """The problems of one target: missing, another signature, an instance attribute no longer assigned."""
    obj, problem = _resolve(target, import_module)
    if problem:
        return [problem]
    name = f"{target.module}.{target.attr}" if target.attr else target.module
    problems = []
    if target.params is not None or target.includes:
        try:
            params = list(inspect.signature(obj).parameters)
        except (TypeError, ValueError) as err:
            return [f"{name} has no readable signature ({err})"]
        if target.params is not None and params != list(target.params):
            problems.append(f"{name} takes ({', '.join(params)}), written for ({', '.join(target.params)})")
        missing = [p for p in target.includes or () if p not in params]
        if missing:
            problems.append(f"{name} no longer takes {', '.join(missing)}")
    if target.assigns:
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError) as err:
            return problems + [f"{name}: source not readable, cannot check {', '.join(target.assigns)} ({err})"]
        gone = [a for a in target.assigns if not re.search(rf"self\.{re.escape(a)}\s*(:[^=]*)?=(?!=)", source)]
        if gone:
            problems.append(f"{name} no longer sets {', '.join('self.' + a for a in gone)}")
    return problems


def check_patch(patch, import_module=importlib.import_module):
    """The problems of one patch (empty: every target is where and what it was written for)."""
    problems = [p for target in patch.targets for p in check_target(target, import_module)]
    if patch.extra is not None:
        problems += patch.extra(import_module)
    return problems


def check_all(import_module=importlib.import_module):
    """{patch name: [problem, ...]} for the patches whose targets moved; {} when all check out."""
    found = {}
    for patch in PATCHES:
        if not patch.applies():
            continue
        problems = check_patch(patch, import_module)
        if problems:
            found[patch.name] = problems
    return found


def supported_text():
    """'mindformers 1.9.0 + mindspore 2.9.0 (or 1.8.0 + 2.7.2)'."""
    others = " or ".join(f"{pair['mindformers']} + {pair['mindspore']}" for pair in SUPPORTED[1:])
    return (f"mindformers {WRITTEN_FOR['mindformers']} + mindspore {WRITTEN_FOR['mindspore']}" +
            (f" (or {others})" if others else ""))


def installed_versions():
    versions = {}
    for name in WRITTEN_FOR:
        module = sys.modules.get(name)
        versions[name] = getattr(module, "__version__", "?") if module is not None else "not loaded"
    return versions


def message(name, problems):
    patch = BY_NAME[name]
    versions = installed_versions()
    fallback = ("gpt_local falls back to the unpatched behaviour" if not patch.required else
                "the patch is not applied and a gpt_local run stops at its pre-flight")
    return (f"gpt_local's MindFormers patch '{name}' ({patch.where}) was written for {supported_text()}; on "
            f"mindformers {versions['mindformers']} + mindspore {versions['mindspore']} its target moved: "
            f"{'; '.join(problems)}. "
            f"{fallback}. Use mindformers=={WRITTEN_FOR['mindformers']} mindspore=={WRITTEN_FOR['mindspore']}, or "
            f"update this patch in mindformers_gptlocal/mf/compat.py.")


def verify():
    """Check every patch once per process; one GPTLocalCompatWarning per patch whose target moved. Returns
    the problems ({} when all check out)."""
    if _STATE["problems"] is None:
        _STATE["problems"] = check_all()
    if not _STATE["warned"]:
        _STATE["warned"] = True
        for name, problems in _STATE["problems"].items():
            warnings.warn(message(name, problems), GPTLocalCompatWarning, stacklevel=2)
    return _STATE["problems"]


def ok(name):
    """Whether the patch ``name`` checked out here (verify() runs first if it has not)."""
    return name not in verify()


def require(mode="strict"):
    """For a gpt_local run (the pre-flight, with the run YAML's ``gptlocal_compat``): one CompatError naming every
    required patch whose target moved; ``mode`` warn keeps it to the registration warning."""
    if mode not in MODES:
        raise ConfigError(f"{MODE_KEY}: {mode!r} is not a mode; use strict (the default: a MindFormers patch whose "
                          f"target moved stops the run) or warn (it is only a warning).")
    failed = {n: p for n, p in verify().items() if BY_NAME[n].required}
    if failed and mode != "warn":
        raise CompatError(" | ".join(message(n, p) for n, p in failed.items()) +
                          f" (set `{MODE_KEY}: warn` at the run YAML's top level to run anyway)")


def defer_checkpoint_rotation(manager, deferred, method="remove_oldest_ckpoint_file"):
    """Replace ``manager.<method>`` (``remove_oldest_ckpoint_file``, or ``remove_ckpoint_file``) by ``deferred``;
    returns the original. A manager without it is one CompatError naming the patch (assigning would silently add
    an attribute nobody calls)."""
    original = getattr(manager, method, None)
    if not callable(original):
        raise CompatError(message("deferred checkpoint rotation",
                                  [f"{type(manager).__name__} has no {method}"]))
    setattr(manager, method, deferred)
    return original


# --- the patches applied at registration -----------------------------------------------------------------

_CHECKED = set()


def mark_checked(config):
    """The launcher ran the pre-flight already; do not run it twice."""
    _CHECKED.add(id(config))


def _with_preflight(build_context, preflight):
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


def _keeping_gptlocal_prefix(get_pet_model, prefix_types):
    """``get_pet_model(base_model, config)`` returning a gpt_local model with a prefix-tuning pet_config (a pet_type
    of ``prefix_types``) as it is (its prefix is built and the base frozen in ``GPTLocalForCausalLM.__init__``);
    anything else goes on to MindFormers' PetModel."""
    @functools.wraps(get_pet_model)
    def wrapper(base_model, config, *args, **kwargs):
        pet_type = config.get("pet_type") if hasattr(config, "get") else getattr(config, "pet_type", None)
        if pet_type in prefix_types and getattr(getattr(base_model, "config", None), "model_type", None) == \
                MODEL_TYPE:
            return base_model
        return get_pet_model(base_model, config, *args, **kwargs)
    wrapper.gptlocal_wrapped = True
    return wrapper


def _resuming_from_a_file(convert_checkpoint_config):
    """``convert_checkpoint_config(config)`` (MindFormers 1.9) with ``mindformers.trainer.utils.is_hf_checkpoint``
    answering False for an existing file while it runs, for a gpt_local config only: a single file is not a
    HuggingFace checkpoint folder, the one thing that check refuses to resume from."""
    @functools.wraps(convert_checkpoint_config)
    def wrapper(config, *args, **kwargs):
        if not is_gpt_local(config):
            return convert_checkpoint_config(config, *args, **kwargs)
        utils = sys.modules[convert_checkpoint_config.__module__]
        original = utils.is_hf_checkpoint

        def file_is_not_hf(checkpoint_path, *rest, **more):
            if checkpoint_path and os.path.isfile(checkpoint_path):
                return False
            return original(checkpoint_path, *rest, **more)
        utils.is_hf_checkpoint = file_is_not_hf
        try:
            return convert_checkpoint_config(config, *args, **kwargs)
        finally:
            utils.is_hf_checkpoint = original
    wrapper.gptlocal_wrapped = True
    return wrapper


def _refusing_finished_runs(check_runner_config, steps_left):
    """After MindFormers sets epochs, sink size and the resume step: a resumed gpt_local run with no step
    left fails here, before the network is built (``steps_left``: ``checkpoint.resume.check_steps_left``)."""
    @functools.wraps(check_runner_config)
    def wrapper(config, dataset, *args, **kwargs):
        result = check_runner_config(config, dataset, *args, **kwargs)
        if is_gpt_local(config) and config.get("resume_training"):
            steps_left(config.runner_config, dataset.get_dataset_size(), config.get("load_checkpoint"))
        return result
    wrapper.gptlocal_wrapped = True
    return wrapper


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


def barrier_bound_modules(barrier):
    """Names of the loaded mindformers modules whose ``barrier`` is ``barrier``."""
    return sorted(name for name, module in list(sys.modules.items())
                  if module is not None and (name == "mindformers" or name.startswith("mindformers."))
                  and getattr(module, "barrier", None) is barrier)


def _patch_barriers():
    from mindspore.communication import comm_func
    if getattr(comm_func.barrier, "gptlocal_wrapped", False):
        return
    original = comm_func.barrier
    wrapped = _barrier_on_cpu(original)
    comm_func.barrier = wrapped  # barrier_world calls comm_func.barrier()
    for name in BARRIER_USERS:  # loaded now, so the scan below patches them (a moved one was reported)
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    for name in barrier_bound_modules(original):
        sys.modules[name].barrier = wrapped


def apply(hooks):
    """The patches made at registration (idempotent), each only where its check passed; ``hooks`` (``Hooks``):
    what they call of the layers above this module."""
    verify()
    import mindformers
    if ok("build_context pre-flight"):
        import mindformers.core
        import mindformers.core.context
        original = mindformers.core.context.build_context
        if not getattr(original, "gptlocal_wrapped", False):
            wrapped = _with_preflight(original, hooks.preflight)
            for module in (mindformers, mindformers.core, mindformers.core.context):
                if getattr(module, "build_context", None) is original:
                    module.build_context = wrapped
    if ok("instruction handler by name"):
        import mindformers.dataset.handler as handlers
        setattr(handlers, hooks.instruct_handler.__name__, hooks.instruct_handler)
    if ok("CPU barrier"):
        _patch_barriers()
    if ok("finished run refused"):
        from mindformers.trainer import base_trainer
        if not getattr(base_trainer.check_runner_config, "gptlocal_wrapped", False):
            base_trainer.check_runner_config = _refusing_finished_runs(base_trainer.check_runner_config,
                                                                       hooks.steps_left)
    if BY_NAME["resume from a checkpoint file"].applies() and ok("resume from a checkpoint file"):
        from mindformers.trainer import trainer
        if not getattr(trainer.convert_checkpoint_config, "gptlocal_wrapped", False):
            trainer.convert_checkpoint_config = _resuming_from_a_file(trainer.convert_checkpoint_config)
    if ok("prefix tuning kept ours"):
        import mindformers.pet
        if not getattr(mindformers.pet.get_pet_model, "gptlocal_wrapped", False):
            mindformers.pet.get_pet_model = _keeping_gptlocal_prefix(mindformers.pet.get_pet_model,
                                                                     hooks.prefix_types)
    if ok("gpt_local wrapper kept"):
        from mindformers.trainer.base_trainer import BaseTrainer
        for name in ("_reset_wrapper_for_pipeline_parallel", "_reset_wrapper_for_grad_accu"):
            reset = getattr(BaseTrainer, name)
            if not getattr(reset, "gptlocal_wrapped", False):
                setattr(BaseTrainer, name, _keeping_gptlocal_wrapper(reset))
