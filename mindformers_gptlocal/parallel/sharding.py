"""gpt_local's tensor-parallel layout, written once, as data.

Each ``OpRule`` names an operator (its attribute path, e.g. ``attention.linear_qkv.matmul``),
its MindSpore ``shard`` strategy in symbols (``"dp"``, ``"mp"`` or 1 per axis of each input),
and which of its inputs are Parameters. Everything else is derived from these rules:

- ``apply_sharding``: the ``op.shard(...)`` calls, made only when the model is built under
  semi-auto/auto parallel (on one device no strategy is set and the graph is unchanged);
- ``param_layouts``: each Parameter's layout = its input strategy in the op that reads it
  (a Parameter read by two ops, the tied embedding, must get the same layout from both);
- ``rank_slice`` / ``merge_slices``: one rank's piece of a full weight, and back, used by the
  CPU proofs (tests/parallel/test_tensor_parallel.py) and, through the parameter table
  (``model/params.py``), by ``gptlocal ckpt split/merge``.

Parameters are only ever split over ``mp``; over ``dp`` they are replicated (optimizer-state
sharding over dp, ``parallel.enable_parallel_optimizer``, is MindSpore's and needs nothing here).

Layout (weights are [out, in], MatMul(transpose_b)): QKV and fc1 column-parallel, matmul
((dp, 1), (mp, 1)) then bias ((dp, mp), (mp,)); attention out-proj and fc2 row-parallel,
((dp, mp), (1, mp)), then the bias after the all-reduce ((dp, 1), (1,)); attention scores,
mask, softmax, dropout and context over (dp, mp heads). LayerNorm, dropout and residual adds
are (dp, 1, 1), or (dp, mp, 1) over the sequence with ``use_seq_parallel``: MindSpore's
redistribution then all-gathers the sequence before a column-parallel matmul and splits it
after a row-parallel one. ``vocab_emb_dp`` True (MindFormers' default) keeps the embedding
table whole on every rank; False splits its rows (the vocabulary) over mp for the embedding
Gather (MindSpore masks out-of-range ids and all-reduces) and for the tied head's MatMul,
whose logits come out (dp, mp). The cross-entropy stays (dp, 1): MindSpore's redistribution
all-gathers the logits once before LogSoftmax. We chose that over a hand-written vocab-parallel
cross-entropy because it keeps the one-device graph and numerics untouched and the head matmul
and table memory are still split; the cost is a [tokens/dp, vocab] all-gather per step.
"""
from collections import namedtuple

import numpy as np

from ..errors import ConfigError
from .layout import Layout, config_value
from .rules import PARALLEL_MODES, check_parallel_layout, raise_if_bad

DP, MP = "dp", "mp"

OpRule = namedtuple("OpRule", "op strategy params optional")
OpRule.__new__.__defaults__ = (None, False)
OpRule.__doc__ = ("op: attribute path of a Primitive; strategy: per input, per axis 'dp'/'mp'/1; "
                  "params: {input index: Parameter path}; optional: the op exists only in some builds.")


def layout_of(config):
    """The Layout of a model config (its own ``layout`` when it keeps one, as GPTLocalConfig does; else
    ``Layout.of_model_config``), or ``config`` if it is one."""
    if isinstance(config, Layout):
        return config
    kept = config_value(config, "layout", None)
    return kept if isinstance(kept, Layout) else Layout.of_model_config(config)


def column_rules(linear, bias=True):
    return [OpRule(f"{linear}.matmul", ((DP, 1), (MP, 1)), {1: f"{linear}.weight"})] + \
        ([OpRule(f"{linear}.bias_add", ((DP, MP), (MP,)), {1: f"{linear}.bias"})] if bias else [])


def row_rules(linear, bias=True):
    return [OpRule(f"{linear}.matmul", ((DP, MP), (1, MP)), {1: f"{linear}.weight"})] + \
        ([OpRule(f"{linear}.bias_add", ((DP, 1), (1,)), {1: f"{linear}.bias"})] if bias else [])


def _norm(name, act, rmsnorm=False):
    if rmsnorm:  # model/layers.py RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, every op over act's layout
        return [OpRule(f"{name}.square", (act,)), OpRule(f"{name}.mean", (act,)),
                OpRule(f"{name}.rsqrt", (act,)), OpRule(f"{name}.normalize", (act, act)),
                OpRule(f"{name}.weight_mul", (act, (1,)), {1: f"{name}.weight"})]
    return [OpRule(f"{name}.layer_norm", (act, (1,), (1,)), {1: f"{name}.weight", 2: f"{name}.bias"})]


