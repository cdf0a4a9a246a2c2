"""GPTLocalConfig: the one config of a gpt_local model (GPT-2, Llama-style, NeoX-style), in Hugging Face style.

Its keys are ``fields.py``'s table (each key's default, its other names, how it is read and its rule, declared
once). Their names follow MindFormers' mcore vocabulary (``num_hidden_layers``, ``layernorm_epsilon``,
``hidden_dropout`` ...) so that the same YAML ``model_config`` section feeds both this config and MindFormers'
``TransformerConfig``; GPT-2's own names (``n_layer``, ``n_embd`` ...) are accepted too. Unknown keys are refused
with the closest known key. The architecture (sizes, layer choices and what they imply) is read once into
``config.arch`` (``model/arch.py``); the parallel ``Layout`` and the PEFT settings are read once too (``layout``,
``pet_spec``).

Plain Python on a plain base (``ConfigBase``): MindFormers never imported. The class MindFormers builds from a YAML
(``model_config: type: GPTLocalConfig``) is ``mf/model.py``'s, this one on MindFormers' ``PretrainedConfig``.
"""
import copy
import difflib
import inspect

from ..errors import ConfigError
from ..generation.defaults import MINDFORMERS as MINDFORMERS_GENERATION_DEFAULTS
from ..parallel.layout import Layout
from ..parallel.rules import build_device_count, check_parallel_layout, raise_if_bad
from .arch import Arch
from .fields import ALIASES, FIELDS, dtype
from ..peft import check_trainable, read as read_pet_config
from .params import table_of_dims, dims
from .quantization import read_quantization

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



def _our_names(kwargs):
    """``kwargs`` with GPT-2's and mcore's names of our keys (``fields.ALIASES``) renamed to ours; one ConfigError
    for a key given twice with different values."""
    for alias, name in ALIASES.items():
        if alias not in kwargs:
            continue
        value = kwargs.pop(alias)
        if name in kwargs and kwargs[name] != value:
            raise ConfigError(f"model_config sets {name} twice with different values "
                              f"({name}={kwargs[name]!r} and {alias}={value!r}); keep one.")
        kwargs[name] = value
    return kwargs


def _layout_section(parallel_config):
    return DictConfig(parallel_config) if isinstance(parallel_config, dict) else parallel_config


class GPTLocalConfig(ConfigBase):
    """Configuration of a causal LM: GPT-2 by default (learned positions, pre-LN, biases, tied head); rope, GQA,
    SwiGLU, RMSNorm, untied head and parallel residual by their keys (``model/arch.py``). Takes the keys of
    ``fields.FIELDS`` (and their other names), besides what MindFormers puts into ``model_config``."""

    model_type = "gpt_local"

    def __init__(self, **kwargs):
        kwargs = _our_names(kwargs)
        parallel_config = kwargs.pop("parallel_config", None)
        if parallel_config is not None:
            self.parallel_config = _layout_section(parallel_config)
        _reject_unknown(kwargs)
        layout_batch_size = kwargs.get("batch_size")
        given = {key.name: kwargs.pop(key.name, key.default) for key in FIELDS}
        for key in MINDFORMERS_INJECTED | {"architectures"}:
            kwargs.pop(key, None)
        # the architecture, read once (model/arch.py): its resolved values are what config.json keeps
        arch = Arch.read(given)
        kept = {}
        for key in FIELDS:
            value = given[key.fallback] if given[key.name] is None and key.fallback else given[key.name]
            kept[key.name] = getattr(arch, key.name) if key.arch else key.read(key.name, value) if key.read else value
        kept["tie_word_embeddings"] = not arch.untied
        for key in FIELDS:
            if not key.base:
                setattr(self, key.name, kept[key.name])
        # MindFormers 1.9's PretrainedConfig.__init__ (the base of mf/model.py's class) sets pet_config and
        # parallel_config from its kwargs (None / its default layout): ours go there too, and no default layout
        # stays where none was given (as on 1.8: config.json and this class on ConfigBase stay the same)
        layout = {} if parallel_config is None else {"parallel_config": _layout_section(parallel_config)}
        super().__init__(**{key.name: kept[key.name] for key in FIELDS if key.base}, pet_config=self.pet_config,
                         **layout, architectures=["GPTLocalForCausalLM"], **kwargs)
        if parallel_config is None:
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

    def validate(self):
        """Refuse shapes and settings the model cannot build, naming the key and the fix: the architecture's rules
        (``Arch.check``), each other key's own (``fields.FIELDS``), then the PEFT settings and int8's dtype."""
        self.arch.check()
        for key in FIELDS:
            if key.check and not key.arch:
                key.check(key.name, getattr(self, key.name))
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


# help() and inspect show every key and its default
GPTLocalConfig.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] +
    [inspect.Parameter(key.name, inspect.Parameter.KEYWORD_ONLY, default=key.default) for key in FIELDS] +
    [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
_KNOWN = None


DTYPE_KEYS = tuple(key.name for key in FIELDS if key.check is dtype)
_DTYPE_NOTES = {  # what a dtype key set to bfloat16 does on CPU, said once per process (compute_dtype: as asked)
    "params_dtype": "params_dtype (param_init_type) bfloat16 on CPU: the Parameters and the optimizer state are "
                    "float32 (master weights); the GEMMs follow compute_dtype.",
    "layernorm_compute_dtype": "layernorm_compute_dtype bfloat16 on CPU: the norms compute in float32.",
    "softmax_compute_dtype": "softmax_compute_dtype bfloat16 on CPU: the softmax computes in float32.",
}
_NOTED = set()


# the rates an inference build runs at 0 (``graph_config``): dropout and LayerDrop are identities there, and a build
# with them on holds each dropout site's counter tables (GPT-2 small: ~20 MB) for nothing
DROPOUT_KEYS = ("hidden_dropout", "attention_dropout", "embedding_dropout", "layerdrop")


def graph_config(config, kernels):
    """The config a model's Cells are built from, for its ``KernelProvider`` ``kernels``: ``config`` itself where
    every dtype key runs as set, else a copy with the dtypes the device runs (``kernels.graph_dtype``: on CPU
    bfloat16 -> float32, the GEMMs then bf16 by ``kernels.gemm_dtype``), each such key but compute_dtype said in one
    stderr line per process; and for a build for inference only (``kernels.inference``) the dropout rates and
    LayerDrop 0 (``DROPOUT_KEYS``: identities in inference; no training-only buffers). The model keeps ``config``
    (config.json, save_pretrained, MindFormers see the YAML's dtypes and rates)."""
    import sys  # pylint: disable=import-outside-toplevel
    changed = {}
    for key in DTYPE_KEYS:
        value = kernels.graph_dtype(getattr(config, key))
        if value != str(getattr(config, key)):
            changed[key] = value
    if kernels.inference:
        changed.update({key: 0.0 for key in DROPOUT_KEYS if getattr(config, key, None)})
    if not changed:
        return config
    for key in changed:
        if key in _DTYPE_NOTES and key not in _NOTED:
            _NOTED.add(key)
            sys.stderr.write(f"gptlocal: {_DTYPE_NOTES[key]}\n")
    view = copy.copy(config)
    for key, value in changed.items():
        setattr(view, key, value)
    return view


def known_keys():
    """Every key a gpt_local model_config may hold."""
    global _KNOWN  # pylint: disable=global-statement
    if _KNOWN is None:
        own = {key.name for key in FIELDS}
        base = set(ConfigBase().to_dict())
        _KNOWN = own | base | set(ALIASES) | MINDFORMERS_INJECTED | {
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

