"""Which checkpoint file a ``resume_training`` run continues from.

Single-card MindFormers refuses the ``checkpoint/rank_0`` folder its own CheckpointMonitor
writes, but resumes exactly from one file. So the pre-flight check turns the folder into
the newest *complete* file: one listed in ``manifest.json`` whose size and SHA-256 still
match (``GPTLocalCheckpointMonitor``), or, in a folder without a manifest (the stock
CheckpointMonitor), the newest file whose safetensors header says it is whole. Temp files
and truncated files are skipped with a note, never resumed from.

It also refuses resumes that would go silently wrong: a run already at its last step
(``check_steps_left``), a YAML that changed what the run is since the checkpoint was written
(``check_same_run`` against the ``run_record`` stored with each manifest entry), and, with many
ranks, rank folders without a complete checkpoint at one common step (``common_rank_checkpoint``).

``earlier_run`` tells what a training run already left in an ``output_dir`` (its newest checkpoint and step, its
model directories), from the files alone, so every rank of a launch decides the same: the pre-flight refuses to
start a new run over it unless the YAML says ``overwrite_output_dir: True`` (``preflight/inputs.py``).
"""
import glob
import os
from collections import namedtuple

from ..errors import CheckpointError
from ..safetensors_io import SafetensorsReader, safetensors_problem, step_of
from . import manifest as ckpt_manifest

RESUME_KEYS = ("step_num", "epoch_num", "global_batch_size", "loss_scale")
CHECKPOINT_SUFFIXES = (".safetensors", ".ckpt")


def resume_info(path):
    """step_num, epoch_num, ... stored in a training checkpoint; CheckpointError if it has none."""
    problem = safetensors_problem(path)
    if problem:
        raise CheckpointError(f"resume checkpoint {path}: {problem}. Resume from an earlier checkpoint (point "
                              f"load_checkpoint at its folder to pick the newest complete one).")
    reader = SafetensorsReader(path)
    info = {k: reader.get(k).item() for k in RESUME_KEYS if k in reader.names()}
    if "step_num" not in info:
        raise CheckpointError(f"resume checkpoint {path} holds weights only (no step_num / optimizer state), so "
                              f"training cannot resume from it. Use it as load_checkpoint without resume_training, "
                              f"or resume from a folder written by GPTLocalCheckpointMonitor.")
    return info


def _candidate_dirs(path):
    dirs = [path, os.path.join(path, "rank_0"), os.path.join(path, "checkpoint", "rank_0")]
    return [d for d in dirs if os.path.isdir(d)]


def _newest_in(directory, wanted, log):
    """Newest complete checkpoint file in one folder, or None; notes each file it passes over."""
    for partial in glob.glob(os.path.join(directory, ckpt_manifest.PARTIAL_PREFIX + "*")):
        log(f"[gptlocal] resume: ignoring unfinished temp file {partial}")
    entries = ckpt_manifest.read_manifest(directory)
    files = [p for p in glob.glob(os.path.join(directory, "*.safetensors"))
             if not os.path.basename(p).startswith(ckpt_manifest.PARTIAL_PREFIX)]
    if entries:
        listed = {e["file"] for e in entries}
        for path in files:
            if os.path.basename(path) not in listed:
                log(f"[gptlocal] resume: ignoring {path}: not recorded as complete in {ckpt_manifest.MANIFEST}")
        for entry in sorted(entries, key=lambda e: e["step"], reverse=True):
            if wanted and entry["file"] != wanted:
                continue
            problem = ckpt_manifest.verify(directory, entry)
            if problem is None:
                return os.path.join(directory, entry["file"])
            log(f"[gptlocal] resume: skipping {entry['file']}: {problem}")
        return None
    for path in sorted(files, key=lambda p: (step_of(p), os.path.getmtime(p)), reverse=True):
        if wanted and os.path.basename(path) != wanted:
            continue
        problem = safetensors_problem(path)
        if problem is None:
            return path
        log(f"[gptlocal] resume: skipping {path}: {problem}")
    return None


