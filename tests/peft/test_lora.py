"""LoRA through MindFormers' ``model_config.pet_config``: a MindFormers user's YAML trains only the adapters,
the base weights stay bit-identical, resume is exact; merged weights and the Hugging Face PEFT export give
the adapter model's logits; the A/B layouts reassemble per rank for model_parallel 2; bad settings are one
clear error before anything compiles."""
import os

import numpy as np
import pytest
import mindspore as ms
from mindspore import ParameterTuple, Tensor
from safetensors.numpy import load_file

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.errors import CheckpointError, ConfigError
from mindformers_gptlocal.kernels.provider import KernelProvider
from mindformers_gptlocal.model import GPTLocalBlock
from references import causal_bias, rank_block
from mindformers_gptlocal.model.lora_cells import lora_layer_spec
from mindformers_gptlocal.model.params import parameter_table
from mindformers_gptlocal.parallel.layout import Layout
from mindformers_gptlocal.parallel.sharding import block_rules, merge_slices, param_layouts, rank_slice, split_axis
from conftest import TINY, finetune_resumes_exactly, launch_in_process, save_tiny_base
from conftest import write_yaml
from references import SMALL, AllReduceParts, params_by_path, randomised, value_and_grads

TARGETS = ".*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2"
PET = dict(pet_type="lora", lora_rank=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
           freeze_include=["*"], freeze_exclude=["*lora*"])  # MindFormers' documented LoRA YAML


