"""Hugging Face GPT-2 <-> gpt_local weight conversion, exact both ways, streamed tensor by tensor.

HF GPT-2 stores Conv1D weights as [in, out] and fuses Q, K, V as [q | k | v] along the output
axis. gpt_local stores linear weights as [out, in] and lays the fused QKV head-major,
[head, (q, k, v), head_dim], so a tensor-parallel column split keeps whole heads. Both
directions are transposes and reshapes only: hf -> ms -> hf is bit-exact.

Output is written into ``<out>.partial-<pid>`` and renamed into place; a failure leaves nothing.
"""
import json
import os
import shutil
import struct

import numpy as np

from ..data.tokenizer import EOD_TOKEN, from_gpt2_files
from ..errors import CheckpointError
from ..model.params import ACTIVATIONS, parameter_table
from ..parallel.layout import Layout
from ..safetensors_io import TOKENIZER_FILES, read_header, resolve_weights_file
from ..staging import write_folder
from ..tokenizer_id import write_id

GPT2_TYPES = ("gpt2",)
GPT2_ACTIVATIONS = tuple(a for a in ACTIVATIONS if a not in ("silu", "swiglu"))  # the gated ones are Llama's
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


# ---------------------------------------------------------------------------------------------
# config
def gpt2_to_local_config(hf):
    """HF GPT2Config dict -> gpt_local config dict; refuses what would change the maths."""
    model_type = hf.get("model_type")
    if model_type not in GPT2_TYPES:
        raise CheckpointError(f"config.json has model_type {model_type!r}; only GPT-2 checkpoints (model_type "
                              f"'gpt2') convert to gpt_local.")
    if hf.get("activation_function", "gelu_new") not in GPT2_ACTIVATIONS:
        raise CheckpointError(f"config.json activation_function {hf['activation_function']!r} is not supported; "
                              f"gpt_local supports {', '.join(GPT2_ACTIVATIONS)}.")
    if hf.get("scale_attn_weights", True) is False:
        raise CheckpointError("config.json has scale_attn_weights=false (no 1/sqrt(head_dim) scaling); gpt_local "
                              "always scales attention, so this checkpoint would compute different logits.")
    if hf.get("reorder_and_upcast_attn", False):
        raise CheckpointError("config.json has reorder_and_upcast_attn=true; gpt_local does not implement that "
                              "attention variant. Set it to false only if the model was trained in fp32.")
    if hf.get("add_cross_attention", False):
        raise CheckpointError("config.json has add_cross_attention=true; gpt_local is decoder-only.")
    n_positions = hf.get("n_positions", 1024)
    local = {
        "model_type": "gpt_local", "architectures": ["GPTLocalForCausalLM"],
        "vocab_size": hf["vocab_size"], "hidden_size": hf["n_embd"], "num_hidden_layers": hf["n_layer"],
        "num_attention_heads": hf["n_head"], "intermediate_size": hf.get("n_inner") or 4 * hf["n_embd"],
        "max_position_embeddings": n_positions, "seq_length": n_positions,
        "layernorm_epsilon": hf.get("layer_norm_epsilon", 1e-5),
        "hidden_act": "gelu_new" if hf.get("activation_function", "gelu_new") in ("gelu_pytorch_tanh",) else
        hf.get("activation_function", "gelu_new"),
        "hidden_dropout": hf.get("resid_pdrop", 0.1), "attention_dropout": hf.get("attn_pdrop", 0.1),
        "embedding_dropout": hf.get("embd_pdrop", 0.1), "initializer_range": hf.get("initializer_range", 0.02),
        "scale_attn_by_inverse_layer_idx": bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
        "bos_token_id": hf.get("bos_token_id", 50256), "eos_token_id": hf.get("eos_token_id", 50256),
        "pad_token_id": hf.get("pad_token_id") if hf.get("pad_token_id") is not None else hf.get("eos_token_id", 50256),
    }
    if hf.get("tie_word_embeddings", True) is False:
        raise CheckpointError("config.json has tie_word_embeddings=false; gpt_local ties the head to the token "
                              "embedding as GPT-2 does.")
    return local


