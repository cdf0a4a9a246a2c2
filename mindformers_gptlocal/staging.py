"""Write a whole output folder or nothing: build it under ``<out>.partial-<pid>``, then rename it.

A failure (or Ctrl-C) removes the partial folder; an older ``out`` is only replaced once the new
one is complete. ``ACTIVE`` holds the partial folders being built in this process and ``committing()`` says whether
one is being renamed into place: ``cli/interrupt.py`` removes the former when it must end the process at once and
waits for the latter.

Every file and folder this package publishes (model directories, prepared data, checkpoints) gets the
permissions the process's umask gives a new one, whatever the writer made (``tempfile`` and the safetensors
writer create 0600, MindSpore's checkpoints 0400, its checkpoint folders 0700): ``publish_file`` and
``write_folder`` set them, fsync, and only then rename, so a crash leaves the old file or the whole new one.
"""
import os
import shutil
import stat
import threading

ACTIVE = set()  # the staging folders (and atomic_write's temporary files) this process is building
_COMMIT = threading.Lock()  # held while a finished folder is renamed into place


def umask():
    """The process's umask, read without changing it (Linux's /proc; elsewhere set and put back at once)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_mode(directory=False, executable=False):
    """The mode the umask gives a new folder (0755 under umask 0022, 0700 under 0077) or file (0644 / 0600)."""
    return (0o777 if directory or executable else 0o666) & ~umask()


def set_new_mode(path, mask=None):
    """Give ``path`` (a file or a folder, not followed if a link) the mode ``new_mode`` says; a file keeps an
    executable bit only if it had one."""
    mask = umask() if mask is None else mask
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return
    wide = 0o777 if stat.S_ISDIR(info.st_mode) or info.st_mode & 0o111 else 0o666
    if stat.S_IMODE(info.st_mode) != wide & ~mask:
        os.chmod(path, wide & ~mask)


def fsync_path(path):
    """Flush a file's or a folder's entry to disk (a folder: its renames)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_file(tmp, path):
    """Move the finished ``tmp`` to ``path`` (same folder): the umask's mode, fsync, rename, fsync the folder."""
    set_new_mode(tmp)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def _publish_tree(folder):
    """The umask's modes on ``folder`` and everything in it, each file flushed, before the folder is renamed."""
    mask = umask()
    for root, _, files in os.walk(folder):  # links to folders are not walked into
        set_new_mode(root, mask)
        for name in files:
            path = os.path.join(root, name)
            set_new_mode(path, mask)
            if not os.path.islink(path):
                fsync_path(path)
    fsync_path(folder)


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
        _publish_tree(staging)
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
    fsync_path(os.path.dirname(out))
    if backup:
        shutil.rmtree(backup, ignore_errors=True)
