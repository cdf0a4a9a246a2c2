"""MindFormers' own GPT-2 (the 1.x line, removed in 1.6) <-> gpt_local, exact both ways.

``gptlocal convert mf2ms`` reads a MindSpore ``.ckpt`` with MindFormers' GPT-2 names (``GPT2LMHeadModel``,
``GPT2WithLora``'s base weights, the 13B and 52B YAMLs: one module, other sizes) and writes a gpt_local model
directory through ``weights_io.write_ms_dir`` (config.json + model.safetensors + tokenizer); ``convert ms2mf`` writes
the same names back with ``ms.save_checkpoint``. The ``.ckpt`` is read with ``ms.load_checkpoint`` (protobuf, no
pickle).

MindFormers' layout, read from mindspore-lab/mindformers branch r1.3.0 (the same in r1.0 and r1.5.0):
- ``mindformers/models/gpt2/convert_weight.py``: the names, HF ``c_attn`` split into q, k, v along its output
  axis and each transposed; ``c_proj``, ``c_fc`` and the MLP ``c_proj`` copied untransposed; HF's ``attn.bias`` /
  ``attn.masked_bias`` buffers copied to ``attention.beta`` / ``attention.masked_beta`` when the state dict has
  them (they are a causal mask and -1e4, not weights: dropped here, not written back).
- ``mindformers/modules/transformer/transformer.py`` (``MultiHeadAttention``, ``FeedForward``) and
  ``mindformers/modules/layers.py`` (``Linear``: weight ``[out, in]`` when ``transpose_b=True``, else
  ``[in, out]``): ``dense1/2/3`` (q, k, v) are ``[out, in]``; ``attention.projection``, ``output.mapping`` and
  ``output.projection`` are ``transpose_b=False``, ``[in, out]`` as HF's Conv1D.
- ``mindformers/models/gpt2/gpt2.py``: ``GPTHead`` multiplies by the word embedding table (tied, no head
  tensor); learned positions of ``max_position_embeddings`` (default ``seq_length``); pre-LayerNorm with
  eps 1e-5 (``LayerNorm`` default); ``ffn_hidden_size = hidden_size * expand_ratio``; attention scaled by
  1/sqrt(head_dim) (q and k each by 1/sqrt(sqrt(head_dim))).
- ``hidden_act``: ``gelu`` is MindSpore's ``nn.GELU()`` with ``approximate=True``, the tanh form (gpt_local
  ``gelu_new``); ``fast_gelu`` (the xl, 13B and 52B YAMLs) is ``P.FastGeLU``, x * sigmoid(1.702 x): gpt_local's
  ``quick_gelu`` (HF's name), computed with the same primitive.

A ``Family`` of the converter framework (``family.py``) like the Hugging Face ones: one config translation each
way and ONE weight map, (gpt_local name, MindFormers names, kind), read by both directions, with the framework's
kinds (dense1/2/3 are ``groups``, the ``[in, out]`` Linears ``transpose``). Its own are the file format (a
``.ckpt``, no config.json: sizes from ``--mf-yaml`` or the shapes) and the training state it reports and drops.
"""
import os
import re

import numpy as np

from .. import yaml_io
from ..errors import CheckpointError
from ..model.arch import Arch
from ..safetensors_io import SafetensorsReader, resolve_weights_file
from ..staging import publish_file
from .family import Family, expected_shapes, foreign_shapes, to_foreign, to_local
from .weights_io import read_ms_config, write_ms_dir

