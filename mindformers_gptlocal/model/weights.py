"""Model weights in and out: load a safetensors file into a model (strict on names and shapes), refuse a
checkpoint of another size before anything is built, and write model directories
(config.json + model.safetensors + tokenizer files) that ``from_pretrained`` reads.
"""
import json
import os
import shutil

import mindspore as ms
import numpy as np

from ..errors import CheckpointError
from ..safetensors_io import (CONFIG_NAME, TOKENIZER_FILES, WEIGHTS_NAME, SafetensorsReader, atomic_write,
                              resolve_weights_file, tensor_shapes, write_json, write_safetensors)
from ..parallel.layout import Layout
from ..tokenizer_id import write_id
from ..peft import METHODS as PET_METHODS, is_pet_name
from ..peft.lora import is_multi_lora_name
from .params import WORD_EMBEDDINGS, is_weight, layer_of, parameter_table

__all__ = ["WEIGHTS_NAME", "check_matches_config", "load_weights", "save_model_dir", "save_weights"]


def check_matches_config(path, config):
    """Refuse, before anything is built, a checkpoint of another architecture or size than ``config``:
    every tensor of the parameter table that the file holds must have the table's shape."""
    shapes = tensor_shapes(path)
    if WORD_EMBEDDINGS not in shapes:
        raise CheckpointError(f"load_checkpoint {path} is not a gpt_local checkpoint (no "
                              f"{WORD_EMBEDDINGS}; it holds e.g. {sorted(shapes)[:3]}). Convert "
                              f"Hugging Face GPT-2 weights with `gptlocal convert hf2ms`.")
    for name, spec in parameter_table(config, Layout()).items():
        if name in shapes and shapes[name] != spec.shape:
            raise CheckpointError(f"load_checkpoint {path}: tensor '{name}' has shape {shapes[name]} but "
                                  f"model_config implies {spec.shape}; the checkpoint is of another size. Make "
                                  f"model_config match the checkpoint (vocab_size, hidden_size, "
                                  f"max_position_embeddings, intermediate_size).")
    layers = {layer_of(name) for name in shapes} - {None}
    if layers and max(layers) + 1 != config.num_hidden_layers:
        raise CheckpointError(f"load_checkpoint {path} has {max(layers) + 1} layers but model_config."
                              f"num_hidden_layers is {config.num_hidden_layers}; set num_hidden_layers: "
                              f"{max(layers) + 1} or use a matching checkpoint.")


def model_state(tensors, model):
    """Keep the model's own parameters from a checkpoint (drops optimizer state), checking names and shapes.
    ``tensors``: name -> array, or name -> shape tuple (then the kept names map to their shapes)."""
    params = {p.name: p for p in model.get_parameters() if is_weight(p.name)}
    # a LoRA, adapter or prefix model (pet_config) loads its base weights; what the file lacks keeps its init
    missing = [name for name in params if name not in tensors and not is_pet_name(name)
               and not is_multi_lora_name(name)]  # serve --lora's stacks: built from the adapters
    if missing:
        foreign = sorted(tensors)[:3]
        raise CheckpointError(f"checkpoint lacks {len(missing)} of the model's {len(params)} tensors, e.g. "
                              f"'{missing[0]}'; it holds e.g. {foreign}. It is not a gpt_local checkpoint of "
                              f"this architecture (convert Hugging Face weights with `gptlocal convert hf2ms`).")
    for method in PET_METHODS:  # a PEFT method's tensors the model has none of would be ignored: refused
        found = [name for name in tensors if method.owns(name) and name.startswith("model.")]
        if found and not any(method.owns(name) for name in params):
            raise CheckpointError(method.loaded_without(found[0]))
    state = {}
    for name, param in params.items():
        if name not in tensors:
            continue
        array = tensors[name]
        shape = array if isinstance(array, tuple) else tuple(array.shape)
        if shape != tuple(param.shape):
            raise CheckpointError(f"tensor '{name}' has shape {shape} in the checkpoint but "
                                  f"{tuple(param.shape)} in the model; the checkpoint is of another size. Make "
                                  f"model_config match the checkpoint's config.json.")
        state[name] = array
    return state


