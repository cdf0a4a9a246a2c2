"""Prefix tuning / P-Tuning v2 (``pet_type: prefixtuning | ptuning2``): the settings from
``model_config.pet_config``, checked once, the prefix tensors' shapes, the frozen base and the tensor-parallel
layout, in pure Python; the Cells (``PrefixEncoder``, ``prefix_rows``) are ``prefix_cells.py``.

MindFormers' keys (mindformers/pet/pet_config.py PrefixTuningConfig / Ptuning2Config) with their defaults:
key -> (our field, default). prefixtuning always reparameterises through the MLP (MindFormers' adapter does).
"""
from collections import namedtuple

from ..errors import ConfigError
from ..parallel.sharding import DP, MP, OpRule
from .base import Method, PetSpec, get as _get, items

PREFIX_TYPES = ("prefixtuning", "ptuning2")
PREFIX_KEYS = {
    "prefixtuning": {"prefix_token_num": ("tokens", 128), "mid_dim": ("hidden", 512), "dropout_rate": ("dropout", 0.1)},
    "ptuning2": {"pre_seq_len": ("tokens", 128), "prefix_projection": ("projection", False),
                 "projection_dim": ("hidden", 128), "dropout_prob": ("dropout", 0.01)},
}
PREFIX_NAME = "prefix_encoder"  # the Cell under ``model.``: model.prefix_encoder.embedding, .transform_*


class PrefixSpec(namedtuple("PrefixSpec", "pet_type tokens projection hidden dropout"), PetSpec):
    """pet_type: prefixtuning / ptuning2, read by ``read``: no Cell in a layer (attention reads the rows of the
    model's ``prefix_encoder``); only the prefix trains."""
    __slots__ = ()
    plan_part = "prefix"
    adds_prefix = True
    freeze_include = freeze_exclude = None

    @property
    def dropout_rate(self):
        return self.dropout

    def layer_rules(self, index, act, arch):
        return list(PREFIX_BLOCK_RULES)

    def model_rules(self):
        return prefix_rules(self)

    def param_shapes(self, d, base):
        arch = d.get("arch")  # grouped-query attention: one prefix per key/value group
        kv_width = ((arch.groups if arch is not None else None) or d["heads"]) * (d["hidden"] // d["heads"])
        return {f"model.{PREFIX_NAME}.{name}": shape
                for name, shape in prefix_shapes(self, d["layers"], kv_width).items()}

    def check_config(self, config):
        if self.tokens + config.seq_length > config.max_position_embeddings:
            raise ConfigError(f"model_config.pet_config prefix of {self.tokens} tokens + model_config.seq_length "
                              f"{config.seq_length} is more than max_position_embeddings "
                              f"({config.max_position_embeddings}): the real tokens' positions start after the prefix "
                              f"(as peft's). Set seq_length: {config.max_position_embeddings - self.tokens} or fewer "
                              f"prefix tokens.")

    def is_frozen(self, name):
        return not is_prefix_name(name)  # the base model is frozen, only model.prefix_encoder.* trains

    def summary(self, model, trainable, total):
        return (f"[gptlocal] {self.pet_type}: {trainable:,} trainable parameters ({100.0 * trainable / total:.2g}% "
                f"of {total:,}), {self.tokens} prefix tokens a layer"
                + (f", MLP width {self.hidden}" if self.projection else ""))


def read(pet_config, num_layers=None, max_positions=None):  # pylint: disable=unused-argument
    """``pet_config`` of ``pet_type: prefixtuning | ptuning2`` -> PrefixSpec; None for any other pet_config.
    ``tokens``: the virtual tokens (prefix rows per layer); ``projection``: peft's reparameterisation MLP
    (``hidden``: its width); the real tokens' positions start after the prefix (as peft's), so the prefix
    must leave room in ``max_positions``. One ConfigError naming the key for every bad key or value."""
    if not pet_config or _get(pet_config, "pet_type") not in PREFIX_TYPES:
        return None
    pet_type = _get(pet_config, "pet_type")
    keys = PREFIX_KEYS[pet_type]
    for key, value in items(pet_config):
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


# The prefix tensors stay replicated (the table's columns are peft's layer-major [layers, 2, groups, head_dim], so
# no one-axis split gives a rank its groups, and they are small); each rank takes its own key/value groups where
# attention reads them, the Concats in front of the keys and values being (dp, mp, 1, 1) like the keys: a local
# slice of a replicated tensor (no communication), and the replicated parameters' gradients are all-reduced by
# MindSpore as for any replicated weight.
PREFIX_BLOCK_RULES = [
    OpRule("attention.prefix_concat.key", ((DP, MP, 1, 1), (DP, MP, 1, 1))),  # [B, G, P + K, D]: groups over mp
    OpRule("attention.prefix_concat.value", ((DP, MP, 1, 1), (DP, MP, 1, 1))),
    OpRule("attention.prefix_concat.mask", ((1, 1, 1, 1), (1, 1, 1, 1))),  # [b, 1, S, P + K], as add_mask's
]


def prefix_rules(spec, path=f"model.{PREFIX_NAME}"):
    """The PrefixEncoder's ops (``spec``: a PrefixSpec): everything replicated (see PREFIX_BLOCK_RULES)."""
    rules = [OpRule(f"{path}.cast", ((1, 1),), {0: f"{path}.embedding"})]
    if spec.projection:
        for dense in ("transform_in", "transform_out"):
            rules += [OpRule(f"{path}.{dense}.matmul", ((1, 1), (1, 1)), {1: f"{path}.{dense}.weight"}),
                      OpRule(f"{path}.{dense}.bias_add", ((1, 1), (1,)), {1: f"{path}.{dense}.bias"})]
        rules.append(OpRule(f"{path}.tanh", ((1, 1),)))
    rules.append(OpRule(f"{path}.dropout.dropout", ((1, 1, 1, 1),), optional=True))  # only with dropout > 0
    rules += [OpRule(f"{path}.transpose", ((1, 1, 1, 1),)),  # [P, 2L, G, D] -> [2L, G, P, D]
              OpRule(f"{path}.unstack", ((1, 1, 1, 1),))]  # -> 2L x [G, P, D]
    return rules


METHOD = Method(
    PREFIX_TYPES, read, is_prefix_name,
    lambda name: (f"checkpoint holds a prefix-tuning prefix (e.g. '{name}') but the model has none, so it would be "
                  f"ignored; build the model with the run's pet_config (a model directory's config.json has it)."),
    lambda name: (f"a prefix-tuning prefix (e.g. '{name}'), which is no update of the base weights, so it cannot be "
                  f"folded into them nor exported as a PEFT LoRA adapter; use the run's model directory as it is, or "
                  f"export the prefix with `gptlocal convert ms2hf --peft`."))
