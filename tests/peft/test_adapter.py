"""Houlsby bottleneck adapters (``pet_type: adapter``) and LayerDrop (``model_config.layerdrop``).

Adapters: a new adapter leaves the base model's logits unchanged; only the adapters train, the base stays
bit-identical and a run stopped and resumed repeats the uninterrupted run's losses (with LayerDrop on in the
same run); a model directory loads back with its adapters; cached generation equals recomputation; merging
is refused; the table, the shard layouts and the planner count the new tensors. LayerDrop: the skip rate
is p, a training forward equals the model with the skipped layers removed, eval is the model without it."""
import os

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor
from safetensors.numpy import load_file

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.errors import CheckpointError, ConfigError
from mindformers_gptlocal.model.dropout import LAYERDROP_SITE, LayerDrop
from references import keep_reference
from mindformers_gptlocal.model.params import parameter_table
from mindformers_gptlocal.parallel.layout import Layout
from mindformers_gptlocal.parallel.sharding import merge_slices, rank_slice
from conftest import TINY, finetune_resumes_exactly, launch_in_process, save_tiny_base
from conftest import write_yaml

PET = dict(pet_type="adapter", bottleneck_size=16, non_linearity="gelu")


def adapter_count(config, width, sites=2):
    """(H * m + m) + (m * H + H) per adapter, from the sizes alone."""
    h = config["hidden_size"]
    return sites * config["num_hidden_layers"] * (2 * h * width + width + h)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, corpus):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    return save_tiny_base(tmp_path_factory.mktemp("adapter_base") / "base", corpus, seed=7)


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(3).integers(0, TINY["vocab_size"], (2, 19)).astype(np.int32)


