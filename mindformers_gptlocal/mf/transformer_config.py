"""Translate a GPTLocalConfig into MindFormers' own TransformerConfig.

MindFormers' trainer, wrappers and callbacks read parallel and recompute
settings from ``model.get_gpt_transformer_config()``; we hand them the real
class, built by MindFormers' own converter, so they see what the model uses: the
same ``Layout`` the model is built with.
"""
from mindformers.parallel_core.transformer_config_utils import convert_to_transformer_config

# the recompute keys MindFormers' TransformerConfig takes (gpt_local reads more, see parallel/recompute.py)
RECOMPUTE_KEYS = ("recompute", "select_recompute", "parallel_optimizer_comm_recompute", "mp_comm_recompute",
                  "select_comm_recompute")


def to_transformer_config(config):
    """MindFormers TransformerConfig describing this model: its sizes, layer choices and layout."""
    layout = config.layout
    parallel = {"data_parallel": layout.dp, "model_parallel": layout.mp, "pipeline_stage": layout.pp,
                "micro_batch_num": layout.micro, "use_seq_parallel": layout.seq_parallel,
                "vocab_emb_dp": layout.vocab_emb_dp}
    recompute = {k: v for k, v in layout.recompute.items() if k in RECOMPUTE_KEYS}
    if recompute:
        parallel["recompute"] = recompute
    values = {
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "ffn_hidden_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "seq_length": config.seq_length,
        "max_position_embeddings": config.max_position_embeddings,
        "layernorm_epsilon": config.layernorm_epsilon,
        "hidden_dropout": config.hidden_dropout,
        "attention_dropout": config.attention_dropout,
        "init_method_std": config.initializer_range,
        "params_dtype": config.params_dtype,
        "compute_dtype": config.compute_dtype,
        "layernorm_compute_dtype": config.layernorm_compute_dtype,
        "softmax_compute_dtype": config.softmax_compute_dtype,
        "use_flash_attention": config.use_flash_attention,
        "position_embedding_type": config.position_embedding_type,
        "partial_rotary_factor": config.rotary_percent,  # MindFormers' name for rotary_percent
        "rotary_base": config.rotary_base,
        "num_query_groups": config.num_query_groups,
        "normalization": config.normalization,
        "add_bias_linear": config.add_bias_linear,
        "add_qkv_bias": config.add_qkv_bias,
        "gated_linear_unit": config.gated_linear_unit,
        "hidden_act": "silu" if config.gated_linear_unit else config.hidden_act,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "untie_embeddings_and_output_weights": config.untie_embeddings_and_output_weights,
        "pad_token_id": config.pad_token_id,
        "ignore_token_id": config.ignore_token_id,
        "parallel_config": parallel,
    }
    return convert_to_transformer_config(values)
