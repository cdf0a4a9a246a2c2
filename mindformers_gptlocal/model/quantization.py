"""int8 model directories: the scheme, the names and the config key, in plain Python and numpy (``gptlocal
quantize`` and the loader use it without building a model; the Cells that run it are ``quant_cells.py``).

The scheme (CTranslate2's int8): every 2-D weight but the position table (the Linears, the token table, an untied
head) is stored int8 with one float32 scale per row, i.e. per output channel of a Linear and per token of the
table: ``scale = max |row| / 127``, ``q = round(row / scale)`` (a row of zeros: scale 0, q 0). A Linear quantizes
its input per row on the fly in the same way and multiplies in int32 (``kernels/csrc/cpu_linear_int8.cc``); the token
lookup is the int8 row times its scale; the tied head is the same int8 GEMM over the table (its rows are the head's
output channels, so the same scales serve both). Norms, biases and the position table stay float32.

In the files: ``<name>`` int8 and ``<name>_scale`` float32 (``scale_name``), ``config.json``
``"quantization": QUANTIZATION``. docs/model-directory.md describes the format.
"""
import numpy as np

from ..errors import ConfigError
from .params import POSITION_EMBEDDINGS

QUANTIZATION = {"dtype": "int8", "weights": "per_channel_symmetric", "activations": "dynamic_per_row"}
SCALE_SUFFIX = "_scale"


def scale_name(name):
    """The scale tensor of the int8 tensor ``name`` (``...linear_qkv.weight`` -> ``...linear_qkv.weight_scale``)."""
    return name + SCALE_SUFFIX


def is_scale_name(name):
    return name.endswith(SCALE_SUFFIX)


def is_quantized_name(name, shape):
    """True for the tensors an int8 directory stores int8: every 2-D weight but the position table."""
    return len(shape) == 2 and name != POSITION_EMBEDDINGS and not is_scale_name(name)


def read_quantization(value, where="model_config.quantization"):
    """``config.quantization`` -> "int8" or None (absent); one ConfigError naming the key for anything else."""
    if value is None or value == {}:
        return None
    if hasattr(value, "items") and dict(value.items()) == QUANTIZATION:
        return "int8"
    raise ConfigError(f"{where} is {value!r}; the one supported value is {QUANTIZATION!r} (what `gptlocal "
                      f"quantize --dtype int8` writes), or leave it out for a float model.")


def quantize_rows(weight):
    """float array [N, K] -> (int8 [N, K], float32 scales [N]): symmetric, one scale per row."""
    weight = np.asarray(weight, np.float32)
    amax = np.max(np.abs(weight), axis=1) if weight.shape[1] else np.zeros(weight.shape[0], np.float32)
    scale = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    quantized = np.clip(np.rint(weight / safe[:, None]), -127, 127).astype(np.int8)
    return quantized, scale


def dequantize_rows(quantized, scale):
    """The float32 rows an int8 tensor and its scales stand for."""
    return quantized.astype(np.float32) * np.asarray(scale, np.float32)[:, None]
