"""``gptlocal migrate-yaml``: a MindFormers 1.x GPT-2 YAML (``configs/gpt2/run_gpt2*.yaml``) -> a gpt_local YAML.

Every key of the old YAML is mapped to its gpt_local / MindFormers 1.8 successor, kept as it is, or dropped
with one line saying so (the lines go into the new YAML's header and onto stdout). Keys the old YAMLs did not
have but a gpt_local run needs (``use_legacy: False``, ``load_ckpt_format``, the gpt_local callbacks) are added.
The old layout is read from mindspore-lab/mindformers, branch r1.3.0 (``configs/gpt2/``,
``mindformers/models/gpt2/gpt2_config.py``); the new one is that of ``model_configs/pretrain_gpt2_*.yaml``.
Pure Python: no MindSpore, no MindFormers.
"""
import copy
import os

from .. import yaml_io
from ..checkpoint.mf_gpt2 import MF_ACTIVATIONS
from ..data.mf_mindrecord import converted_path
from ..errors import ConfigError
from ..safetensors_io import atomic_write

DEVICES = ("CPU", "GPU", "Ascend")
COLUMNS = ["input_ids", "labels", "loss_mask", "position_ids"]
# MindFormers GPT2Config key -> gpt_local model_config key (values kept as they are)
MODEL_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
              "num_heads": "num_attention_heads", "seq_length": "seq_length",
              "max_position_embeddings": "max_position_embeddings", "hidden_dropout_rate": "hidden_dropout",
              "attention_dropout_rate": "attention_dropout", "embedding_dropout_prob": "embedding_dropout",
              "param_init_type": "params_dtype", "compute_dtype": "compute_dtype",
              "layernorm_compute_type": "layernorm_compute_dtype", "softmax_compute_type": "softmax_compute_dtype",
              "eos_token_id": "eos_token_id", "bos_token_id": "bos_token_id", "pad_token_id": "pad_token_id",
              "use_flash_attention": "use_flash_attention", "offset": "offset"}
# model_config keys with no gpt_local successor: the reason for each
MODEL_DROPPED = {
    "type": "GPT2Config -> model_type: gpt_local",
    "checkpoint_name_or_path": "weights come from load_checkpoint (a `gptlocal convert mf2ms` directory)",
    "use_prompt_flash_attention": "an Ascend inference kernel of MindFormers' GPT-2; gpt_local decodes with its "
                                  "own KV cache",
    "use_past": "gpt_local's generate always uses its KV cache",
    "repetition_penalty": "a generation setting; pass it to generate",
    "max_decode_length": "a generation setting; pass max_new_tokens to generate",
    "top_k": "a generation setting; pass it to generate", "top_p": "a generation setting; pass it to generate",
    "do_sample": "a generation setting; pass it to generate",
    "batch_size": "the batch comes from runner_config.batch_size",
    "num_labels": "sequence classification (GPT2ForSequenceClassification) is not part of gpt_local",
    "is_dynamic": "MindFormers' paged-attention inference setting", "block_size": "paged-attention setting",
    "num_blocks": "paged-attention setting",
}
TOP_DROPPED = {
    "remote_save_url": "ModelArts/AICC OBS upload; copy output_dir yourself",
    "auto_tune": "MindSpore 2.x has no auto_tune", "filepath_prefix": "auto_tune's folder",
    "autotune_per_step": "auto_tune's interval",
    "layer_scale": "ViT layer-wise lr decay, unused by GPT-2", "layer_decay": "ViT layer-wise lr decay, unused by GPT-2",
    "lr_scale": "MindFormers 1.8 has no lr_scale; scale learning_rate yourself",
    "lr_scale_factor": "MindFormers 1.8 has no lr_scale",
    "src_strategy_path_or_dir": "strategy of the old run; gpt_local checkpoints are full or split by `gptlocal ckpt`",
    "moe_config": "gpt_local is a dense model (expert_num 1)",
    "eval_callbacks": "ObsMonitor only (ModelArts OBS upload)",
    "processor": "the tokenizer comes from the model directory (tokenizer.json), not a GPT2Processor",
    "metric": None,  # mapped below
}
KEPT_TOP = ("seed", "run_mode", "output_dir", "only_save_strategy", "auto_trans_ckpt", "use_parallel",
            "micro_batch_interleave_num", "do_eval", "profile", "profile_start_step", "profile_stop_step",
            "init_start_profile", "profile_communication", "profile_memory")
CPU_CONTEXT_DROPPED = ("max_device_memory", "jit_config", "enable_graph_kernel", "ascend_config",
                       "memory_optimize_level")