def lora_count(config, rank):
    """rank * (in + out) per adapted Linear, from the sizes alone."""
    h, i = config["hidden_size"], config.get("intermediate_size") or 4 * config["hidden_size"]
    per_layer = rank * ((h + 3 * h) + (h + h) + (h + i) + (i + h))
    return per_layer * config["num_hidden_layers"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, corpus):
    """A tiny gpt_local model directory (random weights, the corpus tokenizer) to finetune from."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    return save_tiny_base(tmp_path_factory.mktemp("lora_base") / "base", corpus, seed=5)


def lora_yaml_changes(base, **pet):
    return dict(model__model_config__pet_config=dict(PET, **pet), load_checkpoint=base,
                lr_schedule__learning_rate=5e-3, lr_schedule__lr_end=5e-3)


def test_pet_config_yaml_trains_only_the_adapters_and_resumes_exactly(tmp_path, corpus, base_dir):
    """The YAML of the issue trains; the log states the count and share; base weights are bit-identical
    afterwards; the adapters moved and the loss fell; the checkpoints hold the adapters, and a new run
    resumed from the step-N one (``--resume_training <file> --load_checkpoint output/checkpoint``) repeats
    the uninterrupted run's losses bit for bit (conftest.finetune_resumes_exactly)."""
    steps = 12  # lora_dropout 0.1: its masks come from the model's forward counter, saved in the checkpoints
    run = finetune_resumes_exactly(tmp_path, corpus, steps, steps // 2,
                                   train_dataset__data_loader__num_samples=4 * steps,
                                   **lora_yaml_changes(base_dir, lora_dropout=0.1))
    out = run["out"]
    expected = lora_count(TINY, 8)
    total = sum(int(np.prod(s.shape)) for s in parameter_table(TINY, Layout()).values()) + expected
    assert f"LoRA: {expected:,} trainable parameters ({100.0 * expected / total:.2g}% of" in out, out[-3000:]
    base = load_file(os.path.join(base_dir, "model.safetensors"))
    tuned = load_file(str(run["model_dir"] / "model.safetensors"))
    assert set(tuned) - set(base) == {n for n in tuned if n.endswith((".lora_a", ".lora_b"))}
    for name, value in base.items():
        assert np.array_equal(tuned[name], value), f"{name} changed: a frozen base weight was trained"
    assert min(np.abs(tuned[n]).max() for n in tuned if n.endswith(".lora_b")) > 0  # B starts at zero
    reference = run["losses"]
    assert np.mean(reference[-3:]) < np.mean(reference[:3]) - 0.05, reference
    saved = run["stopped_names"]  # the checkpoints hold the adapters, and the dropout counter
    assert "dropout_step" in saved, sorted(saved)
    assert {n for n in saved if n.startswith("model.") and "lora" in n} == {n for n in tuned if "lora" in n}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, base_dir):
    """A LoRA model on the base weights with non-zero adapters, saved as a run's model directory."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY, pet_config=dict(PET, lora_rank=4, lora_alpha=12)))
    model.load_weights(base_dir)
    rng = np.random.default_rng(0)
    for name, param in model.parameters_and_names():
        if name.endswith(".lora_b"):
            param.set_data(Tensor(rng.normal(0, 0.2, param.shape).astype(np.float32)))
    out = tmp_path_factory.mktemp("lora_tuned")
    model.save_pretrained(str(out / "tuned"), tokenizer_dir=base_dir)
    model.set_train(False)
    ids = rng.integers(0, TINY["vocab_size"], (2, 16)).astype(np.int32)
    return dict(dir=str(out / "tuned"), root=out, ids=ids, logits=model(Tensor(ids)).asnumpy())


def test_merge_equals_the_adapter_model(tuned, base_dir):
    from mindformers_gptlocal.cli.main import main
    merged = str(tuned["root"] / "merged")
    assert main(["lora", "merge", "--base", base_dir, "--adapter", tuned["dir"], "--out", merged]) == 0
    model = GPTLocalForCausalLM.from_pretrained(merged)
    assert model.config.pet_config is None and not any("lora" in n for n, _ in model.parameters_and_names())
    model.set_train(False)
    base = GPTLocalForCausalLM.from_pretrained(base_dir)
    base.set_train(False)
    logits = model(Tensor(tuned["ids"])).asnumpy()
    assert np.abs(base(Tensor(tuned["ids"])).asnumpy() - tuned["logits"]).max() > 0.1  # the adapters matter
    np.testing.assert_allclose(logits, tuned["logits"], atol=1e-5, rtol=0)
    with pytest.raises(CheckpointError, match="holds LoRA adapters .* but the model has none.*gptlocal lora merge"):
        base.load_weights(tuned["dir"])  # not silently the base model


def test_peft_export_loads_in_peft_with_equal_logits(tuned, base_dir):
    """ms2hf of the base + ms2hf --lora-only of the run: transformers' GPT2LMHeadModel with
    peft.PeftModel.from_pretrained gives our adapter model's logits."""
    import torch
    from peft import PeftModel
    from transformers import GPT2LMHeadModel
    from mindformers_gptlocal.cli.main import main
    hf_base, adapter = str(tuned["root"] / "hf_base"), str(tuned["root"] / "peft")
    assert main(["convert", "ms2hf", "--ms-dir", base_dir, "--out", hf_base]) == 0
    assert main(["convert", "ms2hf", "--ms-dir", tuned["dir"], "--out", adapter, "--lora-only"]) == 0
    assert sorted(os.listdir(adapter))[:2] == ["adapter_config.json", "adapter_model.safetensors"]
    model = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(hf_base), adapter).eval()
    assert model.peft_config["default"].r == 4 and model.peft_config["default"].lora_alpha == 12
    with torch.no_grad():
        logits = model(torch.tensor(tuned["ids"].astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(logits, tuned["logits"], atol=2e-5, rtol=0)


def test_table_and_rules_name_the_adapters():
    config = GPTLocalConfig(**TINY, pet_config=dict(PET, target_modules=r"model\.layers\.1\..*|.*linear_qkv"))
    model = GPTLocalForCausalLM(config)
    built = {name: tuple(p.shape) for name, p in model.parameters_and_names()}
    table = parameter_table(config)
    assert {name: spec.shape for name, spec in table.items()} == built
    assert "model.layers.0.mlp.linear_fc1.lora_a" not in built and "model.layers.1.mlp.linear_fc1.lora_a" in built
    trainable = {p.name for p in model.trainable_params()}
    assert trainable == {n for n in built if n.endswith((".lora_a", ".lora_b"))}
    layouts = parameter_table(config, Layout(mp=2))
    assert layouts["model.layers.0.attention.linear_qkv.lora_b"].layout == ("mp", 1)  # column: B split like W
    assert layouts["model.layers.1.mlp.linear_fc2.lora_a"].layout == (1, "mp")  # row: A split like W


def test_layer_spec_keeps_the_plain_models_names_and_builds_lora_as_a_linear():
    """The layer spec builds LoRALinear through Linear.__init__ where pet_config targets: the LoRA model's names
    are the plain model's, in the same order, plus lora_a/lora_b on exactly the targeted Linears (a one-layer
    target included); each LoRALinear owns its base weight (no Parameter shared with another Cell)."""
    from mindformers_gptlocal.model.layers import Linear
    from mindformers_gptlocal.model.lora_cells import LoRALinear
    plain = [n for n, _ in GPTLocalForCausalLM(GPTLocalConfig(**TINY)).parameters_and_names()]
    pet = dict(PET, target_modules="model.layers.1.mlp.linear_fc1|.*linear_qkv")
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY, pet_config=pet))
    names = [n for n, _ in model.parameters_and_names()]
    assert [n for n in names if not n.endswith((".lora_a", ".lora_b"))] == plain
    adapted = sorted({n.rsplit(".", 1)[0] for n in names if n.endswith((".lora_a", ".lora_b"))})
    assert adapted == ["model.layers.0.attention.linear_qkv", "model.layers.1.attention.linear_qkv",
                       "model.layers.1.mlp.linear_fc1"]
    cells = dict(model.cells_and_names())
    assert all(isinstance(cells[path], LoRALinear) for path in adapted)
    assert type(cells["model.layers.0.mlp.linear_fc1"]) is Linear  # pylint: disable=unidiomatic-typecheck
    weights = [id(cells[path].weight) for path, cell in cells.items() if isinstance(cell, Linear)]
    assert len(weights) == len(set(weights))


