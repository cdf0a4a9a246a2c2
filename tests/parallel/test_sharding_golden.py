"""A golden table of the concrete `shard` strategy of every op at data_parallel 2, model_parallel 4 (also
with sequence parallel and with the vocabulary split), each entry justified by the op's math: the rules
in parallel/sharding.py are compared with what they should be, not only with themselves."""
import pytest

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.parallel.sharding import apply_sharding
from references import SMALL


# The concrete `shard` strategy of every op at data_parallel 2, model_parallel 4, written out by hand.
# Shapes: hidden [B, S, H]; linear inputs are flattened to [B*S, in]; weights are [out, in] (MatMul
# transpose_b); attention works on [B, N heads, S, head_dim]. One tuple per input, one entry per axis.
GOLDEN_DP2_MP4 = {
    # token table [V, H] whole on every rank (vocab_emb_dp True); ids [B, S] split over the batch
    "model.embedding.gather": ((1, 1), (2, 1)),
    "model.embedding.position_gather": ((1, 1), (2, 1)),
    "model.embedding.dropout.dropout": ((2, 1, 1),),               # element-wise on [B, S, H]: batch only
    "input_layernorm.layer_norm": ((2, 1, 1), (1,), (1,)),        # normalises over H: H must stay whole
    # column parallel: each rank computes its rows of W (out features) = whole heads of q, k, v
    "attention.linear_qkv.matmul": ((2, 1), (4, 1)),
    "attention.linear_qkv.bias_add": ((2, 4), (4,)),               # the bias follows the output columns
    # [B, S, N, 3, D] -> [3, B, N, S, D]: the heads axis (2) carries the mp split, never S or D
    "attention.transpose": ((2, 1, 4, 1, 1),),
    "attention.split_qkv": ((1, 2, 4, 1, 1),),                     # unstack q/k/v: axis 0 must stay whole
    # scores, softmax and context are per head: batch over dp, heads over mp; S and D whole (a row's
    # softmax needs all its keys)
    "attention.plain.qk_matmul": ((2, 4, 1, 1), (2, 4, 1, 1)),
    "attention.plain.scale_mul": ((2, 4, 1, 1), ()),
    "attention.plain.add_mask": ((2, 4, 1, 1), (1, 1, 1, 1)),           # the [1, 1, S, S] mask is broadcast whole
    "attention.plain.softmax": ((2, 4, 1, 1),),
    "attention.plain.attention_dropout.dropout": ((2, 4, 1, 1),),
    "attention.plain.pv_matmul": ((2, 4, 1, 1), (2, 4, 1, 1)),
    "attention.plain.merge_heads": ((2, 4, 1, 1),),                      # [B, N, S, D] -> [B, S, N, D]
    # row parallel: each rank holds its heads' columns of W; the partial sums are all-reduced, then the
    # bias is added once, after the reduction
    "attention.linear_proj.matmul": ((2, 4), (1, 4)),
    "attention.linear_proj.bias_add": ((2, 1), (1,)),
    "post_attention_layernorm.layer_norm": ((2, 1, 1), (1,), (1,)),
    "mlp.linear_fc1.matmul": ((2, 1), (4, 1)),                     # column parallel over the ffn width
    "mlp.linear_fc1.bias_add": ((2, 4), (4,)),
    "mlp.activation.gelu": ((2, 1, 4),),                           # element-wise on the ffn columns it holds
    "mlp.activation.relu": ((2, 1, 4),),
    "mlp.linear_fc2.matmul": ((2, 4), (1, 4)),                     # row parallel back to H
    "mlp.linear_fc2.bias_add": ((2, 1), (1,)),
    "attention_output_dropout.dropout": ((2, 1, 1),),
    "mlp_output_dropout.dropout": ((2, 1, 1),),
    "add": ((2, 1, 1), (2, 1, 1)),                                 # residual adds: batch only
    "model.final_layernorm.layer_norm": ((2, 1, 1), (1,), (1,)),
    "head_matmul": ((2, 1), (1, 1)),                               # tied head, the table whole
    "log_softmax": ((2, 1),),                                      # over the vocabulary: V whole
    "gather_d": ((2, 1), (2, 1)),
}
# With use_seq_parallel, what is element-wise over [B, S, H] (norms, dropout, residual adds) also splits S
# over mp; MindSpore all-gathers S before the column-parallel matmuls and reduce-scatters after the row ones.
SEQUENCE_PARALLEL = {"model.embedding.dropout.dropout": ((2, 4, 1),),
                     "input_layernorm.layer_norm": ((2, 4, 1), (1,), (1,)),
                     "post_attention_layernorm.layer_norm": ((2, 4, 1), (1,), (1,)),
                     "attention_output_dropout.dropout": ((2, 4, 1),),
                     "mlp_output_dropout.dropout": ((2, 4, 1),), "add": ((2, 4, 1), (2, 4, 1)),
                     "model.final_layernorm.layer_norm": ((2, 4, 1), (1,), (1,))}
