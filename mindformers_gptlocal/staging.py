"""Write a whole output folder or nothing: build it under ``<out>.partial-<pid>``, then rename it.

A failure (or Ctrl-C) removes the partial folder; an older ``out`` is only replaced once the new
one is complete. ``ACTIVE`` holds the partial folders being built in this process and ``committing()`` says whether
one is being renamed into place: ``cli/interrupt.py`` removes the former when it must end the process at once and
waits for the latter.
"""
import os
import shutil
import threading

ACTIVE = set()  # the staging folders (and atomic_write's temporary files) this process is building
_COMMIT = threading.Lock()  # held while a finished folder is renamed into place


def committing():
    """Whether a finished folder is being renamed into place now (a signal then waits for it)."""
    return _COMMIT.locked()


def remove_active():
    """Remove every staging folder (or file: ``safetensors_io.atomic_write``'s) this process is building (the
    process ends at once after)."""
    for staging in list(ACTIVE):
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)
        elif os.path.lexists(staging):
            try:
                os.remove(staging)
            except OSError:
                pass
        ACTIVE.discard(staging)


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
    ACTIVE.add(staging)
    try:
        os.makedirs(staging)
        result = build(staging)
        with _COMMIT:
            _replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        ACTIVE.discard(staging)
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
