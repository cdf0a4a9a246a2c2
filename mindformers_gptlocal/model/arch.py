"""``Arch``: the architecture of a gpt_local model, described once (pure Python, no MindSpore).

The YAML's ``model_config`` (a dict, a ``GPTLocalConfig`` or any object with its attributes) is read
once by ``Arch.of``: GPT-2 names (``n_layer``, ``n_embd`` ...) resolved to ours (``GPT2_ALIASES``),
absent keys filled from ``DEFAULTS`` (GPT-2 small; ``GPTLocalConfig``'s signature reads the same table),
and every value that depends on others derived in ``__post_init__`` (as litgpt's ``Config`` does):
``head_dim``, ``groups`` (key/value heads), ``gated`` (SwiGLU), ``untied`` (own output head),
``bias``/``qkv_bias``, ``rope``/``learned_positions``, ``rotary_dim``, ``rmsnorm``, ``parallel_residual``.
``check`` applies every architecture rule, one ``ConfigError`` per rule naming the key and the fix.

Everything that needs these facts reads an ``Arch``: ``GPTLocalConfig`` (``config.arch``, built once),
the parameter table (``params.py``), the sharding rules (``parallel/sharding.py``, handed the Arch),
the planner (``plan/memory.py`` through ``params.dims``), the converters (``params.architecture``)
and the Cells (``attention.py``, ``gpt.py``).
"""
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..parallel.layout import config_value
from ..parallel.rules import seq_length_problem

# GPT-2 (Hugging Face) names and MindFormers' mcore names -> ours; GPTLocalConfig accepts every one.
GPT2_ALIASES = {
    "n_layer": "num_hidden_layers", "num_layers": "num_hidden_layers",
    "n_head": "num_attention_heads", "num_heads": "num_attention_heads",
    "n_embd": "hidden_size", "n_inner": "intermediate_size", "ffn_hidden_size": "intermediate_size",
    "n_positions": "max_position_embeddings", "layer_norm_epsilon": "layernorm_epsilon",
    "activation_function": "hidden_act", "resid_pdrop": "hidden_dropout", "attn_pdrop": "attention_dropout",
    "embd_pdrop": "embedding_dropout", "param_init_type": "params_dtype",
}

