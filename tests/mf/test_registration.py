"""gpt_local is found through MindFormers' own registries, AutoConfig, and the import hook."""
import os
import subprocess
import sys

import pytest
from mindformers.tools.register import MindFormerRegister, MindFormerModuleType

import mindformers_gptlocal
from conftest import REPO, TINY, Launch, source_env

CHECK = ("import mindformers, sys\n"
         "from mindformers.tools.register import MindFormerRegister as R\n"
         "print('LOADED', 'mindformers_gptlocal' in sys.modules, 'mcore_GPTLocalForCausalLM' in R.registry['models'])\n")


def test_registered_in_mindformers_registries():
    registry = MindFormerRegister.registry
    assert registry[MindFormerModuleType.CONFIG]["mcore_GPTLocalConfig"] is mindformers_gptlocal.GPTLocalConfig
    assert registry[MindFormerModuleType.MODELS]["mcore_GPTLocalForCausalLM"] is mindformers_gptlocal.GPTLocalForCausalLM
    for kind, name in ((MindFormerModuleType.WRAPPER, "GPTLocalTrainOneStepCell"),
                       (MindFormerModuleType.WRAPPER, "GPTLocalPipelineWithLossScaleCell"),
                       (MindFormerModuleType.CALLBACK, "GPTLocalThroughputMonitor"),
                       (MindFormerModuleType.CALLBACK, "GPTLocalSaveModelDir"),
                       (MindFormerModuleType.TOKENIZER, "GPTLocalTokenizer")):
        assert name in registry[kind], name


def test_mcore_selection_by_model_type_and_architectures():
    """With use_legacy False, MindFormers builds config and model from model_type and architectures."""
    from mindformers.tools.register import MindFormerConfig
    from mindformers.core.context.build_context import MFContextOperator
    MFContextOperator(MindFormerConfig(use_legacy=False))
    try:
        cfg = dict(TINY, model_type="gpt_local", architectures=["GPTLocalForCausalLM"])
        config = MindFormerRegister.get_instance_from_cfg(dict(cfg), MindFormerModuleType.CONFIG)
        model = MindFormerRegister.get_instance_from_cfg(config.to_dict(), MindFormerModuleType.MODELS,
                                                         default_args={"config": config})
    finally:
        MFContextOperator.reset_instance()
    assert isinstance(config, mindformers_gptlocal.GPTLocalConfig)
    assert isinstance(model, mindformers_gptlocal.GPTLocalForCausalLM)
    # MindFormers' kind of model and config (mf/model.py), and the model's own classes too (what gpt_local's code asks)
    from mindformers.models.configuration_utils import PretrainedConfig
    from mindformers.models.modeling_utils import PreTrainedModel
    from mindformers_gptlocal import model as core
    assert isinstance(model, PreTrainedModel) and isinstance(model, core.GPTLocalForCausalLM)
    assert isinstance(config, PretrainedConfig) and isinstance(config, core.GPTLocalConfig)


def test_autoconfig_loads_model_dir(tmp_path, tiny_config):
    from mindformers import AutoConfig
    from mindformers_gptlocal import GPTLocalForCausalLM
    GPTLocalForCausalLM(tiny_config).save_pretrained(str(tmp_path))
    config = AutoConfig.from_pretrained(str(tmp_path))
    assert isinstance(config, mindformers_gptlocal.GPTLocalConfig)
    assert config.hidden_size == tiny_config.hidden_size


TORCH_CHECK = ("import sys, tempfile, mindformers\n"
               "print('TORCH', 'torch' in sys.modules)\n"
               "import torch\n"
               "from tensorboardX import SummaryWriter\n"
               "w = SummaryWriter(tempfile.mkdtemp()); w.add_scalar('loss', float(torch.ones(3).sum()), 1); w.close()\n"
               "print('WORKS')\n")
# after import mindformers: no nltk module is left loaded, MindFormers' BLEU equals nltk's, and nltk is whole
NLTK_CHECK = ("import sys\n"
              "print('NLTK', sorted(m for m in sys.modules if m.split('.')[0] == 'nltk')[:3])\n"
              "from mindformers.core.metric.metric import sentence_bleu as mf_bleu, SmoothingFunction as MFSmoothing\n"
              "import nltk, nltk.translate.bleu_score\n"
              "ref, hyp = [['the', 'cat', 'is', 'on', 'the', 'mat']], ['the', 'cat', 'sat', 'on', 'the', 'mat']\n"
              "ours = mf_bleu(ref, hyp, smoothing_function=MFSmoothing().method1)\n"
              "theirs = nltk.translate.bleu_score.sentence_bleu(ref, hyp, smoothing_function="
              "nltk.translate.bleu_score.SmoothingFunction().method1)\n"
              "print('BLEU', 0 < ours < 1 and ours == theirs, callable(nltk.word_tokenize))\n")