def _arch(arch, config=None):
    """The block's layer choices: ``arch`` (a ``model/arch.py`` ``Arch``), else the model config's own
    (``config.arch``). This module may not import model/, so it never makes one up."""
    if arch is None and config is not None and not isinstance(config, Layout):
        arch = config_value(config, "arch", None)
    if arch is None:
        raise ConfigError("the sharding rules need the model's architecture: pass arch=config.arch "
                          "(model/arch.py Arch) or a GPTLocalConfig.")
    return arch


LINEAR_SPLITS = {"attention.linear_qkv": "column", "attention.linear_proj": "row",
                 "mlp.linear_fc1": "column", "mlp.linear_gate": "column", "mlp.linear_fc2": "row"}



def block_rules(seq_parallel=False, arch=None, pet=None, index=0):
    """The rules of one GPTLocalBlock (layer ``index``), paths relative to the block; ``arch``: the block's layer
    choices (``model/arch.py`` ``Arch``); ``pet``: the PEFT method's settings (a ``peft`` PetSpec, e.g. LoRA on
    some Linears), whose rules for the layer come first (``pet.layer_rules``). With grouped-query
    attention the fused QKV
    rows are group-major, [group, (q heads of the group, k, v), head_dim], so the same column split
    hands every rank whole query groups (``parallel/rules.py`` requires mp | num_query_groups)."""
    arch = _arch(arch)
    act = (DP, MP, 1) if seq_parallel else (DP, 1, 1)
    heads = (DP, MP, 1, 1)
    adapters = [] if pet is None else pet.layer_rules(index, act, arch)
    gated = [*column_rules("mlp.linear_gate", arch.bias), OpRule("mlp.activation.sigmoid", ((DP, 1, MP),)),
             OpRule("mlp.activation.mul", ((DP, 1, MP), (DP, 1, MP))),
             OpRule("mlp.gate_mul", ((DP, 1, MP), (DP, 1, MP)))] if arch.gated else []
    return adapters + [
        *_norm("input_layernorm", act, arch.rmsnorm),
        *column_rules("attention.linear_qkv", arch.qkv_bias),
        OpRule("attention.transpose", ((DP, 1, MP, 1, 1),)),  # [B, S, N, 3, D]: whole heads per rank
        OpRule("attention.split_qkv", ((1, DP, MP, 1, 1),)),  # [3, B, N, S, D] -> q, k, v
        OpRule("attention.plain.qk_matmul", (heads, heads)),
        OpRule("attention.plain.scale_mul", (heads, ())),
        OpRule("attention.plain.add_mask", (heads, (1, 1, 1, 1))),
        OpRule("attention.plain.softmax", (heads,)),
        OpRule("attention.plain.attention_dropout.dropout", (heads,)),
        OpRule("attention.plain.pv_matmul", (heads, heads)),
        # flash attention (Ascend): model/attention.py's FlashCore in place of the plain core (its merge_heads shared)
        OpRule("attention.core.flash_attention", (heads, heads, heads, (1, 1)), optional=True),
        # packed rows on Ascend: [B, N, S, D] -> [B, S, N, D], then TND flash attention over [B*S, N, D] with
        # the compressed mask and the document ends (MindFormers' mcore FlashAttention TND strategy)
        OpRule("attention.core.varlen_merge", (heads,), optional=True),
        OpRule("attention.core.flash_attention_varlen", ((DP, MP, 1), (DP, MP, 1), (DP, MP, 1), (1, 1), (DP,), (DP,)),
               optional=True),
        OpRule("attention.plain.merge_heads", (heads,)),
        *row_rules("attention.linear_proj", arch.bias),
        *_norm("post_attention_layernorm", act, arch.rmsnorm),
        *column_rules("mlp.linear_fc1", arch.bias),
        *gated,
        OpRule("mlp.activation.gelu", ((DP, 1, MP),)),
        OpRule("mlp.activation.relu", ((DP, 1, MP),)),
        OpRule("mlp.activation.fast_gelu", ((DP, 1, MP),), optional=True),  # only with hidden_act quick_gelu
        *row_rules("mlp.linear_fc2", arch.bias),
        OpRule("attention_output_dropout.dropout", (act,)),
        OpRule("mlp_output_dropout.dropout", (act,)),
        OpRule("add", (act, act)),
    ]


