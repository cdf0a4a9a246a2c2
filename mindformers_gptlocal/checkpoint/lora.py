"""LoRA adapters out of a checkpoint: fold them into the base weights (``gptlocal lora merge``), or export
them as a Hugging Face PEFT adapter (``gptlocal convert ms2hf --lora-only``). Pure numpy, no MindSpore.

An adapter on a Linear with weight W [out, in] is A [r, in] (``lora_a``) and B [out, r] (``lora_b``);
the layer computes x W^T + (alpha / r) x A^T B^T, so merging is W + (alpha / r) B A. PEFT names
them ``lora_A.weight`` / ``lora_B.weight`` under the HF module; GPT-2's fused ``c_attn`` orders its
outputs q|k|v where ours are head-major, so B of ``linear_qkv`` gets the rows permutation the
weight gets (``hf_gpt2.py``); A, like the input axis, is unchanged.
"""
import json
import os

import numpy as np

from ..errors import CheckpointError
from ..peft import METHODS as PET_METHODS
from ..peft.lora import LORA_A, LORA_B, is_lora_name
from ..safetensors_io import (SafetensorsReader, read_safetensors, resolve_weights_file, write_safetensors,
                              write_safetensors_streamed)
from ..staging import write_folder
from .hf_gpt2 import local_to_hf_name
from .weights_io import copy_tokenizer as _copy_tokenizer, read_json as _read_json

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_tensors(path):
    """{Linear path: (A, B)} from a safetensors file, model directory or checkpoint folder (optimizer
    moments of the adapters, also in training checkpoints, are left out)."""
    weights = resolve_weights_file(path)
    reader = SafetensorsReader(weights)
    for method in PET_METHODS:  # another PEFT method's tensors (adapters, a prefix): refused, named by the method
        other = [n for n in reader.names() if n.startswith("model.") and method.owns(n)]
        if other and method.not_foldable is not None:
            raise CheckpointError(f"--adapter {path}: {weights} holds {method.not_foldable(other[0])}")
    names = [n for n in reader.names() if n.startswith("model.layers.") and is_lora_name(n)]
    pairs = {}
    for name in names:
        linear, kind = name.rsplit(".", 1)
        pairs.setdefault(linear, {})[kind] = reader.get(name).astype(np.float32)
    broken = [p for p, ab in pairs.items() if set(ab) != {LORA_A, LORA_B}]
    if broken:
        raise CheckpointError(f"{weights}: adapter {broken[0]} lacks its {LORA_A} or {LORA_B} tensor.")
    if not pairs:
        raise CheckpointError(f"--adapter {path}: {weights} holds no LoRA adapter tensors (*.{LORA_A} / *.{LORA_B}); "
                              f"give a checkpoint or model directory of a run with model_config.pet_config.")
    return weights, {p: (ab[LORA_A], ab[LORA_B]) for p, ab in sorted(pairs.items())}


def lora_settings(adapter_path, weights):
    """The run's pet_config: config.json beside the weights (a model directory), or MindFormers'
    adapter_config.json in the run's output folder (a checkpoint two levels down)."""
    folder = os.path.dirname(os.path.abspath(weights))
    for level in range(4):
        config = os.path.join(folder, "config.json")
        if os.path.isfile(config):
            pet = json.load(open(config, encoding="utf-8")).get("pet_config")
            if pet:
                return pet
        peft = os.path.join(folder, ADAPTER_CONFIG)
        if os.path.isfile(peft):
            values = json.load(open(peft, encoding="utf-8"))
            return {"pet_type": "lora", "lora_rank": values["r"], "lora_alpha": values["lora_alpha"],
                    "lora_dropout": values.get("lora_dropout", 0.0)}
        if level < 3:
            folder = os.path.dirname(folder)
    raise CheckpointError(f"--adapter {adapter_path}: no config.json with pet_config nor {ADAPTER_CONFIG} found beside "
                          f"it or in the folders above, so lora_alpha is unknown; pass --lora-alpha.")


def _scaling(pet, pairs, alpha):
    rank = next(iter(pairs.values()))[0].shape[0]
    if pet is not None and int(pet.get("lora_rank", rank)) != rank:
        raise CheckpointError(f"the adapters have rank {rank} but the run's pet_config says lora_rank "
                              f"{pet.get('lora_rank')}; pass --lora-alpha to state the scaling yourself.")
    alpha = float(alpha if alpha is not None else pet.get("lora_alpha", 16))
    return alpha / rank, rank, alpha