OPTIMIZERS = ("FusedAdamWeightDecay", "AdamWeightDecay", "AdamW", "FusedAdamW", "adamw")
CHECKPOINT_MONITORS = ("CheckpointMonitor", "CheckpointMointor")  # MindFormers' old misspelled alias too


def migrate(old, device_target=None, model_dir=None):
    """(new YAML dict, notes) from an old MindFormers GPT-2 YAML dict. ``device_target`` overrides the old
    context.device_target; ``model_dir`` is a ``gptlocal convert mf2ms`` output to load and take the tokenizer
    from."""
    old = copy.deepcopy(old)
    notes = []
    model = old.pop("model", None) or {}
    model_config = model.get("model_config") or {}
    arch = (model.get("arch") or {}).get("type", "GPT2LMHeadModel")
    if model_config.get("type", "GPT2Config") != "GPT2Config" or arch not in ("GPT2LMHeadModel", "GPT2WithLora"):
        raise ConfigError(f"model.model_config.type {model_config.get('type')!r} / model.arch.type {arch!r}: "
                          f"migrate-yaml reads MindFormers' GPT-2 YAMLs (GPT2Config with GPT2LMHeadModel or "
                          f"GPT2WithLora) only.")
    context = dict(old.pop("context", None) or {})
    target = device_target or context.get("device_target") or "Ascend"
    if target not in DEVICES:
        raise ConfigError(f"--device-target {target!r} is not one of {', '.join(DEVICES)}.")
    if device_target and context.get("device_target") not in (None, device_target):
        notes.append(f"context.device_target {context.get('device_target')} -> {device_target} (--device-target)")
    context["device_target"] = target
    cpu = target == "CPU"

    new = {}
    for key in KEPT_TOP:
        if key in old:
            new[key] = old.pop(key)
    new["use_legacy"] = False
    new["load_ckpt_format"] = "safetensors"
    load = old.pop("load_checkpoint", "") or ""
    if model_dir:
        new["load_checkpoint"] = model_dir
        new["pretrained_model_dir"] = model_dir  # predict reads the tokenizer there
        if load:
            notes.append(f"load_checkpoint {load!r} -> {new['load_checkpoint']} (--model-dir)")
    else:
        new["load_checkpoint"] = ""
        if load:
            notes.append(f"load_checkpoint {load!r} dropped: gpt_local loads safetensors; run `gptlocal convert "
                         f"mf2ms --mf-ckpt {load} --out DIR` (a MindFormers name like 'gpt2' means its download: "
                         f"take HF's gpt2 with `gptlocal convert hf2ms`), then migrate again with --model-dir DIR")
    if old.pop("resume_training", False):
        notes.append("resume_training True -> False: a MindFormers 1.x training checkpoint does not resume in "
                     "gpt_local (mf2ms keeps its weights, drops the optimizer state)")
    new["resume_training"] = False

    new["trainer"] = _trainer(old.pop("trainer", None) or {}, notes)
    new["runner_config"] = _runner_config(old.pop("runner_config", None) or {}, cpu, notes)
    new["model"] = {"model_config": _model_config(model_config, arch, cpu, notes)}
    no_fp16 = new["model"]["model_config"].get("compute_dtype", "float32") != "float16"
    new["runner_wrapper"] = _runner_wrapper(old.pop("runner_wrapper", None), no_fp16, notes)
    new["optimizer"] = _optimizer(old.pop("optimizer", None) or {}, notes)
    new["lr_schedule"] = _lr_schedule(old.pop("lr_schedule", None) or {}, notes)
    new["context"] = _context(context, cpu, notes)
    parallel = old.pop("parallel", None)
    if parallel is not None:
        new["parallel"] = _parallel(parallel, notes)
    for key in ("parallel_config", "recompute_config"):
        if key in old:
            new[key] = old.pop(key)
    for split in ("train", "eval"):
        section = old.pop(f"{split}_dataset", None)
        old.pop(f"{split}_dataset_task", None)
        if section is not None:
            new[f"{split}_dataset"] = _dataset(section, split, notes)
            new[f"{split}_dataset_task"] = {"type": "CausalLanguageModelDataset",
                                            "dataset_config": new[f"{split}_dataset"]}
    new["callbacks"] = _callbacks(old.pop("callbacks", None) or [], model_dir, notes)
    if "metric" in old:
        metric = old.pop("metric")
        if (metric or {}).get("type") == "PerplexityMetric":
            new["metric"] = {"type": "GPTLocalPerplexityMetric"}
            notes.append("metric PerplexityMetric -> GPTLocalPerplexityMetric (the same perplexity on the mcore "
                         "path)")
        else:
            notes.append(f"metric {metric!r} dropped: gpt_local evaluates perplexity (GPTLocalPerplexityMetric) "
                         f"or lm-eval tasks (gptlocal eval)")
    if "moe_config" in old and ((old.get("moe_config") or {}).get("expert_num") or 1) > 1:
        raise ConfigError(f"moe_config.expert_num is {old['moe_config']['expert_num']}: mixture-of-experts GPT-2 "
                          f"does not migrate, gpt_local is a dense model.")
    for key in list(old):
        reason = TOP_DROPPED.get(key)
        if reason:
            notes.append(f"{key} dropped: {reason}")
        elif key.startswith("profile") or key == "profile_output":
            new[key] = old[key]
            continue
        else:
            notes.append(f"{key} dropped: not a key gpt_local or MindFormers 1.8 takes")
        old.pop(key)
    return new, notes


