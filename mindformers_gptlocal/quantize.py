"""``gptlocal quantize``: a gpt_local model directory -> an inference model directory in int8 or bfloat16.

``quantize_model(model_dir, out_dir, dtype)`` reads the float model tensor by tensor and writes, all at once
(``staging.write_folder``: a temporary folder renamed at the end, nothing left behind on an error):

- ``dtype="int8"``: every 2-D weight but the position table (the Linears, the token table, an untied head) as int8
  plus ``<name>_scale`` float32, one scale per output channel (``model/quantization.py``: the scheme); norms, biases
  and the position table stay float32; ``config.json`` gains ``"quantization": QUANTIZATION`` (and computes in
  float32: a Linear quantizes its input per row on the fly, ``kernels/csrc/cpu_linear_int8.cc``).
- ``dtype="bfloat16"``: every floating tensor as bfloat16 (rounded to nearest even), ``config.json``
  ``compute_dtype: "bfloat16"``; an inference build (generate, chat, serve, eval) reads the bits into its bfloat16
  Linear and untied-head weights as they are, every other tensor (and every tensor of a training build) is widened
  into float32 Parameters exactly (``model/weights.py`` ``load_weights``).

The tokenizer files and the ``tokenizer_id`` are copied. Refused with one line, nothing written: an unknown dtype,
a folder without config.json or weights, an already quantized (int8 or bfloat16) model, an ``out_dir`` that holds
files. Progress goes to stderr, one line per layer. Plain Python and numpy: MindSpore is not imported.
"""
import json
import os
import shutil
import sys

import numpy as np

from .errors import CheckpointError, ConfigError
from .model.params import layer_of
from .model.quantization import QUANTIZATION, is_quantized_name, quantize_rows, read_quantization, scale_name
from .safetensors_io import (DTYPES as DTYPES_STORED, CONFIG_NAME, TOKENIZER_FILES, WEIGHTS_NAME, SafetensorsReader,
                             to_bfloat16_bits, write_safetensors_streamed)
from .staging import write_folder
from .tokenizer_id import ID_FILE

DTYPES = ("int8", "bfloat16")


def _source(model_dir, dtype):
    """(config dict, reader) of a float gpt_local model directory, or one error naming what is wrong."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    config_path, weights = os.path.join(model_dir, CONFIG_NAME), os.path.join(model_dir, WEIGHTS_NAME)
    if not os.path.isfile(config_path):
        raise CheckpointError(f"--model {model_dir} has no {CONFIG_NAME}, so it is not a gpt_local model directory; "
                              f"give a trained one (a run's output/model, `gptlocal convert hf2ms`).")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    if config.get("model_type") != "gpt_local":
        raise CheckpointError(f"--model {model_dir}/{CONFIG_NAME} has model_type {config.get('model_type')!r}, not "
                              f"gpt_local; convert it first (`gptlocal convert hf2ms`).")
    if not os.path.isfile(weights):
        raise CheckpointError(f"--model {model_dir} has no weights ({WEIGHTS_NAME}); give a trained model "
                              f"directory.")
    reader = SafetensorsReader(weights)
    stored = {reader.header[name]["dtype"] for name in reader.names()}
    if read_quantization(config.get("quantization"), f"{config_path} quantization") or "I8" in stored:
        raise CheckpointError(f"--model {model_dir} is already int8 (`gptlocal quantize`); quantize the float model "
                              f"directory it was made from.")
    if "BF16" in stored or config.get("compute_dtype") == "bfloat16" and dtype == "bfloat16":
        raise CheckpointError(f"--model {model_dir} is already bfloat16; quantize the float32 model directory it "
                              f"was made from.")
    return config, reader


def _plan(reader, dtype, log):
    """write_safetensors_streamed's plan: (name, shape, dtype, produce), each tensor read when written."""
    plan, scales, seen = [], {}, set()

    def progress(name):
        group = layer_of(name)
        group = "the embeddings and head" if group is None else f"layer {group}"
        if group not in seen:
            seen.add(group)
            log(f"quantize: {group}")

    def quantized(name):
        progress(name)
        values, scales[name] = quantize_rows(reader.get(name))
        return values

    def float_tensor(name, out):
        progress(name)
        array = reader.get(name)
        return to_bfloat16_bits(array) if out == "BF16" else array

    for name in sorted(reader.names()):
        shape = reader.shape(name)
        if dtype == "int8" and is_quantized_name(name, shape):
            plan.append((name, shape, np.int8, lambda n=name: quantized(n)))
            plan.append((scale_name(name), shape[:1], np.float32, lambda n=name: scales.pop(n)))
        elif dtype == "bfloat16" and reader.header[name]["dtype"] in ("F32", "F64", "F16"):
            plan.append((name, shape, "BF16", lambda n=name: float_tensor(n, "BF16")))
        else:
            stored = reader.header[name]["dtype"]  # as read: BF16 widened to float32
            plan.append((name, shape, np.float32 if stored == "BF16" else DTYPES_STORED[stored],
                         lambda n=name: float_tensor(n, None)))
    return plan


def quantize_model(model_dir, out_dir, dtype="int8", log=None):
    """Write ``out_dir``: ``model_dir``'s model in ``dtype`` ("int8" or "bfloat16"; module docstring). Returns a
    summary dict (out, dtype, tensors, bytes of the weights file before and after)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    config, reader = _source(model_dir, dtype)
    plan = _plan(reader, dtype, log)
    config = dict(config)
    if dtype == "int8":
        config["quantization"] = dict(QUANTIZATION)
        config["compute_dtype"] = "float32"
    else:
        config["compute_dtype"] = "bfloat16"

    def build(staging):
        write_safetensors_streamed(os.path.join(staging, WEIGHTS_NAME), plan, {"format": "gpt_local"})
        with open(os.path.join(staging, CONFIG_NAME), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)
        for name in TOKENIZER_FILES + (ID_FILE,):
            if os.path.isfile(os.path.join(model_dir, name)):
                shutil.copyfile(os.path.join(model_dir, name), os.path.join(staging, name))
        return os.path.getsize(os.path.join(staging, WEIGHTS_NAME))

    size = write_folder(out_dir, build, CheckpointError)
    return {"out": os.path.abspath(out_dir), "dtype": dtype, "tensors": len(plan),
            "bytes_before": os.path.getsize(reader.path), "bytes_after": size}
