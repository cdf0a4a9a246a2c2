"""The keys the pre-flight sets in a gpt_local run's YAML for MindFormers' trainer, after every check passed.

``preflight`` is the pre-flight of a gpt_local run (``gptlocal run``, and MindFormers' ``build_context`` through
``compat.apply``): the MindFormers patches it needs in place (``compat.require``), every check (``preflight/checks.py``
``check_run``, handed MindFormers' names), then ``rewrite_for_trainer``, once per run. Each rewrite works around what
MindFormers' trainer does with the YAML; the ones that depend on MindFormers' code are listed with the run-time patches
(``compat.PATCHES``: "callbacks told the resume step", "stop_step honoured") and checked
like them:
- ``load_checkpoint`` / ``resume_training``: resolved to the newest complete checkpoint file (``checkpoint.resume``)
  and checked against the model, because single-card MindFormers refuses the ``rank_0`` folder its own
  CheckpointMonitor writes; on many ranks, to the step every rank folder holds;
- the resume step and the global batch handed to gpt_local's callbacks, which the trainer tells only callbacks typed
  exactly ``CheckpointMonitor``, and what the run is, stored with each checkpoint;
- ``runner_config.stop_step`` turned into the callback that stops (MindFormers 1.8 reads it and never stops);
- ``runner_wrapper.compile_cache`` ``on`` for a one-process run that leaves it out (the step graph stored and loaded
  by the next run of the same graph: ``mf/wrapper.py``);
- ``overwrite_output_dir: True``: the earlier run's checkpoint folder and model directories removed (``start_over``),
  so a later resume cannot take its checkpoints for this run's.
"""
import os
import shutil
import time

from ..checkpoint.resume import check_same_run, common_rank_checkpoint, earlier_run, find_resume_checkpoint, run_record
from ..model.weights import check_matches_config
from ..parallel.layout import Layout
from ..parallel.rules import global_batch_size as batch_formula
from ..errors import ConfigError
from ..preflight.checks import check_run
from ..preflight.inputs import OVERWRITE_KEY, model_subdirs
from ..safetensors_io import check_safetensors_only, resolve_weights_file
from . import symbols
from .compat import MODE_KEY, is_gpt_local, require


def preflight(config, log=print):
    """All checks for a gpt_local run, then the keys MindFormers' trainer needs set in its YAML
    (``rewrite_for_trainer``); other models pass through untouched."""
    if not is_gpt_local(config):
        return
    # a MindFormers patch whose target moved stops here, named (mf/compat.py), unless the YAML says warn
    require(config.get(MODE_KEY) or "strict")
    model_config = check_run(config, symbols, log)
    rewrite_for_trainer(config, model_config, log)


def rewrite_for_trainer(config, model_config, log=print):
    """Set the YAML keys MindFormers' trainer needs (module docstring), after the checks: ``model_config`` is the
    run's checked GPTLocalConfig."""
    resolve_checkpoint(config, model_config, log)
    if config.get("load_checkpoint") and not config.get("use_parallel"):
        check_matches_config(config.load_checkpoint, model_config)
    configure_checkpoint_monitor(config, model_config)
    configure_compile_cache(config)
    honor_stop_step(config)
    start_over(config, log)


def resolve_checkpoint(config, model_config, log=print):
    """Single-card MindFormers refuses the rank_0 folder its own CheckpointMonitor writes: load the file."""
    if config.get("resume_training") and config.run_mode in ("train", "finetune"):
        if config.get("use_parallel"):
            resolve_rank_resume(config, model_config, log)
        else:
            resolve_resume(config, model_config, log)
        return
    path = config.get("load_checkpoint")
    if not path or config.get("use_parallel"):
        return
    config.load_checkpoint = resolve_weights_file(path)
    check_safetensors_only(config.load_checkpoint)


def resolve_resume(config, model_config, log=print):
    """Point load_checkpoint at the newest complete checkpoint file (default: <output_dir>/checkpoint) and
    hand its step to our callbacks, which the trainer only tells when they are typed ``CheckpointMonitor``."""
    wanted = config.resume_training if isinstance(config.resume_training, str) else None
    path, info = find_resume_checkpoint(resume_folder(config), wanted, log)
    check_same_run(info.get("run"), this_run(config, model_config), path, info["step_num"])
    log(f"[gptlocal] resuming from {path} (step {info['step_num']})")
    config.load_checkpoint = path
    config.resume_training = True
    _tell_callbacks(config, info)


def resume_folder(config):
    """Where a resumed run's checkpoints are: load_checkpoint when it names checkpoints, else (unset, or the
    model directory a finetune starts from, which holds weights only) ``<output_dir>/checkpoint``."""
    own = os.path.join(config.get("output_dir") or "./output", "checkpoint")
    path = config.get("load_checkpoint")
    if not path or (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))):
        return own
    return path


def resolve_rank_resume(config, model_config, log=print):
    """Many ranks: every rank resumes from the newest step all rank folders hold complete (named by file, so
    MindFormers takes the same step in each rank's folder), after the same checks as one card."""
    path = config.get("load_checkpoint") or os.path.join(config.get("output_dir") or "./output", "checkpoint")
    if not os.path.isdir(path) or not any(name.startswith("rank_") for name in os.listdir(path)):
        return  # not our rank_* layout (e.g. a merged checkpoint): MindFormers' own resume handles it
    wanted = config.resume_training if isinstance(config.resume_training, str) else None
    name, step, info = common_rank_checkpoint(path, _this_rank(), wanted, log)
    check_same_run(info.get("run"), this_run(config, model_config), os.path.join(path, f"rank_{_this_rank()}",
                                                                                  name), step)
    log(f"[gptlocal] rank {_this_rank()} resumes from step {step} ({name} in {path}/rank_*)")
    config.load_checkpoint = path
    config.resume_training = name
    _tell_callbacks(config, info)