def local_to_gpt2_config(local):
    """gpt_local config dict -> HF GPT2Config dict (transformers reads it with GPT2LMHeadModel)."""
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": local["vocab_size"],
        "n_embd": local["hidden_size"], "n_layer": local["num_hidden_layers"], "n_head": local["num_attention_heads"],
        "n_inner": local.get("intermediate_size"), "n_positions": local["max_position_embeddings"],
        "n_ctx": local["max_position_embeddings"], "layer_norm_epsilon": local.get("layernorm_epsilon", 1e-5),
        "activation_function": local.get("hidden_act", "gelu_new"), "resid_pdrop": local.get("hidden_dropout", 0.1),
        "attn_pdrop": local.get("attention_dropout", 0.1), "embd_pdrop": local.get("embedding_dropout", 0.1),
        "initializer_range": local.get("initializer_range", 0.02),
        "scale_attn_by_inverse_layer_idx": local.get("scale_attn_by_inverse_layer_idx", False),
        "bos_token_id": local.get("bos_token_id", 50256), "eos_token_id": local.get("eos_token_id", 50256),
        "tie_word_embeddings": True, "torch_dtype": "float32",
    }


# ---------------------------------------------------------------------------------------------
# tensor name and layout maps
# (HF name, gpt_local name, layout change); one table serves both directions
FIXED_NAMES = [("wte.weight", "model.embedding.word_embeddings", "copy"),
               ("wpe.weight", "model.embedding.position_embeddings", "copy"),
               ("ln_f.weight", "model.final_layernorm.weight", "copy"),
               ("ln_f.bias", "model.final_layernorm.bias", "copy")]
LAYER_NAMES = [("ln_1.weight", "input_layernorm.weight", "copy"), ("ln_1.bias", "input_layernorm.bias", "copy"),
               ("ln_2.weight", "post_attention_layernorm.weight", "copy"),
               ("ln_2.bias", "post_attention_layernorm.bias", "copy"),
               ("attn.c_attn.weight", "attention.linear_qkv.weight", "qkv_weight"),
               ("attn.c_attn.bias", "attention.linear_qkv.bias", "qkv_bias"),
               ("attn.c_proj.weight", "attention.linear_proj.weight", "transpose"),
               ("attn.c_proj.bias", "attention.linear_proj.bias", "copy"),
               ("mlp.c_fc.weight", "mlp.linear_fc1.weight", "transpose"),
               ("mlp.c_fc.bias", "mlp.linear_fc1.bias", "copy"),
               ("mlp.c_proj.weight", "mlp.linear_fc2.weight", "transpose"),
               ("mlp.c_proj.bias", "mlp.linear_fc2.bias", "copy")]


def hf_to_local_name(name, n_layer):
    """HF GPT-2 tensor name -> (gpt_local name, kind) or None for buffers to drop."""
    if name.startswith("transformer."):
        name = name[len("transformer."):]
    if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
        return None
    fixed = {hf: (local, kind) for hf, local, kind in FIXED_NAMES}
    if name in fixed:
        return fixed[name]
    parts = name.split(".")
    if parts[0] != "h" or len(parts) < 4 or not parts[1].isdigit() or int(parts[1]) >= n_layer:
        raise CheckpointError(f"tensor '{name}' is not part of a GPT-2 model of {n_layer} layers; this does not "
                              f"look like a GPT-2 checkpoint (expected transformer.h.N.*, wte, wpe, ln_f).")
    layer, rest = parts[1], ".".join(parts[2:])
    table = {hf: (local, kind) for hf, local, kind in LAYER_NAMES}
    if rest not in table:
        raise CheckpointError(f"tensor '{name}' is not a GPT-2 tensor (unknown '{rest}' in layer {layer}).")
    local, kind = table[rest]
    return f"model.layers.{layer}.{local}", kind


def local_to_hf_name(name):
    """gpt_local name -> (HF name, kind), the inverse of hf_to_local_name."""
    fixed = {local: ("transformer." + hf, kind) for hf, local, kind in FIXED_NAMES}
    if name in fixed:
        return fixed[name]
    parts = name.split(".")
    table = {local: (hf, kind) for hf, local, kind in LAYER_NAMES}
    rest = ".".join(parts[3:])
    if parts[:2] != ["model", "layers"] or rest not in table:
        raise CheckpointError(f"tensor '{name}' is not a gpt_local model tensor.")
    hf, kind = table[rest]
    return f"transformer.h.{parts[2]}.{hf}", kind


