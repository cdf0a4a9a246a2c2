"""GPTLocalModel (embeddings + CellList of blocks + final norm) and GPTLocalForCausalLM (tied head + loss).

Training returns ``(lm_loss, mtp_loss, aux_loss)`` as MindFormers' mcore wrappers
expect; eval with labels returns ``(logits, labels, mask)`` laid out for
MindFormers' PerplexityMetric; predict returns logits ``[batch, seq, vocab]``.
Decoding runs the same ``GPTLocalModel.construct`` with per-layer caches (``kv_cache.py``).
The parallel layout is read once (``config.layout``) and handed to placement, recompute and sharding.
"""
import os

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor, Parameter
from mindspore.common.initializer import initializer, Normal

from ..errors import ConfigError
from ..generation import GenerationMixin
from ..parallel.recompute import RecomputePlan
from ..tokenizer_id import check_model_dir as check_tokenizer_id
from ..parallel.sharding import apply_sharding, is_parallel_build
from .bases import LEAN, MindFormerModuleType, MindFormerRegister, ModelMixin, PreTrainedModel, TrainModelMixin
from .attention import MASK_VALUE, RotaryEmbedding
from .block import GPTLocalBlock
from .config import GPTLocalConfig
from .dropout import counter_dropout_enabled, make_dropout
from .kv_cache import KVCache, cache_length
from .layers import make_norm, to_mstype
from .params import DROPOUT_STEP
from .weights import load_weights, save_model_dir, WEIGHTS_NAME


def use_flash_attention(config):
    """Ascend's fused kernel when asked for and on Ascend; matmul + softmax everywhere else."""
    return bool(config.use_flash_attention) and ms.get_context("device_target") == "Ascend"


class GPTLocalEmbedding(nn.Cell):
    """Token + learned absolute position embeddings (none with rope: positions turn q and k instead),
    then dropout."""

    def __init__(self, config, counter_dropout=False):
        super().__init__()
        params_dtype = to_mstype(config.params_dtype)
        self.word_embeddings = Parameter(initializer(Normal(config.initializer_range),
                                                     (config.vocab_size, config.hidden_size), params_dtype),
                                         name="word_embeddings")
        self.learned_positions = not config.rope
        if self.learned_positions:
            self.position_embeddings = Parameter(initializer(Normal(config.initializer_range),
                                                             (config.max_position_embeddings, config.hidden_size),
                                                             params_dtype), name="position_embeddings")
            self.position_gather = ops.Gather()  # its own primitive: its shard strategy differs from gather's
        self.gather = ops.Gather()
        self.dropout = make_dropout(config.embedding_dropout, 0, config, counter_dropout)
        self.compute_dtype = to_mstype(config.compute_dtype)

    def construct(self, input_ids, position_ids, dropout_step=None):
        words = self.gather(self.word_embeddings, input_ids, 0)
        if not self.learned_positions:
            return self.dropout(ops.cast(words, self.compute_dtype), dropout_step)
        positions = self.position_gather(self.position_embeddings, position_ids, 0)
        return self.dropout(ops.cast(words + positions, self.compute_dtype), dropout_step)