def find_resume_checkpoint(path, wanted=None, log=print):
    """(file, info) to resume from: ``path`` itself if a file, else the newest complete one under it.

    ``wanted`` is a file name (``resume_training: NAME``) to pick instead of the newest.
    """
    if wanted and not wanted.endswith(".safetensors"):
        wanted += ".safetensors"
    if path and os.path.isfile(path):
        return _outside_rank_folder(path, log), resume_info(path)
    found = None
    for directory in _candidate_dirs(path) if path else []:
        found = _newest_in(directory, wanted, log)
        if found:
            break
    if not found:
        what = f"checkpoint {wanted!r}" if wanted else "complete checkpoint"
        raise CheckpointError(f"resume_training: no {what} under {path!r} (looked in it, rank_0/ and "
                              f"checkpoint/rank_0/). Train without resume_training first, or set load_checkpoint "
                              f"to the folder or .safetensors file of the run to continue.")
    info = resume_info(found)
    _with_entry(info, ckpt_manifest.entry_of(found))
    return _outside_rank_folder(found, log), info


def _with_entry(info, entry):
    """What the manifest stored with the checkpoint: the run record (``check_same_run``) and the run's id (the
    resumed run's checkpoints are the same run's: rotation may remove them, ``mf/checkpoint_monitor.py``)."""
    for key in ("run", "run_id"):
        if entry and entry.get(key):
            info[key] = entry[key]


def _outside_rank_folder(path, log):
    """Single-card MindFormers refuses a file whose folder is rank_*: hard-link it one level up (no copy)."""
    folder = os.path.dirname(path)
    if not os.path.basename(folder).startswith("rank_"):
        return path
    target = os.path.join(os.path.dirname(folder), os.path.basename(path))
    if not os.path.exists(target):
        try:
            os.link(path, target)
        except OSError:
            import shutil
            shutil.copyfile(path, target)
        log(f"[gptlocal] resume: single-card MindFormers does not resume from inside {folder}; using {target}")
    return target


# --- refusing resumes that would go wrong ------------------------------------------------------------------------

def run_record(config, model_config, layout, global_batch_size):
    """What a training run is, as dotted YAML keys -> values: stored with each checkpoint in the manifest and
    compared on resume. A change of any of these makes the resumed steps differ from the run that was saved."""
    record = {f"model.model_config.{key}": getattr(model_config, key)
              for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "intermediate_size", "seq_length")}
    runner = config.get("runner_config") or {}
    record["runner_config.batch_size"] = int(runner.get("batch_size", 1))
    record["global batch size"] = int(global_batch_size)
    record.update({"parallel_config.data_parallel": layout.dp, "parallel_config.model_parallel": layout.mp,
                   "parallel_config.pipeline_stage": layout.pp})
    loader = ((config.get("train_dataset") or {}).get("data_loader")) or {}
    record["train_dataset.data_loader.type"] = loader.get("type")
    inner = loader.get("config") or {}
    for key in ("dataset_dir", "data_path", "path", "data_files"):
        where, value = (("", loader.get(key)) if loader.get(key) is not None else ("config.", inner.get(key)))
        if value is not None:
            record[f"train_dataset.data_loader.{where}{key}"] = _paths(value)
    return record


def _paths(value):
    """Data locations compared by the file they name, so ./data and /abs/data are the same place."""
    if isinstance(value, (list, tuple)):
        return [_paths(v) for v in value]
    if isinstance(value, str) and os.path.exists(value):
        return os.path.realpath(value)
    return value


def check_same_run(recorded, current, checkpoint, step):
    """CheckpointError naming every key whose value differs from the run that wrote ``checkpoint``."""
    if not recorded:
        return
    changed = [(key, recorded[key], current.get(key)) for key in recorded
               if key in current and _plain(current[key]) != _plain(recorded[key])]
    if not changed:
        return
    keys = "; ".join(f"{key} is {new!r} now but was {old!r}" for key, old, new in changed)
    raise CheckpointError(
        f"resume_training: {keys} when {checkpoint} (step {step}) was saved. Resuming would silently continue a "
        f"different run. Put {'it' if len(changed) == 1 else 'them'} back to the saved value"
        f"{'' if len(changed) == 1 else 's'}, or start a new run in a new output_dir (load_checkpoint "
        f"without resume_training takes the weights only).")


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def check_steps_left(runner_config, data_size, checkpoint=None):
    """After MindFormers' ``check_runner_config``: a resumed run with no step left would end in MindSpore's
    "epoch must bigger than initial_epoch"; say what happened instead."""
    per_epoch = runner_config.sink_size if runner_config.sink_mode and runner_config.sink_size > 0 else data_size
    total = int(runner_config.epochs) * int(per_epoch)
    done = int(runner_config.initial_step or 0)
    if done >= total:
        where = f" ({checkpoint})" if checkpoint else ""
        raise CheckpointError(f"training already complete at step {done} of {total}{where}; raise "
                              f"runner_config.epochs or pass a new output_dir")