def hf_to_local_tensor(array, kind, heads):
    """HF layout -> gpt_local layout. c_attn [H, 3H] (q|k|v) -> [3H, H] head-major (head, qkv, dim)."""
    if kind == "copy":
        return array
    if kind == "transpose":
        return np.ascontiguousarray(array.T)
    hidden = array.shape[0] if kind == "qkv_weight" else array.shape[0] // 3
    dim = hidden // heads
    if kind == "qkv_weight":  # [in, (3, heads, dim)] -> [(heads, 3, dim), in]
        return np.ascontiguousarray(array.T.reshape(3, heads, dim, hidden).transpose(1, 0, 2, 3)
                                    .reshape(3 * hidden, hidden))
    return np.ascontiguousarray(array.reshape(3, heads, dim).transpose(1, 0, 2).reshape(3 * hidden))


def local_to_hf_tensor(array, kind, heads):
    """gpt_local layout -> HF layout, the exact inverse of hf_to_local_tensor."""
    if kind == "copy":
        return array
    if kind == "transpose":
        return np.ascontiguousarray(array.T)
    hidden = array.shape[-1] if kind == "qkv_weight" else array.shape[0] // 3
    dim = hidden // heads
    if kind == "qkv_weight":
        return np.ascontiguousarray(array.reshape(heads, 3, dim, hidden).transpose(1, 0, 2, 3)
                                    .reshape(3 * hidden, hidden).T)
    return np.ascontiguousarray(array.reshape(heads, 3, dim).transpose(1, 0, 2).reshape(3 * hidden))


def expected_local_shapes(local):
    """gpt_local tensor name -> shape, from a gpt_local config dict (the parameter table's shapes)."""
    return {name: spec.shape for name, spec in parameter_table(local, Layout()).items()}


# ---------------------------------------------------------------------------------------------
# reading HF checkpoints lazily, one tensor at a time
class TensorSource:
    """name -> lazily loaded numpy array over safetensors (single or sharded) or a weights-only .bin."""

    def __init__(self, directory, allow_pickle=False):
        self.directory = directory
        self.files = {}
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        binary = os.path.join(directory, "pytorch_model.bin")
        if os.path.isfile(single):
            self._add_safetensors(single)
        elif os.path.isfile(index):
            with open(index, encoding="utf-8") as handle:
                weight_map = json.load(handle)["weight_map"]
            for shard in sorted(set(weight_map.values())):
                path = os.path.join(directory, shard)
                if not os.path.isfile(path):
                    raise CheckpointError(f"{index} lists shard {shard}, but {path} does not exist.")
                self._add_safetensors(path)
        elif os.path.isfile(binary):
            self._add_pickle(binary, allow_pickle)
        else:
            raise CheckpointError(f"{directory}: no weights found (looked for {', '.join(HF_WEIGHT_FILES)}).")

    def _add_safetensors(self, path):
        reader = SafetensorsReader(path)
        for name in reader.names():
            self.files[name] = (reader, name)

    def _add_pickle(self, path, allow_pickle):
        try:
            import torch
        except ImportError as err:
            raise CheckpointError(f"{path} is a PyTorch pickle; reading it needs torch (pip install torch), or "
                                  f"convert it to safetensors first.") from err
        try:
            state = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
        except Exception as err:
            raise CheckpointError(f"{path} could not be loaded with weights_only=True ({err}). If you trust this "
                                  f"file, pass --allow-pickle; better, convert it to safetensors.") from err
        for name, tensor in state.items():
            self.files[name] = (None, tensor.detach().to(torch.float32).numpy() if tensor.is_floating_point()
                                else tensor.numpy())

    def names(self):
        return list(self.files)

    def shape(self, name):
        reader, ref = self.files[name]
        return tuple(ref.shape) if reader is None else reader.shape(ref)

    def get(self, name):
        reader, ref = self.files[name]
        return ref if reader is None else reader.get(ref)


