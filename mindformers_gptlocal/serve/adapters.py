"""``gptlocal serve --lora NAME=DIR ...``: the LoRA adapters one server serves on its base model, read and
checked before anything is built (pure Python + numpy).

An adapter directory is what a LoRA finetune writes (a model directory whose config.json has ``pet_config``
and whose model.safetensors holds ``*.lora_a`` / ``*.lora_b``), or a checkpoint of such a run: read by
``checkpoint/lora.py`` exactly as ``gptlocal lora merge`` reads it, so a served adapter computes what the
merged model computes (W + alpha/r B A; only the adapter tensors are taken, the directory's other weights
are not). Adapters may differ in rank, alpha and target Linears (``model/lora_cells.py`` ``MultiLoRALinear`` pads
ranks with zeros); they must fit the base: the same architecture keys in config.json, the same tokenizer,
and every A/B pair the shape of the base Linear it updates. Each refusal is one ConfigError naming the
adapter and what differs.
"""
import json
import os
import re

from ..errors import CheckpointError, ConfigError
from ..tokenizer_id import model_dir_id, short

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
# config.json keys that must agree between the base and an adapter's run
ARCH_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_query_groups",
             "intermediate_size", "hidden_act", "position_embedding_type", "rotary_percent", "rotary_base",
             "gated_linear_unit", "normalization", "add_bias_linear", "add_qkv_bias",
             "untie_embeddings_and_output_weights", "use_parallel_residual")


def parse_lora_options(values, served_name):
    """``--lora NAME=DIR`` values -> [(name, dir)]; one ConfigError per bad value (missing '=', bad or
    repeated name, the served model's own name, a folder that does not exist)."""
    out = []
    for value in values or ():
        name, sep, folder = value.partition("=")
        if not sep or not name or not folder:
            raise ConfigError(f"--lora {value!r} must be NAME=DIR (e.g. --lora sql=runs/sql/model).")
        if not NAME.match(name):
            raise ConfigError(f"--lora {value!r}: the name {name!r} must start with a letter or digit and hold "
                              f"only letters, digits and . _ : / -; it is the 'model' clients send.")
        if name == served_name or name in (n for n, _ in out):
            what = "the base model's served name" if name == served_name else "the name of another --lora"
            raise ConfigError(f"--lora {value!r}: {name!r} is already {what}; give each adapter its own name.")
        if not os.path.isdir(folder):
            raise ConfigError(f"--lora {value!r}: {folder} is not a directory; give the model directory (or "
                              f"checkpoint folder) of a LoRA finetune.")
        out.append((name, folder))
    return out


def _config(folder):
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def read_adapters(base_dir, specs, base_shapes):
    """[(name, dir)] -> [(name, {Linear path: (A, B)}, alpha / r)] plus one summary line per adapter.

    ``base_shapes``: {tensor name: shape} of the base weights (``safetensors_io.tensor_shapes``)."""
    from ..checkpoint.lora import read_adapter
    base_config = _config(base_dir) or {}
    if base_config.get("pet_config"):
        raise ConfigError(f"--model {base_dir} is itself a LoRA finetune (its config.json has pet_config); with "
                          f"--lora give the base model it was trained from, or fold its adapter in first "
                          f"(`gptlocal lora merge`) and serve the merged directory as the base.")
    base_tokenizer, _ = model_dir_id(base_dir)
    adapters, lines = [], []
    for name, folder in specs:
        try:
            weights, pairs, scaling, rank, alpha = read_adapter(folder)
        except CheckpointError as err:
            raise ConfigError(f"--lora {name}={folder}: {err}") from None
        config = _config(folder) or _config(os.path.dirname(os.path.abspath(weights)))
        if config is not None:
            for key in ARCH_KEYS:
                if config.get(key) != base_config.get(key):
                    raise ConfigError(f"--lora {name}={folder} was trained on another model: its config.json has "
                                      f"{key} {config.get(key)!r}, the base --model {base_dir} has "
                                      f"{base_config.get(key)!r}. Serve it with its own base model.")
        tokenizer, _ = model_dir_id(folder)
        if tokenizer and base_tokenizer and tokenizer != base_tokenizer:
            raise ConfigError(f"--lora {name}={folder} was trained with tokenizer {short(tokenizer)}, the base "
                              f"--model {base_dir} has {short(base_tokenizer)}; an adapter must share its base's "
                              f"tokenizer.")
        for linear, (a, b) in pairs.items():
            weight = base_shapes.get(linear + ".weight")
            if weight is None:
                raise ConfigError(f"--lora {name}={folder}: the base --model {base_dir} has no '{linear}.weight' "
                                  f"for the adapter on {linear}; the adapter belongs to another model.")
            if tuple(weight) != (b.shape[0], a.shape[1]) or a.shape[0] != b.shape[1]:
                raise ConfigError(f"--lora {name}={folder}: on {linear} B {b.shape} x A {a.shape} does not fit the "
                                  f"base weight {tuple(weight)}; the adapter belongs to another model size.")
        adapters.append((name, pairs, scaling))
        lines.append(f"{name}: {folder} (rank {rank}, alpha {alpha:g}, {len(pairs)} Linears)")
    return adapters, lines
