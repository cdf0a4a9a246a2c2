"""Which checkpoint file a ``resume_training`` run continues from.

Single-card MindFormers refuses the ``checkpoint/rank_0`` folder its own CheckpointMonitor
writes, but resumes exactly from one file. So the pre-flight check turns the folder into
the newest *complete* file: one listed in ``manifest.json`` whose size and SHA-256 still
match (``GPTLocalCheckpointMonitor``), or, in a folder without a manifest (the stock
CheckpointMonitor), the newest file whose safetensors header says it is whole. Temp files
and truncated files are skipped with a note, never resumed from.
"""
import glob
import os

from ..errors import CheckpointError
from ..safetensors_io import safetensors_problem, step_of
from . import manifest as ckpt_manifest

RESUME_KEYS = ("step_num", "epoch_num", "global_batch_size", "loss_scale")


def resume_info(path):
    """step_num, epoch_num, ... stored in a training checkpoint; CheckpointError if it has none."""
    from safetensors import safe_open
    problem = safetensors_problem(path)
    if problem:
        raise CheckpointError(f"resume checkpoint {path}: {problem}. Resume from an earlier checkpoint (point "
                              f"load_checkpoint at its folder to pick the newest complete one).")
    with safe_open(path, framework="numpy") as handle:
        keys = set(handle.keys())
        info = {k: handle.get_tensor(k).item() for k in RESUME_KEYS if k in keys}
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
        log(f"[gpt_local] resume: ignoring unfinished temp file {partial}")
    entries = ckpt_manifest.read_manifest(directory)
    files = [p for p in glob.glob(os.path.join(directory, "*.safetensors"))
             if not os.path.basename(p).startswith(ckpt_manifest.PARTIAL_PREFIX)]
    if entries:
        listed = {e["file"] for e in entries}
        for path in files:
            if os.path.basename(path) not in listed:
                log(f"[gpt_local] resume: ignoring {path}: not recorded as complete in {ckpt_manifest.MANIFEST}")
        for entry in sorted(entries, key=lambda e: e["step"], reverse=True):
            if wanted and entry["file"] != wanted:
                continue
            problem = ckpt_manifest.verify(directory, entry)
            if problem is None:
                return os.path.join(directory, entry["file"])
            log(f"[gpt_local] resume: skipping {entry['file']}: {problem}")
        return None
    for path in sorted(files, key=lambda p: (step_of(p), os.path.getmtime(p)), reverse=True):
        if wanted and os.path.basename(path) != wanted:
            continue
        problem = safetensors_problem(path)
        if problem is None:
            return path
        log(f"[gpt_local] resume: skipping {path}: {problem}")
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
    return _outside_rank_folder(found, log), info


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
        log(f"[gpt_local] resume: single-card MindFormers does not resume from inside {folder}; using {target}")
    return target
