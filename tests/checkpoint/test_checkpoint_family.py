"""The converter framework (checkpoint/family.py): every weight-map kind is an exact permutation with an exact
inverse, checked against layouts written out head by head (odd sizes, grouped-query attention), and GPT-2 is a
family like the others (original OpenAI names without ``transformer.``, the tied head)."""
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mindformers_gptlocal.checkpoint import family as framework
from mindformers_gptlocal.checkpoint.hf_gpt2 import GPT2
from mindformers_gptlocal.checkpoint.hf_models import FAMILIES, family_of_hf, family_of_local, hf_to_ms
from mindformers_gptlocal.checkpoint.mf_gpt2 import MF_GPT2
from mindformers_gptlocal.errors import CheckpointError

# head_dim 3, 6 query heads in 2 or 3 groups (or none): odd widths catch a reshape that only works by luck
LOCALS = {groups: dict(vocab_size=16, hidden_size=18, num_hidden_layers=1, num_attention_heads=6,
                       num_query_groups=groups, position_embedding_type="rope", intermediate_size=20)
          for groups in (2, 3, 6)}


def _reference_fused(q, k, v, heads, groups, dim):
    """gpt_local's fused QKV rows written out group by group: the group's query heads, then its k, then its v."""
    rows, per_group = [], heads // groups
    for g in range(groups):
        for h in range(g * per_group, (g + 1) * per_group):
            rows.append(q[h * dim:(h + 1) * dim])
        rows.append(k[g * dim:(g + 1) * dim])
        rows.append(v[g * dim:(g + 1) * dim])
    return np.concatenate(rows, axis=0)


@pytest.mark.parametrize("groups", sorted(LOCALS))
def test_kinds_match_the_layout_written_out_and_invert_exactly(groups):
    local = LOCALS[groups]
    rng = np.random.default_rng(groups)
    dim, heads, hidden = 3, 6, 18
    fused_rows = (heads + 2 * groups) * dim
    for rest in ((hidden,), ()):  # weights [out, in] and biases [out]
        q, k, v = (rng.standard_normal((n * dim,) + rest).astype(np.float32) for n in (heads, groups, groups))
        want = _reference_fused(q, k, v, heads, groups, dim)
        shape = (fused_rows,) + rest
        assert framework.foreign_shapes("groups", shape, local) == [q.shape, k.shape, v.shape]
        np.testing.assert_array_equal(framework.to_local("groups", [q, k, v], local), want)
        for got, part in zip(framework.to_foreign("groups", want, local), (q, k, v)):
            np.testing.assert_array_equal(got, part)
        # GPT-2's c_attn: one tensor, q|k|v along the output axis; a Conv1D weight is stored [in, out]
        kind, c_attn = ("qkv_weight", np.concatenate([q, k, v]).T) if rest else ("qkv_bias", np.concatenate([q, k, v]))
        assert framework.foreign_shapes(kind, shape, local) == [c_attn.shape]
        np.testing.assert_array_equal(framework.to_local(kind, [c_attn], local), want)
        (back,) = framework.to_foreign(kind, want, local)
        np.testing.assert_array_equal(back, c_attn)
    weight = rng.standard_normal((5, 7)).astype(np.float32)
    assert framework.foreign_shapes("transpose", (7, 5), local) == [(5, 7)]
    np.testing.assert_array_equal(framework.to_local("transpose", [weight], local), weight.T)
    np.testing.assert_array_equal(framework.to_foreign("transpose", weight.T, local)[0], weight)
    with pytest.raises(ValueError, match="unknown weight-map kind"):
        framework.to_local("permute", [weight], local)


def test_gpt2_is_a_family_of_the_framework():
    gpt2_local = dict(vocab_size=16, hidden_size=12, num_hidden_layers=2, num_attention_heads=3)
    assert family_of_hf({"model_type": "gpt2"}) is GPT2 is FAMILIES["gpt2"] is family_of_local(gpt2_local)
    names = {n for _, foreign, _ in GPT2.entries(gpt2_local) for n in foreign}
    assert "transformer.h.1.attn.c_attn.weight" in names and len(names) == 4 + 12 * 2
    mf = {n for _, foreign, _ in MF_GPT2.entries(gpt2_local) for n in foreign}
    assert "backbone.blocks.1.attention.dense3.bias" in mf and len(mf) == 4 + 16 * 2  # q, k, v apart


@pytest.fixture(scope="module")
def hf_gpt2_dir(tmp_path_factory):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gpt2") / "hf"
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=12, n_layer=2, n_head=3))
    model.save_pretrained(str(path))
    return path


def test_openai_names_without_the_prefix_and_the_tied_head(hf_gpt2_dir, tmp_path):
    """The original OpenAI GPT-2 files name wte.weight, h.0.* (no ``transformer.``) and may hold
    lm_head.weight: they convert to the same bytes; a head that differs from the embedding is refused."""
    hf_to_ms(str(hf_gpt2_dir), str(tmp_path / "reference"))
    weights = load_file(str(hf_gpt2_dir / "model.safetensors"))
    assert all(name.startswith("transformer.") for name in weights)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((hf_gpt2_dir / "config.json").read_bytes())
    stripped = {name[len("transformer."):]: array for name, array in weights.items()}
    save_file(dict(stripped, **{"lm_head.weight": stripped["wte.weight"]}), str(bare / "model.safetensors"))
    hf_to_ms(str(bare), str(tmp_path / "ms"))
    assert (tmp_path / "ms" / "model.safetensors").read_bytes() == \
        (tmp_path / "reference" / "model.safetensors").read_bytes()
    save_file(dict(stripped, **{"lm_head.weight": stripped["wte.weight"] + 1}), str(bare / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from the token embedding.*cannot convert"):
        hf_to_ms(str(bare), str(tmp_path / "untied"))
    assert not os.path.exists(tmp_path / "untied")
