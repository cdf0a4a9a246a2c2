"""Safetensors weights in and out: model directories (config.json + model.safetensors) and
MindFormers training checkpoints (``checkpoint/rank_0/*.safetensors`` with optimizer state).

Writes go to a temporary name and are renamed into place, so a crash never leaves a
half-written file under the final name.
"""
import glob
import json
import os
import re
import shutil
import struct

import numpy as np
import mindspore as ms

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
        raise CheckpointError(f"{path} is not a readable safetensors file: {problem}. Use an earlier checkpoint "
                              f"or re-export it.")
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def check_matches_config(path, config):
    """Refuse, before anything is built, a checkpoint of another architecture or size than ``config``."""
    shapes = tensor_shapes(path)
    hidden = config.hidden_size
    expected = {"model.embedding.word_embeddings": (config.vocab_size, hidden),
                "model.embedding.position_embeddings": (config.max_position_embeddings, hidden),
                "model.layers.0.attention.linear_qkv.weight": (3 * hidden, hidden),
                "model.layers.0.mlp.linear_fc1.weight": (config.intermediate_size, hidden)}
    if "model.embedding.word_embeddings" not in shapes:
        raise CheckpointError(f"load_checkpoint {path} is not a gpt_local checkpoint (no "
                              f"model.embedding.word_embeddings; it holds e.g. {sorted(shapes)[:3]}). Convert "
                              f"Hugging Face GPT-2 weights with `gptlocal convert hf2ms`.")
    for name, shape in expected.items():
        if name in shapes and shapes[name] != shape:
            raise CheckpointError(f"load_checkpoint {path}: tensor '{name}' has shape {shapes[name]} but "
                                  f"model_config implies {shape}; the checkpoint is of another size. Make "
                                  f"model_config match the checkpoint (vocab_size, hidden_size, "
                                  f"max_position_embeddings, intermediate_size).")
    layers = {int(m.group(1)) for m in (re.match(r"model\.layers\.(\d+)\.", k) for k in shapes) if m}
    if layers and max(layers) + 1 != config.num_hidden_layers:
        raise CheckpointError(f"load_checkpoint {path} has {max(layers) + 1} layers but model_config."
                              f"num_hidden_layers is {config.num_hidden_layers}; set num_hidden_layers: "
                              f"{max(layers) + 1} or use a matching checkpoint.")


def read_safetensors(path):
    """name -> numpy array; a truncated or corrupt file raises CheckpointError naming it."""
    from safetensors.numpy import load_file
    try:
        return load_file(path)
    except Exception as err:  # safetensors raises several types for damaged files
        raise CheckpointError(f"{path} is not a readable safetensors file ({err}); it may be truncated or "
                              f"corrupt. Use an earlier checkpoint or re-export it.") from err


def model_state(tensors, model):
    """Keep the model's own parameters from a checkpoint (drops optimizer state), checking names and shapes."""
    params = {p.name: p for p in model.get_parameters()}
    missing = [name for name in params if name not in tensors]
    if missing:
        foreign = sorted(tensors)[:3]
        raise CheckpointError(f"checkpoint lacks {len(missing)} of the model's {len(params)} tensors, e.g. "
                              f"'{missing[0]}'; it holds e.g. {foreign}. It is not a gpt_local checkpoint of "
                              f"this architecture (convert Hugging Face weights with `gptlocal convert hf2ms`).")
    state = {}
    for name, param in params.items():
        array = tensors[name]
        if tuple(array.shape) != tuple(param.shape):
            raise CheckpointError(f"tensor '{name}' has shape {tuple(array.shape)} in the checkpoint but "
                                  f"{tuple(param.shape)} in the model; the checkpoint is of another size. Make "
                                  f"model_config match the checkpoint's config.json.")
        state[name] = array
    return state


def load_weights(model, path):
    """Load a safetensors checkpoint into ``model`` (strict on names and shapes). Returns the file used."""
    path = resolve_weights_file(path)
    state = model_state(read_safetensors(path), model)
    params = {p.name: p for p in model.get_parameters()}
    for name, array in state.items():
        params[name].set_data(ms.Tensor(array, params[name].dtype))
    return path


def _atomic_write(path, write):
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_weights(model, path):
    """All model parameters to one safetensors file, written atomically."""
    from safetensors.numpy import save_file
    tensors = {p.name: np.ascontiguousarray(p.asnumpy()) for p in model.get_parameters()}
    _atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "gpt_local"}))


def save_model_dir(model, out_dir, tokenizer_dir=None):
    """config.json + model.safetensors (+ tokenizer files copied from ``tokenizer_dir``)."""
    os.makedirs(out_dir, exist_ok=True)
    if not os.access(out_dir, os.W_OK):
        raise CheckpointError(f"cannot write to {out_dir}; choose a writable output_dir.")
    save_weights(model, os.path.join(out_dir, WEIGHTS_NAME))
    config = model.config.to_dict()
    config.pop("parallel_config", None)
    config = {k: v for k, v in config.items() if _json_ok(v)}
    _atomic_write(os.path.join(out_dir, CONFIG_NAME),
                  lambda tmp: _write_json(tmp, config))
    if tokenizer_dir and os.path.abspath(tokenizer_dir) != os.path.abspath(out_dir):
        for name in TOKENIZER_FILES:
            source = os.path.join(tokenizer_dir, name)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(out_dir, name))
    return out_dir


def _json_ok(value):
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


def _write_json(path, data):
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
