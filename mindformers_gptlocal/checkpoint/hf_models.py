"""Hugging Face Llama-family and GPT-NeoX weights <-> gpt_local: two more families of the converter
framework (``family.py``; GPT-2 is ``hf_gpt2.py``), and the family choice ``gptlocal convert`` makes.

Each family is a config translation (both directions, refusing what would change the maths) and ONE weight
map, (gpt_local name, HF names, kind), that both directions read (litgpt's ``convert_hf_checkpoint`` design).
``hf_to_ms`` / ``ms_to_hf`` pick the family (from config.json, or from the gpt_local model's layer options).

Families:

- ``gpt2``: ``GPT2LMHeadModel`` (``hf_gpt2.py``).
- ``llama``: ``LlamaForCausalLM`` (Llama 1-3 without rope_scaling, TinyLlama, SmolLM, ...) and
  ``Qwen2ForCausalLM`` (q/k/v biases, no sliding window). Q, K and V ([heads*D, H], [groups*D, H] x 2)
  become the group-major fused QKV, [groups, (heads/groups q, k, v), D] (``model/attention.py``); HF's
  q/k rows are already in the rotate_half layout that gpt_local's rotary uses, so no permutation.
  gate_proj -> mlp.linear_gate, up_proj -> mlp.linear_fc1, down_proj -> mlp.linear_fc2.
- ``gpt_neox``: ``GPTNeoXForCausalLM`` (Pythia). Its fused query_key_value is already [heads, 3, D]:
  gpt_local's layout, copied as is; partial rotary (``rotary_pct``), parallel residual, LayerNorm.

Pure numpy: no MindSpore, no torch (except to read a weights-only ``.bin``).
"""
import os

from ..errors import CheckpointError
from ..model.arch import Arch, rotary_dim
from . import family as framework
from .family import Family
from .hf_gpt2 import GPT2, GPT2_TYPES
from .weights_io import read_json, read_ms_config

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
    arch = Arch.of(local)
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
    arch = Arch.of(local)
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


FAMILIES = {
    "gpt2": GPT2,
    "llama": Family("llama", LLAMA_TYPES, llama_to_local, local_to_llama, LLAMA_MAP,
                    drop=(".rotary_emb.inv_freq",), tied_head="lm_head.weight", title="Llama/Qwen2"),
    "gpt_neox": Family("gpt_neox", NEOX_TYPES, neox_to_local, local_to_neox, NEOX_MAP,
                       drop=(".rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias"),
                       tied_head="embed_out.weight", title="GPT-NeoX"),
}


def family_of_hf(hf):
    """The family of an HF config.json."""
    model_type = hf.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.hf_types:
            return family
    known = ", ".join(GPT2_TYPES + LLAMA_TYPES + NEOX_TYPES)
    raise CheckpointError(f"config.json has model_type {model_type!r}; gpt_local converts {known} "
                          f"(GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, GPTNeoXForCausalLM).")


def family_of_local(local):
    """The HF family a gpt_local config exports as."""
    arch = Arch.of(local)
    if not arch.rope and not arch.rmsnorm and not arch.gated and arch.bias and arch.qkv_bias and not arch.untied \
            and not arch.parallel_residual:
        return GPT2
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
# the two directions, the family picked for you
def hf_to_ms(hf_dir, out, allow_pickle=False):
    """Convert a Hugging Face directory (any family, GPT-2 included) into a gpt_local model directory."""
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"--hf-dir {hf_dir} does not exist or is not a folder.")
    hf = read_json(os.path.join(hf_dir, "config.json"), "--hf-dir")
    if hf.get("model_type") == "gpt_local":
        raise CheckpointError(f"--hf-dir {hf_dir} is already a gpt_local model directory (config.json model_type "
                              f"'gpt_local'): there is nothing to convert; generate, chat, serve and eval load it "
                              f"directly (--model {hf_dir}), and convert ms2hf --ms-dir {hf_dir} makes a Hugging "
                              f"Face one.")
    return framework.hf_to_ms(family_of_hf(hf), hf_dir, out, allow_pickle=allow_pickle, hf=hf)


def ms_to_hf(ms_dir, out):
    """Convert a gpt_local model directory into a Hugging Face directory of its family."""
    local = read_ms_config(ms_dir)
    return framework.ms_to_hf(family_of_local(local), ms_dir, out, local=local)