@pytest.fixture(scope="module")
def starts():
    """The three fresh interpreters the tests below read, started at once (independent: they overlap, each mostly
    importing MindFormers on one core): "default", the default environment running all the checks (CHECK,
    TORCH_CHECK, NLTK_CHECK), so MindFormers is imported once for three tests; "off", the hook switched off running
    CHECK; "old", the full imports kept (tensorboardX and nltk imported before mindformers: the hook leaves a loaded
    one alone)."""
    runs = {"default": ({}, CHECK + TORCH_CHECK + NLTK_CHECK),
            "off": ({"GPTLOCAL_NO_AUTOREGISTER": "1"}, CHECK),
            "old": ({}, "import mindspore, tensorboardX, nltk\n" + TORCH_CHECK + "print('NLTK', 'nltk' in sys.modules)\n")}
    launches = {name: Launch(None, None, env, command=[sys.executable, "-c", code])
                for name, (env, code) in runs.items()}
    for launch in launches.values():
        launch.result(timeout=300)
    return launches


@pytest.fixture(scope="module")
def default_start(starts):
    return starts["default"]


def test_importing_mindformers_registers_the_plugin(default_start, starts):
    """The installed .pth hook imports the plugin right after mindformers; the env switch turns it off."""
    on = default_start
    off = starts["off"]
    assert "LOADED True True" in on.stdout, on.stdout + on.stderr
    assert "LOADED False False" in off.stdout, off.stdout + off.stderr


def test_python_start_stays_light():
    """The hook must not import mindformers (or anything heavy) at interpreter start."""
    # (an editable install adds setuptools' own `__editable___mindformers_gptlocal_..._finder`: not ours, not heavy)
    out = subprocess.run([sys.executable, "-c", "import sys; print(sorted(m for m in sys.modules if ('mindformers' in m "
                          "or 'mindspore' in m) and not m.startswith('__editable__')))"], capture_output=True,
                         text=True, env=source_env())
    assert out.stdout.strip() == "['mindformers_gptlocal_autoregister']", out.stdout + out.stderr


def test_planning_and_conversion_load_neither_mindspore_nor_mindformers():
    """`gptlocal plan`, `gptlocal convert` and `--help` are arithmetic and file work: their modules stay light."""
    code = ("import sys, mindformers_gptlocal, mindformers_gptlocal.cli.main, mindformers_gptlocal.plan.report, "
            "mindformers_gptlocal.checkpoint.hf_gpt2, mindformers_gptlocal.model.params\n"
            "from mindformers_gptlocal.cli.main import main\n"
            "main(['plan', '--config', sys.argv[1]])\n"
            "print('HEAVY', sorted({m.split('.')[0] for m in sys.modules} & {'mindspore', 'mindformers', 'torch'}))\n")
    plan_yaml = os.path.join(REPO, "model_configs", "pretrain_gpt2_small_dp2mp2pp2_8p.yaml")
    out = subprocess.run([sys.executable, "-c", code, plan_yaml], capture_output=True, text=True, env=source_env())
    assert "HEAVY []" in out.stdout and "fits" in out.stdout, out.stdout + out.stderr


@pytest.fixture(scope="module")
def old_behaviour(starts):
    return starts["old"]


def test_mindformers_does_not_load_torch_through_tensorboardx(default_start, old_behaviour):
    """MindFormers imports tensorboardX at start-up, whose writer tries ``import torch``: the hook imports it
    with torch hidden, so a MindFormers process does not carry PyTorch (~230 MB of RSS) when it is installed;
    torch and tensorboardX still work afterwards, and a process that imports tensorboardX first keeps the old
    import."""
    hidden = default_start
    kept = old_behaviour
    assert "TORCH False" in hidden.stdout and "WORKS" in hidden.stdout, hidden.stdout + hidden.stderr[-3000:]
    assert "TORCH True" in kept.stdout and "WORKS" in kept.stdout, kept.stdout + kept.stderr[-3000:]


def test_mindformers_imports_bleu_without_nltks_package(default_start, old_behaviour):
    """MindFormers imports nltk's BLEU at start-up; the hook loads that module without nltk's package __init__ and
    forgets it afterwards: no nltk module stays loaded, MindFormers' sentence_bleu equals nltk's own, and a later
    ``import nltk`` is the whole package. nltk imported first keeps MindFormers' full import."""
    assert "NLTK []" in default_start.stdout and "BLEU True True" in default_start.stdout, \
        default_start.stdout + default_start.stderr[-3000:]
    assert "NLTK True" in old_behaviour.stdout, old_behaviour.stdout + old_behaviour.stderr[-3000:]
