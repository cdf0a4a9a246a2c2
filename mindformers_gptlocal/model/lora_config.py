"""LoRA and bottleneck-adapter settings from MindFormers' ``model_config.pet_config``, checked once, in pure Python.

A MindFormers user's YAML works unchanged::

    pet_config:
      pet_type: lora
      lora_rank: 8
      lora_alpha: 16
      lora_dropout: 0.05
      target_modules: '.*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2'
      freeze_include: ['*']
      freeze_exclude: ['*lora*']

The keys and their meaning are MindFormers' ``LoraConfig`` (mindformers/pet/pet_config.py):
``target_modules`` is matched with ``re.match`` against a Linear's attribute name (``linear_qkv``)
as MindFormers' ``recursive_replace_dense_cell`` does; we also accept a full match on its path
(``model.layers.0.attention.linear_qkv``), as PEFT does, so one layer can be chosen.
``exclude_layers`` (re.match on any attribute name along the path) skips a sub-tree;
``freeze_include``/``freeze_exclude`` are mindpet's ``freeze_modules`` fnmatch lists (a parameter
matched by both is left as it is, i.e. trainable). Everything here runs without MindSpore, so the
pre-flight (through ``GPTLocalConfig.validate``), ``gptlocal plan`` and ``convert`` use it.

``pet_type: adapter`` (``read_adapter_config``) gives an ``AdapterSpec`` instead: Houlsby bottleneck adapters
(``model/adapter.py``); its keys and defaults are documented in docs/finetune.md.
"""
import re
from collections import namedtuple
from fnmatch import fnmatch

from ..errors import ConfigError
from ..parallel.sharding import LINEAR_SPLITS

PET_TYPES = ("lora", "adapter")
# Our Linear Cells by path inside a block -> how tensor parallel splits their weight (column / row)
LINEARS = LINEAR_SPLITS
LORA_A, LORA_B = "lora_a", "lora_b"  # parameter names under the Linear; '*lora*' freeze patterns match them
INITS = ("normal", "zeros", "zero", "ones", "heuniform", "he_uniform", "xavier_uniform", "truncatednormal")

LoraSpec = namedtuple("LoraSpec", "rank alpha dropout target_modules exclude_layers freeze_include freeze_exclude "
                                  "a_init b_init")


def _get(pet_config, key, default=None):
    value = pet_config.get(key, default) if hasattr(pet_config, "get") else getattr(pet_config, key, default)
    return default if value is None else value


def read_pet_config(pet_config, num_layers):
    """``model_config.pet_config`` (dict or MindFormers' LoraConfig) -> LoraSpec, or None when absent.
    Every bad value is one ConfigError naming the key and the fix."""
    if not pet_config:
        return None
    pet_type = _get(pet_config, "pet_type")
    if pet_type in PREFIX_TYPES:  # prefix tuning / P-Tuning v2: no LoRA; read_prefix_config reads them
        return None
    if pet_type not in PET_TYPES:
        raise ConfigError(f"model_config.pet_config.pet_type {pet_type!r} is not supported by gpt_local; use "
                          f"pet_type: {' or '.join(PET_TYPES + PREFIX_TYPES)}.")
    if pet_type == "adapter":
        return read_adapter_config(pet_config, num_layers)
    rank = _get(pet_config, "lora_rank", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"model_config.pet_config.lora_rank must be a positive integer, got {rank!r}.")
    alpha = _get(pet_config, "lora_alpha", 16)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha == 0:
        raise ConfigError(f"model_config.pet_config.lora_alpha must be a non-zero number, got {alpha!r}.")
    dropout = _get(pet_config, "lora_dropout", 0.01)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"model_config.pet_config.lora_dropout must be in [0, 1), got {dropout!r}.")
    target = _get(pet_config, "target_modules")
    if not isinstance(target, str) or not target:
        raise ConfigError("model_config.pet_config.target_modules is missing; name the Linears to adapt, e.g. "
                          "'.*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2'.")
    try:
        re.compile(target)
    except re.error as err:
        raise ConfigError(f"model_config.pet_config.target_modules {target!r} is not a regular expression "
                          f"({err}).") from None
    exclude = _str_list(pet_config, "exclude_layers")
    include, keep = _str_list(pet_config, "freeze_include"), _str_list(pet_config, "freeze_exclude")
    if include is None and keep is None:
        raise ConfigError("model_config.pet_config needs freeze_include/freeze_exclude (MindFormers freezes the "
                          "base model by them); add freeze_include: ['*'] and freeze_exclude: ['*lora*'].")
    inits = []
    for key, default in (("lora_a_init", "heuniform"), ("lora_b_init", "zeros")):
        value = str(_get(pet_config, key, default)).lower()
        if value not in INITS:
            raise ConfigError(f"model_config.pet_config.{key} {value!r} is not an initializer gpt_local knows; "
                              f"use one of {', '.join(INITS)}.")
        inits.append(value)
    spec = LoraSpec(rank, float(alpha), float(dropout), target, exclude, include, keep, *inits)
    if not targeted_paths(spec, num_layers, gated=True):
        raise ConfigError(f"model_config.pet_config.target_modules {target!r} matches none of gpt_local's Linears "
                          f"({', '.join(n.split('.')[-1] for n in LINEARS)}; full paths like "
                          f"model.layers.0.attention.linear_qkv); e.g. use '.*linear_qkv|.*linear_proj'.")
    return spec


