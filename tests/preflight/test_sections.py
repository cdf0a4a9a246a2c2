"""``gptlocal run``: every YAML section a user sets, every flag and free ``--key value`` pair, and a YAML syntax
error give one line, exit code 2, and nothing created (the output folder included)."""
import glob
import os

import pytest

from conftest import CONFIGS, launch_in_process, tiny_yaml


def _refused(tmp_path, corpus, capsys, monkeypatch, *extra, yaml_path=None, **changes):
    """``gptlocal run`` through the CLI's main, in this process: its one error line; nothing was created."""
    yaml_path = yaml_path or tiny_yaml(tmp_path, corpus=corpus, **changes)
    before = sorted(os.listdir(tmp_path))
    code, out = launch_in_process(["--config", yaml_path, *extra], str(tmp_path), capsys, monkeypatch)
    errors = [line for line in out.splitlines() if line.startswith("gptlocal run: error:")]
    assert code == 2, out[-2000:]
    assert len(errors) == 1 and "Traceback" not in out, out[-2000:]
    assert sorted(os.listdir(tmp_path)) == before, "a refused run created a file or folder"
    assert not os.path.exists(tmp_path / "output")
    return errors[0]


@pytest.fixture
def refused(tmp_path, corpus, capsys, monkeypatch):
    return lambda *extra, **changes: _refused(tmp_path, corpus, capsys, monkeypatch, *extra, **changes)


def test_unknown_flag_is_refused_with_the_closest(refused):
    line = refused("--stepz", "5")
    assert "unknown flag --stepz" in line and "Did you mean --runner_config.stop_step" in line
    assert "Did you mean --runner_config.stop_step?" in refused("--runer_config.stop_step", "5")
    assert "--batch_size" in refused("--batchsize=2")


def test_dotted_overrides_and_top_level_free_pairs_still_set_keys(tmp_path, corpus):
    """MindFormers' launcher's free pairs: a dotted key of any section, a top-level key it reads."""
    from mindformers_gptlocal.cli.launcher import load_config
    config = load_config(["--config", tiny_yaml(tmp_path, corpus=corpus), "--runner_config.stop_step", "3",
                          "--tensorboard.tensorboard_dir", "tb", "--eval_step_interval=7"])
    assert config.runner_config.stop_step == 3 and config.tensorboard.tensorboard_dir == "tb"
    assert config.eval_step_interval == 7


def test_top_level_typo_is_refused(refused):
    line = refused(runer_config__batch_size=4)
    assert "top-level key 'runer_config'" in line and "did you mean 'runner_config'?" in line
    assert "top-level key 'trian_dataset'" in refused(trian_dataset__batch_size=4)


@pytest.mark.parametrize("changes,expected", [
    ({"optimizer__type": "GPTLocalAdamWW"}, "optimizer.type 'GPTLocalAdamWW' is not a registered MindFormers "
                                            "optimizer; did you mean 'GPTLocalAdamW'?"),
    ({"optimizer__learning_rate": "fast"}, "optimizer.learning_rate must be a number, got 'fast'"),
    ({"optimizer__betas": [0.9, 1.5]}, "optimizer.betas must be a list of two numbers in [0, 1)"),
    ({"optimizer__weight_decay": -0.1}, "optimizer.weight_decay must be >= 0"),
    ({"optimizer__weight_decai": 0.1}, "unknown key 'weight_decai'; did you mean 'weight_decay'?"),
    ({"lr_schedule__learning_rate": "fast"}, "lr_schedule.learning_rate must be a number, got 'fast'"),
    ({"lr_schedule__type": "CosineWithWarmupLR"}, "did you mean 'CosineWithWarmUpLR'?"),
    ({"lr_schedule__warmup_ratio": 2}, "lr_schedule.warmup_ratio must be <= 1"),
    ({"lr_schedule__warmup_step": 2}, "did you mean 'warmup_steps'?"),
    ({"runner_config__sink_mode": "yes"}, "runner_config.sink_mode must be True or False"),
    ({"runner_config__stepz": 5}, "runner_config: unknown key 'stepz'"),
    ({"runner_config__epoch": 5}, "did you mean 'epochs'?"),
    ({"context__mode": 3}, "context.mode must be 0 (graph) or 1 (pynative)"),
    ({"context__device_id": -1}, "context.device_id must be >= 0"),
    ({"context__devcie_target": "CPU"}, "context: unknown key 'devcie_target'; did you mean 'device_target'?"),
    ({"parallel__full_batch": "no"}, "parallel.full_batch must be True or False"),
    ({"parallel__parallel_mod": 0}, "parallel: unknown key 'parallel_mod'; did you mean 'parallel_mode'?"),
    ({"parallel_config__data_paralel": 1}, "did you mean 'data_parallel'?"),
    ({"parallel_config__use_seq_parallel": "no"}, "parallel_config.use_seq_parallel must be True or False"),
])
def test_section_mistakes(refused, changes, expected):
    assert expected in refused(**changes)


