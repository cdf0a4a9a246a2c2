"""`gptlocal plan`: layout rules (each one, all collected), the same errors at model build and in
pre-flight, every multi-card config fits its card, and the CPU memory estimate against the peak RSS
of real training runs (tiny and GPT-2 small, two steps each through `gptlocal run`)."""
import copy
import glob
import json
import os
import re

import pytest

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM, yaml_io
from mindformers_gptlocal.cli import main as cli_main
from mindformers_gptlocal.errors import ConfigError
from mindformers_gptlocal.plan import memory as mem
from mindformers_gptlocal.parallel.rules import check_parallel_layout, check_yaml_layout
from mindformers_gptlocal.plan.report import plan
from mindformers_gptlocal.preflight.checks import check_layout
from conftest import CONFIGS, TINY, launch_in_process, run_launcher, tiny_yaml

ASCEND = sorted(p for p in glob.glob(os.path.join(CONFIGS, "*.yaml"))
                if yaml_io.load_yaml(p)["context"]["device_target"] == "Ascend")


def _cards(path):
    return int(re.search(r"_(\d+)p\.yaml$", path).group(1))


def test_every_multi_card_layout_is_covered():
    cards = sorted({_cards(p) for p in ASCEND})
    assert cards == [1, 8, 64]
    assert {"pretrain_gpt2_medium_mp8_8p.yaml", "pretrain_gpt2_small_dp2mp2pp2_8p.yaml",
            "pretrain_gpt3_6.7b_64p.yaml"} <= {os.path.basename(p) for p in ASCEND}


