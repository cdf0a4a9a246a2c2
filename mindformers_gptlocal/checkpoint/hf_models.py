"""Hugging Face Llama-family and GPT-NeoX weights <-> gpt_local, exact both ways, one weight map per family.

``hf_gpt2.py`` does GPT-2; this module adds the rotary families on the same reader/writer
(``TensorSource``, ``write_safetensors_streamed``, the all-or-nothing output folder) with the design
litgpt's ``convert_hf_checkpoint`` uses: each family is a config translation (both directions, refusing
what would change the maths) and ONE weight map, a list of (gpt_local name, HF names, kind) that both
directions read. ``convert_hf_to_ms`` / ``convert_ms_to_hf`` pick the family (GPT-2 included) and are what
``gptlocal convert`` calls.

Families:

- ``llama``: ``LlamaForCausalLM`` (Llama 1-3 without rope_scaling, TinyLlama, SmolLM, ...) and
  ``Qwen2ForCausalLM`` (q/k/v biases, no sliding window). Q, K and V ([heads*D, H], [groups*D, H] x 2)
  become the group-major fused QKV, [groups, (heads/groups q, k, v), D] (``model/attention.py``); HF's
  q/k rows are already in the rotate_half layout that gpt_local's rotary uses, so no permutation.
  gate_proj -> mlp.linear_gate, up_proj -> mlp.linear_fc1, down_proj -> mlp.linear_fc2.
- ``gpt_neox``: ``GPTNeoXForCausalLM`` (Pythia). Its fused query_key_value is already [heads, 3, D]:
  gpt_local's layout, copied as is; partial rotary (``rotary_pct``), parallel residual, LayerNorm.

Pure numpy: no MindSpore, no torch (except to read a weights-only ``.bin``).
"""
import json
import os

import numpy as np

from ..errors import CheckpointError
from ..model.params import architecture, parameter_table, rotary_dim
from ..parallel.layout import Layout
from ..safetensors_io import resolve_weights_file
from ..staging import write_folder
from . import hf_gpt2
from .hf_gpt2 import SafetensorsReader, TensorSource, _copy_tokenizer, _read_json, write_safetensors_streamed

LLAMA_TYPES = ("llama", "qwen2")
NEOX_TYPES = ("gpt_neox",)
# HF activation names gpt_local computes the same way (NeoX's MLP)
NEOX_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_fast": "gelu_fast", "relu": "relu",
                    "gelu_pytorch_tanh": "gelu_new"}
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _refuse(message):
    raise CheckpointError(f"config.json: {message}")


def _plain_rope(hf):
    """Refuse rope_scaling of any type but the default (linear, dynamic, yarn, llama3 ... change positions)."""
    scaling = hf.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        _refuse(f"rope_scaling {scaling!r} is not supported; gpt_local implements plain rotary embeddings "
                f"(rope_scaling null or rope_type 'default') only.")
    for key in MOE_KEYS:
        if hf.get(key):
            _refuse(f"{key}={hf[key]!r}: mixture-of-experts models do not convert; gpt_local is a dense model.")


