"""GPTLocalBlock: one decoder layer as a standalone Cell.

LayerNorm -> ParallelAttention -> residual -> LayerNorm -> ParallelFeedForward -> residual; with
``use_parallel_residual`` (GPT-NeoX/Pythia) x + attention(norm1(x)) + mlp(norm2(x)). The norm is LayerNorm
or RMSNorm (``normalization``), chosen when the block is built.
Where the layer runs (pipeline stage) and whether it recomputes are set on the
Cell when it is built (``GPTLocalModel`` from the ``Layout``, ``parallel/``), never decided in ``construct``.
"""
from mindspore import nn, ops

from .attention import ParallelAttention
from .dropout import make_dropout
from .feedforward import ParallelFeedForward
from .layers import make_norm


class GPTLocalBlock(nn.Cell):
    """A pre-LayerNorm GPT-2 decoder layer. ``layer_number`` counts from 1.

    ``tp_size`` > 1 makes ``attention`` and ``mlp`` one tensor-parallel rank's parts (local heads
    and intermediate columns); such a block is not run whole: ``construct`` needs the all-reduce
    after each part, which the CPU proofs apply between the parts (tests/test_tensor_parallel.py).
    """

    def __init__(self, config, layer_number, use_flash_attention=False, tp_size=1, counter_dropout=False):
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = make_norm(config)
        self.attention = ParallelAttention(config, layer_number, use_flash_attention, tp_size, counter_dropout)
        self.post_attention_layernorm = make_norm(config)
        self.parallel_residual = bool(getattr(config, "use_parallel_residual", False))
        self.mlp = ParallelFeedForward(config, tp_size)
        site = 3 * (layer_number - 1)  # dropout sites: 3 per layer (attention probs, after attention, after MLP)
        self.attention_output_dropout = make_dropout(config.hidden_dropout, site + 2, config, counter_dropout)
        self.mlp_output_dropout = make_dropout(config.hidden_dropout, site + 3, config, counter_dropout)
        self.add = ops.Add()

    def construct(self, hidden, attention_bias, key_cache=None, value_cache=None, write_index=None,
                  seq_ends=None, dropout_step=None, rotary=None, prefix=None):
        """hidden [B, S, H]. The optional KV cache arguments are this layer's (see ParallelAttention);
        ``prefix``: this layer's prefix (keys, values) with prefix tuning (``prefix.py``);
        ``seq_ends``: packed rows' document ends for flash attention's variable-length form;
        ``dropout_step``: the forward counter that picks the dropout masks (``dropout.py``);
        ``rotary``: (cos, sin) of the positions with rope (``attention.RotaryEmbedding``)."""
        dtype = hidden.dtype
        attn = self.attention(self.input_layernorm(hidden), attention_bias, key_cache, value_cache, write_index,
                              seq_ends, dropout_step, rotary, prefix)
        if self.parallel_residual:
            mlp = self.mlp(self.post_attention_layernorm(hidden))
            hidden = self.add(hidden, ops.cast(self.attention_output_dropout(attn, dropout_step), dtype))
            return self.add(hidden, ops.cast(self.mlp_output_dropout(mlp, dropout_step), dtype))
        hidden = self.add(hidden, ops.cast(self.attention_output_dropout(attn, dropout_step), dtype))
        mlp = self.mlp(self.post_attention_layernorm(hidden))
        return self.add(hidden, ops.cast(self.mlp_output_dropout(mlp, dropout_step), dtype))
