"""Safetensors files: finding the weights file a path stands for, reading headers and tensors, checking a
file is whole, and atomic writes. Knows nothing of the model (``model/weights.py`` does the loading).

Writes go to a temporary name and are renamed into place, so a crash never leaves a
half-written file under the final name.
"""
import glob
import json
import os
import re
import struct

from .errors import CheckpointError

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json")


def step_of(path):
    """(epoch, step) from a name like prefix_rank_0-1_20.safetensors, for ordering."""
    numbers = re.findall(r"(\d+)", os.path.basename(path))
    return tuple(int(n) for n in numbers[-2:]) if numbers else (0,)


def resolve_weights_file(path):
    """The one safetensors file ``path`` stands for: the file itself, a model directory's
    model.safetensors, or the newest checkpoint in a MindFormers checkpoint folder (``rank_0`` too)."""
    if not path or not os.path.exists(path):
        raise CheckpointError(f"load_checkpoint {path!r} does not exist; give a .safetensors file, a model "
                              f"directory or a training checkpoint folder.")
    if os.path.isfile(path):
        return path
    direct = os.path.join(path, WEIGHTS_NAME)
    if os.path.isfile(direct):
        return direct
    candidates = []
    for pattern in ("*.safetensors", "rank_0/*.safetensors", "checkpoint/rank_0/*.safetensors"):
        candidates += [p for p in glob.glob(os.path.join(path, pattern))
                       if not os.path.basename(p).startswith("partial-")]  # unfinished writes
    if not candidates:
        raise CheckpointError(f"load_checkpoint {path}: no .safetensors file inside (looked for {WEIGHTS_NAME}, "
                              f"*.safetensors and rank_0/*.safetensors).")
    return max(candidates, key=lambda p: (step_of(p), os.path.getmtime(p)))


class HeaderPastEnd(ValueError):
    """The 8-byte header length points past the end of the file."""


def read_header(path):
    """(header length, header dict) of a safetensors file, reading only the header. HeaderPastEnd,
    another ValueError, OSError or struct.error when the file cannot be one."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > os.path.getsize(path) - 8:
            raise HeaderPastEnd("header runs past the end of the file (truncated or not safetensors)")
        return length, json.loads(handle.read(length))


def _inspect(path):
    """(problem or None, header or None): the header is readable and its tensors end exactly at the file's end."""
    try:
        length, header = read_header(path)
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except HeaderPastEnd as err:
        return str(err), None
    except (OSError, struct.error, ValueError, TypeError, KeyError, AttributeError) as err:
        return f"unreadable safetensors header ({err.__class__.__name__})", None
    size = os.path.getsize(path)
    if 8 + length + max(ends, default=0) != size:
        return f"{size} bytes but the header describes {8 + length + max(ends, default=0)} (truncated or padded)", None
    return None, header


def safetensors_problem(path):
    """None when the safetensors header is readable and its tensors end exactly at the file's end (no data read)."""
    return _inspect(path)[0]


def tensor_shapes(path):
    """name -> shape from a safetensors header; CheckpointError naming the file if it is damaged."""
    problem, header = _inspect(path)
    if problem:
        raise CheckpointError(f"{path} is not a readable safetensors file: {problem}; it may be truncated or "
                              f"corrupt. Use an earlier checkpoint or re-export it.")
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def read_safetensors(path):
    """name -> numpy array; a truncated or corrupt file raises CheckpointError naming it."""
    from safetensors.numpy import load_file
    try:
        return load_file(path)
    except Exception as err:  # safetensors raises several types for damaged files
        raise CheckpointError(f"{path} is not a readable safetensors file ({err}); it may be truncated or "
                              f"corrupt. Use an earlier checkpoint or re-export it.") from err


def atomic_write(path, write):
    """``write(tmp)`` then rename tmp to ``path``: a crash never leaves a half-written file under ``path``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path, data):
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