# --- bottleneck adapters (pet_type: adapter, model/adapter.py) -----------------------------------------------
# Houlsby et al. 2019: after the attention and after the MLP of a layer, x + up(act(down(x))). MindFormers 1.8
# names the type (PetType.ADAPTER) but defines no keys for it; the keys are mindpet's AdapterDense
# (``bottleneck_size``, ``non_linearity``) and adapter-transformers' (``reduction_factor``, ``mh_adapter``,
# ``output_adapter``), ``layers_to_transform`` is PEFT's.
ADAPTER_SITES = ("attention_adapter", "mlp_adapter")  # block attributes: after attention, after the MLP
NON_LINEARITIES = ("relu", "gelu", "gelu_new", "quick_gelu", "silu", "swish")
ADAPTER_KEYS = ("pet_type", "bottleneck_size", "reduction_factor", "non_linearity", "mh_adapter", "output_adapter",
                "layers_to_transform", "freeze_include", "freeze_exclude")

AdapterSpec = namedtuple("AdapterSpec", "bottleneck_size reduction_factor non_linearity sites layers "
                                        "freeze_include freeze_exclude")


def read_adapter_config(pet_config, num_layers):
    """pet_type: adapter -> AdapterSpec; one ConfigError naming the key for every bad value."""
    keys = pet_config.keys() if hasattr(pet_config, "keys") else vars(pet_config).keys()
    unknown = [k for k in keys if k not in ADAPTER_KEYS and _get(pet_config, k) is not None]
    if unknown:
        raise ConfigError(f"model_config.pet_config.{unknown[0]} is not a key of pet_type: adapter; its keys are "
                          f"{', '.join(ADAPTER_KEYS[1:])}. Remove it.")
    size, factor = _get(pet_config, "bottleneck_size"), _get(pet_config, "reduction_factor")
    if size is not None and factor is not None:
        raise ConfigError("model_config.pet_config sets both bottleneck_size and reduction_factor; keep one "
                          "(bottleneck_size = hidden_size / reduction_factor).")
    key, value = ("reduction_factor", factor) if factor is not None else ("bottleneck_size",
                                                                           64 if size is None else size)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"model_config.pet_config.{key} must be a positive integer (the adapter's bottleneck "
                          f"width{' is hidden_size / reduction_factor' if factor is not None else ''}), got "
                          f"{value!r}; e.g. {key}: {16 if factor is not None else 64}.")
    act = str(_get(pet_config, "non_linearity", "gelu")).lower()
    if act not in NON_LINEARITIES:
        raise ConfigError(f"model_config.pet_config.non_linearity {act!r} is not one gpt_local has; use one of "
                          f"{', '.join(NON_LINEARITIES)}.")
    sites = []
    for flag, site in (("mh_adapter", ADAPTER_SITES[0]), ("output_adapter", ADAPTER_SITES[1])):
        value = _get(pet_config, flag, True)
        if not isinstance(value, bool):
            raise ConfigError(f"model_config.pet_config.{flag} must be true or false, got {value!r}.")
        if value:
            sites.append(site)
    if not sites:
        raise ConfigError("model_config.pet_config.mh_adapter and output_adapter are both false, so no adapter "
                          "would be inserted; set one of them true.")
    layers = _get(pet_config, "layers_to_transform")
    if layers is None:
        layers = list(range(num_layers))
    elif isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if not isinstance(layers, (list, tuple)) or not layers or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers):
        raise ConfigError(f"model_config.pet_config.layers_to_transform must be a non-empty list of layer indices "
                          f"in [0, {num_layers}) (num_hidden_layers {num_layers}), got {layers!r}.")
    include, keep = _str_list(pet_config, "freeze_include"), _str_list(pet_config, "freeze_exclude")
    return AdapterSpec(size if factor is None else None, factor, act, tuple(sites), tuple(sorted(set(layers))),
                       include or ["*"], keep or ["*adapter*"])


