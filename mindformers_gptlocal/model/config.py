"""GPTLocalConfig: the one config of a GPT-2-family model, in Hugging Face style.

Field names follow MindFormers' mcore vocabulary (``num_hidden_layers``,
``layernorm_epsilon``, ``hidden_dropout`` ...) so that the same YAML
``model_config`` section feeds both this config and MindFormers'
``TransformerConfig``. GPT-2's own names (``n_layer``, ``n_embd`` ...) are
accepted as aliases. Unknown keys are refused with the closest known key.
"""
import difflib
import functools

from ..errors import ConfigError
from ..parallel.layout import Layout
from ..parallel.rules import build_device_count, check_parallel_layout, raise_if_bad
from .bases import LEAN, MindFormerModuleType, MindFormerRegister, PretrainedConfig, moe_keys
from .lora_config import check_trainable, read_pet_config
from .params import (ACTIVATIONS, GPT2_ALIASES, NORMALIZATIONS, POSITION_TYPES, architecture, parameter_table,
                     rotary_dim)

DTYPES = ("float32", "float16", "bfloat16")

# Keys that MindFormers itself puts into model_config while building a model
# (parallel/moe/dataset settings, trainer bookkeeping). Accepted and ignored
# where they do not concern a dense GPT.
MINDFORMERS_INJECTED = {
    "parallel_config", "moe_config", "dataset_config", "calculate_per_token_loss", "batch_size",
    "pretrained_model_dir", "checkpoint_name_or_path", "type", "auto_register", "use_past",
    "is_dynamic", "block_size", "num_blocks", "pet_config", "quantization_config", "quantization",
    "monitor_config", "input_sliced_sig", "qkv_concat", "print_separate_loss", "disable_lazy_inline",
    "use_legacy", "generation_config", "return_extra_loss", "summary_type",
    "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    "n_ctx", "use_cache",
    # set by MindFormers' trainer for packed data (create_compressed_eod_mask); the model reads actual_seq_len
    # whenever the data has it
    "use_eod_attn_mask_compression",
}


class DictConfig(dict):
    """A dict that serialises like MindFormers' parallel config objects (``to_dict``)."""

    def to_dict(self):
        return dict(self)

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError as err:
            raise AttributeError(key) from err


def _accept_gpt2_names(init):
    """Let ``__init__`` take GPT-2 names (n_layer, n_embd ...) for our fields."""
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        for alias, name in GPT2_ALIASES.items():
            if alias not in kwargs:
                continue
            value = kwargs.pop(alias)
            if name in kwargs and kwargs[name] != value:
                raise ConfigError(f"model_config sets {name} twice with different values "
                                  f"({name}={kwargs[name]!r} and {alias}={value!r}); keep one.")
            kwargs[name] = value
        return init(self, *args, **kwargs)
    return wrapper