# vocab_emb_dp False: the table's rows (the vocabulary) split over mp for the lookup and the tied head
VOCAB_PARALLEL = {"model.embedding.gather": ((4, 1), (2, 1)), "head_matmul": ((2, 1), (4, 1))}


def _split(table):
    """(ops of the model outside the layers, ops of one layer relative to it)."""
    top = {op: st for op, st in table.items() if op.startswith("model.") or op in ("head_matmul", "log_softmax",
                                                                                "gather_d")}
    return top, {op: st for op, st in table.items() if op not in top}


@pytest.mark.parametrize("extra,changes", [({}, {}), ({"use_seq_parallel": True}, SEQUENCE_PARALLEL),
                                           ({"vocab_emb_dp": False}, VOCAB_PARALLEL)],
                         ids=["plain", "sequence parallel", "vocab parallel"])
def test_every_op_strategy_equals_the_golden_table(extra, changes):
    config = GPTLocalConfig(**SMALL, parallel_config={"data_parallel": 2, "model_parallel": 4, **extra})
    applied = apply_sharding(GPTLocalForCausalLM(config), config)
    top, layer = _split(dict(GOLDEN_DP2_MP4, **changes))
    assert {op: st for op, st in applied.items() if not op.startswith("model.layers.")} == top
    for index in range(SMALL["num_hidden_layers"]):
        prefix = f"model.layers.{index}."
        assert {op[len(prefix):]: st for op, st in applied.items() if op.startswith(prefix)} == layer, index


def test_a_parallel_build_applies_the_golden_strategies(monkeypatch):
    """The model's own call (made only under semi-auto/auto parallel, which CPU cannot compile) sets them."""
    import mindformers_gptlocal.model.gpt as gpt
    monkeypatch.setattr(gpt, "is_parallel_build", lambda: True)
    config = GPTLocalConfig(**SMALL, parallel_config={"data_parallel": 2, "model_parallel": 4})
    model = GPTLocalForCausalLM(config)
    top, layer = _split(GOLDEN_DP2_MP4)
    assert {op: st for op, st in model.sharding.items() if not op.startswith("model.layers.")} == top
    assert {op[len("model.layers.1."):]: st for op, st in model.sharding.items()
            if op.startswith("model.layers.1.")} == layer
    assert model.model.layers[1].attention.transpose.attrs["in_strategy"] == ((2, 1, 4, 1, 1),)


# Bottleneck adapters (pet_type: adapter) at data_parallel 2, model_parallel 4, laid out like the MLP: the
# down-projection [m, H] column-parallel (each rank m/4 bottleneck units, its bias with them), the activation
# on the units a rank holds, the up-projection [H, m] row-parallel (partial sums all-reduced, then its bias
# once), the adapter's residual add over [B, S, H] batch only (sequence too with use_seq_parallel).
ADAPTER_GOLDEN_DP2_MP4 = {
    f"{site}.{op}": strategy for site in ("attention_adapter", "mlp_adapter") for op, strategy in {
        "linear_down.matmul": ((2, 1), (4, 1)), "linear_down.bias_add": ((2, 4), (4,)),
        "activation.gelu": ((2, 1, 4),), "activation.relu": ((2, 1, 4),),
        "linear_up.matmul": ((2, 4), (1, 4)), "linear_up.bias_add": ((2, 1), (1,)),
        "add": ((2, 1, 1), (2, 1, 1))}.items()}


@pytest.mark.parametrize("extra,add", [({}, ((2, 1, 1), (2, 1, 1))), ({"use_seq_parallel": True},
                                                                    ((2, 4, 1), (2, 4, 1)))],
                         ids=["plain", "sequence parallel"])
def test_adapter_strategies_equal_the_golden_table(extra, add):
    """pet_type adapter (bottleneck 16) on every layer; the base ops keep their golden strategies."""
    config = GPTLocalConfig(**SMALL, parallel_config={"data_parallel": 2, "model_parallel": 4, **extra},
                            pet_config={"pet_type": "adapter", "bottleneck_size": 16})
    applied = apply_sharding(GPTLocalForCausalLM(config), config)
    golden = {op: (add if op.endswith(".add") else st) for op, st in ADAPTER_GOLDEN_DP2_MP4.items()}
    for index in range(SMALL["num_hidden_layers"]):
        prefix = f"model.layers.{index}."
        assert {op[len(prefix):]: st for op, st in applied.items()
                if op.startswith(prefix) and "_adapter." in op} == golden, index
        assert applied[prefix + "mlp.linear_fc1.matmul"] == ((2, 1), (4, 1))


