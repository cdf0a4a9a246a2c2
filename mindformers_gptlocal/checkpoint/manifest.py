"""A manifest of complete training checkpoints, so resume never picks a half-written file.

``GPTLocalCheckpointMonitor`` writes each checkpoint to a temporary name, fsyncs it, renames
it into place and only then records it here with its size and SHA-256. The manifest itself
is replaced atomically, so after a crash at any moment it lists only files that were whole.
"""
import hashlib
import json
import os

from ..staging import fsync_path

MANIFEST = "manifest.json"
PARTIAL_PREFIX = "partial-"


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(directory):
    """Entries [{file, step, bytes, sha256}], oldest first; [] when absent or unreadable."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as handle:
            entries = json.load(handle).get("checkpoints", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [e for e in entries if isinstance(e, dict) and {"file", "step", "bytes", "sha256"} <= set(e)]


def write_manifest(directory, entries):
    """Replace the manifest atomically: temp file, fsync, rename, fsync the folder."""
    path = os.path.join(directory, MANIFEST)
    tmp = os.path.join(directory, f"{PARTIAL_PREFIX}{os.getpid()}-{MANIFEST}")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump({"checkpoints": entries}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(directory)


CHECKSUMS = ("sha256", "size")


def record(directory, file_path, step, run=None, checksum="sha256", run_id=None):
    """Add a complete, already renamed checkpoint; drop entries whose files were rotated away.

    ``run`` is what the run was (``checkpoint.resume.run_record``), compared on resume; ``run_id`` which run wrote it
    (a resumed run keeps its checkpoint's: checkpoint rotation removes only that run's files); ``checksum``
    ``size`` records no digest (cheaper for very large files; truncation is still caught)."""
    entry = {"file": os.path.basename(file_path), "step": int(step), "bytes": os.path.getsize(file_path),
             "sha256": sha256_of(file_path) if checksum == "sha256" else None}
    if run:
        entry["run"] = run
    if run_id:
        entry["run_id"] = run_id
    entries = [e for e in read_manifest(directory)
               if e["file"] != entry["file"] and os.path.isfile(os.path.join(directory, e["file"]))]
    write_manifest(directory, entries + [entry])


def forget(directory, names):
    """Drop the entries of ``names`` (files about to be removed): the manifest first, so a crash between the two
    leaves an unlisted file (ignored by resume), never a listed file that is gone."""
    names = set(names)
    write_manifest(directory, [e for e in read_manifest(directory) if e["file"] not in names])


def entry_of(path):
    """The manifest entry of a checkpoint file, or None (no manifest, or the file is not listed)."""
    name = os.path.basename(path)
    return next((e for e in read_manifest(os.path.dirname(path)) if e["file"] == name), None)


def verify(directory, entry):
    """None when the entry's file is whole, else why not."""
    path = os.path.join(directory, entry["file"])
    if not os.path.isfile(path):
        return "file is gone"
    if os.path.getsize(path) != entry["bytes"]:
        return f"size {os.path.getsize(path)} != recorded {entry['bytes']}"
    if entry["sha256"] and sha256_of(path) != entry["sha256"]:
        return "checksum differs from the manifest"
    return None