def model_rules(config, num_layers=None, arch=None, pet=None):
    """Every rule of a GPTLocalForCausalLM, paths relative to it (layers expanded). ``config``: a model
    config, or a ``Layout`` with ``num_layers``; ``arch``: the layer choices (None: ``config.arch``); ``pet``: the
    PEFT method's settings (a ``peft`` PetSpec; None: a GPTLocalConfig's own ``pet_spec()``), whose rules
    (``pet.model_rules``, ``pet.layer_rules``) join the base model's."""
    arch = _arch(arch, config)
    layout = layout_of(config)
    if num_layers is None:
        num_layers = config.num_hidden_layers
    seq, vocab_emb_dp = layout.seq_parallel, layout.vocab_emb_dp
    act = (DP, MP, 1) if seq else (DP, 1, 1)
    table = (1, 1) if vocab_emb_dp else (MP, 1)
    word = "model.embedding.word_embeddings"
    rules = [OpRule("model.embedding.gather", (table, (DP, 1)), {0: word})]
    if not arch.rope:
        rules.append(OpRule("model.embedding.position_gather", ((1, 1), (DP, 1)),
                            {0: "model.embedding.position_embeddings"}))
    rules.append(OpRule("model.embedding.dropout.dropout", (act,)))
    if pet is None and hasattr(config, "pet_spec"):
        pet = config.pet_spec()
    if pet is not None:
        rules += pet.model_rules()
    for index in range(num_layers):
        prefix = f"model.layers.{index}."
        for rule in block_rules(seq, arch, pet, index):
            params = {i: prefix + p for i, p in (rule.params or {}).items()} or None
            rules.append(rule._replace(op=prefix + rule.op, params=params))
    rules += [
        *_norm("model.final_layernorm", act, arch.rmsnorm),
        # tied head: same table layout as the Gather; untied: its own table, laid out the same way
        OpRule("head_matmul", ((DP, 1), table), {1: "output_layer.weight" if arch.untied else word}),
        OpRule("log_softmax", ((DP, 1),)),  # vocab split: MindSpore all-gathers the logits here
        OpRule("gather_d", ((DP, 1), (DP, 1))),
    ]
    return rules


def param_layouts(rules):
    """Parameter path -> its symbolic layout (one entry per axis), from the ops that read it."""
    layouts = {}
    for rule in rules:
        for index, name in (rule.params or {}).items():
            layout = tuple(rule.strategy[index])
            if layouts.setdefault(name, layout) != layout:
                raise ConfigError(f"sharding rules give '{name}' two layouts, {layouts[name]} and {layout} "
                                  f"(op {rule.op}); a Parameter has one layout.")
    return layouts


def split_axis(layout):
    """The axis of a Parameter split over mp, or None (replicated)."""
    axes = [i for i, s in enumerate(layout) if s == MP]
    return axes[0] if axes else None


def concrete(strategy, dp, mp):
    """Symbols -> the integers MindSpore's ``shard`` takes."""
    sizes = {DP: dp, MP: mp}
    return tuple(tuple(sizes.get(s, s) for s in per_input) for per_input in strategy)


def rank_slice(array, layout, mp_rank, mp):
    """One mp rank's piece of a full array laid out as ``layout``."""
    axis = split_axis(layout)
    if axis is None or mp == 1:
        return array
    if array.shape[axis] % mp:
        raise ConfigError(f"an axis of size {array.shape[axis]} cannot be split over model_parallel {mp}; "
                          f"choose a model_parallel that divides it.")
    return np.split(array, mp, axis=axis)[mp_rank]


def merge_slices(pieces, layout):
    """The full array from the mp ranks' pieces, in rank order (the inverse of rank_slice)."""
    axis = split_axis(layout)
    if axis is None or len(pieces) == 1:
        return pieces[0]
    return np.concatenate(pieces, axis=axis)


def check_divisible(config, mp):
    """Refuse a model_parallel that does not split the model into whole heads / columns / rows:
    the divisibility rules of ``parallel/rules.py`` (the ones ``gptlocal plan`` applies) for this ``mp``."""
    raise_if_bad(check_parallel_layout(config, Layout(mp=mp, vocab_emb_dp=layout_of(config).vocab_emb_dp)))


def resolve(cell, path):
    """The object at a dotted attribute path (CellList indices included), or None."""
    node = cell
    for part in path.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def is_parallel_build():
    """True when MindSpore builds for semi-auto/auto parallel (the only time strategies matter)."""
    import mindspore as ms
    return ms.get_auto_parallel_context("parallel_mode") in PARALLEL_MODES


def apply_sharding(model, config, arch=None):
    """Set every rule's strategy on ``model``'s primitives; returns {op path: concrete strategy}. ``config``:
    the model's GPTLocalConfig (its sizes and its ``layout``); ``arch``: its layer choices (None: ``config.arch``)."""
    arch = _arch(arch, config)
    layout = layout_of(config)
    check_divisible(config, layout.mp)
    applied = {}
    for rule in model_rules(config, arch=arch):
        op = resolve(model, rule.op)
        if op is None:
            if rule.optional or rule.op.endswith((".relu", ".gelu")):
                continue  # flash attention only on Ascend; one of relu/gelu is unused (both exist)
            raise ConfigError(f"sharding rule names '{rule.op}', which the model does not have.")
        strategy = concrete(rule.strategy, layout.dp, layout.mp)
        op.shard(strategy)
        applied[rule.op] = strategy
    return applied
