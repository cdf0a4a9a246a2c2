"""GPTLocalConfig: the one config of a gpt_local model (GPT-2, Llama-style, NeoX-style), in Hugging Face style.

Field names follow MindFormers' mcore vocabulary (``num_hidden_layers``,
``layernorm_epsilon``, ``hidden_dropout`` ...) so that the same YAML
``model_config`` section feeds both this config and MindFormers'
``TransformerConfig``. GPT-2's own names (``n_layer``, ``n_embd`` ...) are
accepted as aliases. Unknown keys are refused with the closest known key.
The architecture (sizes, layer choices and what they imply) is read once into ``config.arch``
(``model/arch.py``); the parallel ``Layout`` and the PEFT settings are read once too (``layout``, ``pet_spec``).

Plain Python on a plain base (``ConfigBase``): MindFormers never imported. The class MindFormers builds from a YAML
(``model_config: type: GPTLocalConfig``) is ``mf/model.py``'s, this one on MindFormers' ``PretrainedConfig``.
"""
import copy
import difflib
import functools

from ..errors import ConfigError
from ..generation.defaults import MINDFORMERS as MINDFORMERS_GENERATION_DEFAULTS
from ..kernels.provider import plain_cpu_kernels
from ..parallel.layout import Layout
from ..parallel.rules import build_device_count, check_parallel_layout, raise_if_bad
from .arch import DEFAULTS, GPT2_ALIASES, Arch, number as _number
from ..peft import check_trainable, read as read_pet_config
from .params import table_of_dims, dims
from .quantization import read_quantization

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

# MindFormers' MoEConfig fields (a flattened moe_config arrives in model_config; a dense GPT ignores them);
# tests/model/test_lean_process.py compares this with mindformers.modules.transformer.moe.MoEConfig on each line
MOE_KEYS = frozenset((
    "aux_loss_factor", "aux_loss_factors", "aux_loss_types", "balance_via_topk_bias", "callback_moe_droprate",
    "capacity_factor", "cold_token_percent", "comp_comm_parallel", "comp_comm_parallel_degree", "cur_layer",
    "dispatch_global_max_bs", "enable_cold_hot_expert", "enable_deredundency", "enable_gmm_safe_tokens",
    "enable_sdrop", "ep_extend_tp", "expert_group_size", "expert_model_parallel", "expert_num",
    "first_k_dense_replace", "group_wise_a2a", "hot_expert_num", "max_router_load", "moe_intermediate_size",
    "moe_module_name", "moe_shared_expert_overlap", "n_group", "norm_topk_prob", "npu_nums_per_device",
    "num_experts_chosen", "routed_scaling_factor", "router_dense_type", "routing_policy", "save_token_distribution",
    "shared_expert_num", "topk_bias_update_rate", "topk_group", "topk_method", "update_step",
    "use_allgather_dispatcher", "use_fused_ops_permute", "use_fused_ops_topkrouter", "use_gating_sigmoid", "use_gmm",
    "use_shared_expert_gating", "z_loss_factor"))


class ConfigBase:
    """The config's plain base: the attributes a Hugging Face-style config holds besides the model's own keys (as
    MindFormers' ``PretrainedConfig.__init__`` sets them: name, checkpoint, token ids, architectures ...), its
    ``to_dict`` and equality. MindFormers' ``GPTLocalConfig`` (``mf/model.py``) has ``PretrainedConfig`` in its
    place; ``tests/model/test_lean_process.py`` compares the two."""

    model_type = ""

    def __init__(self, **kwargs):
        self._name_or_path = str(kwargs.pop("name_or_path", ""))
        self._commit_hash = kwargs.pop("_commit_hash", None)
        self.checkpoint_name_or_path = kwargs.pop("checkpoint_name_or_path", None)
        self.pretrained_model_dir = str(kwargs.pop("pretrained_model_dir", ""))
        self.mindformers_version = kwargs.pop("mindformers_version", None)
        self.tokenizer_class = kwargs.pop("tokenizer_class", None)
        for key in ("bos_token_id", "pad_token_id", "eos_token_id", "architectures", "is_encoder_decoder",
                    "is_sample_acceleration", "quantization_config", "quantization"):
            setattr(self, key, kwargs.pop(key, None))
        for key, value in kwargs.items():
            setattr(self, key, value)

    @property
    def name_or_path(self):
        return getattr(self, "_name_or_path", None)

    @name_or_path.setter
    def name_or_path(self, value):
        self._name_or_path = str(value)

    def to_dict(self):
        output = copy.deepcopy(self.__dict__)
        output["model_type"] = self.__class__.model_type
        output.pop("_auto_class", None)
        output.pop("_commit_hash", None)
        for key in ("parallel_config", "moe_config"):
            if key in output and hasattr(output[key], "to_dict"):
                output[key] = output[key].to_dict()
        # as MindFormers' to_dict: the installed MindFormers' version (read from its package metadata, nothing
        # imported), so config.json is the same whichever class wrote it
        output["mindformers_version"] = _installed_version("mindformers")
        return output

    def __eq__(self, other):
        return isinstance(other, ConfigBase) and self.__dict__ == other.__dict__

    def __repr__(self):
        return f"{self.__class__.__name__} {self.to_dict()}"