@MindFormerRegister.register(MindFormerModuleType.CONFIG, legacy=False, search_names="gpt_local")
class GPTLocalConfig(PretrainedConfig):
    """Configuration of a GPT-2-family causal LM (learned positions, pre-LN, biases, tied head)."""

    model_type = "gpt_local"

    @_accept_gpt2_names
    def __init__(self,
                 vocab_size=50257,
                 hidden_size=768,
                 num_hidden_layers=12,
                 num_attention_heads=12,
                 intermediate_size=None,
                 max_position_embeddings=1024,
                 seq_length=1024,
                 layernorm_epsilon=1e-5,
                 hidden_act="gelu_new",
                 hidden_dropout=0.1,
                 attention_dropout=0.1,
                 embedding_dropout=None,
                 dropout_seed=0,
                 initializer_range=0.02,
                 tie_word_embeddings=True,
                 params_dtype="float32",
                 compute_dtype="float32",
                 layernorm_compute_dtype="float32",
                 softmax_compute_dtype="float32",
                 use_flash_attention=False,
                 attention_block_size=0,
                 max_batch_size=8,
                 scale_attn_by_inverse_layer_idx=False,
                 reorder_and_upcast_attn=False,
                 scale_attn_weights=True,
                 ignore_token_id=-100,
                 bos_token_id=50256,
                 eos_token_id=50256,
                 pad_token_id=50256,
                 position_embedding_type="learned_absolute",
                 rotary_percent=1.0,
                 rotary_base=10000.0,
                 num_query_groups=None,
                 gated_linear_unit=False,
                 normalization="LayerNorm",
                 add_bias_linear=True,
                 add_qkv_bias=None,
                 untie_embeddings_and_output_weights=False,
                 use_parallel_residual=False,
                 **kwargs):
        parallel_config = kwargs.pop("parallel_config", None)
        if parallel_config is not None:
            self.parallel_config = DictConfig(parallel_config) if isinstance(parallel_config, dict) \
                else parallel_config
        _reject_unknown(kwargs)
        pet_config = kwargs.pop("pet_config", None)  # LoRA (model/lora_config.py); checked in validate()
        layout_batch_size = kwargs.get("batch_size")
        for key in MINDFORMERS_INJECTED:
            kwargs.pop(key, None)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size if intermediate_size else 4 * hidden_size
        self.max_position_embeddings = max_position_embeddings
        self.seq_length = seq_length
        self.layernorm_epsilon = _number("layernorm_epsilon", layernorm_epsilon)
        self.hidden_act = hidden_act
        self.hidden_dropout = _number("hidden_dropout", hidden_dropout)
        self.attention_dropout = _number("attention_dropout", attention_dropout)
        if embedding_dropout is None:
            embedding_dropout = hidden_dropout
        self.embedding_dropout = _number("embedding_dropout", embedding_dropout)
        if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int) or dropout_seed < 0:
            raise ConfigError(f"model_config.dropout_seed must be a whole number >= 0, got {dropout_seed!r}.")
        self.dropout_seed = dropout_seed
        self.initializer_range = _number("initializer_range", initializer_range)
        self.params_dtype = params_dtype
        self.compute_dtype = compute_dtype
        self.layernorm_compute_dtype = layernorm_compute_dtype
        self.softmax_compute_dtype = softmax_compute_dtype
        self.use_flash_attention = bool(use_flash_attention)
        self.attention_block_size = attention_block_size
        self.max_batch_size = max_batch_size
        self.scale_attn_by_inverse_layer_idx = bool(scale_attn_by_inverse_layer_idx)
        self.reorder_and_upcast_attn = bool(reorder_and_upcast_attn)
        self.scale_attn_weights = bool(scale_attn_weights)
        self.ignore_token_id = ignore_token_id
        self.pet_config = _plain_pet_config(pet_config)
        # the block's layer choices (model/params.py ARCH_DEFAULTS: GPT-2's values reproduce today's graph)
        self.position_embedding_type = position_embedding_type
        self.rotary_percent = _number("rotary_percent", rotary_percent)
        self.rotary_base = _number("rotary_base", rotary_base)
        self.num_query_groups = num_attention_heads if num_query_groups is None else num_query_groups
        self.gated_linear_unit = bool(gated_linear_unit) or hidden_act == "swiglu"
        self.normalization = normalization
        self.add_bias_linear = bool(add_bias_linear)
        self.add_qkv_bias = self.add_bias_linear if add_qkv_bias is None else bool(add_qkv_bias)
        untied = bool(untie_embeddings_and_output_weights) or tie_word_embeddings is False
        self.untie_embeddings_and_output_weights = untied
        tie_word_embeddings = not untied
        self.use_parallel_residual = bool(use_parallel_residual)
        kwargs.pop("architectures", None)
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         architectures=["GPTLocalForCausalLM"], **kwargs)
        self.validate()
        if parallel_config is not None:
            self.validate_layout(layout_batch_size)

    @classmethod
    def from_model_dir(cls, model_dir, **overrides):
        """Config from ``model_dir/config.json`` (a gpt_local config), with keyword overrides."""
        import json
        import os
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{path} does not exist; a model directory needs config.json (write one with "
                              f"`gptlocal prepare-data` or `model.save_pretrained`).")
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
        model_type = values.pop("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ConfigError(f"{path} is a '{model_type}' config, not gpt_local; for Hugging Face GPT-2 run "
                              f"`gptlocal convert hf2ms` first.")
        for key in ("architectures", "transformers_version", "mindformers_version", "_name_or_path",
                    "checkpoint_name_or_path", "pretrained_model_dir", "tokenizer_class", "is_encoder_decoder",
                    "is_sample_acceleration", "quantization_config", "quantization", "torch_dtype", "dtype"):
            values.pop(key, None)
        values.update(overrides)
        return cls(**values)

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    @property
    def gated(self):
        """SwiGLU MLP (gated_linear_unit, or hidden_act: swiglu)."""
        return self.gated_linear_unit

    @property
    def rope(self):
        return self.position_embedding_type == "rope"

    @property
    def rotary_dim(self):
        """Channels of each head that rotary embeddings turn (head_dim * rotary_percent); 0 without rope."""
        return rotary_dim(self.head_dim, self.rotary_percent) if self.rope else 0

    @property
    def architecture(self):
        """The block's layer choices as one tuple (``model/params.py`` ``architecture``)."""
        return architecture(self)

    def validate(self):
        """Refuse shapes and settings the model cannot build, naming the key and the fix."""
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "max_position_embeddings", "seq_length", "max_batch_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model_config.{key} must be a positive integer, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model_config.hidden_size ({self.hidden_size}) must be divisible by "
                f"model_config.num_attention_heads ({self.num_attention_heads}); choose a head count "
                f"that divides it, e.g. {_divisor_near(self.hidden_size, self.num_attention_heads)}.")
        self._validate_architecture()
        if self.seq_length > self.max_position_embeddings:
            raise ConfigError(
                f"model_config.seq_length ({self.seq_length}) is larger than "
                f"model_config.max_position_embeddings ({self.max_position_embeddings}): GPT-2 has learned "
                f"positions only up to max_position_embeddings. Lower seq_length or raise "
                f"max_position_embeddings.")
        block = self.attention_block_size
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise ConfigError(f"model_config.attention_block_size must be a whole number >= 0 (0: plain attention; "
                              f"e.g. 256: memory-efficient attention over query blocks of 256 rows), got {block!r}.")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"model_config.hidden_act {self.hidden_act!r} is not supported; "
                              f"use one of {', '.join(ACTIVATIONS)}.")
        for key in ("params_dtype", "compute_dtype", "layernorm_compute_dtype", "softmax_compute_dtype"):
            if str(getattr(self, key)) not in DTYPES:
                raise ConfigError(f"model_config.{key} {getattr(self, key)!r} is not a dtype; "
                                  f"use one of {', '.join(DTYPES)}.")
        for key in ("hidden_dropout", "attention_dropout", "embedding_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"model_config.{key} must be in [0, 1), got {getattr(self, key)}.")
        if not self.scale_attn_weights:
            raise ConfigError("model_config.scale_attn_weights=False (no 1/sqrt(head_dim) scaling) is not "
                              "supported; remove it or set it to True.")
        if self.reorder_and_upcast_attn:
            raise ConfigError("model_config.reorder_and_upcast_attn=True is not supported (it changes "
                              "the attention numerics); set it to False.")
        self.lora_spec()

    def _validate_architecture(self):
        """The layer choices (RoPE, GQA, SwiGLU, RMSNorm, biases, head, residual): one error each."""
        if self.position_embedding_type not in POSITION_TYPES:
            raise ConfigError(f"model_config.position_embedding_type {self.position_embedding_type!r} is not "
                              f"supported; use one of {', '.join(POSITION_TYPES)}.")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"model_config.normalization {self.normalization!r} is not supported; use one of "
                              f"{', '.join(NORMALIZATIONS)}.")
        groups = self.num_query_groups
        if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
            raise ConfigError(f"model_config.num_query_groups must be a positive integer (or unset: one group per "
                              f"head), got {groups!r}.")
        if self.num_attention_heads % groups:
            raise ConfigError(
                f"model_config.num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"model_config.num_query_groups ({groups}): every key/value group serves the same number of "
                f"query heads. Choose num_query_groups among "
                f"{[d for d in range(1, self.num_attention_heads + 1) if self.num_attention_heads % d == 0]}.")
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

    def lora_spec(self):
        """The LoRA settings of ``pet_config`` (a ``LoraSpec``), or None without one."""
        spec = read_pet_config(getattr(self, "pet_config", None), self.num_hidden_layers)
        if spec is not None:  # a freeze that leaves nothing trainable stops here, not in the optimizer
            check_trainable(spec, list(parameter_table(self, Layout())))
        return spec

    @property
    def layout(self):
        """The parallel ``Layout`` of this config: its parallel_config (with recompute) and offset."""
        return Layout.of_model_config(self)

    def validate_layout(self, batch_size=None):
        """The parallel layout rules of ``parallel/rules.py`` (the ones ``gptlocal plan`` applies) on this
        config and the parallel_config MindFormers hands in, so a bad layout stops at model build."""
        raise_if_bad(check_parallel_layout(self, self.layout, devices=build_device_count(), batch_size=batch_size))


