"""The base classes and registry the model takes from MindFormers, chosen once, when the model is first imported.

MindFormers loaded (a YAML run, ``import mindformers`` first, the ``.pth`` hook, ``mindformers_gptlocal.
GPTLocalForCausalLM``): MindFormers' own ``PretrainedConfig``, ``PreTrainedModel``, ``ModelMixin``,
``TrainModelMixin`` and ``MindFormerRegister``, so what MindFormers builds from a YAML is its own kind of model.

Lean (``GPTLOCAL_LEAN=1`` in the environment and MindFormers not loaded; ``gptlocal generate``/``chat``/
``serve``/``eval`` set it for their own process): small stand-ins holding only what gpt_local's model reads from
those bases (the config's base attributes and ``to_dict``, the model's ``config``/``generation_config``), so a
process that only runs the model never imports MindFormers (~210 MB of RSS, ~4,300 modules, 2-3 s). If
MindFormers is imported later in a lean process, ``registration.register()`` imports the model modules again with
MindFormers' bases (``reimport_with_mindformers``): objects made before keep their lean classes.
``tests/test_lean_process.py`` checks each stand-in against MindFormers' real class.
"""
import copy
import os
import sys

from ..generation.defaults import MINDFORMERS as MINDFORMERS_GENERATION_DEFAULTS

LEAN = os.environ.get("GPTLOCAL_LEAN") == "1" and "mindformers" not in sys.modules