def _installed_version(distribution):
    from importlib import metadata
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


class GenerationOptions(dict):
    """A model's default generation options (``model.generation_config``): what MindFormers'
    ``GenerationConfig.from_model_config(config)`` holds for the options the decode loop reads (its defaults are
    ``generation/defaults.py`` ``MINDFORMERS``), so a model decodes the same on either base."""

    @classmethod
    def from_model_config(cls, config):
        values = config.to_dict()
        options = {k: values.get(k, default) for k, default in MINDFORMERS_GENERATION_DEFAULTS.items()}
        eos = options["eos_token_id"]
        options["eos_token_id"] = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
        return cls(options)

    def to_dict(self):
        return dict(self)



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


class GPTLocalConfig(ConfigBase):
    """Configuration of a causal LM: GPT-2 by default (learned positions, pre-LN, biases, tied head); rope, GQA,
    SwiGLU, RMSNorm, untied head and parallel residual by their keys (``model/arch.py``)."""

    model_type = "gpt_local"

    @_accept_gpt2_names
    def __init__(self,
                 vocab_size=DEFAULTS["vocab_size"],
                 hidden_size=DEFAULTS["hidden_size"],
                 num_hidden_layers=DEFAULTS["num_hidden_layers"],
                 num_attention_heads=DEFAULTS["num_attention_heads"],
                 intermediate_size=DEFAULTS["intermediate_size"],
                 max_position_embeddings=DEFAULTS["max_position_embeddings"],
                 seq_length=DEFAULTS["seq_length"],
                 layernorm_epsilon=1e-5,
                 hidden_act=DEFAULTS["hidden_act"],
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
                 position_embedding_type=DEFAULTS["position_embedding_type"],
                 rotary_percent=DEFAULTS["rotary_percent"],
                 rotary_base=DEFAULTS["rotary_base"],
                 num_query_groups=DEFAULTS["num_query_groups"],
                 gated_linear_unit=DEFAULTS["gated_linear_unit"],
                 normalization=DEFAULTS["normalization"],
                 add_bias_linear=DEFAULTS["add_bias_linear"],
                 add_qkv_bias=DEFAULTS["add_qkv_bias"],
                 untie_embeddings_and_output_weights=DEFAULTS["untie_embeddings_and_output_weights"],
                 use_parallel_residual=DEFAULTS["use_parallel_residual"],
                 layerdrop=0.0,
                 cpu_kernels="auto",
                 **kwargs):
        parallel_config = kwargs.pop("parallel_config", None)
        if parallel_config is not None:
            self.parallel_config = DictConfig(parallel_config) if isinstance(parallel_config, dict) \
                else parallel_config
        _reject_unknown(kwargs)
        pet_config = kwargs.pop("pet_config", None)  # PEFT (peft/); checked in validate()
        quantization = kwargs.pop("quantization", None)  # an int8 model's (model/quantization.py); validate()
        layout_batch_size = kwargs.get("batch_size")
        for key in MINDFORMERS_INJECTED:
            kwargs.pop(key, None)
        # the architecture, read once (model/arch.py): its resolved values are what config.json keeps
        arch = Arch.read(dict(
            vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings, seq_length=seq_length, hidden_act=hidden_act,
            position_embedding_type=position_embedding_type, rotary_percent=rotary_percent, rotary_base=rotary_base,
            num_query_groups=num_query_groups, gated_linear_unit=gated_linear_unit, normalization=normalization,
            add_bias_linear=add_bias_linear, add_qkv_bias=add_qkv_bias, tie_word_embeddings=tie_word_embeddings,
            untie_embeddings_and_output_weights=untie_embeddings_and_output_weights,
            use_parallel_residual=use_parallel_residual))
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = arch.inter
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
        # the block's layer choices (model/arch.py ARCH_DEFAULTS: GPT-2's values reproduce GPT-2's graph)
        self.position_embedding_type = position_embedding_type
        self.rotary_percent = arch.rotary_percent
        self.rotary_base = arch.rotary_base
        self.num_query_groups = arch.groups
        self.gated_linear_unit = arch.gated
        self.normalization = normalization
        self.add_bias_linear = arch.bias
        self.add_qkv_bias = arch.qkv_bias
        self.untie_embeddings_and_output_weights = arch.untied
        tie_word_embeddings = not arch.untied
        self.use_parallel_residual = arch.parallel_residual
        self.layerdrop = _number("layerdrop", layerdrop)  # LayerDrop (model/dropout.py), training only
        # which implementation each op runs on CPU (kernels/provider.py): auto, plain, kernel or {op: mode}; checked
        self.cpu_kernels = plain_cpu_kernels(cpu_kernels)
        kwargs.pop("architectures", None)
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         architectures=["GPTLocalForCausalLM"], **kwargs)
        # MindFormers 1.9's PretrainedConfig.__init__ (the base of mf/model.py's class) sets both from its own kwargs
        # (None / its default layout), after ours were set above: ours again, and no default layout where none was
        # given (as on 1.8: config.json and this class on ConfigBase stay the same)
        self.pet_config = _plain_pet_config(pet_config)
        self.quantization = dict(quantization.items()) if hasattr(quantization, "items") else quantization
        if parallel_config is not None:
            self.parallel_config = DictConfig(parallel_config) if isinstance(parallel_config, dict) \
                else parallel_config
        else:
            self.__dict__.pop("parallel_config", None)
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
                    "is_sample_acceleration", "quantization_config", "torch_dtype", "dtype"):
            values.pop(key, None)  # (``quantization`` stays: an int8 directory's, quantization.py)
        values.update(overrides)
        return cls(**values)

    # --- derived once: the Arch, the Layout and the LoRA spec (dropped when a field is set again) -----------
    def __setattr__(self, key, value):
        if not key.startswith("_"):
            self.__dict__.pop("_derived", None)
        super().__setattr__(key, value)

    def _derived_value(self, name, build):
        derived = self.__dict__.setdefault("_derived", {})
        if name not in derived:
            derived[name] = build()
        return derived[name]

    def to_dict(self):
        output = super().to_dict()
        output.pop("_derived", None)
        return output

    def __eq__(self, other):
        return isinstance(other, ConfigBase) and \
            {k: v for k, v in self.__dict__.items() if k != "_derived"} == \
            {k: v for k, v in other.__dict__.items() if k != "_derived"}

    __hash__ = None

    @property
    def arch(self):
        """The model's architecture (``model/arch.py`` ``Arch``): sizes, layer choices, derived values."""
        return self._derived_value("arch", lambda: Arch.read(self))

    @property
    def gated(self):
        """SwiGLU MLP (gated_linear_unit, or hidden_act: swiglu)."""
        return self.arch.gated

    @property
    def rope(self):
        return self.arch.rope

    @property
    def rotary_dim(self):
        """Channels of each head that rotary embeddings turn (head_dim * rotary_percent); 0 without rope."""
        return self.arch.rotary_dim

    @property
    def architecture(self):
        """The block's layer choices: the ``Arch`` (kept as a name; ``arch`` is the same object)."""
        return self.arch

    def validate(self):
        """Refuse shapes and settings the model cannot build, naming the key and the fix."""
        self.arch.check()
        value = self.max_batch_size
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"model_config.max_batch_size must be a positive integer, got {value!r}.")
        block = self.attention_block_size
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise ConfigError(f"model_config.attention_block_size must be a whole number >= 0 (0: plain attention; "
                              f"e.g. 256: memory-efficient attention over query blocks of 256 rows), got {block!r}.")
        for key in ("params_dtype", "compute_dtype", "layernorm_compute_dtype", "softmax_compute_dtype"):
            if str(getattr(self, key)) not in DTYPES:
                raise ConfigError(f"model_config.{key} {getattr(self, key)!r} is not a dtype; "
                                  f"use one of {', '.join(DTYPES)}.")
        for key in ("hidden_dropout", "attention_dropout", "embedding_dropout", "layerdrop"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"model_config.{key} must be in [0, 1), got {getattr(self, key)}.")
        if not self.scale_attn_weights:
            raise ConfigError("model_config.scale_attn_weights=False (no 1/sqrt(head_dim) scaling) is not "
                              "supported; remove it or set it to True.")
        if self.reorder_and_upcast_attn:
            raise ConfigError("model_config.reorder_and_upcast_attn=True is not supported (it changes "
                              "the attention numerics); set it to False.")
        self.pet_spec()
        if read_quantization(self.quantization) and str(self.compute_dtype) != "float32":
            raise ConfigError(f"model_config.compute_dtype {self.compute_dtype!r} with an int8 model (quantization): "
                              f"int8 models compute in float32; set compute_dtype: float32.")

    def pet_spec(self):
        """The PEFT settings of ``pet_config`` (its method's ``peft`` PetSpec: LoRA, bottleneck adapters, prefix
        tuning), or None without one; read and checked once."""
        return self._derived_value("pet", self._read_pet)

    def _read_pet(self):
        spec = read_pet_config(self.pet_config, self.num_hidden_layers, self.max_position_embeddings)
        if spec is not None:
            spec.check_config(self)
            # a freeze that leaves nothing trainable stops here, not in the optimizer
            check_trainable(spec, list(table_of_dims(dims(self.arch), Layout(), spec)))
        return spec

    def lora_spec(self):
        """The settings of a method that puts Cells in the layers (LoRA, adapters), or None."""
        spec = self.pet_spec()
        return None if spec is None or spec.adds_prefix else spec

    def prefix_spec(self):
        """The prefix tuning / P-Tuning v2 settings (attention reads the prefix rows), or None."""
        spec = self.pet_spec()
        return spec if spec is not None and spec.adds_prefix else None

    @property
    def layout(self):
        """The parallel ``Layout`` of this config: its parallel_config (with recompute) and offset; read once."""
        return self._derived_value("layout", lambda: Layout.of_model_config(self))

    def validate_layout(self, batch_size=None):
        """The parallel layout rules of ``parallel/rules.py`` (the ones ``gptlocal plan`` applies) on this
        config and the parallel_config MindFormers hands in, so a bad layout stops at model build."""
        raise_if_bad(check_parallel_layout(self, self.layout, devices=build_device_count(), batch_size=batch_size))