# (gpt_local name, MindFormers names, kind); "{}" is the layer index.
# kinds (family.py): copy; transpose ([in, out] <-> [out, in]); groups (dense1/2/3, each [out, in] or [out], <->
# gpt_local's head-major fused [(head, (q, k, v), head_dim), in]).
MF_MAP = [
    ("model.embedding.word_embeddings", ["backbone.embedding.word_embedding.embedding_table"], "copy"),
    ("model.embedding.position_embeddings", ["backbone.embedding.position_embedding.embedding_table"], "copy"),
    ("model.final_layernorm.weight", ["backbone.layernorm.gamma"], "copy"),
    ("model.final_layernorm.bias", ["backbone.layernorm.beta"], "copy"),
    ("model.layers.{}.input_layernorm.weight", ["backbone.blocks.{}.layernorm1.gamma"], "copy"),
    ("model.layers.{}.input_layernorm.bias", ["backbone.blocks.{}.layernorm1.beta"], "copy"),
    ("model.layers.{}.attention.linear_qkv.weight",
     ["backbone.blocks.{}.attention.dense1.weight", "backbone.blocks.{}.attention.dense2.weight",
      "backbone.blocks.{}.attention.dense3.weight"], "groups"),
    ("model.layers.{}.attention.linear_qkv.bias",
     ["backbone.blocks.{}.attention.dense1.bias", "backbone.blocks.{}.attention.dense2.bias",
      "backbone.blocks.{}.attention.dense3.bias"], "groups"),
    ("model.layers.{}.attention.linear_proj.weight", ["backbone.blocks.{}.attention.projection.weight"], "transpose"),
    ("model.layers.{}.attention.linear_proj.bias", ["backbone.blocks.{}.attention.projection.bias"], "copy"),
    ("model.layers.{}.post_attention_layernorm.weight", ["backbone.blocks.{}.layernorm2.gamma"], "copy"),
    ("model.layers.{}.post_attention_layernorm.bias", ["backbone.blocks.{}.layernorm2.beta"], "copy"),
    ("model.layers.{}.mlp.linear_fc1.weight", ["backbone.blocks.{}.output.mapping.weight"], "transpose"),
    ("model.layers.{}.mlp.linear_fc1.bias", ["backbone.blocks.{}.output.mapping.bias"], "copy"),
    ("model.layers.{}.mlp.linear_fc2.weight", ["backbone.blocks.{}.output.projection.weight"], "transpose"),
    ("model.layers.{}.mlp.linear_fc2.bias", ["backbone.blocks.{}.output.projection.bias"], "copy"),
]
# buffers convert_weight.py copies from HF's attn.bias / attn.masked_bias: a causal mask and -1e4, not weights
MF_BUFFERS = re.compile(r"^backbone\.blocks\.\d+\.attention\.(beta|masked_beta)$")
# training state in a MindFormers training checkpoint (MFTrainOneStepCell + FusedAdamWeightDecay/AdamWeightDecay
# + CheckpointMonitor's appended values): reported, then dropped (see mf_to_ms)
OPTIMIZER_PREFIXES = ("adam_m.", "adam_v.", "moment1.", "moment2.", "accu_grads.", "accumulated_grads.")
TRAINING_SCALARS = ("global_step", "scale_sense", "current_iterator_step", "last_overflow_iterator_step",
                    "epoch_num", "step_num", "loss_scale", "beta1_power", "beta2_power", "learning_rate",
                    "global_batch_size", "learning_rate_scale")
# MindFormers hidden_act -> gpt_local hidden_act: nn.GELU() (approximate=True, the tanh form), P.FastGeLU
# (x * sigmoid(1.702 x), HF's quick_gelu; the same primitive in gpt_local), ReLU
MF_ACTIVATIONS = {"gelu": "gelu_new", "fast_gelu": "quick_gelu", "relu": "relu"}
MF_DEFAULTS = {"vocab_size": 50257, "hidden_size": 768, "num_layers": 12, "num_heads": 12, "expand_ratio": 4,
               "seq_length": 1024, "hidden_act": "gelu", "embedding_dropout_prob": 0.1, "hidden_dropout_rate": 0.1,
               "attention_dropout_rate": 0.1, "eos_token_id": 50256, "pad_token_id": 50256, "bos_token_id": 50256}
GPT2_HEAD_DIM = 64  # GPT-2 small ... xl; the 13B (128) and 52B (256) differ: give --mf-yaml for those


# ---------------------------------------------------------------------------------------------
# config translations
def read_mf_model_config(path):
    """``model.model_config`` of a MindFormers GPT-2 YAML (base_config merged), refused if it is not one."""
    if not os.path.isfile(path):
        raise CheckpointError(f"--mf-yaml {path} does not exist.")
    config = yaml_io.load_yaml(path)
    model_config = (config.get("model") or {}).get("model_config")
    if not isinstance(model_config, dict):
        raise CheckpointError(f"--mf-yaml {path} has no model.model_config mapping; give the YAML the checkpoint "
                              f"was trained with (configs/gpt2/run_gpt2*.yaml).")
    if model_config.get("type") not in (None, "GPT2Config"):
        raise CheckpointError(f"--mf-yaml {path}: model.model_config.type is {model_config.get('type')!r}, not "
                              f"GPT2Config; this converter reads MindFormers' GPT-2 only.")
    return model_config