def check_precision(path, reader, params):
    """Refuse an int8 file (``gptlocal quantize``: int8 tensors and their ``*_scale``, ``quantization.py``) for a
    float model, and a float file for an int8 one, before anything is read: the shapes agree, the numbers would
    not."""
    int8_file = any(reader.header[name]["dtype"] == "I8" for name in reader.names())
    int8_model = any(param.dtype == ms.int8 for param in params.values())
    if int8_file and not int8_model:
        raise CheckpointError(f"{path} holds int8 weights (a `gptlocal quantize` model directory), which are for "
                              f"inference only: load the directory with from_pretrained / --model (its config.json "
                              f"says quantization), or train from the float model directory it was quantized from.")
    if int8_model and not int8_file:
        raise CheckpointError(f"{path} holds float weights but the model is int8 (config quantization); make the "
                              f"int8 directory with `gptlocal quantize --dtype int8`, or drop quantization from its "
                              f"config.json.")


def load_weights(model, path):
    """Load a safetensors checkpoint into ``model`` (strict on names and shapes). Returns the file used.

    Names and shapes are checked from the file's header first; then each tensor is read straight into its
    Parameter's own buffer when the dtypes agree (``asnumpy()`` shares a CPU Parameter's memory), else read
    alone and converted, so the process never holds a second copy of the model (GPT-2 small, fp32: peak
    RSS of building + loading 2,039 -> 1,090 MB, measured). A bfloat16 Parameter (an inference build of a bf16
    model, ``KernelProvider.bf16_weights``) takes a BF16 tensor's bits as stored, a float one rounded to nearest
    even (``SafetensorsReader.read_bf16_into``)."""
    path = resolve_weights_file(path)
    reader = SafetensorsReader(path)
    params = {p.name: p for p in model.get_parameters() if is_weight(p.name)}
    check_precision(path, reader, params)
    names = model_state(reader.shapes(), model)
    for name in names:
        param = params[name]
        if param.dtype == ms.bfloat16:  # an inference build's bf16 weight: its bits (asnumpy shares the memory)
            reader.read_bf16_into(name, param.asnumpy().view(np.uint16))
            continue
        target = param.asnumpy() if param.dtype in (ms.float32, ms.float16, ms.float64, ms.int8) else None
        if target is None or not reader.read_into(name, target):
            param.set_data(ms.Tensor(reader.get(name), param.dtype))
        if param.dtype == ms.int8:
            check_int8_range(path, name, param.asnumpy())
    return path


def check_int8_range(path, name, values):
    """Refuse an int8 weight holding -128: the scheme is symmetric, [-127, 127] (``quantization.quantize_rows``),
    and the int8 GEMM's AVX2 tiles (``maddubs``) are exact only inside it."""
    if values.size and int(values.min()) == -128:
        raise CheckpointError(f"{path}: int8 tensor {name} holds -128, outside gpt_local's symmetric int8 range "
                              f"[-127, 127]; make the directory with `gptlocal quantize --dtype int8`.")


def save_weights(model, path):
    """All model parameters to one safetensors file, written atomically (a bfloat16 Parameter of an inference build,
    ``KernelProvider.bf16_weights``, widened exactly to float32: the writer takes numpy dtypes)."""
    write_safetensors(path, {p.name: p.asnumpy().astype(np.float32) if p.dtype == ms.bfloat16 else p.asnumpy()
                             for p in model.get_parameters() if is_weight(p.name)}, {"format": "gpt_local"})


def save_model_dir(model, out_dir, tokenizer_dir=None):
    """config.json + model.safetensors (+ tokenizer files copied from ``tokenizer_dir``, and their
    ``tokenizer_id``). A ``tokenizer_dir`` that is not a folder is an error, not a model without a tokenizer."""
    if tokenizer_dir and not os.path.isdir(tokenizer_dir):
        raise CheckpointError(f"tokenizer_dir {tokenizer_dir} does not exist, so the model directory {out_dir} "
                              f"would have no tokenizer; point tokenizer_dir at the folder of the tokenizer.json "
                              f"the training data was made with (prepare-data's <out>/model).")
    os.makedirs(out_dir, exist_ok=True)
    if not os.access(out_dir, os.W_OK):
        raise CheckpointError(f"cannot write to {out_dir}; choose a writable output_dir.")
    save_weights(model, os.path.join(out_dir, WEIGHTS_NAME))
    config = model.config.to_dict()
    config.pop("parallel_config", None)
    config = {k: v for k, v in config.items() if _json_ok(v)}
    atomic_write(os.path.join(out_dir, CONFIG_NAME), lambda tmp: write_json(tmp, config))
    if tokenizer_dir and os.path.abspath(tokenizer_dir) != os.path.abspath(out_dir):
        for name in TOKENIZER_FILES:
            source = os.path.join(tokenizer_dir, name)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(out_dir, name))
    write_id(out_dir)
    return out_dir


def _json_ok(value):
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False