# Prefix tuning (pet_type ptuning2 / prefixtuning) at data_parallel 2, model_parallel 4: the prefix tensors are
# replicated (peft's table is layer-major, [P, layers x 2 x groups x D]: no one-axis split gives a rank its
# groups); the table's reader, the MLP and its tanh whole on every rank. Each layer's Concats put the prefix in
# front of the keys and values [B, G, P + K, D] split like the keys (batch over dp, key/value groups over mp):
# rank r reads the prefix rows of its own groups (a local slice of the replicated rows); the mask
# [b, 1, S, P + K] whole, as add_mask's.
PREFIX_ENCODER_GOLDEN = {"model.prefix_encoder.cast": ((1, 1),), "model.prefix_encoder.transpose": ((1, 1, 1, 1),),
                         "model.prefix_encoder.unstack": ((1, 1, 1, 1),)}
PREFIX_MLP_GOLDEN = {"model.prefix_encoder.transform_in.matmul": ((1, 1), (1, 1)),
                     "model.prefix_encoder.transform_in.bias_add": ((1, 1), (1,)),
                     "model.prefix_encoder.tanh": ((1, 1),),
                     "model.prefix_encoder.transform_out.matmul": ((1, 1), (1, 1)),
                     "model.prefix_encoder.transform_out.bias_add": ((1, 1), (1,))}
PREFIX_DROPOUT_GOLDEN = {"model.prefix_encoder.dropout.dropout": ((1, 1, 1, 1),)}  # [P, 2L, G, D], element-wise
PREFIX_LAYER_GOLDEN = {"attention.prefix_concat.key": ((2, 4, 1, 1), (2, 4, 1, 1)),
                       "attention.prefix_concat.value": ((2, 4, 1, 1), (2, 4, 1, 1)),
                       "attention.prefix_concat.mask": ((1, 1, 1, 1), (1, 1, 1, 1))}
PREFIX_SMALL = dict(SMALL, seq_length=12)  # + the 4 prefix tokens = max_position_embeddings 16


@pytest.mark.parametrize("pet,encoder", [
    ({"pet_type": "ptuning2", "pre_seq_len": 4, "prefix_projection": False, "dropout_prob": 0.0},
     PREFIX_ENCODER_GOLDEN),
    ({"pet_type": "prefixtuning", "prefix_token_num": 4, "mid_dim": 8, "dropout_rate": 0.0},
     dict(PREFIX_ENCODER_GOLDEN, **PREFIX_MLP_GOLDEN))], ids=["ptuning2", "prefixtuning-mlp"])
def test_prefix_strategies_equal_the_golden_table(pet, encoder):
    """The prefix encoder's ops and each layer's prefix Concats; the base ops keep their golden strategies."""
    config = GPTLocalConfig(**PREFIX_SMALL, parallel_config={"data_parallel": 2, "model_parallel": 4},
                            pet_config=pet)
    applied = apply_sharding(GPTLocalForCausalLM(config), config)
    assert {op: st for op, st in applied.items() if op.startswith("model.prefix_encoder.")} == encoder
    for index in range(SMALL["num_hidden_layers"]):
        prefix = f"model.layers.{index}."
        assert {op[len(prefix):]: st for op, st in applied.items()
                if op.startswith(prefix) and "prefix_concat" in op} == PREFIX_LAYER_GOLDEN, index
        assert applied[prefix + "attention.plain.qk_matmul"] == GOLDEN_DP2_MP4["attention.plain.qk_matmul"]
    from mindformers_gptlocal.model.params import parameter_table
    for name, spec in parameter_table(config).items():  # the table ckpt split/merge reads: replicated too
        if ".prefix_encoder." in name:
            assert set(spec.layout) == {1}, (name, spec.layout)


def test_a_parallel_build_takes_a_prefix(monkeypatch):
    """Prefix tuning under semi-auto/auto parallel is built (it was refused before the strategies) and the
    model's own call sets the prefix strategies on its primitives, the MLP's and the dropout's too (MindSpore's
    Dropout there: the counter-based one is for parallel_mode 0)."""
    import mindformers_gptlocal.model.gpt as gpt
    import mindformers_gptlocal.model.dropout as dropout
    monkeypatch.setattr(gpt, "is_parallel_build", lambda: True)
    monkeypatch.setattr(dropout, "is_parallel_build", lambda: True)
    config = GPTLocalConfig(**PREFIX_SMALL, parallel_config={"data_parallel": 2, "model_parallel": 4},
                            pet_config={"pet_type": "prefixtuning", "prefix_token_num": 4, "mid_dim": 8,
                                        "dropout_rate": 0.1})
    model = GPTLocalForCausalLM(config)
    assert not model.model.counter_dropout
    golden = dict(PREFIX_ENCODER_GOLDEN, **PREFIX_MLP_GOLDEN, **PREFIX_DROPOUT_GOLDEN)
    assert {op: st for op, st in model.sharding.items() if op.startswith("model.prefix_encoder.")} == golden
    assert model.model.prefix_encoder.dropout.dropout.attrs["in_strategy"] == ((1, 1, 1, 1),)
    assert model.model.layers[1].attention.prefix_concat.key.attrs["in_strategy"] == ((2, 4, 1, 1), (2, 4, 1, 1))