_KNOWN = None


def _plain_pet_config(pet_config):
    """pet_config as a plain dict (MindFormers hands a DictConfig/LoraConfig; dtypes become their names)."""
    if not pet_config:
        return None
    items = pet_config.items() if hasattr(pet_config, "items") else vars(pet_config).items()
    return {k: (v if v is None or isinstance(v, (str, int, float, bool, list, tuple)) else str(v))
            for k, v in items}


def _number(key, value):
    """float(value), or a ConfigError naming the key (YAML may hand strings such as '1e-5', which are fine)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"model_config.{key} must be a number, got {value!r}.") from None


def known_keys():
    """Every key a gpt_local model_config may hold."""
    global _KNOWN  # pylint: disable=global-statement
    if _KNOWN is None:
        import inspect
        own = set(inspect.signature(GPTLocalConfig.__init__).parameters) - {"self", "kwargs"}
        base = set(PretrainedConfig().to_dict())
        _KNOWN = own | base | set(GPT2_ALIASES) | MINDFORMERS_INJECTED | {
            "model_type", "architectures", "transformers_version", "mindformers_version",
            "_name_or_path", "position_embedding_type", "normalization", "add_bias_linear",
            "gated_linear_unit", "offset", "recompute", "pipeline_stage", "name_or_path"}
    return _KNOWN


def _reject_unknown(kwargs):
    # MoE keys arrive flattened from moe_config; a dense GPT ignores them.
    moe = moe_keys()
    # underscore keys are loader bookkeeping (_commit_hash, _from_auto ...), not model settings
    unknown = [k for k in kwargs if k not in known_keys() and k not in moe and k != "self" and not k.startswith("_")]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(known_keys()), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"model_config.{key} is not a gpt_local config key.{hint} "
                          f"Remove or rename it (known keys: see GPTLocalConfig).")


def _divisor_near(number, target):
    divisors = [d for d in range(1, number + 1) if number % d == 0]
    return min(divisors, key=lambda d: abs(d - target))


def _register_auto_class():
    """MindFormers' AutoConfig resolves model_type gpt_local to this class (not in a lean process)."""
    if LEAN:
        return
    from mindformers import AutoConfig
    AutoConfig.register(GPTLocalConfig.model_type, GPTLocalConfig, exist_ok=True)


_register_auto_class()