def mf_to_local_config(mf):
    """MindFormers GPT2Config values -> gpt_local config dict; refuses what would change the maths."""
    values = {**MF_DEFAULTS, **{k: v for k, v in mf.items() if v is not None}}
    act = values["hidden_act"]
    if act not in MF_ACTIVATIONS:
        raise CheckpointError(f"model_config.hidden_act {act!r} is not supported for conversion (gpt_local "
                              f"converts {', '.join(MF_ACTIVATIONS)}); another activation would change every logit.")
    if values.get("post_layernorm_residual"):
        raise CheckpointError("model_config.post_layernorm_residual is True; gpt_local is a pre-LayerNorm "
                              "GPT-2 (the MindFormers default, False).")
    experts = (values.get("moe_config") or {}).get("expert_num", 1) if isinstance(values.get("moe_config"), dict) else 1
    if experts and experts > 1:
        raise CheckpointError(f"model_config.moe_config.expert_num is {experts}; mixture-of-experts GPT-2 does "
                              f"not convert, gpt_local is a dense model.")
    hidden, heads = int(values["hidden_size"]), int(values["num_heads"])
    if hidden % heads:
        raise CheckpointError(f"model_config.hidden_size {hidden} is not a multiple of num_heads {heads}.")
    positions = int(values.get("max_position_embeddings") or values["seq_length"])
    return {
        "model_type": "gpt_local", "architectures": ["GPTLocalForCausalLM"],
        "vocab_size": int(values["vocab_size"]), "hidden_size": hidden, "num_hidden_layers": int(values["num_layers"]),
        "num_attention_heads": heads, "intermediate_size": hidden * int(values["expand_ratio"]),
        "max_position_embeddings": positions, "seq_length": int(values["seq_length"]), "layernorm_epsilon": 1e-5,
        "hidden_act": MF_ACTIVATIONS[act], "hidden_dropout": float(values["hidden_dropout_rate"]),
        "attention_dropout": float(values["attention_dropout_rate"]),
        "embedding_dropout": float(values["embedding_dropout_prob"]), "initializer_range": 0.02,
        "bos_token_id": int(values["bos_token_id"]), "eos_token_id": int(values["eos_token_id"]),
        "pad_token_id": int(values["pad_token_id"]),
    }


def local_to_mf_config(local):
    """gpt_local config dict -> MindFormers GPT2Config values (``model.model_config`` of a 1.x YAML)."""
    inverse = {v: k for k, v in MF_ACTIVATIONS.items()}
    return {
        "type": "GPT2Config", "vocab_size": local["vocab_size"], "hidden_size": local["hidden_size"],
        "num_layers": local["num_hidden_layers"], "num_heads": local["num_attention_heads"],
        "expand_ratio": local["intermediate_size"] // local["hidden_size"], "seq_length": local["seq_length"],
        "max_position_embeddings": local["max_position_embeddings"],
        "hidden_act": inverse[local.get("hidden_act", "gelu_new")],
        "hidden_dropout_rate": local.get("hidden_dropout", 0.1), "attention_dropout_rate": local.get("attention_dropout", 0.1),
        "embedding_dropout_prob": local.get("embedding_dropout", 0.1), "eos_token_id": local.get("eos_token_id", 50256),
        "bos_token_id": local.get("bos_token_id", 50256), "pad_token_id": local.get("pad_token_id", 50256),
    }


