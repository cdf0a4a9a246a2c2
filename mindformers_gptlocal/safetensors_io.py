"""The one home of weight-file I/O: finding the weights file a path stands for, reading safetensors
headers and tensors (one reader, one dtype table, one "not a readable file" error), checking a file is
whole, writing safetensors (whole dicts through the ``safetensors`` library, or streamed tensor by tensor)
and atomic writes. Knows nothing of the model (``model/weights.py`` loads a model, ``checkpoint/`` converts).

Reading is our own plain file reads rather than ``safetensors.numpy``: numpy has no bfloat16 (the library
refuses BF16 tensors; we widen them to float32 exactly), the library memory-maps the whole file (its pages
count against the process's RSS; a converter's peak stays near the largest tensor here), and a model's
Parameters are read into in place (no second copy). No torch, no MindSpore: lean processes import it.

Writes go to a temporary name and are renamed into place, so a crash never leaves a
half-written file under the final name.
"""
import glob
import json
import os
import re
import struct

import numpy as np

from .errors import CheckpointError
from .staging import ACTIVE, publish_file

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
    """(problem or None, header length, header or None): the header is readable and its tensors end exactly at
    the file's end."""
    try:
        length, header = read_header(path)
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except HeaderPastEnd as err:
        return str(err), 0, None
    except (OSError, struct.error, ValueError, TypeError, KeyError, AttributeError) as err:
        return f"unreadable safetensors header ({err.__class__.__name__})", 0, None
    size = os.path.getsize(path)
    if 8 + length + max(ends, default=0) != size:
        return (f"{size} bytes but the header describes {8 + length + max(ends, default=0)} (truncated or padded)",
                0, None)
    return None, length, header


def safetensors_problem(path):
    """None when the safetensors header is readable and its tensors end exactly at the file's end (no data read)."""
    return _inspect(path)[0]


def unreadable(path, detail):
    """The one error for a file that is not a readable safetensors file (``detail`` says what is wrong)."""
    return CheckpointError(f"{path} is not a readable safetensors file: {detail}; it may be truncated or "
                           f"corrupt. Use an earlier checkpoint or re-export it.")


def tensor_shapes(path):
    """name -> shape from a safetensors header; CheckpointError naming the file if it is damaged."""
    return SafetensorsReader(path).shapes()


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".npy", ".npz")


def check_safetensors_only(path, key="load_checkpoint"):
    """Weights load from safetensors only: pickle-based formats can run code when loaded."""
    if path and os.path.isfile(path) and path.lower().endswith(PICKLE_SUFFIXES):
        raise CheckpointError(f"{key} {path} is a pickle-based file; gpt_local loads safetensors only, because "
                              f"unpickling a file can run arbitrary code. Convert it once with `gptlocal convert "
                              f"hf2ms --allow-pickle` if you trust it.")


# safetensors dtype -> numpy dtype of the stored bytes. BF16 (numpy has none) is stored as its upper 16 bits
# and read widened to float32 exactly (``SafetensorsReader.get``) or as those bits (``read_bf16_into``: a bfloat16
# Parameter's memory); written only by ``write_safetensors_streamed`` from those bits (a plan entry of dtype
# "BF16": ``gptlocal quantize --dtype bfloat16``; ``to_bfloat16_bits``).
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
          "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
WRITABLE = {np.dtype(v): k for k, v in DTYPES.items() if k != "BF16"}


def to_bfloat16_bits(array):
    """float32 -> the upper 16 bits of its bfloat16 rounding (nearest, ties to even), as uint16 (NaN kept NaN)."""
    array = np.ascontiguousarray(array, np.float32)
    bits = array.view(np.uint32)  # uint32 sums wrap only for NaN bit patterns, replaced below
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(array), np.uint16(0x7FC0), rounded)


BF16_BLOCK = 1 << 20  # float32 values read and rounded at a time into a bfloat16 Parameter (read_bf16_into)


