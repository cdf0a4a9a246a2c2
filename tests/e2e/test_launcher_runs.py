"""Every run_mode through the launcher (MindFormers' Trainer), in subprocesses, on the tiny model."""
import json
import os
import re

import pytest

from conftest import REPO, TRAINED_STEPS, Launch, megatron_changes, run_launcher, source_env, step_losses, tiny_yaml
from conftest import uninterrupted_run, write_yaml

STEPS = TRAINED_STEPS  # conftest.tiny_trained_run: one 20-step launch shared with test_optim


@pytest.fixture(scope="module")
def trained(tiny_trained_run):
    """The tiny model trained for STEPS steps on the MindRecord data; returns (output text, model dir)."""
    return tiny_trained_run["out"], tiny_trained_run["model_dir"]


def _set_print_every_step(yaml_path):
    from mindformers_gptlocal import yaml_io
    config = yaml_io.load_yaml(yaml_path)
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["per_print_times"] = 1
    yaml_io.dump_yaml(config, yaml_path)


def test_train_loss_decreases_and_writes_model_dir(trained):
    """Also: the console of a fresh `gptlocal run` process (conftest.tiny_trained_run starts a new interpreter)
    holds gpt_local's lines only, none that importing MindSpore or MindFormers prints."""
    out, model_dir = trained
    assert [line for line in out.splitlines() if line.strip() and not line.startswith("[gptlocal]")] == [], out
    losses = step_losses(out)
    assert len(losses) == STEPS
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    assert re.search(r"tokens/s", out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(model_dir, name)), name
    assert json.load(open(os.path.join(model_dir, "config.json")))["model_type"] == "gpt_local"


def test_eval_reports_perplexity_lower_than_untrained(trained, corpus, tmp_path):
    _, model_dir = trained
    launches = []
    for folder, flags in (("untrained", []), ("trained", ["--load_checkpoint", model_dir])):
        (tmp_path / folder).mkdir()
        yaml_path = tiny_yaml(tmp_path / folder, "eval_gpt_local_tiny_cpu.yaml", corpus=corpus)
        launches.append(Launch(["--config", yaml_path, *flags], cwd=str(tmp_path / folder)))  # the two overlap
    texts = []
    for launch in launches:
        code, text = launch.result()
        assert code == 0, text[-3000:]
        assert "[MS_ALLOC_CONF]" not in text, text[-3000:]  # MindSpore's print of what MindFormers sets for eval
        texts.append(text)
    ppl = [float(re.search(r"^\s+PPL\s+([0-9.]+)", text, re.M).group(1)) for text in texts]
    assert ppl[0] > 400  # random init over a 512-token vocabulary
    assert ppl[1] < 0.7 * ppl[0], ppl


@pytest.fixture(scope="module")
def from_trained(trained, corpus, tmp_path_factory):
    """The predict run and the finetune run (8 steps) from the trained model directory, started at once
    (independent: they overlap); {"predict": Launch, "finetune": Launch}."""
    _, model_dir = trained
    predict_dir, finetune_dir = tmp_path_factory.mktemp("predict"), tmp_path_factory.mktemp("finetune")
    predict_yaml = tiny_yaml(predict_dir, "predict_gpt_local_tiny_cpu.yaml", corpus=corpus,
                             pretrained_model_dir=model_dir, generation_config__max_new_tokens=8)
    finetune_yaml = tiny_yaml(finetune_dir, "finetune_gpt_local_tiny_cpu.yaml", corpus=corpus,
                              train_dataset__data_loader__num_samples=8)
    _set_print_every_step(finetune_yaml)
    return {"predict": Launch(["--config", predict_yaml, "--load_checkpoint", model_dir, "--predict_data",
                               "def main(", "--predict_batch_size", "1"], cwd=str(predict_dir)),
            "finetune": Launch(["--config", finetune_yaml, "--load_checkpoint", model_dir], cwd=str(finetune_dir))}


def test_predict_returns_text(from_trained):
    code, out = from_trained["predict"].result()
    assert code == 0, out[-3000:]
    texts = [json.loads(t) for t in re.findall(r"\[gptlocal\] generated: (.*)", out)]
    assert len(texts) == 1 and texts[0].startswith("def main(") and len(texts[0]) > len("def main(")


def test_train_from_megatron_bin_idx(corpus, tmp_path, tmp_path_factory):
    """The tiny Megatron YAML trains on the corpus's .bin/.idx: test_resume's Megatron run (dropout on, a dynamic
    loss scale), run once for both (conftest's uninterrupted_run)."""
    yaml_path = write_yaml(tmp_path, corpus, "pretrain_gpt_local_tiny_cpu_megatron.yaml",
                           **megatron_changes(corpus, 8))
    code, out = uninterrupted_run(tmp_path_factory, corpus, yaml_path)
    assert code == 0, out[-3000:]
    assert len(step_losses(out)) == 8


def test_register_path_route_without_autoregistration(corpus, tmp_path):
    """MindFormers' documented route: --register_path + model_config.auto_register, the plugin not preloaded."""
    yaml_path = tiny_yaml(tmp_path, corpus=corpus, train_dataset__data_loader__num_samples=8,
                          model__model_config__auto_register="gpt_local.GPTLocalConfig",
                          runner_wrapper__type="GPTLocalTrainOneStepCell")
    script = tmp_path / "run_like_mindformers.py"
    # The body of MindFormers' run_mindformer.py (r1.8.0) for this route: REGISTER_PATH, config, context, Trainer.
    script.write_text(
        "import os, sys\n"
        "os.environ['REGISTER_PATH'] = sys.argv[2]; sys.path.append(sys.argv[2])\n"
        "from mindformers.tools.register import MindFormerConfig\n"
        "from mindformers.core.context import build_context\n"
        "from mindformers.trainer import Trainer\n"
        "from mindformers.utils.file_utils import set_output_path\n"
        "assert 'mindformers_gptlocal' not in sys.modules, 'plugin was preloaded'\n"
        "config = MindFormerConfig(sys.argv[1])\n"
        "set_output_path(config.output_dir)\n"
        "build_context(config)\n"
        "Trainer(config).train()\n"
        "print('TRAINED', 'mindformers_gptlocal' in sys.modules)\n")
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, str(script), yaml_path, os.path.join(REPO, "run_scripts", "register")],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=600,
                          env=source_env(GPTLOCAL_NO_AUTOREGISTER="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "TRAINED True" in out


def test_finetune_starts_from_loaded_weights(trained, from_trained):
    """run_mode finetune with load_checkpoint = a model directory: the first loss is the trained model's,
    not a fresh model's (ln 512 = 6.24)."""
    out, _ = trained
    trained_last = step_losses(out)[-1]
    code, text = from_trained["finetune"].result()
    assert code == 0, text[-3000:]
    first = step_losses(text)[0]
    assert first < 6.0 and abs(first - trained_last) < 0.6, (first, trained_last)
