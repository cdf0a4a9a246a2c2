"""``Arch``: the architecture of a gpt_local model, described once (pure Python, no MindSpore).

Its fields are the architecture keys of ``model_config`` (``fields.py`` ``ARCH_FIELDS``: their defaults, their
GPT-2 / mcore names, how a value is read, each key's own rule). The YAML's ``model_config`` (a dict, a
``GPTLocalConfig`` or any object with its attributes) is read once by ``Arch.of``: other names resolved to ours,
absent keys filled from the defaults (GPT-2 small), and every value that depends on others derived in
``__post_init__`` (as litgpt's ``Config`` does): ``head_dim``, ``groups`` (key/value heads), ``gated`` (SwiGLU),
``untied`` (own output head), ``bias``/``qkv_bias``, ``rope``/``learned_positions``, ``rotary_dim``, ``rmsnorm``,
``parallel_residual``. ``check`` applies every architecture rule, one ``ConfigError`` per rule naming the key and
the fix.

Everything that needs these facts reads an ``Arch``: ``GPTLocalConfig`` (``config.arch``, built once; it keeps the
resolved values), the parameter table (``params.py``), the sharding rules (``parallel/sharding.py``, handed the Arch),
the planner (``plan/memory.py`` through ``params.dims``), the converters (``Arch.of`` of a config dict) and the Cells
(``attention.py``, ``gpt.py``).
"""
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..parallel.layout import config_value
from ..parallel.rules import seq_length_problem
from .fields import ALIASES, ARCH_FIELDS, whole

DEFAULTS = {key.name: key.default for key in ARCH_FIELDS}  # the architecture keys and their defaults
# the layer choices, in the order ``gptlocal plan --json`` lists them ("arch")
LAYER_CHOICES = ("rope", "rotary_percent", "rotary_base", "groups", "gated", "rmsnorm", "bias", "qkv_bias", "untied",
                 "parallel_residual")


def rotary_dim(head_dim, rotary_percent):
    """Channels of each head that rotary embeddings turn (the first ones, as NeoX's rotary_pct does)."""
    return int(round(head_dim * rotary_percent))


def model_value(config, key, default=None):
    """``key`` of a model config (dict or object) or of one of its other names; None counts as absent."""
    value = config_value(config, key, None)
    if value is None:
        for alias, name in ALIASES.items():
            if name == key and config_value(config, alias, None) is not None:
                return config_value(config, alias)
    return default if value is None else value


def _architecture_keys(cls):
    """``cls`` as a frozen dataclass whose fields are the architecture keys (``ARCH_FIELDS``, with their defaults),
    then its own annotated fields (the values derived from them)."""
    derived = dict(cls.__annotations__)
    cls.__annotations__ = {key.name: object for key in ARCH_FIELDS}
    cls.__annotations__.update(derived)
    for key in ARCH_FIELDS:
        setattr(cls, key.name, key.default)
    return dataclass(frozen=True)(cls)


@_architecture_keys
class Arch:  # pylint: disable=too-many-instance-attributes
    """The model's sizes and layer choices (the architecture keys of ``fields.py``: other names resolved, defaults
    filled, None-means-derived keys resolved), and what they imply.

    Build with ``Arch.of(model_config)``; reading never raises for bad sizes (``gptlocal plan`` reports
    them), ``check()`` does. Equal descriptions compare equal."""

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
        sized = whole(hidden) and whole(heads) and heads > 0
        put("inter", self.intermediate_size or (4 * hidden if whole(hidden) else None))
        put("head_dim", hidden // heads if sized else None)
        put("groups", heads if self.num_query_groups is None else self.num_query_groups)
        put("group_size", heads // self.groups if sized and whole(self.groups) and self.groups > 0 else None)
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
        values = {}
        for key in ARCH_FIELDS:
            value = model_value(config, key.name, key.default)
            values[key.name] = key.read(key.name, value) if key.read else value
        if config_value(config, "tie_word_embeddings", True) is False:  # Hugging Face's name of the same choice
            values["untie_embeddings_and_output_weights"] = True
        return cls(**values)

    def check(self):
        """Every architecture rule, in order (each key's own, then those between keys); the first broken one raises a
        ConfigError naming key and fix."""
        for key in ARCH_FIELDS:  # each key's own rule (fields.py), on the resolved values
            if key.check:
                key.check(key.name, getattr(self, key.name))
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model_config.hidden_size ({self.hidden_size}) must be divisible by "
                f"model_config.num_attention_heads ({self.num_attention_heads}); choose a head count "
                f"that divides it, e.g. {_divisor_near(self.hidden_size, self.num_attention_heads)}.")
        self._check_layers()
        problem = seq_length_problem(self.seq_length, self.max_position_embeddings, self.rope)
        if problem:
            raise ConfigError(problem)
        return self

    def _check_layers(self):
        """The rules between layer choices (RoPE, GQA, SwiGLU): one error each."""
        groups, heads = self.groups, self.num_attention_heads
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
        elif (self.rotary_percent, self.rotary_base) != (DEFAULTS["rotary_percent"], DEFAULTS["rotary_base"]):
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