class SafetensorsReader:
    """One safetensors file, read one tensor at a time with plain file reads (no mmap), so the file's pages
    never count against this process's memory. The header is checked whole at construction (the tensors end
    exactly at the file's end), else ``unreadable``."""

    def __init__(self, path):
        self.path = path
        problem, length, header = _inspect(path)
        if problem:
            raise unreadable(path, problem)
        self.data_start = 8 + length
        header.pop("__metadata__", None)
        self.header = header

    def names(self):
        return list(self.header)

    def shape(self, name):
        return tuple(self.header[name]["shape"])

    def shapes(self):
        return {name: self.shape(name) for name in self.header}

    def _stored(self, name):
        info = self.header[name]
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor '{name}' has dtype {info['dtype']}, which is not supported "
                                  f"(supported: {', '.join(DTYPES)}).")
        return info, np.dtype(dtype)

    def _read(self, name, info, into=None):
        start, stop = info["data_offsets"]
        with open(self.path, "rb") as handle:
            handle.seek(self.data_start + start)
            if into is None:
                raw = handle.read(stop - start)
                got = len(raw)
            else:
                got = handle.readinto(into)
        if got != stop - start:
            raise unreadable(self.path, f"tensor '{name}' ends early")
        return raw if into is None else None

    def get(self, name):
        """The tensor as a writable numpy array of its stored dtype (BF16 widened to float32 exactly)."""
        info, dtype = self._stored(name)
        array = np.frombuffer(self._read(name, info), dtype=dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":
            return (array.astype(np.uint32) << 16).view(np.float32)
        return array.copy()

    def read_into(self, name, target):
        """Read the tensor straight into numpy array ``target``'s memory when it has the stored dtype and shape
        and is C-contiguous; True when done, False when the caller must ``get`` and convert."""
        info, dtype = self._stored(name)
        if (info["dtype"] == "BF16" or target.dtype != dtype or tuple(target.shape) != self.shape(name)
                or not target.flags["C_CONTIGUOUS"] or not target.flags["WRITEABLE"]):
            return False
        self._read(name, info, memoryview(target).cast("B"))
        return True

    def read_bf16_into(self, name, bits):
        """The tensor as bfloat16 bits into the uint16 array ``bits`` (a bfloat16 Parameter's memory, same shape):
        a BF16 tensor read straight in, an F32 one read and rounded to nearest even (``to_bfloat16_bits``) in blocks
        of ``BF16_BLOCK`` values (the rounding's temporaries stay small: a whole 32,000 x 768 head read at once took
        ~300 MB of them at its peak), any other read whole and rounded."""
        info, _ = self._stored(name)
        if info["dtype"] == "BF16" and bits.flags["C_CONTIGUOUS"]:
            self._read(name, info, memoryview(bits).cast("B"))
        elif info["dtype"] == "F32" and bits.flags["C_CONTIGUOUS"]:
            flat = bits.reshape(-1)
            with open(self.path, "rb") as handle:
                handle.seek(self.data_start + info["data_offsets"][0])
                for begin in range(0, flat.size, BF16_BLOCK):
                    block = np.empty(min(BF16_BLOCK, flat.size - begin), np.float32)
                    if handle.readinto(memoryview(block).cast("B")) != block.nbytes:
                        raise unreadable(self.path, f"tensor '{name}' ends early")
                    flat[begin:begin + block.size] = to_bfloat16_bits(block)
        else:
            bits[...] = to_bfloat16_bits(self.get(name))


def read_safetensors(path):
    """name -> numpy array of a whole file; a truncated or corrupt file raises ``unreadable``."""
    reader = SafetensorsReader(path)
    return {name: reader.get(name) for name in reader.names()}


def write_safetensors(path, tensors, metadata=None):
    """name -> array to one safetensors file (the ``safetensors`` library's layout), written atomically."""
    from safetensors.numpy import save_file
    tensors = {name: np.asarray(array, order="C") for name, array in tensors.items()}  # 0-d stays 0-d
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def write_safetensors_streamed(path, plan, metadata=None):
    """Write safetensors from ``plan``: list of (name, shape, dtype, produce) where produce() returns
    the array. Only one tensor is in memory at a time. dtype "BF16": produce() returns the bfloat16 bits (uint16)."""
    header, offset = {}, 0
    plan = [(name, shape, np.uint16 if dtype == "BF16" else dtype, produce, dtype == "BF16")
            for name, shape, dtype, produce in plan]
    for name, shape, dtype, _, bf16 in plan:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": "BF16" if bf16 else WRITABLE[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)))
        handle.write(blob)
        for name, shape, dtype, produce, _ in plan:
            array = np.asarray(produce(), dtype=dtype, order="C")
            if tuple(array.shape) != tuple(shape):
                raise CheckpointError(f"tensor '{name}' came out {array.shape}, expected {tuple(shape)}.")
            handle.write(array.tobytes())


def atomic_write(path, write):
    """``write(tmp)`` then rename tmp to ``path``: a crash never leaves a half-written file under ``path``, and the
    file has the mode the umask gives a new one (the safetensors writer creates 0600; ``staging.publish_file``).
    The temporary file is in ``staging.ACTIVE``: removed too if a signal ends the process at once."""
    tmp = f"{path}.tmp-{os.getpid()}"
    ACTIVE.add(tmp)
    try:
        write(tmp)
        publish_file(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
        ACTIVE.discard(tmp)


def write_json(path, data):
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