_KNOWN = None


DTYPE_KEYS = ("params_dtype", "compute_dtype", "layernorm_compute_dtype", "softmax_compute_dtype")
_DTYPE_NOTES = {  # what a dtype key set to bfloat16 does on CPU, said once per process (compute_dtype: as asked)
    "params_dtype": "params_dtype (param_init_type) bfloat16 on CPU: the Parameters and the optimizer state are "
                    "float32 (master weights); the GEMMs follow compute_dtype.",
    "layernorm_compute_dtype": "layernorm_compute_dtype bfloat16 on CPU: the norms compute in float32.",
    "softmax_compute_dtype": "softmax_compute_dtype bfloat16 on CPU: the softmax computes in float32.",
}
_NOTED = set()


def graph_config(config, kernels):
    """The config a model's Cells are built from, for its ``KernelProvider`` ``kernels``: ``config`` itself where
    every dtype key runs as set, else a copy with the dtypes the device runs (``kernels.graph_dtype``: on CPU
    bfloat16 -> float32, the GEMMs then bf16 by ``kernels.gemm_dtype``), each such key but compute_dtype said in one
    stderr line per process. The model keeps ``config`` (config.json, save_pretrained, MindFormers see the
    YAML's dtypes)."""
    import sys  # pylint: disable=import-outside-toplevel
    changed = {}
    for key in DTYPE_KEYS:
        value = kernels.graph_dtype(getattr(config, key))
        if value != str(getattr(config, key)):
            changed[key] = value
    if not changed:
        return config
    for key in changed:
        if key in _DTYPE_NOTES and key not in _NOTED:
            _NOTED.add(key)
            sys.stderr.write(f"gpt_local: {_DTYPE_NOTES[key]}\n")
    view = copy.copy(config)
    for key, value in changed.items():
        setattr(view, key, value)
    return view


