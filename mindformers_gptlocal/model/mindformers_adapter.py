"""What MindFormers calls on a model besides ``construct``, answered for gpt_local in one mixin.

MindFormers' trainer reads ``get_gpt_transformer_config`` (parallel and recompute settings) and
``get_model_parameters``; its predict pipeline and ``GenerationMixin.infer`` call
``prepare_inputs_for_generation`` / ``prepare_inputs_for_predict_layout`` and pick tokens with
``self.argmax`` (``GenerationMixin.postprocess``); its perplexity metric wants ``(logits, labels, mask)``
laid out its way (``_perplexity_layout``); ``eval_with_harness.py`` and the model runner call
``set_dynamic_inputs`` (refused with one clear error). ``GPTLocalForCausalLM`` mixes this in; the model
itself (``gpt.py``) does not know these callers.
"""
import numpy as np
import mindspore as ms
from mindspore import Tensor, ops

from ..errors import ConfigError


def _argmax(logits, axis=-1):
    """Greedy pick with the Argmax primitive, which has kernels on CPU, GPU and Ascend."""
    return ops.Argmax(axis=axis, output_type=ms.int32)(logits)


class MindFormersAdapter:
    """The MindFormers-facing methods of ``GPTLocalForCausalLM`` (call ``init_mindformers_adapter`` in
    ``__init__``)."""

    def init_mindformers_adapter(self):
        self.transformer_config = None
        # MindFormers' GenerationMixin.postprocess (model.infer) picks greedy tokens with self.argmax, set to
        # mint.argmax (ArgMaxExt) in its __init__; that has no CPU kernel
        self.argmax = _argmax

    def get_gpt_transformer_config(self):
        if self.transformer_config is None:
            from .transformer_config import to_transformer_config  # imports MindFormers: not in a lean process
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

    def _perplexity_layout(self, logits, labels, loss_mask):
        """PerplexityMetric scores logits[:, t] against labels[:, t + 1]; our labels are already
        shifted, so pad one position on each to keep every token."""
        if loss_mask is None:
            loss_mask = ops.ones_like(labels)
        mask = ops.cast(loss_mask, ms.int32) * ops.cast(ops.not_equal(labels, self.ignore_token_id), ms.int32)
        logits = ops.concat((logits, logits[:, -1:]), axis=1)
        labels = ops.concat((labels[:, :1], ops.maximum(labels, 0)), axis=1)
        mask = ops.concat((mask[:, :1], mask), axis=1)
        return logits, labels, mask
