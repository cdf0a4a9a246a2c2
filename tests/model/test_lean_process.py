"""The model without MindFormers: ``model/`` and the inference runtime import none of it, so generate/serve/eval
never load it; MindFormers' classes (``mf/model.py``) are the model's own on MindFormers' bases.

A `gptlocal generate` process (the real command line, main() with sys.argv) must never load MindFormers and must
give the tokens the MindFormers-based model gives; MindFormers imported afterwards in the same process registers
(and builds) its own kind of model, the model's own classes left as they are. Each plain base is compared with
MindFormers' class it stands in for.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import TINY, source_env

LEAN_SCRIPT = r"""
import contextlib, io, json, sys
model_dir, prompt = sys.argv[1], sys.argv[2]
from mindformers_gptlocal.cli.main import main
sys.argv = ["gptlocal", "generate", "--model", model_dir, "--prompt", prompt, "--temperature", "0",
            "--max-new-tokens", "6"]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main()
report = {"code": code, "cli_text": out.getvalue(), "mindformers_after_cli": "mindformers" in sys.modules}
from mindformers_gptlocal.model import GPTLocalForCausalLM
lean = GPTLocalForCausalLM.from_pretrained(model_dir)
report["lean"] = "mindformers" not in sys.modules
report["greedy_default"] = lean.generate([[5, 6, 7]])
report["sampled"] = lean.generate([[5, 6, 7], [9]], do_sample=True, top_k=20, seed=3, max_new_tokens=5)
report["config"] = {k: v for k, v in lean.config.to_dict().items() if k != "pet_config"}
report["mindformers_after_generate"] = "mindformers" in sys.modules
import mindformers
from mindformers.models.modeling_utils import PreTrainedModel
from mindformers.tools.register import MindFormerRegister, MindFormerModuleType
from mindformers_gptlocal import GPTLocalForCausalLM as Registered
built = MindFormerRegister.registry[MindFormerModuleType.MODELS]["mcore_GPTLocalForCausalLM"]
config_cls = MindFormerRegister.registry[MindFormerModuleType.CONFIG]["mcore_GPTLocalConfig"]
from mindformers.models.configuration_utils import PretrainedConfig
from mindformers import AutoConfig
report["registered_is_mindformers_model"] = (built is Registered and issubclass(built, PreTrainedModel)
                                             and issubclass(config_cls, PretrainedConfig)
                                             and type(AutoConfig.for_model("gpt_local")) is config_cls)
from mindformers_gptlocal.model import GPTLocalForCausalLM as Plain
report["lean_class_kept"] = (Registered is not GPTLocalForCausalLM and Plain is GPTLocalForCausalLM
                             and issubclass(Registered, GPTLocalForCausalLM)
                             and not isinstance(lean, PreTrainedModel))
report["registered_greedy"] = built.from_pretrained(model_dir).generate([[5, 6, 7]])
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def lean_run(tmp_path_factory, corpus):
    """(model directory, the lean subprocess's report): one process for every lean check."""
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    out = str(tmp_path_factory.mktemp("lean_model") / "model")
    GPTLocalForCausalLM(GPTLocalConfig(**TINY)).save_pretrained(out, tokenizer_dir=corpus["model_dir"])
    proc = subprocess.run([sys.executable, "-c", LEAN_SCRIPT, out, "def main():\n    "], env=source_env(),
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out, json.loads(lines[-1][len("REPORT "):])


def test_generate_process_never_loads_mindformers_and_gives_the_same_tokens(lean_run):
    from tokenizers import Tokenizer
    from mindformers_gptlocal import GPTLocalForCausalLM
    model_dir, report = lean_run
    assert report["code"] == 0 and report["lean"]
    assert not report["mindformers_after_cli"] and not report["mindformers_after_generate"]
    reference = GPTLocalForCausalLM.from_pretrained(model_dir)  # MindFormers' bases (this process loads it)
    prompt = "def main():\n    "
    ids = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(prompt).ids
    eos = reference.config.eos_token_id
    tokens = reference.generate([ids], do_sample=False, max_new_tokens=6, eos_token_id=eos)[0][len(ids):]
    text = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).decode([t for t in tokens if t != eos])
    assert report["cli_text"] == prompt + text + "\n"
    # the model's default generation options (MindFormers' GenerationConfig: max_length 20, ...) are kept
    assert report["greedy_default"] == reference.generate([[5, 6, 7]])
    assert report["sampled"] == reference.generate([[5, 6, 7], [9]], do_sample=True, top_k=20, seed=3,
                                                   max_new_tokens=5)
    expected = {k: v for k, v in reference.config.to_dict().items() if k != "pet_config"}
    assert report["config"] == json.loads(json.dumps(expected))


