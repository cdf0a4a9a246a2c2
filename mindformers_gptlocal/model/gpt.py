"""GPTLocalModel (embeddings + CellList of blocks + final norm) and GPTLocalForCausalLM (tied head + loss).

Training returns ``(lm_loss, mtp_loss, aux_loss)`` as MindFormers' mcore wrappers
expect; eval with labels returns ``(logits, labels, mask)`` laid out for
MindFormers' PerplexityMetric; predict returns logits ``[batch, seq, vocab]``.
"""
import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor, Parameter
from mindspore.common.initializer import initializer, Normal

from mindformers.models.modeling_utils import PreTrainedModel
from mindformers.parallel_core.utils.model_mixin import ModelMixin, TrainModelMixin
from mindformers.tools.register import MindFormerRegister, MindFormerModuleType

from ..configuration_gpt_local import GPTLocalConfig
from .attention import causal_bias
from .block import GPTLocalBlock
from .layers import LayerNorm, to_mstype
from .placement import placement_from_config
from .recompute import RecomputePlan
from .sharding import apply_sharding, is_parallel_build


def use_flash_attention(config):
    """Ascend's fused kernel when asked for and on Ascend; matmul + softmax everywhere else."""
    return bool(config.use_flash_attention) and ms.get_context("device_target") == "Ascend"


class GPTLocalEmbedding(nn.Cell):
    """Token + learned absolute position embeddings, then dropout."""

    def __init__(self, config):
        super().__init__()
        params_dtype = to_mstype(config.params_dtype)
        self.word_embeddings = Parameter(initializer(Normal(config.initializer_range),
                                                     (config.vocab_size, config.hidden_size), params_dtype),
                                         name="word_embeddings")
        self.position_embeddings = Parameter(initializer(Normal(config.initializer_range),
                                                         (config.max_position_embeddings, config.hidden_size),
                                                         params_dtype), name="position_embeddings")
        self.gather = ops.Gather()
        self.position_gather = ops.Gather()  # its own primitive: its shard strategy differs from gather's
        self.dropout = nn.Dropout(p=config.embedding_dropout)
        self.compute_dtype = to_mstype(config.compute_dtype)

    def construct(self, input_ids, position_ids):
        words = self.gather(self.word_embeddings, input_ids, 0)
        positions = self.position_gather(self.position_embeddings, position_ids, 0)
        return self.dropout(ops.cast(words + positions, self.compute_dtype))