# ---------------------------------------------------------------------------------------------
# config translations
def llama_to_local(hf):
    """HF LlamaConfig / Qwen2Config dict -> gpt_local config dict; refuses what would change the maths."""
    _plain_rope(hf)
    model_type = hf["model_type"]
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(f"hidden_act {hf['hidden_act']!r}: the Llama-family MLP converts with silu (SwiGLU) only.")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, hidden // heads) or hidden % heads:
        _refuse(f"head_dim {hf.get('head_dim')} differs from hidden_size / num_attention_heads "
                f"({hidden} / {heads}); gpt_local's heads are hidden_size / num_attention_heads wide.")
    if hf.get("pretraining_tp", 1) != 1:
        _refuse(f"pretraining_tp {hf['pretraining_tp']} changes the matmul order; set it to 1.")
    if hf.get("use_sliding_window") or (model_type != "qwen2" and hf.get("sliding_window")):
        _refuse("sliding-window attention is not supported; gpt_local attends over the whole context.")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse(f"partial_rotary_factor {hf['partial_rotary_factor']} is not a Llama-family setting gpt_local "
                f"converts (Llama turns whole heads).")
    if model_type == "qwen2":  # q/k/v with biases, o_proj and the MLP without
        qkv_bias, bias = True, False
    else:
        qkv_bias = bool(hf.get("attention_bias", False))
        if qkv_bias != bool(hf.get("mlp_bias", False)):
            _refuse(f"attention_bias={qkv_bias} with mlp_bias={hf.get('mlp_bias', False)} is not supported: "
                    f"gpt_local's add_bias_linear covers o_proj and the MLP together.")
        bias = qkv_bias
    positions = hf.get("max_position_embeddings", 2048)
    eos = hf.get("eos_token_id", 2)
    eos = eos[0] if isinstance(eos, list) else eos
    return {
        "model_type": "gpt_local", "architectures": ["GPTLocalForCausalLM"],
        "vocab_size": hf["vocab_size"], "hidden_size": hidden, "num_hidden_layers": hf["num_hidden_layers"],
        "num_attention_heads": heads, "num_query_groups": hf.get("num_key_value_heads") or heads,
        "intermediate_size": hf["intermediate_size"], "max_position_embeddings": positions,
        "seq_length": positions, "layernorm_epsilon": hf.get("rms_norm_eps", 1e-6), "hidden_act": "swiglu",
        "gated_linear_unit": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
        "rotary_base": float(hf.get("rope_theta", 10000.0)), "add_bias_linear": bias, "add_qkv_bias": qkv_bias,
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
        "hidden_dropout": 0.0, "attention_dropout": float(hf.get("attention_dropout", 0.0)),
        "embedding_dropout": 0.0, "initializer_range": hf.get("initializer_range", 0.02),
        "bos_token_id": hf.get("bos_token_id", 1), "eos_token_id": eos,
        "pad_token_id": hf.get("pad_token_id") if hf.get("pad_token_id") is not None else eos,
    }


def local_to_llama(local):
    """gpt_local config dict (Llama-style) -> HF LlamaConfig or Qwen2Config dict."""
    arch = architecture(local)
    qwen2 = arch.qkv_bias and not arch.bias
    hf = {
        "model_type": "qwen2" if qwen2 else "llama",
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "vocab_size": local["vocab_size"], "hidden_size": local["hidden_size"],
        "intermediate_size": local["intermediate_size"], "num_hidden_layers": local["num_hidden_layers"],
        "num_attention_heads": local["num_attention_heads"], "num_key_value_heads": arch.groups,
        "head_dim": local["hidden_size"] // local["num_attention_heads"], "hidden_act": "silu",
        "max_position_embeddings": local["max_position_embeddings"],
        "rms_norm_eps": local.get("layernorm_epsilon", 1e-5), "rope_theta": arch.rotary_base, "rope_scaling": None,
        "tie_word_embeddings": not arch.untied, "attention_dropout": local.get("attention_dropout", 0.0),
        "initializer_range": local.get("initializer_range", 0.02), "bos_token_id": local.get("bos_token_id"),
        "eos_token_id": local.get("eos_token_id"), "pad_token_id": local.get("pad_token_id"),
        "torch_dtype": "float32",
    }
    if qwen2:
        hf["use_sliding_window"] = False
    else:
        hf.update(attention_bias=arch.bias, mlp_bias=arch.bias)
    return hf