def bottleneck_width(spec, hidden_size):
    """The adapter's bottleneck width: bottleneck_size, or hidden_size // reduction_factor (refused when 0)."""
    if spec.reduction_factor is None:
        return spec.bottleneck_size
    width = hidden_size // spec.reduction_factor
    if width < 1:
        raise ConfigError(f"model_config.pet_config.reduction_factor ({spec.reduction_factor}) is larger than "
                          f"hidden_size ({hidden_size}), so the adapter size would be 0; use a reduction_factor "
                          f"<= {hidden_size} or bottleneck_size.")
    return width


def is_adapter_spec(spec):
    return isinstance(spec, AdapterSpec)


def adapter_paths(spec, num_layers):
    """Full paths of the adapter Cells (``model.layers.0.attention_adapter``), layer by layer."""
    return [f"model.layers.{i}.{site}" for i in range(num_layers) if i in spec.layers for site in spec.sites]


def adapter_shapes(hidden_size, width):
    """One adapter's parameters, names relative to it: down [m, H] + bias, up [H, m] + bias."""
    return {"linear_down.weight": (width, hidden_size), "linear_down.bias": (width,),
            "linear_up.weight": (hidden_size, width), "linear_up.bias": (hidden_size,)}


def is_adapter_name(name):
    """A parameter of a bottleneck adapter (``model.layers.0.mlp_adapter.linear_up.weight``)."""
    return any(f".{site}." in name for site in ADAPTER_SITES)


def _str_list(pet_config, key):
    value = _get(pet_config, key)
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    value = list(value)
    if not value or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"model_config.pet_config.{key} must be a non-empty list of strings, got {value!r}.")
    return value


def is_target(spec, path):
    """Whether the Linear at ``path`` (``model.layers.3.mlp.linear_fc1``) gets an adapter."""
    parts = path.split(".")
    if spec.exclude_layers and any(re.match(p, part) for part in parts for p in spec.exclude_layers):
        return False
    return bool(re.match(spec.target_modules, parts[-1]) or re.fullmatch(spec.target_modules, path))


def targeted_paths(spec, num_layers, gated=False):
    """Full paths of the Linears that get an adapter, layer by layer (``model.layers.0.attention.linear_qkv``);
    ``mlp.linear_gate`` exists only in a gated (SwiGLU) MLP."""
    linears = [linear for linear in LINEARS if gated or linear != "mlp.linear_gate"]
    return [f"model.layers.{i}.{linear}" for i in range(num_layers) for linear in linears
            if is_target(spec, f"model.layers.{i}.{linear}")]


def lora_shapes(in_features, out_features, rank):
    """{lora_a: [rank, in], lora_b: [out, rank]}: PEFT's lora_A / lora_B weights."""
    return {LORA_A: (rank, in_features), LORA_B: (out_features, rank)}


def is_lora_name(name):
    return name.endswith((f".{LORA_A}", f".{LORA_B}"))


def is_frozen(spec, name):
    """mindpet's freeze_modules on one parameter name: frozen when it matches freeze_include and not
    freeze_exclude; matched by both, it is left trainable (as it was built)."""
    include = any(fnmatch(name, p) for p in spec.freeze_include or [])
    keep = any(fnmatch(name, p) for p in spec.freeze_exclude or [])
    return include and not keep


def check_trainable(spec, names):
    """The trainable names under the freeze lists; one ConfigError when none is left."""
    trainable = [n for n in names if not is_frozen(spec, n)]
    if not trainable:
        named, keep = ("'*.attention_adapter.*' and '*.mlp_adapter.*'", "*adapter*") if is_adapter_spec(spec) \
            else (f"'*.{LORA_A}' and '*.{LORA_B}'", "*lora*")
        raise ConfigError(f"model_config.pet_config freeze_include {spec.freeze_include} / freeze_exclude "
                          f"{spec.freeze_exclude} freeze every parameter, so nothing would train; the adapters are "
                          f"named {named}: use freeze_include: ['*'], freeze_exclude: ['{keep}'].")
    return trainable


def freeze(model, spec):
    """The freeze lists of ``spec`` (LoraSpec or AdapterSpec) applied to every parameter of ``model``; one
    ConfigError when none is left to train. Returns (trainable, total) parameter counts. Training state that is
    not a weight (the dropout counter ``dropout_step``) is left as it is and not counted."""
    from .params import is_weight  # pylint: disable=import-outside-toplevel  (params imports this module)
    params = {name: param for name, param in model.parameters_and_names() if is_weight(name)}
    check_trainable(spec, list(params))
    for name, param in params.items():
        param.requires_grad = not is_frozen(spec, name)
    total = sum(p.size for p in params.values())
    return sum(p.size for p in params.values() if p.requires_grad), total