def read_adapter(path):
    """(weights file, {Linear path: (A, B)}, alpha / r, rank, alpha) of one adapter, as ``merge`` folds it."""
    weights, pairs = adapter_tensors(path)
    scaling, rank, alpha = _scaling(lora_settings(path, weights), pairs, None)
    return weights, pairs, scaling, rank, alpha


def merge(base_dir, adapter, out, alpha=None, overwrite=False):
    """base model directory + adapters -> a plain model directory with W + (alpha / r) B A."""
    base_config = _read_json(os.path.join(base_dir, "config.json"), "--base")
    if base_config.get("model_type") != "gpt_local":
        raise CheckpointError(f"--base {base_dir}/config.json is not a gpt_local config; convert it with "
                              f"`gptlocal convert hf2ms` first.")
    if base_config.get("quantization"):
        raise CheckpointError(f"--base {base_dir} is an int8 model directory (`gptlocal quantize`); merge into the "
                              f"float model directory, then quantize the merged one.")
    weights, pairs = adapter_tensors(adapter)
    pet = None if alpha is not None else lora_settings(adapter, weights)
    scaling, rank, alpha = _scaling(pet, pairs, alpha)
    base_file = resolve_weights_file(base_dir)
    base = read_safetensors(base_file)
    for linear, (a, b) in pairs.items():
        name = linear + ".weight"
        if name not in base:
            raise CheckpointError(f"--base {base_file} has no '{name}' for the adapter on {linear}; the adapter "
                                  f"belongs to another model.")
        if base[name].shape != (b.shape[0], a.shape[1]):
            raise CheckpointError(f"adapter {linear}: B {b.shape} x A {a.shape} does not fit the base weight "
                                  f"{base[name].shape}; the adapter belongs to another model size.")
        base[name] = (base[name].astype(np.float64) + scaling * (b.astype(np.float64) @ a.astype(np.float64))
                      ).astype(base[name].dtype)
    tensors = {k: np.ascontiguousarray(v) for k, v in base.items() if not is_lora_name(k)}
    config = {k: v for k, v in base_config.items() if k != "pet_config"}

    def build(staging):
        write_safetensors(os.path.join(staging, "model.safetensors"), tensors, {"format": "gpt_local"})
        with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2)
        for name in os.listdir(base_dir):
            if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "generation_config")):
                with open(os.path.join(base_dir, name), "rb") as src, open(os.path.join(staging, name), "wb") as dst:
                    dst.write(src.read())
        return {"adapters": len(pairs), "rank": rank, "alpha": alpha, "out": out}
    return write_folder(out, build, CheckpointError, overwrite, "--overwrite")