def neox_to_local(hf):
    """HF GPTNeoXConfig dict -> gpt_local config dict."""
    _plain_rope(hf)
    act = hf.get("hidden_act", "gelu")
    if act not in NEOX_ACTIVATIONS:
        _refuse(f"hidden_act {act!r} is not supported; GPT-NeoX converts with {', '.join(NEOX_ACTIVATIONS)}.")
    if hf.get("attention_bias", True) is False:
        _refuse("attention_bias=false (no bias on query_key_value and dense, biases on the MLP) is not "
                "supported: gpt_local's add_bias_linear covers the attention output and the MLP together.")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hidden // heads
    pct = float(hf.get("rotary_pct", hf.get("partial_rotary_factor", 0.25)))
    ndims = int(head_dim * pct)  # HF: int(head_size * rotary_pct)
    positions = hf.get("max_position_embeddings", 2048)
    return {
        "model_type": "gpt_local", "architectures": ["GPTLocalForCausalLM"],
        "vocab_size": hf["vocab_size"], "hidden_size": hidden, "num_hidden_layers": hf["num_hidden_layers"],
        "num_attention_heads": heads, "intermediate_size": hf.get("intermediate_size") or 4 * hidden,
        "max_position_embeddings": positions, "seq_length": positions,
        "layernorm_epsilon": hf.get("layer_norm_eps", 1e-5), "hidden_act": NEOX_ACTIVATIONS[act],
        "position_embedding_type": "rope", "rotary_percent": ndims / head_dim,
        "rotary_base": float(hf.get("rotary_emb_base", hf.get("rope_theta", 10000.0))),
        "use_parallel_residual": bool(hf.get("use_parallel_residual", True)),
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
        "hidden_dropout": float(hf.get("hidden_dropout", 0.0)), "attention_dropout": float(hf.get("attention_dropout", 0.0)),
        "embedding_dropout": float(hf.get("hidden_dropout", 0.0)), "initializer_range": hf.get("initializer_range", 0.02),
        "bos_token_id": hf.get("bos_token_id", 0), "eos_token_id": hf.get("eos_token_id", 0),
        "pad_token_id": hf.get("pad_token_id") if hf.get("pad_token_id") is not None else hf.get("eos_token_id", 0),
    }


def local_to_neox(local):
    """gpt_local config dict (NeoX-style) -> HF GPTNeoXConfig dict."""
    arch = architecture(local)
    head_dim = local["hidden_size"] // local["num_attention_heads"]
    return {
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "vocab_size": local["vocab_size"],
        "hidden_size": local["hidden_size"], "num_hidden_layers": local["num_hidden_layers"],
        "num_attention_heads": local["num_attention_heads"], "intermediate_size": local["intermediate_size"],
        "hidden_act": local.get("hidden_act", "gelu"), "rotary_pct": rotary_dim(head_dim, arch.rotary_percent) / head_dim,
        "rotary_emb_base": arch.rotary_base, "max_position_embeddings": local["max_position_embeddings"],
        "layer_norm_eps": local.get("layernorm_epsilon", 1e-5), "use_parallel_residual": arch.parallel_residual,
        "attention_bias": True, "tie_word_embeddings": not arch.untied, "rope_scaling": None,
        "hidden_dropout": local.get("hidden_dropout", 0.0), "attention_dropout": local.get("attention_dropout", 0.0),
        "initializer_range": local.get("initializer_range", 0.02), "bos_token_id": local.get("bos_token_id"),
        "eos_token_id": local.get("eos_token_id"), "torch_dtype": "float32",
    }