def _plain_pet_config(pet_config):
    """pet_config as a plain dict (MindFormers hands a DictConfig/LoraConfig; dtypes become their names)."""
    if not pet_config:
        return None
    items = pet_config.items() if hasattr(pet_config, "items") else vars(pet_config).items()
    return {k: (v if v is None or isinstance(v, (str, int, float, bool, list, tuple)) else str(v))
            for k, v in items}


def known_keys():
    """Every key a gpt_local model_config may hold."""
    global _KNOWN  # pylint: disable=global-statement
    if _KNOWN is None:
        import inspect
        own = set(inspect.signature(GPTLocalConfig.__init__).parameters) - {"self", "kwargs"}
        base = set(ConfigBase().to_dict())
        _KNOWN = own | base | set(GPT2_ALIASES) | MINDFORMERS_INJECTED | {
            "model_type", "architectures", "transformers_version", "mindformers_version",
            "_name_or_path", "position_embedding_type", "normalization", "add_bias_linear",
            "gated_linear_unit", "offset", "recompute", "pipeline_stage", "name_or_path"}
    return _KNOWN


def _reject_unknown(kwargs):
    # MoE keys arrive flattened from moe_config; a dense GPT ignores them.
    moe = MOE_KEYS
    # underscore keys are loader bookkeeping (_commit_hash, _from_auto ...), not model settings
    unknown = [k for k in kwargs if k not in known_keys() and k not in moe and k != "self" and not k.startswith("_")]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(known_keys()), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"model_config.{key} is not a gpt_local config key.{hint} "
                          f"Remove or rename it (known keys: see GPTLocalConfig).")

