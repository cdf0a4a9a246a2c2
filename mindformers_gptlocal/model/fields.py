"""The keys of a gpt_local ``model_config``, each declared once (``FIELDS``): its default, its other names (GPT-2's
and MindFormers' mcore names), how a given value is read (``read``: a number, a bool ... one ConfigError naming the
key when it cannot be) and the rule it must keep (``check``, run by ``GPTLocalConfig.validate``).

``GPTLocalConfig`` (``config.py``) takes every key of this table, in this order (config.json's order); ``Arch``
(``arch.py``) is built from the architecture keys (``arch``: the sizes and layer choices) and their defaults, GPT-2
small's. Pure Python: ``gptlocal plan`` and ``gptlocal convert`` read it without MindSpore.
"""
from collections import namedtuple

from ..errors import ConfigError

DTYPES = ("float32", "float16", "bfloat16")
ACTIVATIONS = ("gelu_new", "gelu", "relu", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu", "silu", "swiglu")
POSITION_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class Field(namedtuple("Field", "name default aliases read check arch base fallback",
                       defaults=((), None, None, False, False, None))):
    """One key of ``model_config``: ``default``; ``aliases`` (other names taken for it); ``read(key, value)``: the value
    kept (None: as given); ``check(key, value)``: raises a ConfigError naming the key when the kept value breaks the
    key's own rule (rules between keys: ``Arch.check``, ``GPTLocalConfig.validate``); ``arch``: an architecture
    key (``Arch`` reads it and resolves what it implies; the config keeps the resolved value); ``base``: kept by the
    config's base class (token ids, the head's tying, the int8 settings); ``fallback``: the key whose value a None
    takes."""


def number(key, value):
    """float(value), or a ConfigError naming the key (YAML may hand strings such as '1e-5', which are fine)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"model_config.{key} must be a number, got {value!r}.") from None


def flag(key, value):
    del key
    return bool(value)


def whole(value):
    return isinstance(value, int) and not isinstance(value, bool)


def positive_integer(key, value):
    if not whole(value) or value <= 0:
        raise ConfigError(f"model_config.{key} must be a positive integer, got {value!r}.")


def _seed(key, value):
    if not whole(value) or value < 0:
        raise ConfigError(f"model_config.{key} must be a whole number >= 0, got {value!r}.")
    return value


def _query_groups(key, value):
    if not whole(value) or value <= 0:
        raise ConfigError(f"model_config.{key} must be a positive integer (or unset: one group per head), "
                          f"got {value!r}.")


def _block_size(key, value):
    if not whole(value) or value < 0:
        raise ConfigError(f"model_config.{key} must be a whole number >= 0 (0: plain attention; e.g. 256: "
                          f"memory-efficient attention over query blocks of 256 rows), got {value!r}.")


def _one_of(choices):
    def check(key, value):
        if value not in choices:
            raise ConfigError(f"model_config.{key} {value!r} is not supported; use one of {', '.join(choices)}.")
    return check


def dtype(key, value):
    if str(value) not in DTYPES:
        raise ConfigError(f"model_config.{key} {value!r} is not a dtype; use one of {', '.join(DTYPES)}.")


def _fraction(key, value):
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"model_config.{key} must be in [0, 1), got {value}.")


def _scaled(key, value):
    if not value:
        raise ConfigError(f"model_config.{key}=False (no 1/sqrt(head_dim) scaling) is not supported; remove it or "
                          f"set it to True.")


def _not_reordered(key, value):
    if value:
        raise ConfigError(f"model_config.{key}=True is not supported (it changes the attention numerics); set it "
                          f"to False.")


def _plain_mapping(key, value):
    """A mapping MindFormers hands (a DictConfig) as a plain dict; anything else as given."""
    del key
    return dict(value.items()) if hasattr(value, "items") else value


def _pet_config(key, value):
    """pet_config as a plain dict (MindFormers hands a DictConfig/LoraConfig; dtypes become their names)."""
    del key
    if not value:
        return None
    items = value.items() if hasattr(value, "items") else vars(value).items()
    return {k: (v if v is None or isinstance(v, (str, int, float, bool, list, tuple)) else str(v)) for k, v in items}


def _cpu_kernels(key, value):
    """auto, plain, kernel or {op: mode}, checked (``kernels/provider.py``, imported when a config is made)."""
    del key
    from ..kernels.provider import plain_cpu_kernels  # pylint: disable=import-outside-toplevel
    return plain_cpu_kernels(value)


FIELDS = (
    # the architecture (GPT-2 small by default: learned positions, LayerNorm, biases, tied head, sequential
    # residual); intermediate_size None: 4 * hidden_size
    Field("vocab_size", 50257, arch=True, check=positive_integer),
    Field("hidden_size", 768, ("n_embd",), arch=True, check=positive_integer),
    Field("num_hidden_layers", 12, ("n_layer", "num_layers"), arch=True, check=positive_integer),
    Field("num_attention_heads", 12, ("n_head", "num_heads"), arch=True, check=positive_integer),
    Field("intermediate_size", None, ("n_inner", "ffn_hidden_size"), arch=True, check=positive_integer),
    Field("max_position_embeddings", 1024, ("n_positions",), arch=True, check=positive_integer),
    Field("seq_length", 1024, arch=True, check=positive_integer),
    Field("layernorm_epsilon", 1e-5, ("layer_norm_epsilon",), read=number),
    Field("hidden_act", "gelu_new", ("activation_function",), arch=True, check=_one_of(ACTIVATIONS)),
    # dropout (model/dropout.py); embedding_dropout None: hidden_dropout's
    Field("hidden_dropout", 0.1, ("resid_pdrop",), read=number, check=_fraction),
    Field("attention_dropout", 0.1, ("attn_pdrop",), read=number, check=_fraction),
    Field("embedding_dropout", None, ("embd_pdrop",), read=number, check=_fraction, fallback="hidden_dropout"),
    Field("dropout_seed", 0, read=_seed),
    Field("initializer_range", 0.02, read=number),
    Field("params_dtype", "float32", ("param_init_type",), check=dtype),
    Field("compute_dtype", "float32", check=dtype),
    Field("layernorm_compute_dtype", "float32", check=dtype),
    Field("softmax_compute_dtype", "float32", check=dtype),
    Field("use_flash_attention", False, read=flag),
    Field("attention_block_size", 0, check=_block_size),
    Field("max_batch_size", 8, check=positive_integer),  # the KV cache's slots (generate)
    # Hugging Face GPT-2's attention switches: only GPT-2's own values are supported
    Field("scale_attn_by_inverse_layer_idx", False, read=flag),
    Field("reorder_and_upcast_attn", False, read=flag, check=_not_reordered),
    Field("scale_attn_weights", True, read=flag, check=_scaled),
    Field("ignore_token_id", -100),
    Field("pet_config", None, read=_pet_config),  # PEFT (peft/), checked by GPTLocalConfig.validate
    # the block's layer choices (None: num_query_groups one per head, add_qkv_bias = add_bias_linear)
    Field("position_embedding_type", "learned_absolute", arch=True, check=_one_of(POSITION_TYPES)),
    Field("rotary_percent", 1.0, arch=True, read=number),
    Field("rotary_base", 10000.0, arch=True, read=number),
    Field("num_query_groups", None, arch=True, check=_query_groups),
    Field("gated_linear_unit", False, arch=True, read=flag),
    Field("normalization", "LayerNorm", arch=True, check=_one_of(NORMALIZATIONS)),
    Field("add_bias_linear", True, arch=True, read=flag),
    Field("add_qkv_bias", None, arch=True),
    Field("untie_embeddings_and_output_weights", False, arch=True, read=flag),
    Field("use_parallel_residual", False, arch=True, read=flag),
    Field("layerdrop", 0.0, read=number, check=_fraction),  # LayerDrop (model/dropout.py), training only
    # which implementation each op runs on CPU (kernels/provider.py): auto, plain, kernel or {op: mode}
    Field("cpu_kernels", "auto", read=_cpu_kernels),
    # kept by the base (ConfigBase / MindFormers' PretrainedConfig); tie_word_embeddings: Hugging Face's name of
    # not untie_embeddings_and_output_weights
    Field("tie_word_embeddings", True, base=True),
    Field("bos_token_id", 50256, base=True),
    Field("eos_token_id", 50256, base=True),
    Field("pad_token_id", 50256, base=True),
    Field("quantization", None, base=True, read=_plain_mapping),  # an int8 model's (model/quantization.py)
)
BY_NAME = {field.name: field for field in FIELDS}
ARCH_FIELDS = tuple(field for field in FIELDS if field.arch)
ALIASES = {alias: field.name for field in FIELDS for alias in field.aliases}  # GPT-2 / mcore name -> ours