def test_mindformers_imported_later_registers_its_own_kind_of_model(lean_run):
    _, report = lean_run
    assert report["registered_is_mindformers_model"] and report["lean_class_kept"]
    assert report["registered_greedy"] == report["greedy_default"]


def test_each_plain_base_holds_what_mindformers_class_holds(tiny_config):
    """The model's plain bases against the MindFormers classes MindFormers' GPTLocalConfig / GPTLocalForCausalLM put
    in their place: the config's base attributes and dict, the flattened MoE keys, the default generation options;
    and the model's own config gives the dict MindFormers' config gives (config.json is the same)."""
    import inspect
    import mindformers
    from mindformers.generation import GenerationConfig
    from mindformers.models.configuration_utils import PretrainedConfig
    from mindformers.modules.transformer.moe import MoEConfig
    from mindformers_gptlocal.generation.defaults import LIBRARY
    from mindformers_gptlocal.model import config as plain
    def theirs(**made):
        """PretrainedConfig's dict without what MindFormers 1.9's base also sets: its default layout and pet_config
        None (GPTLocalConfig sets its own pet_config, and drops the layout where no parallel_config was given, as
        1.8 never set one: tiny_config below has none)."""
        values = PretrainedConfig(**made).to_dict()
        layout, pet = values.pop("parallel_config", None), values.pop("pet_config", None)
        assert (layout is None and pet is None) or mindformers.__version__.startswith("1.9."), layout  # only 1.9
        assert pet is None
        return values
    assert plain.ConfigBase().to_dict() == theirs()
    made = dict(name_or_path="x", eos_token_id=[3, 4], architectures=["A"], quantization="q", extra=1)
    assert plain.ConfigBase(**made).to_dict() == theirs(**made)
    assert "parallel_config" not in tiny_config.to_dict()
    assert isinstance(tiny_config, PretrainedConfig)  # the package's GPTLocalConfig: MindFormers' (mf/model.py)
    assert plain.GPTLocalConfig(**TINY).to_dict() == tiny_config.to_dict()
    live = (set(inspect.signature(MoEConfig.__init__).parameters) | set(MoEConfig().__dict__)) - {"self"}
    assert plain.MOE_KEYS == live
    for config in (tiny_config, PretrainedConfig(eos_token_id=7, pad_token_id=1, max_length=40, top_k=3)):
        theirs = GenerationConfig.from_model_config(config).to_dict()
        ours = plain.GenerationOptions.from_model_config(config)
        assert {k: ours[k] for k in LIBRARY} == {k: theirs.get(k) for k in LIBRARY}


def test_the_plain_model_and_mindformers_model_compute_the_same(tiny_config):
    """The model's own class and MindFormers' (same weights): the same logits; in training the same loss, the plain
    model returning it alone, MindFormers' with the zeros its mcore step unpacks (train_outputs)."""
    import numpy as np
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalForCausalLM
    from mindformers_gptlocal.model import config as plain_config, gpt as plain_gpt
    registered = GPTLocalForCausalLM(tiny_config)
    plain = plain_gpt.GPTLocalForCausalLM(plain_config.GPTLocalConfig(**TINY))
    ms.load_param_into_net(plain, {p.name: p for p in registered.get_parameters()})
    tokens = ms.Tensor(np.arange(34, dtype=np.int32).reshape(2, 17) * 7 % TINY["vocab_size"])
    for model in (registered, plain):
        model.set_train(False)
    np.testing.assert_array_equal(plain(tokens).asnumpy(), registered(tokens).asnumpy())
    for model in (registered, plain):
        model.set_train(True)
    ours, theirs = plain(tokens), registered(tokens)
    assert plain.train_outputs == len(ours) == 1 and len(theirs) == registered.train_outputs >= 3
    assert float(ours[0].asnumpy()) == float(theirs[0].asnumpy()) > 0
    assert not isinstance(plain.config, type(tiny_config)) and plain.config.to_dict() == tiny_config.to_dict()