def is_multi_lora_name(name):
    """A Parameter of ``serve --lora``'s MultiLoRALinear (stacks, index): built from the adapters, never in a
    checkpoint."""
    return name.rsplit(".", 1)[-1] in ("multi_lora_a", "multi_lora_b", "adapter_index")


# --- prefix tuning / P-Tuning v2 (model/prefix.py) ------------------------------------------------------------
# MindFormers' keys (mindformers/pet/pet_config.py PrefixTuningConfig / Ptuning2Config) with their defaults:
# key -> (our field, default). prefixtuning always reparameterises through the MLP (MindFormers' adapter does).
PREFIX_TYPES = ("prefixtuning", "ptuning2")
PREFIX_KEYS = {
    "prefixtuning": {"prefix_token_num": ("tokens", 128), "mid_dim": ("hidden", 512), "dropout_rate": ("dropout", 0.1)},
    "ptuning2": {"pre_seq_len": ("tokens", 128), "prefix_projection": ("projection", False),
                 "projection_dim": ("hidden", 128), "dropout_prob": ("dropout", 0.01)},
}
PREFIX_NAME = "prefix_encoder"  # the Cell under ``model.``: model.prefix_encoder.embedding, .transform_*
PrefixSpec = namedtuple("PrefixSpec", "pet_type tokens projection hidden dropout")


def read_prefix_config(pet_config, max_positions=None):
    """``pet_config`` of ``pet_type: prefixtuning | ptuning2`` -> PrefixSpec; None for any other pet_config.
    ``tokens``: the virtual tokens (prefix rows per layer); ``projection``: peft's reparameterisation MLP
    (``hidden``: its width); the real tokens' positions start after the prefix (as peft's), so the prefix
    must leave room in ``max_positions``. One ConfigError naming the key for every bad key or value."""
    if not pet_config or _get(pet_config, "pet_type") not in PREFIX_TYPES:
        return None
    pet_type = _get(pet_config, "pet_type")
    keys = PREFIX_KEYS[pet_type]
    items = pet_config.items() if hasattr(pet_config, "items") else vars(pet_config).items()
    for key, value in items:
        if key not in keys and key not in ("pet_type", "freeze_include", "freeze_exclude") and value is not None:
            raise ConfigError(f"model_config.pet_config.{key} is not a {pet_type} setting; {pet_type} takes "
                              f"{', '.join(keys)}. Remove {key}.")
    values = {"projection": True}  # prefixtuning: always the MLP, of width mid_dim
    for key, (field, default) in keys.items():
        value = _get(pet_config, key, default)
        if field == "projection":
            if not isinstance(value, bool):
                raise ConfigError(f"model_config.pet_config.{key} must be true or false, got {value!r}.")
        elif field == "dropout":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ConfigError(f"model_config.pet_config.{key} must be in [0, 1), got {value!r}.")
            value = float(value)
        elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"model_config.pet_config.{key} must be a positive integer, got {value!r}.")
        values[field] = value
    spec = PrefixSpec(pet_type, values["tokens"], values["projection"], values["hidden"], values["dropout"])
    if max_positions is not None and spec.tokens >= max_positions:
        key = next(k for k, (f, _) in keys.items() if f == "tokens")
        raise ConfigError(f"model_config.pet_config.{key} {spec.tokens} leaves no room in max_position_embeddings "
                          f"({max_positions}): the real tokens' positions start after the prefix. Use fewer "
                          f"prefix tokens (e.g. {max(1, max_positions // 8)}).")
    return spec


def prefix_shapes(spec, num_layers, kv_width):
    """The prefix Parameters under ``model.prefix_encoder.`` -> shape (peft's PrefixEncoder: ``embedding``
    [tokens, layers*2*kv_width], or with the MLP [tokens, kv_width] -> transform_in [hidden, kv_width] -> tanh
    -> transform_out [layers*2*kv_width, hidden]); kv_width = num_query_groups * head_dim."""
    out = num_layers * 2 * kv_width
    if not spec.projection:
        return {"embedding": (spec.tokens, out)}
    return {"embedding": (spec.tokens, kv_width), "transform_in.weight": (spec.hidden, kv_width),
            "transform_in.bias": (spec.hidden,), "transform_out.weight": (out, spec.hidden),
            "transform_out.bias": (out,)}


def is_prefix_name(name):
    return f".{PREFIX_NAME}." in f".{name}"