def common_rank_checkpoint(path, rank, wanted=None, log=print):
    """(file name for rank 0, step, info) that every rank folder ``path/rank_*`` holds complete, for a
    many-rank resume; ``rank`` is this process's rank, whose folder must be there.

    MindFormers resumes each rank from its own folder's newest file; after a worker was killed, ranks can
    stop at different steps, and each would resume from a different one. Here all take the newest step
    that every rank has whole (``resume_training: NAME``, which MindFormers maps to each rank's file)."""
    folders = sorted(glob.glob(os.path.join(path, "rank_*")), key=lambda d: int(d.rsplit("_", 1)[1])
                     if d.rsplit("_", 1)[1].isdigit() else -1)
    own = os.path.join(path, f"rank_{rank}")
    if not os.path.isdir(own):
        raise CheckpointError(f"resume_training: rank {rank} has no checkpoint folder {own}; every rank needs its "
                              f"own. Resume with the same number of processes and output_dir as the saved run.")
    steps = {}
    for folder in folders:
        complete = {}
        for entry in ckpt_manifest.read_manifest(folder):
            problem = ckpt_manifest.verify(folder, entry)
            if problem is None:
                complete[entry["step"]] = entry
            else:
                log(f"[gptlocal] resume: skipping {os.path.join(folder, entry['file'])}: {problem}")
        steps[folder] = complete
    if wanted:
        step = step_of(wanted)[-1]
        for folder, complete in steps.items():
            if step not in complete:
                raise CheckpointError(f"resume_training: rank {folder.rsplit('_', 1)[1]} has no complete checkpoint "
                                      f"at step {step} ({folder}); resume from a step every rank saved.")
    else:
        common = set.intersection(*(set(c) for c in steps.values())) if steps else set()
        if not common:
            newest = {folder.rsplit("_", 1)[1]: max(c) if c else None for folder, c in steps.items()}
            raise CheckpointError(f"resume_training: the rank folders under {path} share no complete checkpoint "
                                  f"step (newest per rank: {newest}); resume needs one step every rank saved. "
                                  f"Start a new run, or copy matching checkpoints back.")
        step = max(common)
        for folder, complete in steps.items():
            if max(complete) != step:
                log(f"[gptlocal] resume: rank {folder.rsplit('_', 1)[1]} has a newer checkpoint (step "
                    f"{max(complete)}) than all ranks share; every rank resumes from step {step}")
    entry = steps[own][step]
    info = resume_info(os.path.join(own, entry["file"]))
    _with_entry(info, entry)
    return entry["file"], step, info


# --- what an earlier run left in an output_dir -------------------------------------------------------------------

EarlierRun = namedtuple("EarlierRun", "checkpoint_dir checkpoint step model_dirs")
EarlierRun.__doc__ = """What a training run left in an output_dir: ``checkpoint_dir`` (``<output_dir>/checkpoint``),
``checkpoint`` (its newest checkpoint file, None if none) and that file's ``step``, ``model_dirs`` (the model
directories GPTLocalSaveModelDir wrote, each non-empty)."""


def earlier_run(output_dir, model_subdirs=("model",)):
    """The ``EarlierRun`` in ``output_dir``, or None when it holds no checkpoint and no model directory. Decided
    from the files alone (no clock, no rank), so every rank of a launch sees the same before any writes."""
    folder = os.path.join(output_dir, "checkpoint")
    found = []  # (step, file)
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        listed = {e["file"]: e["step"] for e in ckpt_manifest.read_manifest(root)}
        for name in sorted(names):
            if name.endswith(CHECKPOINT_SUFFIXES) and not name.startswith(ckpt_manifest.PARTIAL_PREFIX):
                found.append((listed.get(name, step_of(name)[-1]), os.path.join(root, name)))
    models = [os.path.join(output_dir, sub) for sub in dict.fromkeys(model_subdirs)
              if os.path.isdir(os.path.join(output_dir, sub)) and os.listdir(os.path.join(output_dir, sub))]
    if not found and not models:
        return None
    step = max(item[0] for item in found) if found else None
    newest = min(path for s, path in found if s == step) if found else None  # a tie: rank_0's, as the walk sorts
    return EarlierRun(folder, newest, step, models)
