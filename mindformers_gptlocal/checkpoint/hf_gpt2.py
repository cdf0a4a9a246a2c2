"""Hugging Face GPT-2 <-> gpt_local: the ``gpt2`` family of the converter framework (``family.py``).

HF GPT-2 stores Conv1D weights as [in, out] and fuses Q, K, V as [q | k | v] along the output
axis. gpt_local stores linear weights as [out, in] and lays the fused QKV head-major,
[head, (q, k, v), head_dim], so a tensor-parallel column split keeps whole heads. Both
directions are transposes and reshapes only (kinds ``transpose``, ``qkv_weight``, ``qkv_bias``):
hf -> ms -> hf is bit-exact. HF names carry ``transformer.``; the original OpenAI files lack it, and
both read. The head is tied to the token embedding (``lm_head.weight``, when present, must equal it).

Output is written into ``<out>.partial-<pid>`` and renamed into place; a failure leaves nothing.
"""
from ..errors import CheckpointError
from ..model.fields import ACTIVATIONS
from . import family as framework
from .family import Family, expected_shapes

GPT2_TYPES = ("gpt2",)
GPT2_ACTIVATIONS = tuple(a for a in ACTIVATIONS if a not in ("silu", "swiglu"))  # the gated ones are Llama's
expected_local_shapes = expected_shapes  # the name tests and older callers use: the same function


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
# the weight map: (gpt_local name, [HF names], kind), both directions; "{}" is the layer index
GPT2_MAP = [
    ("model.embedding.word_embeddings", ["transformer.wte.weight"], "copy"),
    ("model.embedding.position_embeddings", ["transformer.wpe.weight"], "copy"),
    ("model.final_layernorm.weight", ["transformer.ln_f.weight"], "copy"),
    ("model.final_layernorm.bias", ["transformer.ln_f.bias"], "copy"),
] + [(f"model.layers.{{}}.{ours}", [f"transformer.h.{{}}.{theirs}"], kind) for ours, theirs, kind in (
    ("input_layernorm.weight", "ln_1.weight", "copy"), ("input_layernorm.bias", "ln_1.bias", "copy"),
    ("post_attention_layernorm.weight", "ln_2.weight", "copy"),
    ("post_attention_layernorm.bias", "ln_2.bias", "copy"),
    ("attention.linear_qkv.weight", "attn.c_attn.weight", "qkv_weight"),
    ("attention.linear_qkv.bias", "attn.c_attn.bias", "qkv_bias"),
    ("attention.linear_proj.weight", "attn.c_proj.weight", "transpose"),
    ("attention.linear_proj.bias", "attn.c_proj.bias", "copy"),
    ("mlp.linear_fc1.weight", "mlp.c_fc.weight", "transpose"),
    ("mlp.linear_fc1.bias", "mlp.c_fc.bias", "copy"),
    ("mlp.linear_fc2.weight", "mlp.c_proj.weight", "transpose"),
    ("mlp.linear_fc2.bias", "mlp.c_proj.bias", "copy"))]

GPT2 = Family("gpt2", GPT2_TYPES, gpt2_to_local_config, local_to_gpt2_config, GPT2_MAP,
              drop=(".attn.bias", ".attn.masked_bias"), tied_head="lm_head.weight", title="GPT-2",
              optional_prefix="transformer.",
              untie_hint="GPT-2 ties them, so this checkpoint cannot convert")


def local_to_hf_name(name):
    """gpt_local name -> (HF name, kind), read off the weight map (LoRA export names its adapters with it)."""
    parts = name.split(".")
    pattern = ".".join(parts[:2] + ["{}"] + parts[3:]) if parts[:2] == ["model", "layers"] and len(parts) > 3 \
        and parts[2].isdigit() else name
    entry = GPT2.names().get(pattern)
    if entry is None:
        raise CheckpointError(f"tensor '{name}' is not a gpt_local model tensor.")
    (hf,), kind = entry
    return (hf.format(parts[2]) if "{}" in hf else hf), kind


def hf_to_ms(hf_dir, out, allow_pickle=False):
    """Convert a Hugging Face GPT-2 directory into a gpt_local model directory. Returns a summary."""
    return framework.hf_to_ms(GPT2, hf_dir, out, allow_pickle=allow_pickle)


def ms_to_hf(ms_dir, out):
    """Convert a gpt_local model directory into a Hugging Face GPT-2 directory. Returns a summary."""
    return framework.ms_to_hf(GPT2, ms_dir, out)