class SafetensorsReader:
    """Reads one tensor at a time with plain file reads (no mmap), so the source file's pages never
    count against this process's memory: peak RSS stays near the largest tensor, not the file."""

    DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "F64": np.float64, "I64": np.int64,
              "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}

    def __init__(self, path):
        self.path = path
        try:
            length, self.header = read_header(path)
            self.data_start = 8 + length
        except (OSError, ValueError, struct.error) as err:
            raise CheckpointError(f"{path} is not a readable safetensors file ({err}); it may be truncated.") from err
        self.header.pop("__metadata__", None)
        end = max((info["data_offsets"][1] for info in self.header.values()), default=0)
        if self.data_start + end > os.path.getsize(path):
            raise CheckpointError(f"{path} is truncated: its header describes {self.data_start + end} bytes, the "
                                  f"file has {os.path.getsize(path)}.")

    def names(self):
        return list(self.header)

    def shape(self, name):
        return tuple(self.header[name]["shape"])

    def get(self, name):
        info = self.header[name]
        start, stop = info["data_offsets"]
        with open(self.path, "rb") as handle:
            handle.seek(self.data_start + start)
            raw = handle.read(stop - start)
        if info["dtype"] == "BF16":  # widen bfloat16 to float32 exactly
            bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(info["shape"])
        dtype = self.DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: tensor '{name}' has dtype {info['dtype']}, which is not supported.")
        return np.frombuffer(raw, dtype=dtype).reshape(info["shape"]).copy()


# ---------------------------------------------------------------------------------------------
# writing safetensors one tensor at a time
_DTYPES = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("int64"): "I64",
           np.dtype("int32"): "I32"}


def write_safetensors_streamed(path, plan, metadata=None):
    """Write safetensors from ``plan``: list of (name, shape, dtype, produce) where produce() returns
    the array. Only one tensor is in memory at a time."""
    header, offset = {}, 0
    for name, shape, dtype, _ in plan:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _DTYPES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)))
        handle.write(blob)
        for name, shape, dtype, produce in plan:
            array = np.ascontiguousarray(produce(), dtype=dtype)
            if tuple(array.shape) != tuple(shape):
                raise CheckpointError(f"tensor '{name}' came out {array.shape}, expected {tuple(shape)}.")
            handle.write(array.tobytes())


# ---------------------------------------------------------------------------------------------
def _read_json(path, what):
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist; {what} needs it.")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def hf_to_ms(hf_dir, out, allow_pickle=False):
    """Convert a Hugging Face GPT-2 directory into a gpt_local model directory. Returns a summary."""
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"--hf-dir {hf_dir} does not exist or is not a folder.")
    local = gpt2_to_local_config(_read_json(os.path.join(hf_dir, "config.json"), "--hf-dir"))
    source = TensorSource(hf_dir, allow_pickle)
    heads, n_layer = local["num_attention_heads"], local["num_hidden_layers"]
    expected = expected_local_shapes(local)
    plan, seen = [], {}
    for hf_name in source.names():
        mapped = hf_to_local_name(hf_name, n_layer)
        if mapped is None:
            continue
        name, kind = mapped
        hf_shape = source.shape(hf_name)
        shape = tuple(reversed(hf_shape)) if kind in ("transpose", "qkv_weight") else hf_shape
        if shape != expected[name]:
            raise CheckpointError(f"tensor '{hf_name}' has shape {hf_shape}, which does not fit config.json "
                                  f"(n_embd={local['hidden_size']}, n_inner={local['intermediate_size']}, "
                                  f"vocab_size={local['vocab_size']}, n_positions={local['max_position_embeddings']}); "
                                  f"the config does not match these weights.")
        seen[name] = hf_name
        plan.append((name, shape, np.float32,
                     lambda n=hf_name, k=kind: hf_to_local_tensor(source.get(n).astype(np.float32), k, heads)))
    missing = sorted(set(expected) - set(seen))
    if missing:
        raise CheckpointError(f"{hf_dir} lacks {len(missing)} GPT-2 tensors for a {n_layer}-layer model, e.g. "
                              f"'{missing[0]}' (from HF '{local_to_hf_name(missing[0])[0]}').")
    _check_tied_head(source, hf_dir)
    return write_ms_dir(out, plan, local, hf_dir)