class GPTLocalModel(nn.Cell):
    """The decoder stack. Each layer is a GPTLocalBlock whose stage and recompute are set here, once.

    Placement: the embedding on stage 0, each block on its stage (placement.py), the final norm
    (and, in GPTLocalForCausalLM, the head) on the last. The token embedding is used on stage 0
    (lookup) and on the last stage (tied head); no copy is made here. MindSpore's pipeline pass
    (PipelineTransformer::HandleSharedParameter) makes the lowest stage that reads a shared
    Parameter its owner: the owner Sends its slice of the table to the later stage, which Receives
    it in place of its own copy; the backward of that Receive sends the head's gradient back and
    the owner adds it to the lookup's gradient, so only stage 0's table is updated.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        stage_ids, _, _ = placement_from_config(config)
        recompute = RecomputePlan(config, stage_ids)
        flash = use_flash_attention(config)
        self.embedding = GPTLocalEmbedding(config)
        blocks = []
        for index in range(config.num_hidden_layers):
            block = GPTLocalBlock(config, index + 1, flash)
            block.pipeline_stage = stage_ids[index]
            block.recompute_mode = recompute.apply(block, index)
            blocks.append(block)
        self.layers = nn.CellList(blocks)
        self.final_layernorm = LayerNorm(config.hidden_size, config.layernorm_epsilon,
                                         to_mstype(config.params_dtype), to_mstype(config.layernorm_compute_dtype))
        self.embedding.pipeline_stage = 0
        self.final_layernorm.pipeline_stage = stage_ids[-1]
        if flash:  # FlashAttentionScore takes a uint8 mask, 1 = masked
            self.flash_mask = Tensor(np.triu(np.ones((config.max_position_embeddings,) * 2, np.uint8), 1))
        else:
            self.causal_bias = causal_bias(config.max_position_embeddings)
        self.use_flash = flash
        self.stage_ids = stage_ids

    def construct(self, input_ids, position_ids, attention_bias=None):
        seq = input_ids.shape[1]
        if attention_bias is None:
            if self.use_flash:
                attention_bias = self.flash_mask[:seq, :seq]
            else:
                attention_bias = self.causal_bias[:, :, :seq, :seq]
        hidden = self.embedding(input_ids, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_bias)
        return self.final_layernorm(hidden)


def _config_dict(config):
    if config is None:
        return {}
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def _as_prompts(input_ids, pad_token_id):
    """A list of token lists from a list, a batch, or a numpy/Tensor block; trailing padding removed."""
    if hasattr(input_ids, "asnumpy"):
        input_ids = input_ids.asnumpy()
    if isinstance(input_ids, np.ndarray):
        input_ids = input_ids.tolist()
    if input_ids and not isinstance(input_ids[0], (list, tuple)):
        input_ids = [input_ids]
    rows = [list(row) for row in input_ids]
    if pad_token_id is not None and len(rows) > 1:
        rows = [_strip_right(row, pad_token_id) for row in rows]
    return rows


def _strip_right(row, pad):
    end = len(row)
    while end > 1 and row[end - 1] == pad:
        end -= 1
    return row[:end]


def _argmax(logits, axis=-1):
    """Greedy pick with the Argmax primitive, which has kernels on CPU, GPU and Ascend."""
    return ops.Argmax(axis=axis, output_type=ms.int32)(logits)


class GPTLocalPreTrainedModel(PreTrainedModel, ModelMixin):
    """Ties GPTLocalConfig to the model for MindFormers' loading utilities."""

    config_class = GPTLocalConfig
    base_model_prefix = "gpt_local"