# MindFormers 1.8.0's MoEConfig fields (a flattened moe_config arrives in model_config; a dense GPT ignores them);
# tests/test_lean_process.py compares this with mindformers.modules.transformer.moe.MoEConfig
LEAN_MOE_KEYS = frozenset((
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

# MindFormers' GenerationConfig defaults for the options gpt_local's decode loop reads: generation/defaults.py, the one
# table of generation defaults
GENERATION_DEFAULTS = MINDFORMERS_GENERATION_DEFAULTS


def _mindformers_version():
    from importlib import metadata
    try:
        return metadata.version("mindformers")
    except metadata.PackageNotFoundError:
        return None


def mcore_train_outputs(version=None):
    """How many losses MindFormers' mcore train steps unpack from a model's training ``construct``: 1.8's
    ``MFTrainOneStepCell.grads_for_mcore`` takes ``(lm_loss, mtp_loss, aux_loss)``; 1.9 adds ``indexer_loss``
    (DeepSeek sparse attention's indexer; the pipeline cell takes ``losses[-1]`` as it), four. gpt_local returns
    its loss and zeros for the others (``mindformers_compat`` "mcore training outputs" checks this number against
    the installed ``grads_for_mcore``). Without MindFormers (lean): 1.8's three."""
    version = version if version is not None else _mindformers_version()
    try:
        major_minor = tuple(int(part) for part in (version or "").split(".")[:2])
    except ValueError:
        major_minor = ()
    return 4 if major_minor >= (1, 9) else 3


class LeanPretrainedConfig:
    """MindFormers' ``PretrainedConfig.__init__`` attributes and ``to_dict``, without MindFormers."""

    model_type = ""

    def __init__(self, **kwargs):
        self._name_or_path = str(kwargs.pop("name_or_path", ""))
        self._commit_hash = kwargs.pop("_commit_hash", None)
        self.checkpoint_name_or_path = kwargs.pop("checkpoint_name_or_path", None)
        self.pretrained_model_dir = str(kwargs.pop("pretrained_model_dir", ""))
        self.mindformers_version = kwargs.pop("mindformers_version", None)
        self.tokenizer_class = kwargs.pop("tokenizer_class", None)
        keys = ("bos_token_id", "pad_token_id", "eos_token_id", "architectures", "is_encoder_decoder",
                "is_sample_acceleration", "quantization_config", "quantization")
        if mcore_train_outputs() == 4:  # MindFormers 1.9 also sets pet_config (and its default parallel_config)
            keys += ("pet_config",)
        for key in keys:
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
        output["mindformers_version"] = _mindformers_version()
        return output

    def __eq__(self, other):
        return isinstance(other, LeanPretrainedConfig) and self.__dict__ == other.__dict__

    def __repr__(self):
        return f"{self.__class__.__name__} {self.to_dict()}"


class LeanGenerationConfig(dict):
    """What ``GenerationConfig.from_model_config(config)`` holds for the decode loop's options."""

    @classmethod
    def from_model_config(cls, config):
        values = config.to_dict()
        options = {k: values.get(k, default) for k, default in GENERATION_DEFAULTS.items()}
        eos = options["eos_token_id"]
        options["eos_token_id"] = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
        return cls(options)

    def to_dict(self):
        return dict(self)


def _lean_model_base():
    from mindspore import nn

    class LeanPreTrainedModel(nn.Cell):
        """What MindFormers' ``PreTrainedModel.__init__`` (and ``ModelMixin``'s) set, without MindFormers."""

        def __init__(self, config, *inputs, **kwargs):
            super().__init__(**kwargs)
            if not isinstance(config, LeanPretrainedConfig):
                raise TypeError(f"{self.__class__.__name__}(config) needs a config built in this lean process "
                                f"(GPTLOCAL_LEAN=1, MindFormers not loaded); got {type(config).__module__}."
                                f"{type(config).__name__}.")
            self.config = config
            self.name_or_path = config.name_or_path
            self.transformer_config = None
            self.generation_config = LeanGenerationConfig.from_model_config(config)

    return LeanPreTrainedModel


class LeanTrainModelMixin:
    """MindFormers' ``TrainModelMixin`` holds weight-concatenation helpers for its own checkpoints: none are used
    by gpt_local's model."""


class _LeanRegister:
    """``MindFormerRegister.register(...)`` as a no-op: nothing builds from a YAML in a lean process."""

    @staticmethod
    def register(*args, **kwargs):
        return lambda cls: cls


class _LeanModuleType:
    MODELS = "models"
    CONFIG = "config"


def moe_keys():
    """The MoEConfig keys model_config may carry flattened."""
    if LEAN:
        return LEAN_MOE_KEYS
    import inspect
    from mindformers.modules.transformer.moe import MoEConfig
    return (frozenset(inspect.signature(MoEConfig.__init__).parameters) | frozenset(MoEConfig().__dict__)) - {"self"}


if LEAN:
    PretrainedConfig = LeanPretrainedConfig
    PreTrainedModel = _lean_model_base()
    ModelMixin = object
    TrainModelMixin = LeanTrainModelMixin
    MindFormerRegister = _LeanRegister
    MindFormerModuleType = _LeanModuleType
else:
    from mindformers.models.configuration_utils import PretrainedConfig  # noqa: F401
    from mindformers.models.modeling_utils import PreTrainedModel  # noqa: F401
    from mindformers.parallel_core.utils.model_mixin import ModelMixin, TrainModelMixin  # noqa: F401
    from mindformers.tools.register import MindFormerRegister, MindFormerModuleType  # noqa: F401

# the modules that take their bases from here, in import order (reimport_with_mindformers)
MODEL_MODULES = ("model.bases", "model.config", "model.gpt")


def reimport_with_mindformers(package):
    """Called by ``registration.register()`` once MindFormers is loaded: if the model was imported lean, import
    its modules again so MindFormers registers (and builds) classes with its own bases. Returns True if it did."""
    own = sys.modules.get(f"{package}.model.bases")
    if own is None or not own.LEAN:
        return False
    parent = sys.modules[f"{package}.model"]
    for name in MODEL_MODULES:
        sys.modules.pop(f"{package}.{name}", None)
        if hasattr(parent, name.split(".")[1]):
            delattr(parent, name.split(".")[1])
    import importlib
    for name in MODEL_MODULES:  # MindFormers is loaded now, so bases is not LEAN this time
        importlib.import_module(f"{package}.{name}")
    return True