def write_ms_dir(out, plan, local, hf_dir, **summary):
    """Write a gpt_local model directory all at once: the planned tensors (name-sorted), config.json and the
    Hugging Face directory's tokenizer. Returns the summary (tensor count, config, ``summary``)."""
    plan = sorted(plan, key=lambda item: item[0])

    def build(staging):
        write_safetensors_streamed(os.path.join(staging, "model.safetensors"), plan, {"format": "gpt_local"})
        with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(local, handle, indent=2)
        if hf_dir:  # None: no tokenizer to carry (convert mf2ms without --tokenizer)
            _copy_tokenizer(hf_dir, staging, local["max_position_embeddings"])
        return {"tensors": len(plan), "config": local, **summary}
    return write_folder(out, build, CheckpointError)


def _check_tied_head(source, hf_dir):
    if "lm_head.weight" in source.files:
        wte = "transformer.wte.weight" if "transformer.wte.weight" in source.files else "wte.weight"
        if not np.array_equal(source.get("lm_head.weight"), source.get(wte)):
            raise CheckpointError(f"{hf_dir}: lm_head.weight differs from the token embedding; gpt_local ties "
                                  f"the head to the embedding as GPT-2 does, so this checkpoint cannot convert.")


def _copy_tokenizer(src, dst, max_length):
    """Copy tokenizer files; build tokenizer.json from vocab.json + merges.txt when it is missing."""
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    vocab, merges = os.path.join(src, "vocab.json"), os.path.join(src, "merges.txt")
    if not os.path.isfile(os.path.join(dst, "tokenizer.json")) and os.path.isfile(vocab) and os.path.isfile(merges):
        from_gpt2_files(vocab, merges).save(os.path.join(dst, "tokenizer.json"))
    if os.path.isfile(os.path.join(dst, "tokenizer.json")) and not os.path.isfile(
            os.path.join(dst, "tokenizer_config.json")):
        with open(os.path.join(dst, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
            json.dump({"tokenizer_class": "GPT2TokenizerFast", "bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN,
                       "unk_token": EOD_TOKEN, "model_max_length": max_length}, handle, indent=2)
    write_id(dst)  # the id of the tokenizer these weights go with (tokenizer_id.py)


def read_ms_config(ms_dir):
    """The config.json of a gpt_local model directory (--ms-dir), refused with one error if it is not one."""
    if not os.path.isdir(ms_dir):
        raise CheckpointError(f"--ms-dir {ms_dir} does not exist or is not a folder.")
    local = _read_json(os.path.join(ms_dir, "config.json"), "--ms-dir")
    if local.get("model_type") != "gpt_local":
        raise CheckpointError(f"{ms_dir}/config.json has model_type {local.get('model_type')!r}, not gpt_local.")
    return local


def ms_to_hf(ms_dir, out):
    """Convert a gpt_local model directory into a Hugging Face GPT-2 directory. Returns a summary."""
    local = read_ms_config(ms_dir)
    weights = resolve_weights_file(ms_dir)
    reader = SafetensorsReader(weights)
    local.setdefault("intermediate_size", 4 * local["hidden_size"])
    local.setdefault("max_position_embeddings", 1024)
    lora = local.pop("pet_config", None)  # the base weights only; adapters: --lora-only or `gptlocal lora merge`
    expected = expected_local_shapes(local)
    heads = local["num_attention_heads"]
    missing = sorted(set(expected) - set(reader.names()))
    if missing:
        raise CheckpointError(f"{weights} lacks '{missing[0]}' (and {len(missing) - 1} more); not a gpt_local "
                              f"model of this config.")
    plan = []
    for name, shape in expected.items():
        actual = reader.shape(name)
        if actual != shape:
            raise CheckpointError(f"tensor '{name}' has shape {actual}; config.json implies {shape}.")
        hf_name, kind = local_to_hf_name(name)
        hf_shape = tuple(reversed(shape)) if kind in ("transpose", "qkv_weight") else shape
        plan.append((hf_name, hf_shape, np.float32,
                     lambda n=name, k=kind: local_to_hf_tensor(reader.get(n).astype(np.float32), k, heads)))
    plan.sort(key=lambda item: item[0])

    def build(staging):
        write_safetensors_streamed(os.path.join(staging, "model.safetensors"), plan, {"format": "pt"})
        with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(local_to_gpt2_config(local), handle, indent=2)
        _copy_tokenizer(ms_dir, staging, local["max_position_embeddings"])
        return {"tensors": len(plan), "lora_left_out": bool(lora)}
    return write_folder(out, build, CheckpointError)