class GPTLocalModel(nn.Cell):
    """The decoder stack. Each layer is a GPTLocalBlock whose stage and recompute are set here, once.

    Placement: the embedding on stage 0, each block on its stage (``Layout.stage_of_layers``), the final norm
    (and, in GPTLocalForCausalLM, the head) on the last. The token embedding is used on stage 0
    (lookup) and on the last stage (tied head); no copy is made here. MindSpore's pipeline pass
    (PipelineTransformer::HandleSharedParameter) makes the lowest stage that reads a shared
    Parameter its owner: the owner Sends its slice of the table to the later stage, which Receives
    it in place of its own copy; the backward of that Receive sends the head's gradient back and
    the owner adds it to the lookup's gradient, so only stage 0's table is updated.
    """

    def __init__(self, config, layout=None):
        super().__init__()
        self.config = config
        layout = config.layout if layout is None else layout
        stage_ids = layout.stage_of_layers(config.num_hidden_layers)
        recompute = RecomputePlan(layout, config.num_hidden_layers)
        flash = use_flash_attention(config)
        # dropout masks from a step counter (dropout.py), so a resumed run draws the same ones
        self.counter_dropout = counter_dropout_enabled(config)
        self.embedding = GPTLocalEmbedding(config, self.counter_dropout)
        blocks = []
        for index in range(config.num_hidden_layers):
            block = GPTLocalBlock(config, index + 1, flash, counter_dropout=self.counter_dropout)
            block.pipeline_stage = stage_ids[index]
            block.recompute_mode = recompute.apply(block, index)
            blocks.append(block)
        self.layers = nn.CellList(blocks)
        self.final_layernorm = make_norm(config)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rotary_base) if config.rope else None
        self.embedding.pipeline_stage = 0
        self.final_layernorm.pipeline_stage = stage_ids[-1]
        if flash:  # sparse_mode 3's compressed mask (FlashAttentionScore: uint8, 1 = masked)
            self.varlen_mask = Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1))
        # the causal mask is built per call from the token index (one [S, S] comparison), not kept as a
        # [max_position_embeddings]^2 constant: a converted Qwen2 (32,768 positions) would hold 4 GiB of it
        self.token_index = Tensor(np.arange(config.max_position_embeddings, dtype=np.int32)[None])
        self.use_flash = flash
        self.stage_ids = stage_ids
        self.num_layers = config.num_hidden_layers

    def construct(self, input_ids, position_ids, attention_bias=None, key_caches=None, value_caches=None,
                  write_index=None, actual_seq_len=None, dropout_step=None):
        """input_ids/position_ids [B, S] -> hidden [B, S, H]. The causal mask is built here unless given.

        Decoding (``kv_cache.py``) passes per-layer caches (``key_caches``/``value_caches``: tuples of
        [B, N, L, D] Parameters), ``write_index`` [B, N, S, 3] and an ``attention_bias`` over the L
        cached rows; each layer writes its keys and values there (see ParallelAttention).
        ``actual_seq_len`` (packed rows, see ``document_mask``) replaces position_ids and the mask.
        ``dropout_step`` (training): the forward counter that picks every dropout mask (``dropout.py``)."""
        seq = input_ids.shape[1]
        seq_ends = None
        if actual_seq_len is not None:
            position_ids, attention_bias, seq_ends = self.document_mask(actual_seq_len, input_ids.shape[0], seq)
        if attention_bias is None:
            attention_bias = self.causal_mask(seq)
        hidden = self.embedding(input_ids, position_ids, dropout_step)
        rotary = None if self.rotary is None else self.rotary(position_ids)  # per-row positions, ragged or packed
        if key_caches is None:
            for layer in self.layers:
                hidden = layer(hidden, attention_bias, None, None, None, seq_ends, dropout_step, rotary)
        else:
            for index in range(self.num_layers):
                hidden = self.layers[index](hidden, attention_bias, key_caches[index], value_caches[index],
                                            write_index, None, None, rotary)
        return self.final_layernorm(hidden)

    def document_mask(self, actual_seq_len, batch, seq):
        """Packed rows: several documents in one row of ``seq`` tokens, as MindFormers' PackingHandler and
        Megatron's compressed EOD mask describe them: ``actual_seq_len`` [B, L] holds each row's cumulative
        document ends, padded with ``seq`` (after MindFormers' batch map, row b's ends are offset by b * seq;
        both forms are read). Returns position_ids [B, S] restarting at every document, the mask, and
        the ends over the flattened batch for flash attention (else None).

        The mask keeps token i -> j where j <= i and both lie in one document: additive [B, 1, S, S] for
        matmul attention (CPU/GPU); for flash attention the varlen kernel takes the ends themselves.
        All tensor arithmetic on static shapes, no control flow on values."""
        ends = ops.reshape(ops.cast(actual_seq_len, ms.int32), (batch, -1))
        ends = ops.floor_mod(ends - 1, seq) + 1  # row-local ends in (0, seq]
        index = self.token_index[:, :seq]  # [1, S]
        passed = ops.cast(ops.less_equal(ops.expand_dims(ends, 2), ops.expand_dims(index, 1)), ms.int32)
        doc = ops.reduce_sum(passed, 1)  # [B, S]: documents ended at or before token i = its document number
        start = ops.reduce_max(ops.expand_dims(ends, 2) * passed, 1)  # [B, S]: where token i's document starts
        positions = ops.broadcast_to(index, (batch, seq)) - start
        if self.use_flash:
            offsets = ops.reshape(ops.arange(batch, dtype=ms.int32) * seq, (batch, 1))
            return positions, self.varlen_mask, ops.reshape(ends + offsets, (-1,))
        same = ops.equal(ops.expand_dims(doc, 2), ops.expand_dims(doc, 1))  # [B, S, S]
        keep = ops.logical_and(same, self.causal_keep(seq))
        bias = ops.cast(ops.logical_not(keep), ms.float32) * MASK_VALUE
        return positions, ops.reshape(bias, (batch, 1, seq, seq)), None

    def causal_keep(self, seq):
        """[S, S] bool: query i may attend to key j where j <= i."""
        index = self.token_index[:, :seq]  # [1, S]
        return ops.less_equal(index, ops.reshape(index, (seq, 1)))

    def causal_mask(self, seq):
        """The causal mask of ``seq`` tokens as the attention takes it: additive [1, 1, S, S] (0 or
        MASK_VALUE, as ``attention.causal_bias``), or uint8 [S, S] with 1 = masked for flash attention."""
        masked = ops.logical_not(self.causal_keep(seq))
        if self.use_flash:
            return ops.cast(masked, ms.uint8)
        return ops.reshape(ops.cast(masked, ms.float32) * MASK_VALUE, (1, 1, seq, seq))

    def mask_bias(self, attention_mask, batch, seq):
        """MindFormers' ``attention_mask`` column ([B, 1, S, S] or [B, S, S], 1 = masked: Megatron's reset
        mask, HFDataLoader's packed mask) as this model's mask: additive bias, or uint8 for flash."""
        if self.use_flash:
            return ops.reshape(ops.cast(attention_mask, ms.uint8), (batch, 1, seq, seq))
        return ops.reshape(ops.cast(attention_mask, ms.float32) * MASK_VALUE, (batch, 1, seq, seq))