@MindFormerRegister.register(MindFormerModuleType.MODELS, legacy=False)
class GPTLocalForCausalLM(TrainModelMixin, GPTLocalPreTrainedModel):
    """GPT-2 causal LM with its output head tied to the token embedding."""

    def __init__(self, config: GPTLocalConfig):
        super().__init__(config)
        self.config = config
        self.model = GPTLocalModel(config)
        self.transformer_config = None
        self.compute_dtype = to_mstype(config.compute_dtype)
        self.head_matmul = ops.MatMul(transpose_b=True)
        self.log_softmax = ops.LogSoftmax(axis=-1)
        self.gather_d = ops.GatherD()
        self.ignore_token_id = config.ignore_token_id
        self.vocab_size = config.vocab_size
        self.position_ids = Tensor(np.arange(config.max_position_embeddings, dtype=np.int32)[None])
        # MindFormers' greedy search uses mint.argmax (ArgMaxExt), which has no CPU kernel.
        self.argmax = _argmax
        self.sharding = apply_sharding(self, config) if is_parallel_build() else {}

    # --- MindFormers mcore interface -------------------------------------------------------------
    def get_gpt_transformer_config(self):
        if self.transformer_config is None:
            from ..transformer_config import to_transformer_config
            self.transformer_config = to_transformer_config(self.config)
        return self.transformer_config

    def get_model_parameters(self):
        return set(self.trainable_params())

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": Tensor(np.asarray(input_ids, np.int32))}

    def prepare_inputs_for_predict_layout(self, input_ids, **kwargs):
        return Tensor(np.asarray(input_ids, np.int32)), None, None, None

    # --- weights ---------------------------------------------------------------------------------
    def load_weights(self, path):
        """Load safetensors weights: a file, a model directory or a MindFormers checkpoint folder."""
        from ..checkpoint import load_weights
        return load_weights(self, path)

    @classmethod
    def from_pretrained(cls, model_dir, **overrides):
        """Build from ``model_dir/config.json`` and load ``model_dir``'s safetensors weights if present."""
        config = GPTLocalConfig.from_model_dir(model_dir, **overrides)
        model = cls(config)
        from ..checkpoint import WEIGHTS_NAME
        import os
        if os.path.isfile(os.path.join(model_dir, WEIGHTS_NAME)):
            model.load_weights(model_dir)
        return model

    def save_pretrained(self, save_directory, tokenizer_dir=None, **kwargs):
        """Write config.json + model.safetensors (+ tokenizer files) to ``save_directory``."""
        from ..checkpoint import save_model_dir
        return save_model_dir(self, save_directory, tokenizer_dir)

    # --- generation --------------------------------------------------------------------------------
    def generate(self, input_ids, generation_config=None, streamer=None, seed=None, **kwargs):
        """MindFormers-style generate with the explicit KV cache, on every backend.

        ``input_ids``: a token list or a batch of lists (right padding with ``pad_token_id`` is
        stripped). Options as MindFormers' GenerationConfig (max_new_tokens, do_sample, temperature,
        top_k, top_p, repetition_penalty, eos_token_id, use_past ...), from ``generation_config``,
        else the model's, overridden by keywords. Returns token lists, or GenerateOutput(sequences=...)
        with ``return_dict_in_generate=True`` (what MindFormers' predict pipeline asks for).
        """
        from ..generation import generate_ids, resolve_options
        base = generation_config
        if base is None:  # the model's default: its use_past=False means MindFormers' paged cache, not ours
            base = {k: v for k, v in _config_dict(getattr(self, "generation_config", None)).items() if k != "use_past"}
        options = resolve_options(base, seed=seed, **kwargs)
        prompts = _as_prompts(input_ids, options["pad_token_id"])
        sequences = generate_ids(self, prompts, options)
        if streamer is not None:
            streamer.put(np.asarray(sequences[0]))
            streamer.end()
        return_dict = kwargs.get("return_dict_in_generate")
        if return_dict is None and base is not None:
            return_dict = getattr(base, "return_dict_in_generate", False)
        if return_dict:
            from mindformers.generation.utils import GenerateOutput
            return GenerateOutput(sequences=sequences, scores=None, logits=None)
        return sequences

    # --- forward ---------------------------------------------------------------------------------
    def logits(self, hidden):
        """Tied head: hidden [B, S, H] -> fp32 logits [B*S, V]."""
        batch, seq, width = hidden.shape
        hidden = ops.reshape(ops.cast(hidden, self.compute_dtype), (batch * seq, width))
        weight = ops.cast(self.model.embedding.word_embeddings, self.compute_dtype)
        return ops.cast(self.head_matmul(hidden, weight), ms.float32)

    def construct(self, input_ids, labels=None, loss_mask=None, position_ids=None, attention_mask=None):
        """input_ids [B, S]. With ``labels`` None in training, input_ids holds S+1 tokens and is shifted."""
        if labels is None and self.training:
            labels = input_ids[:, 1:]
            input_ids = input_ids[:, :-1]
        batch, seq = input_ids.shape
        if position_ids is None:
            position_ids = ops.broadcast_to(self.position_ids[:, :seq], (batch, seq))
        hidden = self.model(input_ids, position_ids, attention_mask)
        logits = self.logits(hidden)
        if not self.training:
            logits = ops.reshape(logits, (batch, seq, self.vocab_size))
            if labels is None:
                return logits
            return self._perplexity_layout(logits, labels, loss_mask)
        loss = self.lm_loss(logits, labels, loss_mask)
        zero = ops.zeros((), ms.float32)
        return loss, zero, zero

    def lm_loss(self, logits, labels, loss_mask):
        """Mean token cross-entropy over positions where loss_mask is set and labels are not ignored."""
        labels = ops.reshape(labels, (-1,))
        keep = ops.cast(ops.not_equal(labels, self.ignore_token_id), ms.float32)
        if loss_mask is not None:
            keep = keep * ops.cast(ops.reshape(loss_mask, (-1,)), ms.float32)
        safe_labels = ops.maximum(labels, 0)
        log_probs = self.log_softmax(logits)
        picked = self.gather_d(log_probs, 1, ops.reshape(safe_labels, (-1, 1)))
        nll = -ops.reshape(picked, (-1,))
        return ops.reduce_sum(nll * keep) / ops.maximum(ops.reduce_sum(keep), 1.0)

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