def test_recompute_reaches_the_lora_and_adapter_cells():
    """Built with the layer, the LoRA Linears and bottleneck adapters get their layer's recompute: full recompute
    marks them (they were put in after ``Cell.recompute`` before the layer spec, so it missed them), and a
    select_recompute pattern naming a Linear marks its LoRALinear."""
    from mindformers_gptlocal.model.adapter_cells import BottleneckAdapter
    from mindformers_gptlocal.model.lora_cells import LoRALinear
    for pet, kind in ((PET, LoRALinear), (dict(pet_type="adapter", bottleneck_size=8), BottleneckAdapter)):
        model = GPTLocalForCausalLM(GPTLocalConfig(**TINY, pet_config=pet,
                                                   parallel_config={"recompute": {"recompute": True}}))
        cells = [c for _, c in model.cells_and_names() if isinstance(c, kind)]
        assert len(cells) == (8 if kind is LoRALinear else 4)
        assert all(c._has_config_recompute for c in cells)  # pylint: disable=protected-access
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY, pet_config=PET, parallel_config={
        "recompute": {"select_recompute": [r"mlp\.linear_fc1"]}}))
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.linear_fc1, LoRALinear) and layer.mlp.linear_fc1._has_config_recompute
    assert not layer.mlp.linear_fc2._has_config_recompute  # pylint: disable=protected-access