def _trainer(trainer, notes):
    name = trainer.get("model_name")
    if name and name != "gpt_local":
        notes.append(f"trainer.model_name {name!r} -> 'gpt_local' (MindFormers 1.8 has no GPT-2 of its own)")
    return {"type": trainer.get("type", "CausalLanguageModelingTrainer"), "model_name": "gpt_local"}


def _runner_config(runner, cpu, notes):
    taken = ("epochs", "batch_size", "sink_mode", "sink_size", "gradient_accumulation_steps")
    out = {k: runner[k] for k in taken if k in runner}
    out.setdefault("gradient_accumulation_steps", 1)
    if cpu and out.get("sink_mode"):
        notes.append("runner_config.sink_mode True -> False: data sinking is for Ascend/GPU (sink_size dropped)")
        out["sink_mode"] = False
        out.pop("sink_size", None)
    for key in sorted(set(runner) - set(taken)):
        notes.append(f"runner_config.{key} dropped: not a runner_config key of MindFormers 1.8")
    return out


def _model_config(mf, arch, cpu, notes):
    mf = dict(mf)
    out = {"model_type": "gpt_local", "architectures": ["GPTLocalForCausalLM"]}
    for old_key, new_key in MODEL_KEYS.items():
        if old_key in mf:
            out[new_key] = mf.pop(old_key)
    out.setdefault("seq_length", 1024)
    if "expand_ratio" in mf or "hidden_size" in out:
        out["intermediate_size"] = int(out.get("hidden_size", 768)) * int(mf.pop("expand_ratio", 4))
    act = mf.pop("hidden_act", "gelu")
    if act in MF_ACTIVATIONS:
        out["hidden_act"] = MF_ACTIVATIONS[act]
        if act == "gelu":
            notes.append("model_config.hidden_act gelu -> gelu_new (MindSpore's nn.GELU() is the tanh form)")
        elif act == "fast_gelu":
            notes.append("model_config.hidden_act fast_gelu -> quick_gelu (x * sigmoid(1.702 x), MindSpore's "
                         "FastGeLU primitive: the same function)")
    else:
        raise ConfigError(f"model.model_config.hidden_act {act!r} has no gpt_local activation that computes the "
                          f"same (gpt_local has {', '.join(MF_ACTIVATIONS.values())} for MindFormers' "
                          f"{', '.join(MF_ACTIVATIONS)}); set hidden_act: gelu in the old YAML for a new run.")
    out.setdefault("max_position_embeddings", out["seq_length"])
    if out["max_position_embeddings"] is None:
        out["max_position_embeddings"] = out["seq_length"]
    out.setdefault("layernorm_epsilon", 1e-5)  # MindFormers' LayerNorm default
    if mf.pop("post_layernorm_residual", False):
        raise ConfigError("model.model_config.post_layernorm_residual is True; gpt_local is a pre-LayerNorm GPT-2.")
    if cpu:
        for key in ("params_dtype", "compute_dtype", "layernorm_compute_dtype", "softmax_compute_dtype"):
            if out.get(key) == "float16":
                notes.append(f"model_config.{key} float16 -> float32 on CPU (fp16 matmuls run at half the fp32 "
                             f"speed there; bfloat16 is the CPU's reduced precision)")
                out[key] = "float32"
        if out.get("compute_dtype") == "bfloat16":
            notes.append("model_config.compute_dtype bfloat16 kept: on CPU the GEMMs run bf16 x bf16 -> float32, "
                         "the rest float32 (docs/configuration.md, Precision)")
        if out.get("use_flash_attention"):
            notes.append("model_config.use_flash_attention True -> False on CPU (no flash-attention kernel)")
            out["use_flash_attention"] = False
    pet = mf.pop("pet_config", None)
    if arch == "GPT2WithLora" or pet:
        out["pet_config"] = _pet_config(pet or {}, notes)
    for key in list(mf):
        reason = MODEL_DROPPED.get(key)
        notes.append(f"model_config.{key} dropped: {reason or 'not a gpt_local model key'}")
    return out