class OutputLayer(nn.Cell):
    """The untied output head's table [vocab, hidden] (``untie_embeddings_and_output_weights``)."""

    def __init__(self, config):
        super().__init__()
        self.weight = Parameter(initializer(Normal(config.initializer_range), (config.vocab_size, config.hidden_size),
                                            to_mstype(config.params_dtype)), name="weight")


def _argmax(logits, axis=-1):
    """Greedy pick with the Argmax primitive, which has kernels on CPU, GPU and Ascend."""
    return ops.Argmax(axis=axis, output_type=ms.int32)(logits)


class GPTLocalPreTrainedModel(PreTrainedModel, ModelMixin):
    """Ties GPTLocalConfig to the model for MindFormers' loading utilities."""

    config_class = GPTLocalConfig
    base_model_prefix = "gpt_local"


@MindFormerRegister.register(MindFormerModuleType.MODELS, legacy=False)
class GPTLocalForCausalLM(GenerationMixin, TrainModelMixin, GPTLocalPreTrainedModel):
    """GPT-2 causal LM with its output head tied to the token embedding; ``generate`` from GenerationMixin."""

    KV_CACHES_KEPT = 4  # cache shapes kept compiled at once

    def __init__(self, config: GPTLocalConfig):
        super().__init__(config)
        self.config = config
        layout = config.layout
        self.model = GPTLocalModel(config, layout)
        if config.untie_embeddings_and_output_weights:  # its own head table, on the last stage
            self.output_layer = OutputLayer(config)
            self.output_layer.pipeline_stage = self.model.stage_ids[-1]
        self.untied = config.untie_embeddings_and_output_weights
        if self.model.counter_dropout:  # training state, not a weight (params.DROPOUT_STEP); checkpoints keep it
            self.dropout_step = Parameter(Tensor(0, ms.int32), name=DROPOUT_STEP, requires_grad=False)
            self.one = Tensor(1, ms.int32)
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
        self.lora = config.lora_spec()  # pet_config: LoRA adapters, before the strategies are set
        if self.lora is not None:
            from .lora import add_lora
            add_lora(self, self.lora)
        self.sharding = apply_sharding(self, config, config.architecture) if is_parallel_build() else {}
        self._kv_caches = {}

    # --- MindFormers mcore interface -------------------------------------------------------------
    def get_gpt_transformer_config(self):
        if self.transformer_config is None:
            from .transformer_config import to_transformer_config  # MindFormers' TransformerConfig
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

    # --- weights ---------------------------------------------------------------------------------
    def load_weights(self, path):
        """Load safetensors weights: a file, a model directory or a MindFormers checkpoint folder."""
        return load_weights(self, path)

    @classmethod
    def from_pretrained(cls, model_dir, **overrides):
        """Build from ``model_dir/config.json`` and load ``model_dir``'s safetensors weights if present. The
        folder's tokenizer files must be those its weights were trained with (``tokenizer_id``)."""
        check_tokenizer_id(model_dir)
        model = cls(GPTLocalConfig.from_model_dir(model_dir, **overrides))
        if os.path.isfile(os.path.join(model_dir, WEIGHTS_NAME)):
            model.load_weights(model_dir)
        return model

    def save_pretrained(self, save_directory, tokenizer_dir=None, **kwargs):
        """Write config.json + model.safetensors (+ tokenizer files) to ``save_directory``."""
        return save_model_dir(self, save_directory, tokenizer_dir)

    # --- KV cache ----------------------------------------------------------------------------------
    def kv_cache(self, batch_size, needed_length):
        """The KVCache for ``batch_size`` sequences of up to ``needed_length`` tokens (rounded up to a
        bucket), built once per shape and kept (the KV_CACHES_KEPT most recently used shapes) so no call
        recompiles."""
        key = (batch_size, cache_length(needed_length, self.config.max_position_embeddings))
        if key not in self._kv_caches:
            while len(self._kv_caches) >= self.KV_CACHES_KEPT:  # the least recently used goes
                self._kv_caches.pop(next(iter(self._kv_caches)))
            self._kv_caches[key] = KVCache(self, *key)
        self._kv_caches[key] = self._kv_caches.pop(key)  # now the most recently used
        return self._kv_caches[key]

    # --- forward ---------------------------------------------------------------------------------
    def logits(self, hidden):
        """The head (tied to the token table, or ``output_layer``): hidden [B, S, H] -> fp32 logits [B*S, V]."""
        batch, seq, width = hidden.shape
        hidden = ops.reshape(ops.cast(hidden, self.compute_dtype), (batch * seq, width))
        if self.untied:
            weight = ops.cast(self.output_layer.weight, self.compute_dtype)
        else:
            weight = ops.cast(self.model.embedding.word_embeddings, self.compute_dtype)
        return ops.cast(self.head_matmul(hidden, weight), ms.float32)

    def last_logits(self, hidden, last_index):
        """Logits [B, V] of one position per sequence: hidden [B, S, H], last_index [B]."""
        batch, _, width = hidden.shape
        index = ops.broadcast_to(ops.reshape(last_index, (batch, 1, 1)), (batch, 1, width))
        return self.logits(self.gather_d(hidden, 1, index))

    def construct(self, input_ids, labels=None, loss_mask=None, position_ids=None, attention_mask=None,
                  actual_seq_len=None):
        """input_ids [B, S]. With ``labels`` None in training, input_ids holds S+1 tokens and is shifted.

        Packed rows (several documents a row): ``actual_seq_len`` (cumulative document ends, MindFormers'
        PackingHandler / compressed EOD mask) or ``attention_mask`` (MindFormers' convention, 1 = masked,
        e.g. Megatron's reset_attention_mask) keep attention inside each document; with actual_seq_len
        the positions restart at each document too (``GPTLocalModel.document_mask``)."""
        if labels is None and self.training:
            labels = input_ids[:, 1:]
            input_ids = input_ids[:, :-1]
        batch, seq = input_ids.shape
        if position_ids is None:
            position_ids = ops.broadcast_to(self.position_ids[:, :seq], (batch, seq))
        attention_bias = None
        if attention_mask is not None:
            attention_bias = self.model.mask_bias(attention_mask, batch, seq)
        step = None
        if self.training and self.model.counter_dropout:
            step = self.dropout_step * 1  # read before this forward's increment below
        hidden = self.model(input_ids, position_ids, attention_bias, None, None, None, actual_seq_len, step)
        logits = self.logits(hidden)
        if not self.training:
            logits = ops.reshape(logits, (batch, seq, self.vocab_size))
            if labels is None:
                return logits
            return self._perplexity_layout(logits, labels, loss_mask)
        loss = self.lm_loss(logits, labels, loss_mask)
        if step is not None:
            loss = ops.depend(loss, ops.assign_add(self.dropout_step, self.one))
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


def _register_auto_class():
    """MindFormers' AutoModelForCausalLM resolves a GPTLocalConfig to this class (not in a lean process)."""
    if LEAN:
        return
    from mindformers import AutoModelForCausalLM
    AutoModelForCausalLM.register(GPTLocalConfig, GPTLocalForCausalLM, exist_ok=True)


_register_auto_class()