ACTIVATIONS = ("gelu_new", "gelu", "relu", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu", "silu", "swiglu")
POSITION_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")

# The architecture keys of model_config and their defaults (GPT-2 small: learned positions, LayerNorm, biases,
# tied head, sequential residual). None: derived (intermediate_size 4 * hidden, num_query_groups one per head,
# add_qkv_bias = add_bias_linear). MindFormers' TransformerConfig names.
SIZE_DEFAULTS = {"vocab_size": 50257, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                 "intermediate_size": None, "max_position_embeddings": 1024, "seq_length": 1024}
ARCH_DEFAULTS = {"hidden_act": "gelu_new", "position_embedding_type": "learned_absolute", "rotary_percent": 1.0,
                 "rotary_base": 10000.0, "num_query_groups": None, "gated_linear_unit": False,
                 "normalization": "LayerNorm", "add_bias_linear": True, "add_qkv_bias": None,
                 "untie_embeddings_and_output_weights": False, "use_parallel_residual": False}
DEFAULTS = {**SIZE_DEFAULTS, **ARCH_DEFAULTS}
# the layer choices, in the order ``gptlocal plan --json`` lists them ("arch")
LAYER_CHOICES = ("rope", "rotary_percent", "rotary_base", "groups", "gated", "rmsnorm", "bias", "qkv_bias", "untied",
                 "parallel_residual")
_FLOATS = ("rotary_percent", "rotary_base")
_BOOLS = ("gated_linear_unit", "add_bias_linear", "untie_embeddings_and_output_weights", "use_parallel_residual")


def rotary_dim(head_dim, rotary_percent):
    """Channels of each head that rotary embeddings turn (the first ones, as NeoX's rotary_pct does)."""
    return int(round(head_dim * rotary_percent))


def number(key, value):
    """float(value), or a ConfigError naming the key (YAML may hand strings such as '1e-5', which are fine)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"model_config.{key} must be a number, got {value!r}.") from None


def _whole(value):
    return isinstance(value, int) and not isinstance(value, bool)


def model_value(config, key, default=None):
    """``key`` of a model config (dict or object) or of its GPT-2 alias; None counts as absent."""
    value = config_value(config, key, None)
    if value is None:
        for alias, name in GPT2_ALIASES.items():
            if name == key and config_value(config, alias, None) is not None:
                return config_value(config, alias)
    return default if value is None else value


@dataclass(frozen=True)
class Arch:  # pylint: disable=too-many-instance-attributes
    """The model's sizes and layer choices (aliases resolved, defaults filled, None-means-derived keys resolved),
    and what they imply.

    Build with ``Arch.of(model_config)``; reading never raises for bad sizes (``gptlocal plan`` reports
    them), ``check()`` does. Equal descriptions compare equal."""

    vocab_size: object = DEFAULTS["vocab_size"]
    hidden_size: object = DEFAULTS["hidden_size"]
    num_hidden_layers: object = DEFAULTS["num_hidden_layers"]
    num_attention_heads: object = DEFAULTS["num_attention_heads"]
    intermediate_size: object = None
    max_position_embeddings: object = DEFAULTS["max_position_embeddings"]
    seq_length: object = DEFAULTS["seq_length"]
    hidden_act: str = DEFAULTS["hidden_act"]
    position_embedding_type: str = DEFAULTS["position_embedding_type"]
    rotary_percent: float = DEFAULTS["rotary_percent"]
    rotary_base: float = DEFAULTS["rotary_base"]
    num_query_groups: object = None
    gated_linear_unit: bool = False
    normalization: str = DEFAULTS["normalization"]
    add_bias_linear: bool = True
    add_qkv_bias: object = None
    untie_embeddings_and_output_weights: bool = False
    use_parallel_residual: bool = False
    # derived in __post_init__
    inter: object = field(init=False)
    head_dim: object = field(init=False)
    groups: object = field(init=False)
    group_size: object = field(init=False)
    gated: bool = field(init=False)
    untied: bool = field(init=False)
    bias: bool = field(init=False)
    qkv_bias: bool = field(init=False)
    rope: bool = field(init=False)
    learned_positions: bool = field(init=False)
    rotary_dim: int = field(init=False)
    rmsnorm: bool = field(init=False)
    parallel_residual: bool = field(init=False)

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)
        hidden, heads = self.hidden_size, self.num_attention_heads
        sized = _whole(hidden) and _whole(heads) and heads > 0
        put("inter", self.intermediate_size or (4 * hidden if _whole(hidden) else None))
        put("head_dim", hidden // heads if sized else None)
        put("groups", heads if self.num_query_groups is None else self.num_query_groups)
        put("group_size", heads // self.groups if sized and _whole(self.groups) and self.groups > 0 else None)
        put("gated", bool(self.gated_linear_unit) or self.hidden_act == "swiglu")
        put("untied", bool(self.untie_embeddings_and_output_weights))
        put("bias", bool(self.add_bias_linear))
        put("qkv_bias", self.bias if self.add_qkv_bias is None else bool(self.add_qkv_bias))
        put("rope", self.position_embedding_type == "rope")
        put("learned_positions", not self.rope)
        put("rotary_dim", rotary_dim(self.head_dim, self.rotary_percent) if self.rope and sized else 0)
        put("rmsnorm", self.normalization == "RMSNorm")
        put("parallel_residual", bool(self.use_parallel_residual))
        # the given fields hold their resolved values too (as GPTLocalConfig stores them): one Arch per model
        put("intermediate_size", self.inter)
        put("num_query_groups", self.groups)
        put("gated_linear_unit", self.gated)
        put("add_qkv_bias", self.qkv_bias)
        put("untie_embeddings_and_output_weights", self.untied)

    @classmethod
    def of(cls, config):
        """The Arch of a model config (dict, ``GPTLocalConfig`` or object; GPT-2 names accepted); an Arch
        is returned as it is."""
        if isinstance(config, Arch):
            return config
        cached = config_value(config, "arch", None)
        return cached if isinstance(cached, Arch) else cls.read(config)

    @classmethod
    def read(cls, config):
        """A new Arch from the values of ``config`` (see ``of``)."""
        values = {key: model_value(config, key, default) for key, default in DEFAULTS.items()}
        for key in _FLOATS:
            values[key] = number(key, values[key])
        for key in _BOOLS:
            values[key] = bool(values[key])
        if config_value(config, "tie_word_embeddings", True) is False:  # Hugging Face's name of the same choice
            values["untie_embeddings_and_output_weights"] = True
        return cls(**values)

    def check(self):
        """Every architecture rule, in order; the first broken one raises a ConfigError naming key and fix."""
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "max_position_embeddings", "seq_length"):
            value = self.inter if key == "intermediate_size" else getattr(self, key)
            if not _whole(value) or value <= 0:
                raise ConfigError(f"model_config.{key} must be a positive integer, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model_config.hidden_size ({self.hidden_size}) must be divisible by "
                f"model_config.num_attention_heads ({self.num_attention_heads}); choose a head count "
                f"that divides it, e.g. {_divisor_near(self.hidden_size, self.num_attention_heads)}.")
        self._check_layers()
        problem = seq_length_problem(self.seq_length, self.max_position_embeddings, self.rope)
        if problem:
            raise ConfigError(problem)
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"model_config.hidden_act {self.hidden_act!r} is not supported; "
                              f"use one of {', '.join(ACTIVATIONS)}.")
        return self

    def _check_layers(self):
        """The layer choices (RoPE, GQA, SwiGLU, RMSNorm): one error each."""
        if self.position_embedding_type not in POSITION_TYPES:
            raise ConfigError(f"model_config.position_embedding_type {self.position_embedding_type!r} is not "
                              f"supported; use one of {', '.join(POSITION_TYPES)}.")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"model_config.normalization {self.normalization!r} is not supported; use one of "
                              f"{', '.join(NORMALIZATIONS)}.")
        groups, heads = self.groups, self.num_attention_heads
        if not _whole(groups) or groups <= 0:
            raise ConfigError(f"model_config.num_query_groups must be a positive integer (or unset: one group per "
                              f"head), got {groups!r}.")
        if heads % groups:
            raise ConfigError(
                f"model_config.num_attention_heads ({heads}) is not divisible by "
                f"model_config.num_query_groups ({groups}): every key/value group serves the same number of "
                f"query heads. Choose num_query_groups among "
                f"{[d for d in range(1, heads + 1) if heads % d == 0]}.")
        if self.rope:
            if not 0.0 < self.rotary_percent <= 1.0:
                raise ConfigError(f"model_config.rotary_percent must be in (0, 1], got {self.rotary_percent}.")
            if self.rotary_base <= 0:
                raise ConfigError(f"model_config.rotary_base must be positive, got {self.rotary_base}.")
            rot = self.head_dim * self.rotary_percent
            if rot != int(rot) or int(rot) % 2 or int(rot) == 0:
                raise ConfigError(f"model_config.rotary_percent ({self.rotary_percent}) turns {rot} of each head's "
                                  f"{self.head_dim} channels; that must be a positive even whole number. Choose "
                                  f"rotary_percent so that head_dim * rotary_percent is even.")
        elif self.rotary_percent != 1.0 or self.rotary_base != 10000.0:
            raise ConfigError("model_config.rotary_percent / rotary_base are set but position_embedding_type is "
                              "'learned_absolute'; set position_embedding_type: rope or remove them.")
        if self.gated and self.hidden_act not in ("silu", "swiglu"):
            raise ConfigError(f"model_config.gated_linear_unit is True with hidden_act {self.hidden_act!r}; the gated "
                              f"MLP is SwiGLU: set hidden_act: swiglu (or silu), or gated_linear_unit: False.")
        if self.hidden_act in ("silu", "swiglu") and not self.gated:
            raise ConfigError(f"model_config.hidden_act {self.hidden_act!r} is supported only as the gated MLP "
                              f"(SwiGLU); set gated_linear_unit: True.")

    def choices(self):
        """The layer choices as a tuple in ``LAYER_CHOICES`` order (how ``gptlocal plan --json`` lists them)."""
        return tuple(getattr(self, name) for name in LAYER_CHOICES)

    @property
    def qkv_width(self):
        """Rows of the fused QKV weight: the query heads + 2 * groups key/value heads, head_dim rows each."""
        return (self.num_attention_heads + 2 * self.groups) * self.head_dim


def _divisor_near(number_, target):
    divisors = [d for d in range(1, number_ + 1) if number_ % d == 0]
    return min(divisors, key=lambda d: abs(d - target))