def _pet_config(pet, notes):
    from ..peft.prefix import PREFIX_KEYS
    if pet.get("pet_type") in PREFIX_KEYS:  # prefix tuning / P-Tuning v2: MindFormers' keys, as they are
        out = {"pet_type": pet["pet_type"], **{k: pet[k] for k in PREFIX_KEYS[pet["pet_type"]] if k in pet}}
        notes.append(f"pet_config {pet['pet_type']} kept (peft/prefix.py); the real tokens' positions follow the "
                     f"prefix, so seq_length + the prefix must fit max_position_embeddings")
        return out
    if pet.get("pet_type", "lora") != "lora":
        raise ConfigError(f"model.model_config.pet_config.pet_type {pet.get('pet_type')!r}: gpt_local has LoRA, "
                          f"prefixtuning and ptuning2.")
    out = {"pet_type": "lora", "lora_rank": pet.get("lora_rank", 8), "lora_alpha": pet.get("lora_alpha", 16),
           "lora_dropout": pet.get("lora_dropout", 0.0), "target_modules": ".*linear_qkv",
           "freeze_include": ["*"], "freeze_exclude": ["*lora*"]}
    notes.append(f"pet_config.target_modules {pet.get('target_modules', '.*dense1.*|.*dense3.*')!r} -> "
                 f"'.*linear_qkv': gpt_local's q, k, v are one fused Linear, so the adapter spans q, k and v "
                 f"(MindFormers' GPT2WithLora adapted q and v); freeze_include ['*'] / freeze_exclude ['*lora*'] "
                 f"freeze the base weights as GPT2WithLora did")
    return out


def _runner_wrapper(wrapper, no_fp16, notes):
    wrapper = dict(wrapper or {"type": "MFTrainOneStepCell"})
    old_type = wrapper.pop("type", "MFTrainOneStepCell")
    scale = wrapper.pop("scale_sense", 1.0)
    out = {"type": "GPTLocalTrainOneStepCell", "use_clip_grad": wrapper.pop("use_clip_grad", True),
           "max_grad_norm": wrapper.pop("max_grad_norm", 1.0)}
    notes.append(f"runner_wrapper {old_type} -> GPTLocalTrainOneStepCell (the same step; its overflow check also "
                 f"runs on CPU/GPU)")
    if isinstance(scale, dict) and no_fp16:
        notes.append(f"runner_wrapper.scale_sense {scale.get('type')} -> 1.0: an fp32 or bf16 model needs no loss "
                     f"scale (and takes the wrapper's lean step)")
        scale = 1.0
    out["scale_sense"] = scale
    for key in wrapper:
        notes.append(f"runner_wrapper.{key} dropped: not a GPTLocalTrainOneStepCell argument")
    return out


def _optimizer(optimizer, notes):
    kind = optimizer.get("type", "FusedAdamWeightDecay")
    if kind not in OPTIMIZERS:
        raise ConfigError(f"optimizer.type {kind!r}: migrate-yaml maps MindFormers' AdamW family "
                          f"({', '.join(OPTIMIZERS)}); set the optimizer of the new YAML by hand.")
    out = {"type": "GPTLocalAdamW",
           "betas": [optimizer.get("beta1", 0.9), optimizer.get("beta2", 0.999)] if "betas" not in optimizer
           else list(optimizer["betas"]),
           "eps": optimizer.get("eps", 1e-8), "weight_decay": optimizer.get("weight_decay", 0.0)}
    notes.append(f"optimizer {kind} -> GPTLocalAdamW (AdamW with decoupled weight decay, one fused kernel a "
                 f"parameter, every backend); beta1/beta2 -> betas")
    for key in sorted(set(optimizer) - {"type", "beta1", "beta2", "betas", "eps", "weight_decay"}):
        notes.append(f"optimizer.{key} dropped: not a GPTLocalAdamW argument")
    return out


def _lr_schedule(lr, notes):
    kind = lr.get("type", "polynomial")
    out = dict(lr)
    if kind == "polynomial":
        out["type"] = "PolynomialWithWarmUpLR"
        notes.append("lr_schedule polynomial -> PolynomialWithWarmUpLR (the class MindFormers 1.x registered "
                     "under that alias)")
    return out