# ---------------------------------------------------------------------------------------------
# weight maps: (gpt_local name, HF names, kind); "{}" is the layer index. Entries whose gpt_local name is
# not in the model's parameter table (biases it lacks, the untied head of a tied model) are skipped.
LLAMA_MAP = [
    ("model.embedding.word_embeddings", ["model.embed_tokens.weight"], "copy"),
    ("model.final_layernorm.weight", ["model.norm.weight"], "copy"),
    ("output_layer.weight", ["lm_head.weight"], "copy"),
    ("model.layers.{}.input_layernorm.weight", ["model.layers.{}.input_layernorm.weight"], "copy"),
    ("model.layers.{}.attention.linear_qkv.weight",
     ["model.layers.{}.self_attn.q_proj.weight", "model.layers.{}.self_attn.k_proj.weight",
      "model.layers.{}.self_attn.v_proj.weight"], "groups"),
    ("model.layers.{}.attention.linear_qkv.bias",
     ["model.layers.{}.self_attn.q_proj.bias", "model.layers.{}.self_attn.k_proj.bias",
      "model.layers.{}.self_attn.v_proj.bias"], "groups"),
    ("model.layers.{}.attention.linear_proj.weight", ["model.layers.{}.self_attn.o_proj.weight"], "copy"),
    ("model.layers.{}.attention.linear_proj.bias", ["model.layers.{}.self_attn.o_proj.bias"], "copy"),
    ("model.layers.{}.post_attention_layernorm.weight", ["model.layers.{}.post_attention_layernorm.weight"], "copy"),
    ("model.layers.{}.mlp.linear_fc1.weight", ["model.layers.{}.mlp.up_proj.weight"], "copy"),
    ("model.layers.{}.mlp.linear_fc1.bias", ["model.layers.{}.mlp.up_proj.bias"], "copy"),
    ("model.layers.{}.mlp.linear_gate.weight", ["model.layers.{}.mlp.gate_proj.weight"], "copy"),
    ("model.layers.{}.mlp.linear_gate.bias", ["model.layers.{}.mlp.gate_proj.bias"], "copy"),
    ("model.layers.{}.mlp.linear_fc2.weight", ["model.layers.{}.mlp.down_proj.weight"], "copy"),
    ("model.layers.{}.mlp.linear_fc2.bias", ["model.layers.{}.mlp.down_proj.bias"], "copy"),
]
NEOX_MAP = [
    ("model.embedding.word_embeddings", ["gpt_neox.embed_in.weight"], "copy"),
    ("model.final_layernorm.weight", ["gpt_neox.final_layer_norm.weight"], "copy"),
    ("model.final_layernorm.bias", ["gpt_neox.final_layer_norm.bias"], "copy"),
    ("output_layer.weight", ["embed_out.weight"], "copy"),
] + [(f"model.layers.{{}}.{ours}.{p}", [f"gpt_neox.layers.{{}}.{theirs}.{p}"], "copy")
     for ours, theirs in (("input_layernorm", "input_layernorm"), ("post_attention_layernorm", "post_attention_layernorm"),
                          ("attention.linear_qkv", "attention.query_key_value"),  # [heads, 3, D]: ours already
                          ("attention.linear_proj", "attention.dense"), ("mlp.linear_fc1", "mlp.dense_h_to_4h"),
                          ("mlp.linear_fc2", "mlp.dense_4h_to_h"))
     for p in ("weight", "bias")]


class Family:
    """One Hugging Face architecture family: its config translations, weight map and tied-head name."""

    def __init__(self, name, hf_types, to_local, to_hf, weight_map, drop, tied_head):
        self.name, self.hf_types, self.to_local, self.to_hf = name, hf_types, to_local, to_hf
        self.weight_map, self.drop, self.tied_head = weight_map, drop, tied_head

    def entries(self, local):
        """[(gpt_local name, [HF names], kind)] for every tensor of the model ``local`` describes."""
        table = expected_shapes(local)
        out = []
        for ours, theirs, kind in self.weight_map:
            if "{}" not in ours:
                if ours in table:
                    out.append((ours, theirs, kind))
                continue
            for layer in range(local["num_hidden_layers"]):
                name = ours.format(layer)
                if name in table:
                    out.append((name, [t.format(layer) for t in theirs], kind))
        missing = sorted(set(table) - {name for name, _, _ in out})
        if missing:  # a parameter without an HF name: the map is incomplete for this combination of options
            raise CheckpointError(f"the {self.name} weight map has no Hugging Face name for '{missing[0]}'.")
        return out


FAMILIES = {
    "llama": Family("llama", LLAMA_TYPES, llama_to_local, local_to_llama, LLAMA_MAP,
                    drop=(".rotary_emb.inv_freq",), tied_head="lm_head.weight"),
    "gpt_neox": Family("gpt_neox", NEOX_TYPES, neox_to_local, local_to_neox, NEOX_MAP,
                       drop=(".rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias"),
                       tied_head="embed_out.weight"),
}


