"""Tensor parallel, proved on CPU without a parallel compile (which CPU refuses).

For model_parallel 2 and 4: every weight of a real GPTLocalBlock is sliced per rank by the declared
strategy (parallel/sharding.py), loaded into that rank's real Cells (a GPTLocalBlock with the rank's local
heads and intermediate columns, tests/references.py ``rank_block``), and the ranks are joined by the collectives the layout implies:
the row-parallel partial outputs are summed (all-reduce) and then get their bias; the replicated
input of a column-parallel part receives the sum of the parts' input gradients (the all-reduce in
the backward, done by autodiff on the shared input); column-parallel outputs and gradients are
concatenated (all-gather). Output and every gradient must equal the unsharded block's.
"""
import numpy as np
import pytest
import mindspore as ms
from mindspore import nn, ops, Tensor, Parameter, ParameterTuple

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.kernels.provider import KernelProvider
from mindformers_gptlocal.model import GPTLocalBlock
from mindformers_gptlocal.model.attention import RotaryEmbedding
from references import SMALL, AllReduceParts, causal_bias, params_by_path, randomised, rank_block, value_and_grads
from mindformers_gptlocal.parallel.sharding import (check_divisible, block_rules, model_rules, param_layouts, rank_slice, merge_slices,
                                                 split_axis, apply_sharding, concrete, resolve)

SEQ, BATCH = 8, 2
# the same block with the Llama and NeoX layer options: GQA (4 heads, 2 groups: one group per rank at mp 2),
# SwiGLU, RMSNorm, no biases, rope; and parallel residual with rotary on half of each head
ARCHS = {
    "gpt2": {},
    "llama-gqa": dict(position_embedding_type="rope", num_query_groups=2, hidden_act="swiglu",
                      normalization="RMSNorm", add_bias_linear=False),
    "neox": dict(position_embedding_type="rope", rotary_percent=0.5, use_parallel_residual=True, hidden_act="gelu"),
}
ATOL = 2e-5  # absolute, for values of order 1
RTOL = 1e-5  # fp32 sums over a few hundred terms; gradients are compared relative to their largest entry


@pytest.fixture(autouse=True, scope="module")
def pynative():
    ms.set_context(mode=ms.PYNATIVE_MODE)


def rank_blocks(config, full, mp):
    """mp real rank blocks holding the slices the strategy assigns them (shapes must match exactly)."""
    layouts = param_layouts(block_rules(arch=config.arch))
    full_params = {name: p.asnumpy() for name, p in params_by_path(full).items()}
    assert set(layouts) == set(full_params), "every block parameter has a declared layout"
    parts = []
    for rank in range(mp):
        part = rank_block(config, 1, mp)
        for name, param in params_by_path(part).items():
            piece = rank_slice(full_params[name], layouts[name], rank, mp)
            assert piece.shape == tuple(param.shape), f"{name}: strategy gives {piece.shape}, rank Cell has {param.shape}"
            param.set_data(Tensor(np.ascontiguousarray(piece)))
        parts.append(part)
    return parts, layouts


def joined(parts):
    """Rank 0's block, its attention and MLP replaced by all ranks' parts joined by the all-reduce:
    the real GPTLocalBlock.construct then runs the replicated LayerNorms and residuals."""
    attention = [p.attention for p in parts]
    mlp = [p.mlp for p in parts]
    shell = parts[0]
    shell.attention = AllReduceParts(attention, getattr(attention[0].linear_proj, "bias", None))
    shell.mlp = AllReduceParts(mlp, getattr(mlp[0].linear_fc2, "bias", None))
    return shell


