"""The model as MindFormers builds it from a YAML: ``GPTLocalConfig`` and ``GPTLocalForCausalLM``, registered by name.

Each is the model's own class (``model/config.py``, ``model/gpt.py``: plain Python and MindSpore Cells, no
MindFormers) with MindFormers' base classes put where the model's plain bases stood: the config on MindFormers'
``PretrainedConfig`` in place of ``model.config.ConfigBase``; the model on ``PreTrainedModel`` (with MindFormers'
``ModelMixin`` / ``TrainModelMixin``), whose ``__init__`` sets up the Cell (``_init_base``). What MindFormers
builds is therefore its own kind of model and an instance of the model's class too (``isinstance`` holds both
ways the package's code asks). The forward, the weights and ``generate`` are the model's own.

``MindFormersAdapter`` answers what MindFormers calls on a model besides ``construct``: its trainer reads
``get_gpt_transformer_config`` (parallel and recompute settings) and ``get_model_parameters``; its predict
pipeline and ``GenerationMixin.infer`` call ``prepare_inputs_for_generation`` / ``prepare_inputs_for_predict_layout``
and pick tokens with ``self.argmax`` (``GenerationMixin.postprocess``); ``eval_with_harness.py`` and the model
runner call ``set_dynamic_inputs`` (refused with one clear error). Its mcore train steps unpack a fixed count of
losses (``train_outputs``, ``compat.mcore_train_outputs``).
"""
import numpy as np
import mindspore as ms
from mindspore import Tensor, ops

from mindformers import AutoConfig, AutoModelForCausalLM
from mindformers.generation.utils import GenerateOutput
from mindformers.models.configuration_utils import PretrainedConfig
from mindformers.models.modeling_utils import PreTrainedModel
from mindformers.parallel_core.utils.model_mixin import ModelMixin, TrainModelMixin
from mindformers.tools.register import MindFormerModuleType, MindFormerRegister

from ..errors import ConfigError
from ..model import config as core_config
from ..model import gpt as core_gpt
from .compat import mcore_train_outputs


def _argmax(logits, axis=-1):
    """Greedy pick with the Argmax primitive, which has kernels on CPU, GPU and Ascend."""
    return ops.Argmax(axis=axis, output_type=ms.int32)(logits)


class MindFormersAdapter:
    """The MindFormers-facing methods of MindFormers' ``GPTLocalForCausalLM`` (``init_mindformers_adapter`` is
    called when the Cell is set up)."""

    def init_mindformers_adapter(self):
        self.transformer_config = None
        # MindFormers' GenerationMixin.postprocess (model.infer) picks greedy tokens with self.argmax, set to
        # mint.argmax (ArgMaxExt) in its __init__; that has no CPU kernel
        self.argmax = _argmax

    def get_gpt_transformer_config(self):
        if self.transformer_config is None:
            from .transformer_config import to_transformer_config  # when MindFormers' trainer first asks
            self.transformer_config = to_transformer_config(self.config)
        return self.transformer_config

    def get_model_parameters(self):
        return set(self.trainable_params())

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": Tensor(np.asarray(input_ids, np.int32))}

    def prepare_inputs_for_predict_layout(self, input_ids, **kwargs):
        return Tensor(np.asarray(input_ids, np.int32)), None, None, None

    def set_dynamic_inputs(self, **kwargs):
        """Refused with one clear error: MindFormers' ``toolkit/benchmarks/eval_with_harness.py`` (and its
        model runner) call this first and then expect ``model(input_ids=...)[0]`` to be the logits; gpt_local
        returns the logits tensor itself and compiles one graph per shape bucket instead."""
        raise ConfigError("gpt_local does not run under MindFormers' eval_with_harness.py / model runner "
                          "(they need dynamic-shape inputs and model(...)[0] as the logits); evaluate with "
                          "`gptlocal eval --model DIR --tasks ...` or `lm_eval --model gptlocal "
                          "--model_args pretrained=DIR`.")


@MindFormerRegister.register(MindFormerModuleType.CONFIG, legacy=False, search_names="gpt_local")
class GPTLocalConfig(core_config.GPTLocalConfig, PretrainedConfig, core_config.ConfigBase):
    """The model's ``GPTLocalConfig`` on MindFormers' ``PretrainedConfig``: the bases are listed so that
    ``PretrainedConfig`` comes before the plain ``ConfigBase`` it stands in for (its ``__init__``, ``to_dict`` and
    ``__eq__`` are the ones that run)."""


class GPTLocalPreTrainedModel(PreTrainedModel, ModelMixin):
    """Ties GPTLocalConfig to the model for MindFormers' loading utilities."""

    config_class = GPTLocalConfig
    base_model_prefix = "gpt_local"


@MindFormerRegister.register(MindFormerModuleType.MODELS, legacy=False)
class GPTLocalForCausalLM(MindFormersAdapter, TrainModelMixin, core_gpt.GPTLocalForCausalLM, GPTLocalPreTrainedModel):
    """The model's ``GPTLocalForCausalLM`` on MindFormers' ``PreTrainedModel``: what MindFormers' registry,
    trainer and predict pipeline build and call."""

    config_class = GPTLocalConfig
    train_outputs = mcore_train_outputs()  # what the installed MindFormers' mcore train step unpacks

    def _init_base(self, config):
        """MindFormers' ``PreTrainedModel.__init__`` sets up the Cell (``config``, ``generation_config`` from its
        ``GenerationConfig`` ...), then the adapter's attributes."""
        PreTrainedModel.__init__(self, config)  # pylint: disable=non-parent-init-called
        self.init_mindformers_adapter()

    def generate(self, input_ids, generation_config=None, streamer=None, seed=None, stop_when=None, **kwargs):
        """The model's ``generate`` (the inference runtime's); asked for a dict (``return_dict_in_generate``, as
        MindFormers' predict pipeline does), MindFormers' ``GenerateOutput``."""
        out = super().generate(input_ids, generation_config, streamer=streamer, seed=seed, stop_when=stop_when,
                               **kwargs)
        return GenerateOutput(**out) if isinstance(out, dict) else out


# MindFormers' AutoConfig / AutoModelForCausalLM resolve model_type gpt_local to these classes
AutoConfig.register(GPTLocalConfig.model_type, GPTLocalConfig, exist_ok=True)
AutoModelForCausalLM.register(GPTLocalConfig, GPTLocalForCausalLM, exist_ok=True)
