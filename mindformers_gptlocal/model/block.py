"""GPTLocalBlock: one decoder layer as a standalone Cell.

norm -> ParallelAttention -> residual -> norm -> ParallelFeedForward -> residual; with
``use_parallel_residual`` (GPT-NeoX/Pythia) x + attention(norm1(x)) + mlp(norm2(x)). The norm is LayerNorm
or RMSNorm (``normalization``), chosen when the block is built. Each part's residual update passes its
bottleneck adapter (``pet_type: adapter``, ``adapter.py``; built when the layer spec has one, else None) and
LayerDrop's 0/1 (``model_config.layerdrop``, ``dropout.LayerDrop``) when they exist. Its Linears and adapter sites
are built with the Cells the layer spec (``layer_spec.py``) picks: LoRA and adapters live outside these classes.
Where the layer runs (pipeline stage) and whether it recomputes are set on the
Cell when it is built (``GPTLocalModel`` from the ``Layout``, ``parallel/``), never decided in ``construct``.
"""
from mindspore import nn, ops

from .attention import ParallelAttention
from .dropout import dropout_site, make_dropout, make_layerdrop
from .feedforward import ParallelFeedForward
from .layers import kernel_provider, make_norm


class GPTLocalBlock(nn.Cell):
    """A pre-norm decoder layer (GPT-2's, or Llama/NeoX-style by ``config.arch``). ``layer_number`` counts from 1.
    Under tensor parallel the ``shard`` strategies (``parallel/sharding.py``) split the whole Cell. ``kernels``: the
    model's ``KernelProvider`` (None: ``kernel_provider(config)``), handed to every part."""

    def __init__(self, config, layer_number, use_flash_attention=False, counter_dropout=False, layer_spec=None,
                 kernels=None):
        super().__init__()
        kernels = kernels or kernel_provider(config)
        self.layer_number = layer_number
        self.input_layernorm = make_norm(config, kernels=kernels)
        layer_spec = layer_spec or {}  # which Cell each replaceable part is built with (layer_spec.py)
        self.attention = ParallelAttention(config, layer_number, use_flash_attention, counter_dropout=counter_dropout,
                                           layer_spec=layer_spec, kernels=kernels)
        self.post_attention_layernorm = make_norm(config, kernels=kernels)
        self.parallel_residual = config.arch.parallel_residual
        self.mlp = ParallelFeedForward(config, layer_spec=layer_spec, kernels=kernels)
        self.attention_output_dropout = make_dropout(config.hidden_dropout,
                                                     dropout_site(layer_number, "attention_output"), config,
                                                     counter_dropout)
        self.mlp_output_dropout = make_dropout(config.hidden_dropout, dropout_site(layer_number, "mlp_output"), config,
                                               counter_dropout)
        self.add = ops.Add()
        # pet_type: adapter's BottleneckAdapters (model/adapter.py) when the layer spec has them; LayerDrop scales
        # both updates by 0/1
        self.attention_adapter = layer_spec["attention_adapter"]() if "attention_adapter" in layer_spec else None
        self.mlp_adapter = layer_spec["mlp_adapter"]() if "mlp_adapter" in layer_spec else None
        self.layerdrop = make_layerdrop(config, layer_number, counter_dropout)

    def construct(self, hidden, attention_bias, key_cache=None, value_cache=None, write_index=None,
                  seq_ends=None, dropout_step=None, rotary=None, prefix=None, fresh_prefill=False):
        """hidden [B, S, H]. The optional KV cache arguments are this layer's (see ParallelAttention);
        ``prefix``: this layer's prefix (keys, values) with prefix tuning (``prefix.py``);
        ``seq_ends``: packed rows' document ends for flash attention's variable-length form;
        ``dropout_step``: the forward counter that picks the dropout masks (``dropout.py``);
        ``rotary``: (cos, sin) of the positions with rope (``attention.RotaryEmbedding``);
        ``fresh_prefill``: a KV-cache prefill at positions 0..S-1 (see ParallelAttention)."""
        dtype = hidden.dtype
        attn = self.attention(self.input_layernorm(hidden), attention_bias, key_cache=key_cache,
                              value_cache=value_cache, write_index=write_index, seq_ends=seq_ends,
                              dropout_step=dropout_step, rotary=rotary, prefix=prefix,
                              fresh_prefill=fresh_prefill)
        # each residual update: dropout, then its adapter and LayerDrop's 0/1 when they exist (None: not built)
        attn = ops.cast(self.attention_output_dropout(attn, dropout_step), dtype)
        if self.attention_adapter is not None:
            attn = self.attention_adapter(attn)
        if self.layerdrop is not None:
            attn = self.layerdrop(attn, dropout_step)
        if self.parallel_residual:
            mlp = self.mlp(self.post_attention_layernorm(hidden), dropout_step)
            hidden = self.add(hidden, attn)
        else:
            hidden = self.add(hidden, attn)
            mlp = self.mlp(self.post_attention_layernorm(hidden), dropout_step)
        mlp = ops.cast(self.mlp_output_dropout(mlp, dropout_step), dtype)
        if self.mlp_adapter is not None:
            mlp = self.mlp_adapter(mlp)
        if self.layerdrop is not None:
            mlp = self.layerdrop(mlp, dropout_step)
        return self.add(hidden, mlp)