@pytest.mark.parametrize("mp,arch", [(2, "gpt2"), (4, "gpt2"), (2, "llama-gqa"), (2, "neox")])
def test_block_parts_reassemble_to_the_unsharded_block(mp, arch):
    config = GPTLocalConfig(**SMALL, **ARCHS[arch])
    ms.set_seed(0)
    full = randomised(GPTLocalBlock(config, 1, kernels=KernelProvider.from_config(config)), seed=mp)
    rng = np.random.default_rng(10 + mp)
    x = Tensor(rng.normal(0, 1, (BATCH, SEQ, SMALL["hidden_size"])).astype(np.float32))
    probe = Tensor(rng.normal(0, 1, (BATCH, SEQ, SMALL["hidden_size"])).astype(np.float32))
    bias = causal_bias(SEQ)
    rotary = None
    if config.arch.rope:  # ragged offsets: row 1 starts at position 3
        positions = Tensor(np.array([np.arange(SEQ), np.arange(SEQ) + 3]), ms.int32)
        rotary = RotaryEmbedding(config.arch.rotary_dim, config.rotary_base)(positions)
    full_params = params_by_path(full)
    names = sorted(full_params)
    ref_out, ref_dx, ref_grads = value_and_grads(full, ParameterTuple([full_params[n] for n in names]), x, probe, bias,
                                                 rotary)

    parts, layouts = rank_blocks(config, full, mp)
    # column-parallel outputs: the ranks' QKV columns, concatenated (all-gather), are the full QKV output
    qkv = np.concatenate([p.attention.linear_qkv(x).asnumpy() for p in parts], axis=-1)
    np.testing.assert_allclose(qkv, full.attention.linear_qkv(x).asnumpy(), atol=ATOL)
    # every rank's local Cells: heads / mp, intermediate / mp
    assert all(p.attention.num_heads == SMALL["num_attention_heads"] // mp for p in parts)
    assert all(p.attention.num_groups == config.num_query_groups // mp for p in parts)

    rank_params = [params_by_path(p) for p in parts]
    shell = joined(parts)
    used = []  # (full name, rank, Parameter) for every parameter the joined block reads
    for name in names:
        if split_axis(layouts[name]) is None:
            used.append((name, 0, rank_params[0][name]))  # replicated: rank 0's copy stands for every rank's
        else:
            used += [(name, rank, rank_params[rank][name]) for rank in range(mp)]
    out, dx, grads = value_and_grads(shell, ParameterTuple([p for _, _, p in used]), x, probe, bias, rotary)

    errors = {"output": np.abs(out - ref_out).max(), "input grad": np.abs(dx - ref_dx).max()}
    relative = {}
    np.testing.assert_allclose(out, ref_out, atol=RTOL * np.abs(ref_out).max())
    np.testing.assert_allclose(dx, ref_dx, atol=RTOL * np.abs(ref_dx).max())
    for name, ref in zip(names, ref_grads):
        pieces = [g for (n, _, _), g in zip(used, grads) if n == name]
        merged = merge_slices(pieces, layouts[name])  # column/row pieces gathered along their split axis
        assert merged.shape == ref.shape, name
        np.testing.assert_allclose(merged, ref, atol=RTOL * np.abs(ref).max(), err_msg=name)
        assert np.abs(ref).max() > 1e-4, f"{name} has no gradient to compare"
        errors[name] = np.abs(merged - ref).max()
        relative[name] = errors[name] / np.abs(ref).max()
    worst = max(errors, key=errors.get)
    print(f"\n{arch} model_parallel={mp}: max abs error {errors[worst]:.2e} ({worst}); output "
          f"{errors['output']:.2e} (values up to {np.abs(ref_out).max():.1f}), input grad {errors['input grad']:.2e}, "
          f"over {len(names)} parameter gradients; worst relative to the gradient's largest entry "
          f"{max(relative.values()):.2e}")


class VocabParallelLM(nn.Cell):
    """The model with vocab_emb_dp False across mp ranks: each rank holds a row block of the table.
    Lookup = sum over ranks of the masked local lookups (what MindSpore's Gather with a row-split
    table does); tied head = each rank's logit columns, concatenated (the all-gather before the
    (dp, 1) cross-entropy); the loss is the model's own lm_loss."""

    def __init__(self, model, layout, mp):
        super().__init__()
        self.lm = model
        table = model.model.embedding.word_embeddings.asnumpy()
        self.tables = ParameterTuple([Parameter(Tensor(np.ascontiguousarray(rank_slice(table, layout, r, mp))),
                                                name=f"rank{r}_table") for r in range(mp)])
        self.rows = table.shape[0] // mp

    def construct(self, ids, positions, labels):
        embedding = self.lm.model.embedding
        words = None
        for rank, table in enumerate(self.tables):
            local = ids - rank * self.rows
            inside = ops.cast(ops.logical_and(local >= 0, local < self.rows), ms.float32)
            rows = embedding.gather(table, ops.clip(local, 0, self.rows - 1), 0) * ops.expand_dims(inside, -1)
            words = rows if words is None else words + rows
        hidden = embedding.dropout(words + embedding.position_gather(embedding.position_embeddings, positions, 0))
        bias = self.lm.model.causal_mask(ids.shape[1])
        for layer in self.lm.model.layers:
            hidden = layer(hidden, bias)
        hidden = ops.reshape(self.lm.model.final_layernorm(hidden), (-1, hidden.shape[-1]))
        logits = ops.concat([self.lm.head_matmul(hidden, table) for table in self.tables], axis=1)
        return self.lm.lm_loss(logits, labels, None)


class LossOnly(nn.Cell):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, ids, positions, labels):
        return self.model(ids, labels, None, positions)[0]


@pytest.mark.parametrize("mp", [2, 4])
def test_vocab_parallel_embedding_head_and_loss(mp):
    config = GPTLocalConfig(**dict(SMALL, num_hidden_layers=1), parallel_config={"vocab_emb_dp": False})
    ms.set_seed(0)
    model = randomised(GPTLocalForCausalLM(config), seed=20 + mp)
    model.set_train(True)
    layout = param_layouts(model_rules(config))["model.embedding.word_embeddings"]
    assert split_axis(layout) == 0  # vocab rows over mp
    rng = np.random.default_rng(mp)
    ids = Tensor(rng.integers(0, SMALL["vocab_size"], (BATCH, SEQ)), ms.int32)
    labels = Tensor(rng.integers(0, SMALL["vocab_size"], (BATCH, SEQ)), ms.int32)
    positions = Tensor(np.tile(np.arange(SEQ), (BATCH, 1)), ms.int32)
    table = model.model.embedding.word_embeddings
    full = LossOnly(model)
    ref_loss, ref_grad = ms.value_and_grad(full, None, weights=ParameterTuple([table]))(ids, positions, labels)
    world = VocabParallelLM(model, layout, mp)
    loss, grads = ms.value_and_grad(world, None, weights=world.tables)(ids, positions, labels)
    merged = merge_slices([g.asnumpy() for g in grads], layout)
    err = max(abs(loss.asnumpy() - ref_loss.asnumpy()), np.abs(merged - ref_grad[0].asnumpy()).max())
    print(f"\nvocab parallel mp={mp}: loss {loss.asnumpy():.6f} vs {ref_loss.asnumpy():.6f}, max abs error {err:.2e}")
    np.testing.assert_allclose(loss.asnumpy(), ref_loss.asnumpy(), atol=ATOL)
    np.testing.assert_allclose(merged, ref_grad[0].asnumpy(), atol=ATOL)


def test_strategies_are_set_from_the_rules_only_for_a_parallel_build():
    config = GPTLocalConfig(**SMALL, parallel_config={"data_parallel": 2, "model_parallel": 4,
                                                      "use_seq_parallel": True, "vocab_emb_dp": False})
    model = GPTLocalForCausalLM(config)
    assert model.sharding == {}  # stand-alone: nothing sharded, graph unchanged
    assert model.model.layers[0].attention.linear_qkv.matmul.attrs.get("in_strategy") is None
    applied = apply_sharding(model, config)
    rules = model_rules(config)
    for rule in rules:
        op = resolve(model, rule.op)
        if op is None:
            assert rule.optional or rule.op.endswith((".relu", ".gelu"))
            continue
        assert op.attrs["in_strategy"] == concrete(rule.strategy, 2, 4) == applied[rule.op]
    layer = model.model.layers[1]
    assert layer.attention.linear_qkv.matmul.attrs["in_strategy"] == ((2, 1), (4, 1))
    assert layer.attention.linear_qkv.bias_add.attrs["in_strategy"] == ((2, 4), (4,))
    assert layer.mlp.linear_fc2.matmul.attrs["in_strategy"] == ((2, 4), (1, 4))
    assert layer.mlp.linear_fc2.bias_add.attrs["in_strategy"] == ((2, 1), (1,))
    assert layer.attention.plain.softmax.attrs["in_strategy"] == ((2, 4, 1, 1),)
    assert layer.input_layernorm.layer_norm.attrs["in_strategy"] == ((2, 4, 1), (1,), (1,))  # sequence split
    assert model.model.embedding.gather.attrs["in_strategy"] == ((4, 1), (2, 1))
    assert model.head_matmul.attrs["in_strategy"] == ((2, 1), (4, 1))
    # every parameter of the model has exactly one declared layout
    assert set(param_layouts(rules)) == {p.name for p in model.get_parameters()}


@pytest.mark.parametrize("arch", ["llama-gqa", "neox"])
def test_strategies_cover_every_op_and_parameter_of_each_architecture(arch):
    config = GPTLocalConfig(**SMALL, **ARCHS[arch], untie_embeddings_and_output_weights=True,
                            parallel_config={"data_parallel": 2, "model_parallel": 2, "vocab_emb_dp": False})
    model = GPTLocalForCausalLM(config)
    applied = apply_sharding(model, config, config.arch)
    rules = model_rules(config, arch=config.arch)
    for rule in rules:
        if resolve(model, rule.op) is None:
            assert rule.optional or rule.op.endswith((".relu", ".gelu")), rule.op
    assert set(param_layouts(rules)) == {p.name for p in model.get_parameters()}
    assert applied["head_matmul"] == ((2, 1), (2, 1))  # the untied head's table split like the embedding's
    if arch == "llama-gqa":
        layer = model.model.layers[0]
        assert layer.mlp.linear_gate.matmul.attrs["in_strategy"] == ((2, 1), (2, 1))
        assert layer.input_layernorm.weight_mul.attrs["in_strategy"] == ((2, 1, 1), (1,))


@pytest.mark.parametrize("pet", [dict(pet_type="ptuning2", pre_seq_len=4, prefix_projection=False, dropout_prob=0.0),
                                 dict(pet_type="prefixtuning", prefix_token_num=4, mid_dim=8, dropout_rate=0.0)],
                         ids=["ptuning2", "prefixtuning-mlp"])
@pytest.mark.parametrize("arch", ["gpt2", "llama-gqa"])
def test_prefix_strategies_cover_every_prefix_op_and_parameter(arch, pet):
    """With prefix tuning every Parameter has a layout and every primitive of the prefix encoder and of each
    layer's prefix Concats gets a strategy (no op left to MindSpore's default)."""
    from mindspore.ops import Primitive
    config = GPTLocalConfig(**dict(SMALL, seq_length=12), **ARCHS[arch], pet_config=pet,
                            parallel_config={"data_parallel": 2, "model_parallel": 2})
    model = GPTLocalForCausalLM(config)
    applied = apply_sharding(model, config, config.arch)
    assert set(param_layouts(model_rules(config, arch=config.arch))) == {p.name for p in model.get_parameters()}
    owners = [("model.prefix_encoder", model.model.prefix_encoder)]
    owners += [(f"model.layers.{i}.attention.prefix_concat", layer.attention.prefix_concat)
               for i, layer in enumerate(model.model.layers)]
    found = set()
    for root, owner in owners:
        for path, cell in owner.cells_and_names():
            for attr, value in vars(cell).items():
                if isinstance(value, Primitive):
                    found.add(".".join(part for part in (root, path, attr) if part))
    assert found == {op for op in applied if "prefix" in op}, found ^ {op for op in applied if "prefix" in op}
    mlp = 5 if pet["pet_type"] == "prefixtuning" else 0  # two matmuls, two bias adds, tanh
    assert len(found) == 3 + mlp + 3 * SMALL["num_hidden_layers"], sorted(found)  # cast, transpose, unstack


def test_model_parallel_that_splits_a_query_group_is_refused():
    from mindformers_gptlocal.errors import ConfigError
    llama = dict(SMALL, **ARCHS["llama-gqa"])
    with pytest.raises(ConfigError, match="num_query_groups"):  # 4 heads split, but 2 groups over 4 ranks
        GPTLocalConfig(**llama, parallel_config={"model_parallel": 4})
    with pytest.raises(ConfigError, match="num_query_groups"):
        rank_block(GPTLocalConfig(**llama), 1, 4)


def test_model_parallel_that_splits_a_head_is_refused():
    from mindformers_gptlocal.errors import ConfigError
    with pytest.raises(ConfigError, match="num_attention_heads"):  # the config refuses the layout at build
        GPTLocalConfig(**SMALL, parallel_config={"model_parallel": 3})
    config = GPTLocalConfig(**SMALL)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        check_divisible(config, 3)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        rank_block(config, 1, 3)


class PrefixSlicedParts(AllReduceParts):
    """The attention parts across mp ranks with prefix tuning: each rank reads the replicated prefix (keys,
    values) [G, P, D] sliced to its own key/value groups (what the (dp, mp, 1, 1) Concats of
    ``peft.prefix.PREFIX_BLOCK_RULES`` make MindSpore do), then the partial outputs are all-reduced. The prefix
    Parameters are shared by the parts, so autodiff sums the ranks' gradients (the replicated parameter's
    gradient all-reduce)."""

    def __init__(self, parts, bias, groups):
        super().__init__(parts, bias)
        self.groups = groups  # key/value groups per rank

    def construct(self, hidden, *args, prefix=None, **kwargs):
        total = None
        for rank, part in enumerate(self.parts):
            lo, hi = rank * self.groups, (rank + 1) * self.groups
            out = part(hidden, *args, prefix=(prefix[0][lo:hi], prefix[1][lo:hi]), **kwargs)
            total = out if total is None else total + out
        return total if self.bias is None else total + self.bias


@pytest.mark.parametrize("mp,arch", [(2, "gpt2"), (2, "llama-gqa")])
def test_prefix_block_parts_reassemble_to_the_unsharded_block(mp, arch):
    """Prefix tuning under model_parallel: the real block's rank parts (``references.rank_block``), each with
    its groups' slice of the replicated prefix keys/values, give the unsharded block's output, input gradient,
    every weight's gradient and the prefix keys' and values' gradients (P-Tuning v2's rows of this layer)."""
    from mindformers_gptlocal.parallel.sharding import MP, DP
    from mindformers_gptlocal.peft.prefix import PREFIX_BLOCK_RULES
    for rule in PREFIX_BLOCK_RULES[:2]:  # what the slice below stands for: groups (axis 1 of [B, G, P+K, D]) on mp
        assert rule.strategy == ((DP, MP, 1, 1), (DP, MP, 1, 1)), rule
    pet = dict(pet_type="ptuning2", pre_seq_len=3, prefix_projection=False, dropout_prob=0.0)
    config = GPTLocalConfig(**dict(SMALL, seq_length=SEQ), **ARCHS[arch], pet_config=pet)
    ms.set_seed(0)
    full = randomised(GPTLocalBlock(config, 1, kernels=KernelProvider.from_config(config)), seed=20 + mp)
    rng = np.random.default_rng(30 + mp)
    groups, dim = config.num_query_groups, SMALL["hidden_size"] // SMALL["num_attention_heads"]
    prefix = tuple(Parameter(Tensor(rng.normal(0, 1, (groups, 3, dim)).astype(np.float32)), name=name)
                   for name in ("prefix_key", "prefix_value"))
    x = Tensor(rng.normal(0, 1, (BATCH, SEQ, SMALL["hidden_size"])).astype(np.float32))
    probe = Tensor(rng.normal(0, 1, (BATCH, SEQ, SMALL["hidden_size"])).astype(np.float32))
    bias = causal_bias(SEQ)
    rotary = None
    if config.arch.rope:
        positions = Tensor(np.array([np.arange(SEQ), np.arange(SEQ) + 3]) + 3, ms.int32)  # after the prefix
        rotary = RotaryEmbedding(config.arch.rotary_dim, config.rotary_base)(positions)

    def run(block, weights):
        def loss(hidden):
            return (block(hidden, bias, rotary=rotary, prefix=prefix) * probe).sum()
        out = block(x, bias, rotary=rotary, prefix=prefix)
        _, (dx, grads) = ms.value_and_grad(loss, grad_position=0, weights=ParameterTuple(weights))(x)
        return out.asnumpy(), dx.asnumpy(), [g.asnumpy() for g in grads]

    full_params = params_by_path(full)
    names = sorted(full_params)
    ref_out, ref_dx, ref_grads = run(full, [full_params[n] for n in names] + list(prefix))
    without = full(x, bias, rotary=rotary).asnumpy()
    assert np.abs(ref_out - without).max() > 1e-2, "the prefix does not change the block's output"

    parts, layouts = rank_blocks(config, full, mp)
    rank_params = [params_by_path(p) for p in parts]
    shell = parts[0]
    shell.attention = PrefixSlicedParts([p.attention for p in parts],
                                        getattr(parts[0].attention.linear_proj, "bias", None), groups // mp)
    shell.mlp = AllReduceParts([p.mlp for p in parts], getattr(parts[0].mlp.linear_fc2, "bias", None))
    used = []
    for name in names:
        if split_axis(layouts[name]) is None:
            used.append((name, 0, rank_params[0][name]))
        else:
            used += [(name, rank, rank_params[rank][name]) for rank in range(mp)]
    used += [(p.name, 0, p) for p in prefix]
    out, dx, grads = run(shell, [p for _, _, p in used])

    np.testing.assert_allclose(out, ref_out, atol=RTOL * np.abs(ref_out).max())
    np.testing.assert_allclose(dx, ref_dx, atol=RTOL * np.abs(ref_dx).max())
    layouts = dict(layouts, prefix_key=(1, 1, 1), prefix_value=(1, 1, 1))  # replicated: one Parameter
    for name, ref in zip(names + ["prefix_key", "prefix_value"], ref_grads):
        pieces = [g for (n, _, _), g in zip(used, grads) if n == name]
        merged = merge_slices(pieces, layouts[name])
        assert merged.shape == ref.shape, name
        assert np.abs(ref).max() > 1e-4, f"{name} has no gradient to compare"
        np.testing.assert_allclose(merged, ref, atol=RTOL * np.abs(ref).max(), err_msg=name)