def test_callback_mistakes(tmp_path, corpus, capsys, monkeypatch):
    from mindformers_gptlocal import yaml_io
    base = yaml_io.load_yaml(tiny_yaml(tmp_path, corpus=corpus))
    cases = [({"type": "GPTLocalThroughputMonitor", "per_print_time": 1}, "callbacks[0] (GPTLocalThroughputMonitor): "
              "unknown key 'per_print_time'; did you mean 'per_print_times'?"),
             ({"type": "GPTLocalThroughputMonitr"}, "did you mean 'GPTLocalThroughputMonitor'?"),
             ({"type": "GPTLocalThroughputMonitor", "per_print_times": 0}, "per_print_times must be >= 1"),
             ({"type": "MFLossMonitor", "per_print_timez": 1}, "did you mean 'per_print_times'?")]
    for callback, expected in cases:
        yaml_path = yaml_io.dump_yaml(dict(base, callbacks=[callback]), str(tmp_path / "run.yaml"))
        assert expected in _refused(tmp_path, corpus, capsys, monkeypatch, yaml_path=yaml_path)


def test_yaml_syntax_error_names_line_and_column(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  model_config:\n    model_type: gpt_local\n   hidden_size: [\n")
    line = _refused(tmp_path, None, capsys, monkeypatch, yaml_path=str(bad))
    assert f"{bad}:4:4: YAML syntax error" in line


def test_modal_type_and_adapter_id(refused, tmp_path, corpus):
    """What MindFormers' launcher does with them, for a text-only model without slora: text passes, the rest is
    refused with one line."""
    from mindformers_gptlocal.cli.launcher import load_config
    line = refused("--run_mode", "predict", "--predict_data", "a.jpg", "--modal_type", "image")
    assert "--modal_type image: gpt_local models read text only" in line
    assert "picks an adapter of an slora pet_config" in refused("--run_mode", "predict", "--predict_data", "hi",
                                                                "--adapter_id", "a")
    config = load_config(["--config", tiny_yaml(tmp_path, corpus=corpus), "--run_mode", "predict",
                          "--predict_data", "def", "--modal_type", "text"])
    assert config.input_data == "def"


def test_every_shipped_yaml_passes_the_section_checks():
    from mindformers.tools.register import MindFormerConfig
    from mindformers_gptlocal import yaml_io
    from mindformers_gptlocal.mf import symbols
    from mindformers_gptlocal.preflight.sections import check_sections
    paths = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))
    assert len(paths) > 20
    for path in paths:
        check_sections(yaml_io.load_yaml(path), symbols)
        check_sections(MindFormerConfig(path), symbols)


def test_resume_of_a_finetune_looks_in_its_own_checkpoint_folder(tmp_path):
    """A finetune's load_checkpoint is the base model directory (weights only): --resume_training True looks in
    <output_dir>/checkpoint; a checkpoint folder or file given as load_checkpoint is used as it is."""
    from mindformers_gptlocal.mf.run_yaml import resume_folder
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    out = str(tmp_path / "run")
    assert resume_folder({"load_checkpoint": str(base), "output_dir": out}) == os.path.join(out, "checkpoint")
    assert resume_folder({"load_checkpoint": "", "output_dir": out}) == os.path.join(out, "checkpoint")
    assert resume_folder({"load_checkpoint": str(tmp_path), "output_dir": out}) == str(tmp_path)