@pytest.mark.parametrize("mp", [2])
def test_adapter_layouts_reassemble_per_rank(mp):
    """The per-rank CPU proof (tests/parallel/test_tensor_parallel.py) with adapters on all four Linears: each
    rank's A/B slices from the declared layouts, joined by the all-reduces the layout implies, give
    the unsharded block's output and every gradient (adapters' included)."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    spec = GPTLocalConfig(**SMALL, pet_config=PET).pet_spec()
    config = GPTLocalConfig(**SMALL)
    full = GPTLocalBlock(config, 1, layer_spec=lora_layer_spec(spec, 0), kernels=KernelProvider.from_config(config))
    randomised(full, seed=7)
    layouts = param_layouts(block_rules(arch=config.arch, pet=spec))
    full_params = params_by_path(full)
    assert set(layouts) == set(full_params) and sum("lora" in n for n in layouts) == 8
    parts = []
    for rank in range(mp):
        part = rank_block(config, 1, mp, layer_spec=lora_layer_spec(spec, 0))
        for name, param in params_by_path(part).items():
            piece = rank_slice(full_params[name].asnumpy(), layouts[name], rank, mp)
            assert piece.shape == tuple(param.shape), name
            param.set_data(Tensor(np.ascontiguousarray(piece)))
        parts.append(part)
    rng = np.random.default_rng(1)
    x = Tensor(rng.normal(0, 1, (2, 8, SMALL["hidden_size"])).astype(np.float32))
    probe = Tensor(rng.normal(0, 1, (2, 8, SMALL["hidden_size"])).astype(np.float32))
    bias = causal_bias(8)
    names = sorted(full_params)
    ref_out, ref_dx, ref_grads = value_and_grads(full, ParameterTuple([full_params[n] for n in names]), x, probe, bias)
    rank_params = [params_by_path(p) for p in parts]
    shell = parts[0]
    shell.attention = AllReduceParts([p.attention for p in parts], parts[0].attention.linear_proj.bias)
    shell.mlp = AllReduceParts([p.mlp for p in parts], parts[0].mlp.linear_fc2.bias)
    used = []  # replicated weights outside the adapters: rank 0's copy stands for all (LayerNorms, biases)
    for name in names:
        ranks = [0] if split_axis(layouts[name]) is None and "lora" not in name else range(mp)
        used += [(name, r, rank_params[r][name]) for r in ranks]
    out, dx, grads = value_and_grads(shell, ParameterTuple([p for _, _, p in used]), x, probe, bias)
    np.testing.assert_allclose(out, ref_out, atol=1e-5 * np.abs(ref_out).max())
    np.testing.assert_allclose(dx, ref_dx, atol=1e-5 * np.abs(ref_dx).max())
    for name, ref in zip(names, ref_grads):
        pieces = [g for (n, _, _), g in zip(used, grads) if n == name]
        if split_axis(layouts[name]) is None:  # a replicated A (column) or B (row) is read by every rank's
            merged = np.sum(pieces, axis=0)  # part: its gradient is the sum over ranks (the all-reduce)
        else:
            merged = merge_slices(pieces, layouts[name])
        np.testing.assert_allclose(merged, ref, atol=1e-5 * np.abs(ref).max(), err_msg=name)
        assert np.abs(ref).max() > 1e-4, name


@pytest.mark.parametrize("change,pattern", [
    (dict(pet_type="low_rank_adapter"), r"pet_type 'low_rank_adapter' is not supported .*use pet_type: lora"),
    (dict(target_modules=".*wq|.*wk"), r"target_modules '.\*wq\|.\*wk' matches none of gpt_local's Linears"),
    (dict(freeze_exclude=["*adapter*"]), r"freeze every parameter, so nothing would train"),
    (dict(lora_rank=0), r"lora_rank must be a positive integer"),
    (dict(lora_dropout=1.5), r"lora_dropout must be in \[0, 1\)"),
])
def test_bad_pet_config_is_one_clear_error(change, pattern):
    with pytest.raises(ConfigError, match=pattern):
        GPTLocalConfig(**TINY, pet_config=dict(PET, **change))


def test_launcher_refuses_bad_pet_config_before_compiling(tmp_path, corpus, base_dir, capsys, monkeypatch):
    yaml_path = write_yaml(tmp_path, corpus, "finetune_gpt_local_tiny_cpu.yaml",
                           **lora_yaml_changes(base_dir, target_modules=".*wq|.*wv"))
    code, out = launch_in_process(["--config", yaml_path], str(tmp_path), capsys, monkeypatch)  # no subprocess
    assert code == 2, out[-3000:]
    assert "matches none of gpt_local's Linears" in out and "Traceback" not in out
    assert "step 1/" not in out


# The adapters' concrete strategies at data_parallel 2, model_parallel 4, by the math: x [B*S, in] is split
# over the batch; a column-parallel W [out, in] is split over out: A [r, in] whole, x A^T [B*S, r] batch only,
# B [out, r] split over out like W, so the update is (dp, mp) like the matmul it is added to; a row-parallel
# W is split over in: x arrives (dp, mp), A split over in like W, the partial x_r A_r^T is all-reduced, B
# whole, the update (dp, 1) like the reduced matmul.
LORA_GOLDEN_DP2_MP4 = {
    "attention.linear_qkv.lora_dropout.dropout": ((2, 1),),
    "attention.linear_qkv.lora_a_matmul": ((2, 1), (1, 1)),
    "attention.linear_qkv.lora_b_matmul": ((2, 1), (4, 1)),
    "attention.linear_qkv.lora_mul": ((2, 4), ()),
    "attention.linear_qkv.lora_add": ((2, 4), (2, 4)),
    "mlp.linear_fc2.lora_dropout.dropout": ((2, 4),),
    "mlp.linear_fc2.lora_a_matmul": ((2, 4), (1, 4)),
    "mlp.linear_fc2.lora_b_matmul": ((2, 1), (1, 1)),
    "mlp.linear_fc2.lora_mul": ((2, 1), ()),
    "mlp.linear_fc2.lora_add": ((2, 1), (2, 1)),
}


def test_a_parallel_build_shards_the_adapters(monkeypatch):
    """Built under semi-auto parallel (which CPU cannot compile; the model's own call is made), the
    adapters' primitives carry the golden strategies, and the base Linears keep theirs."""
    import mindformers_gptlocal.model.gpt as gpt
    monkeypatch.setattr(gpt, "is_parallel_build", lambda: True)
    config = GPTLocalConfig(**SMALL, parallel_config={"data_parallel": 2, "model_parallel": 4},
                            pet_config=dict(PET, target_modules=".*linear_qkv|.*linear_fc2"))
    model = GPTLocalForCausalLM(config)
    for index in range(SMALL["num_hidden_layers"]):
        prefix = f"model.layers.{index}."
        lora_ops = {op[len(prefix):]: st for op, st in model.sharding.items() if op.startswith(prefix) and "lora" in op}
        assert lora_ops == LORA_GOLDEN_DP2_MP4, index
        assert model.sharding[prefix + "attention.linear_qkv.matmul"] == ((2, 1), (4, 1))
    layer = model.model.layers[1]
    assert layer.mlp.linear_fc2.lora_a_matmul.attrs["in_strategy"] == ((2, 4), (1, 4))
    assert layer.attention.linear_qkv.lora_b_matmul.attrs["in_strategy"] == ((2, 1), (4, 1))