def _context(context, cpu, notes):
    out = dict(context)
    if cpu:
        for key in ("device_id",) + CPU_CONTEXT_DROPPED:
            if key in out:
                notes.append(f"context.{key} dropped: an Ascend/GPU setting MindSpore only warns about on CPU")
                out.pop(key)
    return out


def _parallel(parallel, notes):
    out = dict(parallel)
    path = out.pop("strategy_ckpt_save_file", None)
    if path:
        out.setdefault("strategy_ckpt_config", {"save_file": path, "only_trainable_params": False})
        notes.append("parallel.strategy_ckpt_save_file -> parallel.strategy_ckpt_config.save_file (MindSpore 2.x)")
    return out


def _dataset(section, split, notes):
    out = dict(section)
    loader = dict(out.get("data_loader") or {})
    columns = out.get("input_columns") or ["input_ids"]
    if loader.get("type") != "MindDataset":
        raise ConfigError(f"{split}_dataset.data_loader.type {loader.get('type')!r}: migrate-yaml maps MindRecord "
                          f"(MindDataset) data, what MindFormers' GPT-2 read.")
    old_dir = loader.get("dataset_dir") or ""
    if old_dir:
        loader["dataset_dir"] = converted_path(old_dir)
        notes.append(f"{split}_dataset.data_loader.dataset_dir {old_dir} -> {loader['dataset_dir']}: write it once "
                     f"with `gptlocal prepare-data --from-mf-mindrecord {old_dir}`")
    else:
        notes.append(f"{split}_dataset.data_loader.dataset_dir is empty (as in MindFormers' own YAMLs): rewrite "
                     f"the old MindRecord with `gptlocal prepare-data --from-mf-mindrecord OLD` and set "
                     f"dataset_dir (or pass --{split}_dataset_dir)")
    out["data_loader"] = loader
    out["input_columns"] = list(COLUMNS)
    out["construct_args_key"] = list(COLUMNS)
    notes.append(f"{split}_dataset.input_columns {columns} -> {COLUMNS} (the rewritten data: labels shifted by "
                 f"one, the old mask as loss_mask)")
    return out


def _callbacks(callbacks, model_dir, notes):
    out = []
    for callback in callbacks:
        kind = (callback or {}).get("type")
        if kind == "MFLossMonitor":
            out.append(dict(callback))
        elif kind in CHECKPOINT_MONITORS:
            keep = {k: callback[k] for k in ("prefix", "save_checkpoint_steps", "keep_checkpoint_max")
                    if k in callback}
            out.append({"type": "GPTLocalCheckpointMonitor", **keep, "checkpoint_format": "safetensors"})
            gone = sorted(set(callback) - set(keep) - {"type"})
            notes.append(f"callbacks {kind} -> GPTLocalCheckpointMonitor (crash-safe safetensors; mcore saves "
                         f"no .ckpt){'; ' + ', '.join(gone) + ' dropped' if gone else ''}")
        elif kind == "ObsMonitor":
            notes.append("callbacks ObsMonitor dropped: ModelArts OBS upload; copy output_dir yourself")
        else:
            notes.append(f"callbacks {kind} dropped: not a callback gpt_local runs")
    out.append({"type": "GPTLocalThroughputMonitor", "per_print_times": 1})
    save = {"type": "GPTLocalSaveModelDir"}
    if model_dir:
        save["tokenizer_dir"] = model_dir
        if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
            notes.append(f"callbacks GPTLocalSaveModelDir.tokenizer_dir {model_dir} holds no tokenizer.json: the "
                         f"pre-flight will refuse the run (a model directory without its tokenizer); convert again "
                         f"with `gptlocal convert mf2ms ... --tokenizer DIR` (the old run's vocab.json + merges.txt)")
    out.append(save)
    return out


def migrate_file(path, out, device_target=None, model_dir=None):
    """Read the old YAML, write the new one with the notes as its header; returns the notes."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path} does not exist; give a MindFormers GPT-2 YAML (configs/gpt2/run_gpt2*.yaml).")
    new, notes = migrate(yaml_io.load_yaml(path), device_target=device_target, model_dir=model_dir)
    header = [f"# Migrated by `gptlocal migrate-yaml` from {os.path.basename(path)} (MindFormers 1.x GPT-2)."]
    header += [f"# - {note}" for note in notes]

    def write(tmp):  # renamed into place whole: an interrupted run leaves no half-written YAML
        yaml_io.dump_yaml(new, tmp)
        with open(tmp, encoding="utf-8") as handle:
            body = handle.read()
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write("\n".join(header) + "\n" + body)
    atomic_write(out, write)
    return notes
