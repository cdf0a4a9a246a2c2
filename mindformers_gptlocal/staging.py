"""Write a whole output folder or nothing: build it under ``<out>.partial-<pid>``, then rename it.

A failure (or Ctrl-C) removes the partial folder; an older ``out`` is only replaced once the new
one is complete.
"""
import os
import shutil


def write_folder(out, build, error, overwrite=False, overwrite_flag=None):
    """Run ``build(staging_dir)`` and move the result to ``out``; returns what ``build`` returned.

    ``error`` is the exception class for refusals; ``overwrite_flag`` names the CLI flag that lets
    an existing, non-empty ``out`` be replaced (None: the command has no such flag).
    """
    out = os.path.abspath(out)
    if os.path.exists(out) and os.listdir(out) and not overwrite:
        fix = f"pass {overwrite_flag} to replace it or choose another folder" if overwrite_flag \
            else "choose an empty or new folder"
        raise error(f"--out {out} already holds files; {fix}.")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    if not os.access(parent, os.W_OK):
        raise error(f"--out {out}: cannot write in {parent}; choose a writable folder.")
    staging = f"{out}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        result = build(staging)
        _replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return result


def _replace_dir(staging, out):
    """Move staging into out; an old out is kept until the new one is in place."""
    backup = None
    if os.path.exists(out):
        backup = f"{out}.old-{os.getpid()}"
        os.replace(out, backup)
    os.replace(staging, out)
    if backup:
        shutil.rmtree(backup, ignore_errors=True)