def family_of_hf(hf):
    """The family of an HF config.json (None for GPT-2, which ``hf_gpt2`` converts)."""
    model_type = hf.get("model_type")
    if model_type in hf_gpt2.GPT2_TYPES:
        return None
    for family in FAMILIES.values():
        if model_type in family.hf_types:
            return family
    known = ", ".join(hf_gpt2.GPT2_TYPES + LLAMA_TYPES + NEOX_TYPES)
    raise CheckpointError(f"config.json has model_type {model_type!r}; gpt_local converts {known} "
                          f"(GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, GPTNeoXForCausalLM).")


def family_of_local(local):
    """The HF family a gpt_local config exports as (None: GPT-2)."""
    arch = architecture(local)
    if not arch.rope and not arch.rmsnorm and not arch.gated and arch.bias and arch.qkv_bias and not arch.untied \
            and not arch.parallel_residual:
        return None
    if arch.rope and arch.rmsnorm and arch.gated and not arch.parallel_residual:
        return FAMILIES["llama"]
    if arch.rope and not arch.rmsnorm and not arch.gated and arch.bias and arch.qkv_bias \
            and arch.groups == local["num_attention_heads"]:
        return FAMILIES["gpt_neox"]
    raise CheckpointError(
        "this gpt_local model's layer options match no Hugging Face architecture gpt_local exports: GPT-2 "
        "(learned positions, LayerNorm, biases, tied head), Llama/Qwen2 (rope, RMSNorm, SwiGLU, sequential "
        "residual) or GPT-NeoX (rope, LayerNorm, biases, no grouped-query attention).")


# ---------------------------------------------------------------------------------------------
# tensor layouts
def expected_shapes(local):
    """gpt_local tensor name -> shape, from a gpt_local config dict (the parameter table)."""
    return {name: spec.shape for name, spec in parameter_table(local, Layout()).items()}


def _group_dims(local):
    heads = local["num_attention_heads"]
    groups = architecture(local).groups
    return groups, heads // groups, local["hidden_size"] // heads


def hf_shapes(kind, shape, local):
    """The HF tensors' shapes for a gpt_local tensor of ``shape``."""
    if kind == "copy":
        return [shape]
    groups, per_group, dim = _group_dims(local)
    rest = tuple(shape[1:])
    return [(groups * per_group * dim,) + rest, (groups * dim,) + rest, (groups * dim,) + rest]


def to_local(kind, arrays, local):
    """HF tensors -> the gpt_local tensor. groups: q [N*D, ...], k, v [G*D, ...] -> [(G, N/G + 2, D), ...]."""
    if kind == "copy":
        return arrays[0]
    groups, per_group, dim = _group_dims(local)
    q, k, v = arrays
    rest = q.shape[1:]
    parts = [q.reshape((groups, per_group, dim) + rest), k.reshape((groups, 1, dim) + rest),
             v.reshape((groups, 1, dim) + rest)]
    return np.ascontiguousarray(np.concatenate(parts, axis=1).reshape((-1,) + rest))


def to_hf(kind, array, local):
    """The gpt_local tensor -> its HF tensors, the exact inverse of ``to_local``."""
    if kind == "copy":
        return [array]
    groups, per_group, dim = _group_dims(local)
    rest = array.shape[1:]
    fused = array.reshape((groups, per_group + 2, dim) + rest)
    return [np.ascontiguousarray(fused[:, :per_group].reshape((-1,) + rest)),
            np.ascontiguousarray(fused[:, per_group].reshape((-1,) + rest)),
            np.ascontiguousarray(fused[:, per_group + 1].reshape((-1,) + rest))]