def _hf_b(b, kind, heads):
    """Our B [out, r] -> PEFT's lora_B [out, r] in HF's output order (c_attn: head-major -> q|k|v)."""
    if kind != "qkv_weight":
        return b
    out, rank = b.shape
    return np.ascontiguousarray(b.reshape(heads, 3, out // (3 * heads), rank).transpose(1, 0, 2, 3).reshape(out, rank))


def to_peft(ms_dir, out, alpha=None):
    """A trained model directory (config.json with pet_config + adapter tensors) -> a PEFT LoRA adapter
    folder (adapter_config.json + adapter_model.safetensors) for the GPT-2 that ``convert ms2hf`` writes."""
    local = _read_json(os.path.join(ms_dir, "config.json"), "--ms-dir")
    from .hf_models import family_of_local
    family = family_of_local(local)
    if family.name != "gpt2":  # a fused QKV adapter would have to become three PEFT adapters (q/k/v_proj)
        raise CheckpointError(f"{ms_dir} is a {family.name}-style model; --lora-only writes PEFT adapters for "
                              f"GPT-2 models only. Fold the adapters in with `gptlocal lora merge`, then "
                              f"`gptlocal convert ms2hf` the merged model.")
    weights, pairs = adapter_tensors(ms_dir)
    pet = local.get("pet_config") or lora_settings(ms_dir, weights)
    scaling, rank, alpha = _scaling(pet, pairs, alpha)
    del scaling
    heads = local["num_attention_heads"]
    plan, modules = [], []
    for linear, (a, b) in pairs.items():
        hf_name, kind = local_to_hf_name(linear + ".weight")
        module = hf_name[:-len(".weight")]
        modules.append(module)
        prefix = "base_model.model." + module
        plan.append((prefix + ".lora_A.weight", a.shape, np.float32, lambda a=a: a))
        plan.append((prefix + ".lora_B.weight", b.shape, np.float32, lambda b=b, k=kind: _hf_b(b, k, heads)))
    plan.sort(key=lambda item: item[0])
    # module suffixes when every layer has the same adapters (PEFT matches names ending in ".<suffix>"),
    # else the full module names
    layers = local["num_hidden_layers"]
    suffixes = sorted({m.split(".", 3)[3] for m in modules})
    if len(modules) == layers * len(suffixes):
        targets = suffixes
    else:
        targets = sorted(modules)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": rank,
              "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
              "lora_dropout": float(pet.get("lora_dropout", 0.0) or 0.0), "target_modules": targets,
              "fan_in_fan_out": True, "bias": "none", "inference_mode": True, "use_rslora": False,
              "init_lora_weights": True, "modules_to_save": None}

    def build(staging):
        write_safetensors_streamed(os.path.join(staging, ADAPTER_WEIGHTS), plan, {"format": "pt"})
        with open(os.path.join(staging, ADAPTER_CONFIG), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2)
        _copy_tokenizer(ms_dir, staging, local.get("max_position_embeddings", 1024))
        return {"tensors": len(plan), "targets": targets}
    return write_folder(out, build, CheckpointError)



def prefix_to_peft(ms_dir, out):
    """A prefix-tuned model directory (config.json with pet_type prefixtuning / ptuning2) -> a PEFT
    ``PrefixTuningConfig`` adapter for the base ``convert ms2hf`` writes: ``prompt_embeddings`` [tokens,
    layers*2*kv_width], the prefix keys and values as peft's PrefixEncoder hands them out (the MLP of
    ``prefix_projection`` / ``mid_dim`` applied here, in numpy, so the adapter says prefix_projection false)."""
    from ..peft.prefix import PREFIX_NAME, read as read_prefix_config
    local = _read_json(os.path.join(ms_dir, "config.json"), "--ms-dir")
    spec = read_prefix_config(local.get("pet_config"))
    if spec is None:
        raise CheckpointError(f"{ms_dir}/config.json has no prefix-tuning pet_config (pet_type prefixtuning or "
                              f"ptuning2); give the model directory of a prefix-tuning run.")
    reader = SafetensorsReader(resolve_weights_file(ms_dir))
    names = {n[len(f"model.{PREFIX_NAME}."):]: n for n in reader.names() if n.startswith(f"model.{PREFIX_NAME}.")}
    need = ["embedding"] + (["transform_in.weight", "transform_in.bias", "transform_out.weight",
                             "transform_out.bias"] if spec.projection else [])
    lacking = [n for n in need if n not in names]
    if lacking:
        raise CheckpointError(f"{ms_dir}: the weights lack model.{PREFIX_NAME}.{lacking[0]}; not a model directory "
                              f"of this prefix-tuning run.")
    get = {n: reader.get(names[n]).astype(np.float64) for n in need}
    table = get["embedding"]
    if spec.projection:  # peft's PrefixEncoder.transform: Linear -> tanh -> Linear
        inner = np.tanh(table @ get["transform_in.weight"].T + get["transform_in.bias"])
        table = inner @ get["transform_out.weight"].T + get["transform_out.bias"]
    table = np.ascontiguousarray(table.astype(np.float32))
    heads, layers = local["num_attention_heads"], local["num_hidden_layers"]
    groups = local.get("num_query_groups") or heads
    kv_width = groups * (local["hidden_size"] // heads)
    if table.shape != (spec.tokens, layers * 2 * kv_width):
        raise CheckpointError(f"{ms_dir}: the prefix is {table.shape}, config.json implies "
                              f"{(spec.tokens, layers * 2 * kv_width)}.")
    config = {"peft_type": "PREFIX_TUNING", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
              "num_virtual_tokens": spec.tokens, "token_dim": kv_width, "num_transformer_submodules": 1,
              "num_attention_heads": groups, "num_layers": layers, "encoder_hidden_size": kv_width,
              "prefix_projection": False, "inference_mode": True}
    plan = [("prompt_embeddings", table.shape, np.float32, lambda: table)]

    def build(staging):
        write_safetensors_streamed(os.path.join(staging, ADAPTER_WEIGHTS), plan, {"format": "pt"})
        with open(os.path.join(staging, ADAPTER_CONFIG), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2)
        _copy_tokenizer(ms_dir, staging, local.get("max_position_embeddings", 1024))
        return {"tensors": 1, "tokens": spec.tokens, "pet_type": spec.pet_type}
    return write_folder(out, build, CheckpointError)