def test_run_trains_only_the_adapters_with_layerdrop_and_resumes_exactly(tmp_path, corpus, base_dir):
    """A finetune YAML with pet_type adapter and layerdrop 0.3: the log states the trainable count; the base
    weights are bit-identical afterwards, the up-projections moved off zero, the loss fell; a new run resumed
    from its step-N checkpoint repeats the uninterrupted run's losses bit for bit (the adapters and the LayerDrop
    counter resume; conftest.finetune_resumes_exactly)."""
    steps = 8
    run = finetune_resumes_exactly(tmp_path, corpus, steps, steps // 2,
                                   train_dataset__data_loader__num_samples=4 * steps,
                                   model__model_config__pet_config=PET, model__model_config__layerdrop=0.3,
                                   load_checkpoint=base_dir, lr_schedule__learning_rate=5e-3, lr_schedule__lr_end=5e-3)
    out = run["out"]
    expected = adapter_count(TINY, 16)
    assert f"adapters: {expected:,} trainable parameters" in out, out[-3000:]
    base = load_file(os.path.join(base_dir, "model.safetensors"))
    tuned = load_file(str(run["model_dir"] / "model.safetensors"))
    assert set(tuned) - set(base) == {n for n in tuned if "_adapter." in n} and len(set(tuned) - set(base)) == 16
    for name, value in base.items():
        assert np.array_equal(tuned[name], value), f"{name} changed: a frozen base weight was trained"
    assert min(np.abs(tuned[n]).max() for n in tuned if n.endswith("linear_up.weight")) > 0  # started at zero
    reference = run["losses"]
    assert np.mean(reference[-3:]) < np.mean(reference[:3]) - 0.05, reference


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, base_dir, ids):
    """An adapter model on the base weights (a new one, and one with non-zero adapters saved as a model dir)."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY, pet_config=dict(PET, layers_to_transform=[1],
                                                                        non_linearity="silu")))
    model.load_weights(base_dir)
    model.set_train(False)
    fresh = model(Tensor(ids)).asnumpy()
    rng = np.random.default_rng(0)
    for name, param in model.parameters_and_names():
        if "_adapter." in name:
            param.set_data(Tensor(rng.normal(0, 0.3, param.shape).astype(np.float32)))
    out = tmp_path_factory.mktemp("adapter_tuned")
    model.save_pretrained(str(out / "tuned"), tokenizer_dir=base_dir)
    return dict(dir=str(out / "tuned"), model=model, fresh=fresh, logits=model(Tensor(ids)).asnumpy())


def test_new_adapter_leaves_the_logits_unchanged_and_only_it_trains(tuned, base_dir, ids, capsys):
    base = GPTLocalForCausalLM.from_pretrained(base_dir)
    base.set_train(False)
    np.testing.assert_array_equal(tuned["fresh"], base(Tensor(ids)).asnumpy())  # up-projection zero: x + 0
    model = tuned["model"]
    trainable = {p.name for p in model.trainable_params()}
    assert trainable == {n for n, _ in model.parameters_and_names() if "_adapter." in n} and len(trainable) == 8
    assert all(n.startswith("model.layers.1.") for n in trainable)  # layers_to_transform: [1]
    capsys.readouterr()
    GPTLocalForCausalLM(model.config)
    count = adapter_count(TINY, 16) // 2
    assert f"adapters: {count:,} trainable parameters" in capsys.readouterr().out
    table = parameter_table(model.config, Layout())
    assert {n: s.shape for n, s in table.items()} == {n: tuple(p.shape) for n, p in model.parameters_and_names()}
    with pytest.raises(CheckpointError, match="holds bottleneck adapters .* but the model has none"):
        base.load_weights(tuned["dir"])  # not silently the base model


def test_model_dir_loads_back_with_its_adapters_and_cached_generation_equals_recomputation(tuned, base_dir, ids):
    model = GPTLocalForCausalLM.from_pretrained(tuned["dir"])
    model.set_train(False)
    logits = model(Tensor(ids)).asnumpy()
    np.testing.assert_array_equal(logits, tuned["logits"])
    base = GPTLocalForCausalLM.from_pretrained(base_dir)
    base.set_train(False)
    assert np.abs(base(Tensor(ids)).asnumpy() - logits).max() > 0.1  # the adapters matter
    prompts = [list(ids[0, :7]), list(ids[1, :4])]
    cached = model.generate(prompts, max_new_tokens=5, do_sample=False, use_past=True)
    plain = model.generate(prompts, max_new_tokens=5, do_sample=False, use_past=False)
    assert cached == plain and [len(c) for c in cached] == [12, 9]


def test_merge_is_refused_clearly(tuned, base_dir, tmp_path):
    from mindformers_gptlocal.checkpoint.lora import merge
    with pytest.raises(CheckpointError, match="bottleneck adapters .* cannot be folded into the base weights"):
        merge(base_dir, tuned["dir"], str(tmp_path / "merged"))
    assert not (tmp_path / "merged").exists()


def test_adapter_layouts_reassemble_per_rank():
    """The table's layouts (down column-parallel, up row-parallel) computed rank by rank and summed over the
    ranks (the all-reduce) give the whole adapter's update, at model_parallel 2 and 4."""
    config = dict(TINY, pet_config=dict(PET, bottleneck_size=8, non_linearity="relu"))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, TINY["hidden_size"])).astype(np.float64)
    for mp in (2, 4):
        table = parameter_table(config, Layout(mp=mp))
        path = "model.layers.0.mlp_adapter."
        names = ("linear_down.weight", "linear_down.bias", "linear_up.weight", "linear_up.bias")
        full = {n: rng.normal(size=table[path + n].shape) for n in names}
        reference = np.maximum(x @ full["linear_down.weight"].T + full["linear_down.bias"], 0) \
            @ full["linear_up.weight"].T + full["linear_up.bias"]
        parts = []
        for rank in range(mp):
            piece = {n: rank_slice(full[n], table[path + n].layout, rank, mp) for n in names}
            assert piece["linear_down.weight"].shape == (8 // mp, TINY["hidden_size"])
            parts.append(np.maximum(x @ piece["linear_down.weight"].T + piece["linear_down.bias"], 0)
                         @ piece["linear_up.weight"].T)
        np.testing.assert_allclose(np.sum(parts, axis=0) + full["linear_up.bias"], reference, rtol=1e-12)
        for n in names:
            pieces = [rank_slice(full[n], table[path + n].layout, r, mp) for r in range(mp)]
            np.testing.assert_array_equal(merge_slices(pieces, table[path + n].layout), full[n])


def test_planner_counts_the_adapters_and_gives_only_them_gradients(tuned):
    from mindformers_gptlocal.plan.report import format_plan, plan
    model = tuned["model"]
    result = plan({"model": {"model_config": dict(TINY, pet_config=model.config.pet_config)},
                   "context": {"device_target": "CPU"}})
    stage = result["stages"][0]
    total = sum(p.size for p in model.get_parameters())
    trainable = sum(p.size for p in model.trainable_params())
    assert stage["params"] == total and stage["trainable_params"] == trainable
    assert stage["param_parts"]["adapters"] == trainable
    assert stage["grads_bytes"] == 4 * trainable and stage["optimizer_bytes"] == 8 * trainable
    assert f"stage 0 {trainable:,} ({trainable:,} in adapters)" in format_plan(result)


@pytest.mark.parametrize("change,pattern", [
    (dict(bottleneck_size=0), r"pet_config.bottleneck_size must be a positive integer.*got 0"),
    (dict(bottleneck_size=None, reduction_factor=128), r"pet_config.reduction_factor \(128\) is larger than "
                                                       r"hidden_size \(64\), so the adapter size would be 0"),
    (dict(reduction_factor=4), r"sets both bottleneck_size and reduction_factor"),
    (dict(non_linearity="tanh"), r"pet_config.non_linearity 'tanh' is not one gpt_local has"),
    (dict(lora_rank=8), r"pet_config.lora_rank is not a key of pet_type: adapter"),
    (dict(mh_adapter=False, output_adapter=False), r"mh_adapter and output_adapter are both false"),
    (dict(layers_to_transform=[2]), r"layers_to_transform must be .* in \[0, 2\)"),
    (dict(freeze_exclude=["*lora*"]), r"freeze every parameter.*freeze_exclude: \['\*adapter\*'\]"),
    (dict(layerdrop=1.0), r"model_config.layerdrop must be in \[0, 1\), got 1.0"),
    (dict(layerdrop=-0.1), r"model_config.layerdrop must be in \[0, 1\), got -0.1"),
], ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(v))
def test_bad_settings_are_one_clear_error(change, pattern):
    change = dict(change)
    layerdrop = change.pop("layerdrop", 0.0)
    with pytest.raises(ConfigError, match=pattern):
        GPTLocalConfig(**TINY, layerdrop=layerdrop, pet_config=dict(PET, **change))


def test_preflight_refuses_adapter_size_zero_before_compiling(tmp_path, corpus, base_dir, capsys, monkeypatch):
    yaml_path = write_yaml(tmp_path, corpus, "finetune_gpt_local_tiny_cpu.yaml", load_checkpoint=base_dir,
                           model__model_config__pet_config=dict(PET, bottleneck_size=0))
    code, out = launch_in_process(["--config", yaml_path], str(tmp_path), capsys, monkeypatch)  # no subprocess
    assert code == 2, out[-3000:]
    assert "pet_config.bottleneck_size must be a positive integer" in out and "Traceback" not in out
    assert "step 1/" not in out


def test_plan_refuses_layerdrop_under_semi_auto_parallel():
    """The layout check (plan, pre-flight) names layerdrop where the counter stream is not used."""
    from mindformers_gptlocal.parallel.rules import check_yaml_layout
    run = {"use_parallel": True, "parallel_config": {"data_parallel": 2},
           "model": {"model_config": dict(TINY, layerdrop=0.1)}}
    assert check_yaml_layout(dict(run, parallel={"parallel_mode": 0}), devices=2) == []
    problems = check_yaml_layout(dict(run, parallel={"parallel_mode": "semi_auto_parallel"}), devices=2)
    assert len(problems) == 1 and problems[0].startswith("model_config.layerdrop (0.1) needs counter-based dropout")


# --- LayerDrop ----------------------------------------------------------------------------------------------

def test_layerdrop_mask_is_the_counter_stream_and_skips_at_rate_p():
    """In-graph draws equal the numpy derivation; over 20,000 steps each layer's skip rate is p within a
    4.5-sigma binomial bound, and two layers' draws are not the same sequence."""
    p, seed = 0.3, 0
    cell = LayerDrop(p, LAYERDROP_SITE + 1, seed)
    cell.set_train(True)
    ones = Tensor(np.ones((1, 2, 3), np.float32))
    for step in (0, 1, 2, 17, 70001):
        kept = cell(ones, Tensor(step, ms.int32)).asnumpy()
        assert set(np.unique(kept)) == {float(keep_reference((1,), step, LAYERDROP_SITE + 1, seed, p)[0])}
    cell.set_train(False)
    np.testing.assert_array_equal(cell(ones, Tensor(5, ms.int32)).asnumpy(), ones.asnumpy())
    steps = 20000
    skipped = []
    for layer in (1, 2, 12):
        keep = keep_reference((1,), np.arange(steps), LAYERDROP_SITE + layer, seed, p)[:, 0]
        rate = 1.0 - keep.mean()
        assert abs(rate - p) < 4.5 * np.sqrt(p * (1 - p) / steps), (layer, rate)
        skipped.append(~keep)
    assert not np.array_equal(skipped[0], skipped[1])


def test_layerdrop_training_forward_is_the_model_without_the_skipped_layers():
    """At a step the training loss equals the loss of the same weights with that step's skipped layers made
    identity (their output projections zeroed) and LayerDrop off; in eval LayerDrop changes nothing."""
    ms.set_seed(11)
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY, layerdrop=0.5))
    plain = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    weights = {p.name: p.asnumpy().copy() for p in model.get_parameters() if p.name != "dropout_step"}
    ids = Tensor(np.random.default_rng(4).integers(0, TINY["vocab_size"], (2, 17)).astype(np.int32))
    drops = np.stack([~keep_reference((1,), np.arange(50), LAYERDROP_SITE + n, 0, 0.5)[:, 0] for n in (1, 2)], 1)
    steps = [int(np.flatnonzero((drops == want).all(1))[0]) for want in ([True, False], [False, True])]
    model.set_train(True)
    plain.set_train(True)
    for step in steps:  # layer 0 skipped, then layer 1 skipped
        model.dropout_step.set_data(Tensor(step, ms.int32))
        loss = float(model(ids)[0].asnumpy())  # reads the counter, then increments it
        assert int(model.dropout_step.asnumpy()) == step + 1
        state = dict(weights)
        for layer in np.flatnonzero(drops[step]):
            for part in ("attention.linear_proj", "mlp.linear_fc2"):
                for kind in ("weight", "bias"):
                    name = f"model.layers.{layer}.{part}.{kind}"
                    state[name] = np.zeros_like(state[name])
        ms.load_param_into_net(plain, {n: ms.Parameter(Tensor(v), name=n) for n, v in state.items()})
        np.testing.assert_allclose(loss, float(plain(ids)[0].asnumpy()), rtol=1e-6, err_msg=str(step))
    ms.load_param_into_net(plain, {n: ms.Parameter(Tensor(v), name=n) for n, v in weights.items()})
    assert abs(loss - float(plain(ids)[0].asnumpy())) > 1e-3  # a skipped layer changes the loss
    model.set_train(False)
    plain.set_train(False)
    np.testing.assert_array_equal(model(ids).asnumpy(), plain(ids).asnumpy())