# ---------------------------------------------------------------------------------------------
# the two directions
def hf_to_ms(hf_dir, out, allow_pickle=False):
    """Convert a Hugging Face directory (any family, GPT-2 included) into a gpt_local model directory."""
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"--hf-dir {hf_dir} does not exist or is not a folder.")
    hf = _read_json(os.path.join(hf_dir, "config.json"), "--hf-dir")
    family = family_of_hf(hf)
    if family is None:
        return hf_gpt2.hf_to_ms(hf_dir, out, allow_pickle=allow_pickle)
    local = family.to_local(hf)
    _check_builds(local)
    source = TensorSource(hf_dir, allow_pickle)
    expected = expected_shapes(local)
    plan, used = [], set()
    for name, hf_names, kind in family.entries(local):
        for hf_name, shape in zip(hf_names, hf_shapes(kind, expected[name], local)):
            if hf_name not in source.files:
                raise CheckpointError(f"{hf_dir} lacks '{hf_name}' (gpt_local '{name}'), which config.json implies; "
                                      f"the config does not match these weights.")
            if source.shape(hf_name) != shape:
                raise CheckpointError(f"tensor '{hf_name}' has shape {source.shape(hf_name)}, config.json implies "
                                      f"{shape}; the config does not match these weights.")
            used.add(hf_name)
        plan.append((name, expected[name], np.float32,
                     lambda n=hf_names, k=kind: to_local(k, [source.get(x).astype(np.float32) for x in n], local)))
    _check_leftovers(source, used, family, local, hf_dir)
    return hf_gpt2.write_ms_dir(out, plan, local, hf_dir, family=family.name)


def _check_builds(local):
    """The translated config passes GPTLocalConfig's own checks (pure Python ones: rotary_percent ...)."""
    head_dim = local["hidden_size"] // local["num_attention_heads"]
    rot = rotary_dim(head_dim, local.get("rotary_percent", 1.0))
    if rot % 2 or rot == 0:
        _refuse(f"rotary dimensions {rot} (head_dim {head_dim} x rotary_pct) must be a positive even number.")
    groups = local.get("num_query_groups") or local["num_attention_heads"]
    if local["num_attention_heads"] % groups:
        _refuse(f"num_attention_heads ({local['num_attention_heads']}) is not divisible by num_key_value_heads "
                f"({groups}).")


def _check_leftovers(source, used, family, local, hf_dir):
    """Every HF tensor is converted, a dropped buffer, or a tied head equal to the token table."""
    for name in source.names():
        if name in used or name.endswith(family.drop):
            continue
        if name == family.tied_head and not architecture(local).untied:
            embedding = family.entries(local)[0][1][0]
            if not np.array_equal(source.get(name), source.get(embedding)):
                raise CheckpointError(f"{hf_dir}: {name} differs from the token embedding but config.json has "
                                      f"tie_word_embeddings=true; fix the config (false) to keep the head.")
            continue
        raise CheckpointError(f"tensor '{name}' of {hf_dir} has no place in a {family.name} model of this "
                              f"config.json ({local['num_hidden_layers']} layers); the config does not match "
                              f"these weights.")


def ms_to_hf(ms_dir, out):
    """Convert a gpt_local model directory into a Hugging Face directory of its family."""
    local = hf_gpt2.read_ms_config(ms_dir)
    family = family_of_local(local)
    if family is None:
        return hf_gpt2.ms_to_hf(ms_dir, out)
    lora = local.pop("pet_config", None)
    local.setdefault("intermediate_size", 4 * local["hidden_size"])
    reader = SafetensorsReader(resolve_weights_file(ms_dir))
    expected = expected_shapes(local)
    plan = []
    for name, hf_names, kind in family.entries(local):
        if name not in reader.header:
            raise CheckpointError(f"{reader.path} lacks '{name}'; not a gpt_local model of this config.")
        if reader.shape(name) != expected[name]:
            raise CheckpointError(f"tensor '{name}' has shape {reader.shape(name)}; config.json implies "
                                  f"{expected[name]}.")
        for index, (hf_name, shape) in enumerate(zip(hf_names, hf_shapes(kind, expected[name], local))):
            plan.append((hf_name, shape, np.float32,
                         lambda n=name, k=kind, i=index: to_hf(k, reader.get(n).astype(np.float32), local)[i]))
    plan.sort(key=lambda item: item[0])

    def build(staging):
        write_safetensors_streamed(os.path.join(staging, "model.safetensors"), plan, {"format": "pt"})
        with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(family.to_hf(local), handle, indent=2)
        _copy_tokenizer(ms_dir, staging, local["max_position_embeddings"])
        return {"tensors": len(plan), "lora_left_out": bool(lora), "family": family.name}
    return write_folder(out, build, CheckpointError)