def sizes_from_shapes(shapes):
    """MindFormers GPT2Config sizes read off a checkpoint's shapes (the head count cannot be: hidden / 64)."""
    def shape(name):
        if name not in shapes:
            raise CheckpointError(f"the checkpoint lacks '{name}', so its sizes cannot be read; it does not look "
                                  f"like a MindFormers GPT-2 checkpoint (or give --mf-yaml).")
        return shapes[name]
    vocab, hidden = shape(MF_MAP[0][1][0])
    positions = shape(MF_MAP[1][1][0])[0]
    layers = 1 + max((int(m.group(1)) for m in (re.match(r"backbone\.blocks\.(\d+)\.", n) for n in shapes) if m),
                     default=-1)
    ffn = shape("backbone.blocks.0.output.mapping.weight")[1]
    if ffn % hidden:
        raise CheckpointError(f"output.mapping.weight is {shapes['backbone.blocks.0.output.mapping.weight']}: its "
                              f"width {ffn} is not a multiple of hidden_size {hidden} (MindFormers' expand_ratio).")
    return {"vocab_size": vocab, "hidden_size": hidden, "num_layers": layers, "num_heads": max(hidden // GPT2_HEAD_DIM, 1),
            "expand_ratio": ffn // hidden, "seq_length": positions, "max_position_embeddings": positions}


MF_GPT2 = Family("mindformers_gpt2", ("GPT2Config",), mf_to_local_config, local_to_mf_config, MF_MAP,
                 title="MindFormers GPT-2")


# ---------------------------------------------------------------------------------------------
# names and layouts
def classify(name):
    """'buffer', 'optimizer' or 'training' for MindFormers non-weight entries, else None."""
    if MF_BUFFERS.match(name):
        return "buffer"
    if name.startswith(OPTIMIZER_PREFIXES):
        return "optimizer"
    if name in TRAINING_SCALARS:
        return "training"
    return None


# ---------------------------------------------------------------------------------------------
def load_mf_checkpoint(path):
    """name -> numpy array of a MindSpore .ckpt, read with MindSpore's own loader (protobuf, no pickle)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"--mf-ckpt {path} does not exist or is not a file.")
    import mindspore as ms
    try:
        params = ms.load_checkpoint(path)
    except Exception as err:  # MindSpore raises ValueError/RuntimeError variants for damaged files
        raise CheckpointError(f"--mf-ckpt {path} is not a readable MindSpore checkpoint ({err}).") from err
    out = {}
    for name, value in params.items():
        data = value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)
        out[name] = data
    return out


def mf_to_ms(mf_ckpt, out, mf_yaml=None, tokenizer=None, num_heads=None):
    """Convert a MindFormers GPT-2 ``.ckpt`` into a gpt_local model directory. Returns a summary with the
    training state found (``dropped``) and the notes to print."""
    tensors = load_mf_checkpoint(mf_ckpt)
    notes = []
    shapes = {name: tuple(a.shape) for name, a in tensors.items()}
    if mf_yaml:
        mf = read_mf_model_config(mf_yaml)
    else:
        mf = sizes_from_shapes(shapes)
        if num_heads:
            mf["num_heads"] = int(num_heads)
        else:
            notes.append(f"no --mf-yaml: sizes read from the checkpoint's shapes, num_heads {mf['num_heads']} "
                         f"assumed (hidden_size / {GPT2_HEAD_DIM}, right for GPT-2 small..xl; give --mf-yaml or "
                         f"--num-heads otherwise), hidden_act gelu (MindFormers' default).")
    if num_heads and mf_yaml and int(num_heads) != int(mf.get("num_heads", MF_DEFAULTS["num_heads"])):
        raise CheckpointError(f"--num-heads {num_heads} disagrees with --mf-yaml's num_heads {mf.get('num_heads')}.")
    local = mf_to_local_config(mf)
    if tokenizer and not os.path.isdir(tokenizer):
        raise CheckpointError(f"--tokenizer {tokenizer} is not a folder (it should hold tokenizer.json, or "
                              f"vocab.json + merges.txt).")
    expected = expected_shapes(local)
    problems, plan, used = [], [], set()
    for name, mf_names, kind in MF_GPT2.entries(local):
        want = foreign_shapes(kind, expected[name], local)
        absent = [n for n in mf_names if n not in tensors]
        if absent:
            problems.append(f"missing {', '.join(absent)}")
            continue
        used.update(mf_names)
        wrong = [f"{n} is {shapes[n]}, expected {w}" for n, w in zip(mf_names, want) if shapes[n] != w]
        if wrong:
            problems.extend(wrong)
            continue
        plan.append((name, expected[name], np.float32,
                     lambda n=mf_names, k=kind: to_local(k, [tensors[x].astype(np.float32) for x in n], local)))
    dropped = {"buffer": [], "optimizer": [], "training": {}}
    unknown = []
    for name in tensors:
        if name in used:
            continue
        kind = classify(name)
        if kind is None:
            unknown.append(name)
        elif kind == "training":
            value = tensors[name]
            dropped["training"][name] = value.item() if value.size == 1 else list(value.shape)
        else:
            dropped[kind].append(name)
    if unknown:
        lora = [n for n in unknown if "lora" in n.lower()]
        problems.append(f"unknown tensor(s) {', '.join(sorted(unknown)[:20])}"
                        f"{f' (and {len(unknown) - 20} more)' if len(unknown) > 20 else ''}"
                        + (f" ({len(lora)} are GPT2WithLora adapters: mf2ms converts base weights; merge the "
                           f"adapters into them in MindFormers first, or convert the base checkpoint and finetune "
                           f"LoRA again with the migrated YAML)" if lora else ""))
    if any(" expected " in p for p in problems):
        problems.append("a checkpoint saved with integrated_save: False (the xl/13B/52B YAMLs) holds one rank's "
                        "slice: merge the ranks into one file first (mindspore.transform_checkpoints with the "
                        "run's strategy file, or MindFormers' own merge)")
    if problems:
        where = f"--mf-yaml {mf_yaml}" if mf_yaml else "the sizes read from its shapes"
        raise CheckpointError(f"--mf-ckpt {mf_ckpt} does not match a MindFormers GPT-2 of {where} "
                              f"(hidden_size {local['hidden_size']}, num_layers {local['num_hidden_layers']}, "
                              f"vocab_size {local['vocab_size']}, positions {local['max_position_embeddings']}, "
                              f"ffn {local['intermediate_size']}): {len(problems)} problem(s): "
                              + "; ".join(problems))
    if dropped["optimizer"] or dropped["training"]:
        state = ", ".join(f"{k}={v}" for k, v in sorted(dropped["training"].items()))
        notes.append(f"training state dropped: {len(dropped['optimizer'])} optimizer moment tensors"
                     f"{', ' + state if state else ''}. The model directory holds weights only; start the migrated "
                     f"run from it with load_checkpoint (a fresh optimizer), not resume_training.")
    summary = write_ms_dir(out, plan, local, tokenizer, dropped=dropped, notes=notes)
    return summary


def ms_to_mf(ms_dir, out):
    """Convert a gpt_local model directory (GPT-2 architecture) into a MindFormers GPT-2 ``.ckpt``."""
    local = read_ms_config(ms_dir)
    local.setdefault("intermediate_size", 4 * local["hidden_size"])
    local.setdefault("max_position_embeddings", 1024)
    local.setdefault("seq_length", local["max_position_embeddings"])
    arch = Arch.of(local)
    if arch.rope or arch.gated or arch.rmsnorm or arch.untied or not arch.bias or arch.parallel_residual or \
            local.get("hidden_act", "gelu_new") not in MF_ACTIVATIONS.values() or \
            local.get("scale_attn_by_inverse_layer_idx") or local.get("pet_config"):
        raise CheckpointError(f"--ms-dir {ms_dir} is not a plain GPT-2 (learned positions, LayerNorm, biases, tied "
                              f"head, hidden_act {' or '.join(MF_ACTIVATIONS.values())}, no LoRA); MindFormers' "
                              f"GPT-2 cannot hold it.")
    if local["intermediate_size"] % local["hidden_size"]:
        raise CheckpointError(f"--ms-dir {ms_dir}: intermediate_size {local['intermediate_size']} is not a "
                              f"multiple of hidden_size; MindFormers' GPT-2 has ffn = hidden_size * expand_ratio.")
    if not out.endswith(".ckpt"):
        raise CheckpointError(f"--out {out}: give a file name ending in .ckpt (MindSpore's checkpoint format).")
    reader = SafetensorsReader(resolve_weights_file(ms_dir))
    expected = expected_shapes(local)
    problems = [f"missing {n}" for n in expected if n not in reader.names()]
    problems += [f"{n} is {reader.shape(n)}, expected {s}" for n, s in expected.items()
                 if n in reader.names() and reader.shape(n) != tuple(s)]
    if problems:
        raise CheckpointError(f"--ms-dir {ms_dir} does not match its config.json: " + "; ".join(problems))
    import mindspore as ms
    entries = []
    for name, mf_names, kind in MF_GPT2.entries(local):
        arrays = to_foreign(kind, reader.get(name).astype(np.float32), local)
        entries.extend({"name": n, "data": ms.Tensor(a)} for n, a in zip(mf_names, arrays))
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    partial = f"{out}.partial-{os.getpid()}.ckpt"
    try:
        ms.save_checkpoint(entries, partial)
        publish_file(partial, out)  # MindSpore writes 0400: the umask's mode
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return {"tensors": len(entries), "out": out, "mf_config": local_to_mf_config(local)}