@pytest.mark.parametrize("path", ASCEND, ids=os.path.basename)
def test_ascend_config_plans_and_fits_the_card(path, capsys):
    result = plan(yaml_io.load_yaml(path), devices=_cards(path))
    assert result["problems"] == []
    assert result["device_target"] == "Ascend" and result["card_bytes"] == 64 * 2 ** 30
    assert result["fits"], f"{path}: {result['peak_device_bytes'] / 2 ** 30:.1f} GiB per device"
    assert sum(st["layers"] for st in result["stages"]) == result["shape"]["layers"]
    assert cli_main(["plan", "--config", path, "--devices", str(_cards(path))]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "Ascend 910B, 64 GB" in out


def test_a_layout_that_does_not_fit_fails(tmp_path, capsys):
    config = yaml_io.load_yaml(os.path.join(CONFIGS, "pretrain_gpt2_xl_1p.yaml"))
    config["runner_config"]["batch_size"] = 64
    config["recompute_config"]["recompute"] = False
    result = plan(config)
    assert result["problems"] == [] and result["fits"] is False
    path = yaml_io.dump_yaml(config, str(tmp_path / "big.yaml"))
    assert cli_main(["plan", "--config", path]) == 2
    assert "exceeds the Ascend 910B, 64 GB card" in capsys.readouterr().err


def test_plan_json_is_one_object_and_counts_the_6_7b_model(capsys):
    path = os.path.join(CONFIGS, "pretrain_gpt3_6.7b_64p.yaml")
    assert cli_main(["plan", "--config", path, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["devices"] == 64 and result["layout"]["mp"] == 8 and result["vocab_parallel"]
    # every tensor-parallel rank of every stage, minus the head copy, adds up to the model
    shape = result["shape"]
    per_rank = sum(st["params"] - st["param_parts"].get("head_copy", 0) for st in result["stages"])
    h, layers = shape["hidden"], shape["layers"]
    full = (shape["vocab"] + shape["positions"]) * h + layers * (12 * h * h + 13 * h) + 2 * h
    replicated = h * shape["positions"] + layers * (2 * h + 4 * h) + 2 * h  # position emb, row biases, norms
    assert per_rank * 8 - 7 * replicated == full
    assert 6.6e9 < full < 6.9e9


def test_single_stage_param_count_matches_the_built_model():
    config = GPTLocalConfig(**TINY)
    model = GPTLocalForCausalLM(config)
    s = mem.shape_of(dict(TINY))
    assert sum(mem.stage_params(s, [config.num_hidden_layers])[0].values()) == \
        sum(p.size for p in model.trainable_params())


def test_planner_defaults_are_gptlocalconfig_defaults():
    s, c = mem.shape_of({}), GPTLocalConfig()
    assert (s["vocab"], s["hidden"], s["layers"], s["heads"], s["inter"], s["positions"], s["seq"]) == \
        (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size,
         c.max_position_embeddings, c.seq_length)
    assert (s["params_dtype"], s["compute_dtype"], s["hidden_dropout"]) == \
        (c.params_dtype, c.compute_dtype, c.hidden_dropout)


GOOD_MODEL = dict(vocab_size=50304, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                  intermediate_size=4096, seq_length=512, max_position_embeddings=1024)
GOOD_PARALLEL = dict(data_parallel=2, model_parallel=2, pipeline_stage=2, micro_batch_num=4,
                     use_seq_parallel=True, vocab_emb_dp=False)

BAD = [  # (model changes, parallel changes, devices, batch, text every problem line must show)
    ({"num_attention_heads": 15}, {}, 8, 1, "model_config.num_attention_heads (15) is not divisible"),
    ({"hidden_size": 1023}, {}, 8, 1, "model_config.hidden_size (1023)"),
    ({"intermediate_size": 4097}, {}, 8, 1, "model_config.intermediate_size (4097)"),
    ({"vocab_size": 50257}, {}, 8, 1, "model_config.vocab_size (50257)"),
    ({"seq_length": 511, "max_position_embeddings": 511}, {}, 8, 1, "parallel_config.use_seq_parallel is True"),
    ({"num_hidden_layers": 1}, {}, 8, 1, "smaller than parallel_config.pipeline_stage"),
    ({"offset": [1, 0]}, {}, 8, 1, "offset [1, 0] gives stages [5, 4]"),
    ({"seq_length": 2048}, {}, 8, 1, "larger than model_config.max_position_embeddings"),
    ({}, {"micro_batch_num": 1}, 8, 1, "parallel_config.micro_batch_num (1) is smaller"),
    ({}, {}, 8, 0, "runner_config.batch_size must be a positive integer"),
    ({}, {}, 16, 1, "= 8, but the run has 16 device(s)"),
    ({}, {"model_parallel": 0}, 8, 1, "parallel_config.model_parallel must be a positive integer"),
]


@pytest.mark.parametrize("model_changes,parallel_changes,devices,batch,expected", BAD,
                         ids=[b[-1][:40] for b in BAD])
def test_each_layout_rule(model_changes, parallel_changes, devices, batch, expected):
    assert check_parallel_layout(GOOD_MODEL, GOOD_PARALLEL, devices=8, batch_size=1) == []
    problems = check_parallel_layout(dict(GOOD_MODEL, **model_changes), dict(GOOD_PARALLEL, **parallel_changes),
                                     devices=devices, batch_size=batch)
    assert len(problems) == 1 and expected in problems[0], problems


def test_vocab_rule_only_when_the_embedding_is_vocab_parallel():
    model = dict(GOOD_MODEL, vocab_size=50257)
    assert check_parallel_layout(model, dict(GOOD_PARALLEL, vocab_emb_dp=True), devices=8) == []
    assert check_parallel_layout(model, dict(GOOD_PARALLEL), devices=8) != []


def test_all_problems_are_collected_and_plan_fails_with_them(tmp_path, capsys):
    config = yaml_io.load_yaml(os.path.join(CONFIGS, "pretrain_gpt2_small_dp2mp2pp2_8p.yaml"))
    config["parallel_config"].update(model_parallel=5, micro_batch_num=1)
    problems = check_yaml_layout(config, devices=8)
    keys = ["num_attention_heads", "hidden_size", "intermediate_size", "use_seq_parallel is True", "micro_batch_num",
            "the run has 8"]
    assert len(problems) == len(keys) and all(any(k in p for p in problems) for k in keys), problems
    path = yaml_io.dump_yaml(config, str(tmp_path / "bad.yaml"))
    assert cli_main(["plan", "--config", path, "--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert all(p in err for p in problems)


def _bad_tiny():
    return dict(TINY, num_attention_heads=4), dict(data_parallel=1, model_parallel=3, pipeline_stage=1,
                                                   micro_batch_num=1)


@pytest.mark.parametrize("as_object", [False, True], ids=["dict", "TransformerOpParallelConfig"])
def test_building_the_model_with_a_bad_layout_raises_the_same_lines(as_object):
    model_values, parallel = _bad_tiny()
    expected = check_parallel_layout(model_values, parallel)
    assert len(expected) == 3  # heads 4, hidden 64 and intermediate 256 are not divisible by 3
    if as_object:  # what MindFormers' trainer hands the model config
        from mindformers.modules.transformer.transformer import TransformerOpParallelConfig
        parallel = TransformerOpParallelConfig(**parallel)
    with pytest.raises(ConfigError) as err:
        GPTLocalForCausalLM(GPTLocalConfig(**model_values, parallel_config=parallel))
    assert all(line in str(err.value) for line in expected)


def test_preflight_and_launcher_stop_with_the_same_lines(tmp_path, corpus, capsys, monkeypatch):
    path = tiny_yaml(tmp_path, corpus=corpus, parallel_config__model_parallel=3)
    config = yaml_io.load_yaml(path)
    expected = check_yaml_layout(config)
    assert len(expected) == 4  # heads, hidden, intermediate, and 1 card (use_parallel False) for dp*mp*pp = 3
    with pytest.raises(ConfigError) as err:
        check_layout(copy.deepcopy(config))
    assert all(line in str(err.value) for line in expected)
    code, out = launch_in_process(["--config", path], str(tmp_path), capsys, monkeypatch)  # the launcher's main
    assert code == 2 and all(line in out for line in expected), out[-2000:]


# --- CPU memory estimate against measured peak RSS ---------------------------------------------------
SHAPES = {  # the tiny config as shipped; GPT-2 small (124M) as benchmarks/train_throughput.py runs it
    "tiny": dict(model={}, batch=4),
    "gpt2_small": dict(model=dict(vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                  max_position_embeddings=1024), batch=2),
}
STEPS = 2


@pytest.fixture(scope="module")
def corpus256(tmp_path_factory):
    """prepare-data output with 256-token windows (a 512-token BPE: ids fit either vocabulary)."""
    from mindformers_gptlocal.data.prepare import prepare
    out = tmp_path_factory.mktemp("corpus256") / "data"
    return prepare(out=str(out), seq_length=256, vocab_size=512, max_bytes=150_000, eval_fraction=0.05)


def _shape_config(name):
    """The shipped CPU YAML (optimizer.type GPTLocalAdamW) resized to one of SHAPES."""
    shape = SHAPES[name]
    config = yaml_io.load_yaml(os.path.join(CONFIGS, "pretrain_gpt_local_tiny_cpu.yaml"))
    config["model"]["model_config"].update(shape["model"])
    config["runner_config"]["batch_size"] = config["train_dataset"]["batch_size"] = shape["batch"]
    return config


@pytest.mark.parametrize("name", list(SHAPES))
def test_cpu_estimate_is_within_25_percent_of_peak_rss(name, corpus256, tmp_path):
    shape = SHAPES[name]
    config = _shape_config(name)
    assert config["optimizer"]["type"] == "GPTLocalAdamW"  # the default the fused-optimizer factor is for
    config["train_dataset"]["data_loader"].update(dataset_dir=corpus256["train_mindrecord"], shuffle=False,
                                                  num_samples=STEPS * shape["batch"])
    config["train_dataset_task"]["dataset_config"] = config["train_dataset"]
    config["callbacks"] = [{"type": "GPTLocalThroughputMonitor", "per_print_times": 1}]
    config["runner_wrapper"]["compile_cache"] = "off"  # the estimate is a compiling run's (a stored graph's is lower)
    config["output_dir"] = str(tmp_path / "output")
    path = yaml_io.dump_yaml(config, str(tmp_path / "run.yaml"))
    result = plan(yaml_io.load_yaml(path))
    assert result["cpu_optimizer"] == {"type": "GPTLocalAdamW", "state_factor": mem.CPU_STATE_FACTOR["GPTLocalAdamW"],
                                       "factor_of": "GPTLocalAdamW", "measured": True}
    estimate = result["cpu_peak_rss_bytes"] / 2 ** 20
    code, out = run_launcher(["--config", path], cwd=str(tmp_path), fresh=True)  # the memory of a process's own
    assert code == 0, out[-3000:]
    measured = float(re.search(r"peak RSS ([0-9,]+) MB", out).group(1).replace(",", ""))
    print(f"{name}: estimate {estimate:,.0f} MB, measured peak RSS {measured:,.0f} MB, "
          f"ratio {estimate / measured:.3f}")
    assert abs(estimate / measured - 1) <= 0.25


@pytest.mark.parametrize("optimizer", ["AdamW", "Lamb"])
def test_cpu_estimate_uses_the_adamw_factor_for_adamw_and_unknown_optimizers(optimizer):
    """Arithmetic only: the unfused AdamW (and any optimizer not measured) gets the larger state factor,
    so the estimate grows by exactly (factor difference) x (weights + grads + moments)."""
    default = plan(_shape_config("gpt2_small"))
    config = _shape_config("gpt2_small")
    config["optimizer"]["type"] = optimizer
    result = plan(config)
    st = result["stages"][0]
    state = st["weights_bytes"] + st["grads_bytes"] + st["optimizer_bytes"]
    extra = (mem.CPU_STATE_FACTOR["AdamW"] - mem.CPU_STATE_FACTOR["GPTLocalAdamW"]) * state
    assert result["cpu_peak_rss_bytes"] - default["cpu_peak_rss_bytes"] == pytest.approx(extra)
    assert extra > 4 * 2 ** 30 * 0.9   # GPT-2 small: measured 9,274 MB with AdamW vs 4,986 MB fused
    assert result["cpu_optimizer"]["factor_of"] == "AdamW"
    note = [n for n in result["notes"] if "no measured CPU memory factor" in n]
    assert note == ([] if optimizer == "AdamW" else
                    [f"optimizer.type 'Lamb' has no measured CPU memory factor: the CPU peak RSS estimate uses "
                     f"AdamW's ({mem.CPU_STATE_FACTOR['AdamW']}x the weights, grads and moments), the conservative one"])
    from mindformers_gptlocal.plan.report import format_plan
    assert f"for optimizer {optimizer}" in format_plan(result)


@pytest.mark.parametrize("pet", [{"pet_type": "ptuning2", "pre_seq_len": 4, "prefix_projection": False},
                                 {"pet_type": "prefixtuning", "prefix_token_num": 4, "mid_dim": 24}],
                         ids=["ptuning2", "prefixtuning-mlp"])
def test_planner_counts_the_prefix_on_every_device_and_gives_only_it_gradients(pet):
    """Prefix tuning: one device counts the built model's parameters, only the prefix trainable (its grads and
    two moments); at model_parallel 2, pipeline 2 every stage's device holds the whole (replicated) prefix on
    top of its share of the base, which the plan without the prefix counts."""
    from mindformers_gptlocal.plan.report import format_plan
    model_config = dict(TINY, seq_length=TINY["seq_length"] - 4, pet_config=pet)
    model = GPTLocalForCausalLM(GPTLocalConfig(**model_config))
    total = sum(p.size for p in model.get_parameters() if p.name != "dropout_step")  # the counter is no weight
    prefix = sum(p.size for p in model.trainable_params())
    assert {p.name.split(".")[1] for p in model.trainable_params()} == {"prefix_encoder"}
    one = plan({"model": {"model_config": model_config}, "context": {"device_target": "CPU"}})
    stage = one["stages"][0]
    assert stage["params"] == total and stage["trainable_params"] == prefix == stage["param_parts"]["prefix"]
    assert stage["grads_bytes"] == 4 * prefix and stage["optimizer_bytes"] == 8 * prefix
    assert f"stage 0 {prefix:,} ({prefix:,} in the prefix)" in format_plan(one)

    parallel = {"data_parallel": 1, "model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 2}
    base = dict(model_config)
    del base["pet_config"]
    tuned = plan({"model": {"model_config": model_config}, "parallel_config": parallel}, devices=4)
    plain = plan({"model": {"model_config": base}, "parallel_config": parallel}, devices=4)
    assert tuned["problems"] == [] and len(tuned["stages"]) == 2
    for with_prefix, without in zip(tuned["stages"], plain["stages"]):
        assert with_prefix["params"] == without["params"] + prefix
        assert with_prefix["trainable_params"] == prefix and with_prefix["grads_bytes"] == 4 * prefix
        assert with_prefix["weights_bytes"] == without["weights_bytes"] + 4 * prefix