def _this_rank():
    """This process's rank before MindSpore's communication is initialised (msrun sets RANK_ID)."""
    for key in ("RANK_ID", "RANK", "MS_NODE_ID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def this_run(config, model_config):
    """``checkpoint.resume.run_record`` of this YAML."""
    return run_record(config, model_config, Layout.of_run_yaml(config), global_batch_size(config))


def _tell_callbacks(config, info):
    step = int(info["step_num"])
    for callback in config.get("callbacks") or []:
        if callback.get("type") == "GPTLocalThroughputMonitor":
            callback["initial_step"] = step
        if callback.get("type") == "GPTLocalCheckpointMonitor":
            callback["append_info"] = [{"epoch_num": int(info.get("epoch_num", 0)), "step_num": step,
                                        "global_step": step, "loss_scale": info.get("loss_scale", 1)}]
            if info.get("run_id"):
                callback["run_id"] = info["run_id"]  # the resumed checkpoints are this run's: rotation may remove them


def start_over(config, log=print):
    """``overwrite_output_dir: True`` on an output_dir holding an earlier run (``check_earlier_run`` let it pass):
    remove that run's checkpoint folder and model directories before anything is written, so its checkpoints
    are never resumed as this run's. Rank 0 removes them all, every other rank its own ``rank_<r>`` folder (its
    disk may be its own); no rank writes a checkpoint before every rank is past its pre-flight (the first save
    follows a step all ranks take)."""
    if not config.get(OVERWRITE_KEY) or config.run_mode not in ("train", "finetune"):
        return
    if os.environ.get("MS_ROLE") == "MS_SCHED":  # msrun's scheduler runs the script too: it is no rank
        return
    out = str(config.get("output_dir") or "./output")
    found = earlier_run(out, model_subdirs(config))
    if found is None:
        return
    rank = _this_rank()
    doomed = [found.checkpoint_dir, *found.model_dirs] if rank == 0 else \
        [os.path.join(found.checkpoint_dir, f"rank_{rank}")]
    doomed = [path for path in doomed if os.path.lexists(path)]
    for path in doomed:
        for _ in range(50):  # another rank may be removing the same folder: its rmdir waits for that one's files
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                break
            time.sleep(0.1)
        else:
            raise ConfigError(f"{OVERWRITE_KEY}: {path} could not be removed (permissions?); remove it yourself "
                              f"or pass a new --output_dir.")
    newest = f" (newest checkpoint: step {found.step})" if found.checkpoint else ""
    if rank == 0:
        log(f"[gptlocal] {OVERWRITE_KEY}: removed the earlier run in {out}{newest}: "
            f"{', '.join(doomed)}; starting over")


def honor_stop_step(config):
    """MindFormers 1.8.0 reads ``runner_config.stop_step`` but never adds the callback that stops: add it.
    It counts the steps of this run (a resumed run counts from its first new step)."""
    stop = (config.get("runner_config") or {}).get("stop_step")
    callbacks = config.get("callbacks") or []
    if isinstance(stop, int) and stop > 0 and not any(c.get("type") == "TrainCallBack" for c in callbacks):
        config.callbacks = list(callbacks) + [{"type": "TrainCallBack", "stop_step": stop}]


def configure_checkpoint_monitor(config, model_config):
    """The trainer passes global_batch_size only to ``CheckpointMonitor``; ours needs it too (resume scaling),
    and what the run is, stored with each checkpoint for the resume check."""
    for callback in config.get("callbacks") or []:
        if callback.get("type") == "GPTLocalCheckpointMonitor":
            if callback.get("global_batch_size") is None:
                callback["global_batch_size"] = global_batch_size(config)
            callback["run_record"] = this_run(config, model_config)


STEP_WRAPPERS = ("GPTLocalTrainOneStepCell", "GPTLocalPipelineWithLossScaleCell")  # mf/wrapper.py


def configure_compile_cache(config):
    """``runner_wrapper.compile_cache`` of a gpt_local step wrapper: ``on`` where the YAML leaves it out and the run
    is one process (``use_parallel`` off), so a run whose step graph was stored before loads it (``mf/wrapper.py``
    ``step_cache``); ``off``, ``on`` or a folder as written (under msrun too: each rank its own graph). A value naming
    a file stops the run here."""
    wrapper = config.get("runner_wrapper")
    if not wrapper or wrapper.get("type") not in STEP_WRAPPERS:
        return
    value = wrapper.get("compile_cache")
    if value is None:
        if not config.get("use_parallel"):
            wrapper["compile_cache"] = "on"
        return
    if isinstance(value, bool):
        wrapper["compile_cache"] = "on" if value else "off"
    elif not isinstance(value, str) or not value.strip():
        raise ConfigError(f"runner_wrapper.compile_cache is {value!r}; give on, off or a folder for the stored step "
                          f"graphs.")
    elif os.path.exists(os.path.expanduser(value)) and not os.path.isdir(os.path.expanduser(value)):
        raise ConfigError(f"runner_wrapper.compile_cache {value!r} is a file; give on, off or a folder for the "
                          f"stored step graphs.")


def global_batch_size(config):
    """``parallel/rules.global_batch_size`` (MindFormers' formula) on the run YAML's values."""
    runner = config.get("runner_config") or {}
    layout = Layout.of_run_yaml(config)
    micro = layout.micro if layout.pp > 1 else 1
    return batch_formula(int(runner.get("batch_size", 1)), int(layout.dp), int(micro),
                         int(runner.get("gradient_accumulation_steps", 1) or 1))


