"""The PEFT registry (``mindformers_gptlocal/peft``): one entry per method, the generic code (parameter table,
sharding rules, freezing, checkpoint checks) asks it and names no method, and the settings side runs without
MindSpore (``gptlocal plan`` / ``convert``)."""
import subprocess
import sys
from collections import namedtuple

import pytest

from mindformers_gptlocal import peft
from mindformers_gptlocal.errors import ConfigError
from mindformers_gptlocal.model.params import parameter_table
from mindformers_gptlocal.parallel.sharding import MP, OpRule
from mindformers_gptlocal.peft.base import Method, PetSpec, check_trainable

MODEL = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=64)


def test_each_pet_type_has_one_method_and_an_unknown_one_is_one_clear_error():
    assert peft.PET_TYPES == ("lora", "adapter", "prefixtuning", "ptuning2")
    assert [peft.method_of(t) for t in peft.PET_TYPES] == [peft.METHODS[0], peft.METHODS[1], peft.METHODS[2],
                                                          peft.METHODS[2]]
    with pytest.raises(ConfigError, match=r"pet_type 'ia3' is not supported by gpt_local; use pet_type: lora or "
                                          r"adapter or prefixtuning or ptuning2\."):
        peft.read({"pet_type": "ia3"}, 2)
    assert peft.read(None, 2) is None and peft.read({}, 2) is None


@pytest.mark.parametrize("pet,owned", [
    (dict(pet_type="lora", target_modules=".*linear_qkv", freeze_include=["*"], freeze_exclude=["*lora*"]),
     "model.layers.1.attention.linear_qkv.lora_b"),
    (dict(pet_type="adapter", bottleneck_size=8), "model.layers.0.mlp_adapter.linear_up.weight"),
    (dict(pet_type="ptuning2", pre_seq_len=3), "model.prefix_encoder.embedding"),
])
def test_a_methods_tensors_are_its_own_and_only_they_train(pet, owned):
    spec = peft.read(pet, MODEL["num_hidden_layers"], MODEL["max_position_embeddings"])
    table = parameter_table(dict(MODEL, pet_config=pet))
    own = sorted(n for n in table if peft.is_pet_name(n))
    assert owned in own and all(peft.method_of(pet["pet_type"]).owns(n) for n in own)
    assert sorted(check_trainable(spec, list(table))) == own  # the base is frozen, the method's tensors train


ToySpec = namedtuple("ToySpec", "width")


class Toy(ToySpec, PetSpec):
    """A made-up method (a per-layer vector after the MLP): what a new method adds, in one module."""
    __slots__ = ()
    pet_type = "toy"
    freeze_include, freeze_exclude = ["*"], ["*toy*"]

    def layer_rules(self, index, act, arch):
        return [OpRule("toy.mul", (act, (MP,)), {1: "toy.scale"})]

    def param_shapes(self, d, base):
        return {f"model.layers.{i}.toy.scale": (self.width,) for i in range(d["layers"])}


def test_a_new_method_is_one_registry_entry_away(monkeypatch):
    """Registered once, a method's tensors reach the parameter table (shapes, stages, layouts from its rules) and
    the checkpoint check, with no other file changed."""
    toy = Method(("toy",), lambda pet, layers, positions=None: Toy(pet["width"]), lambda n: ".toy." in n,
                 lambda name: f"a toy tensor {name}")
    monkeypatch.setattr(peft, "METHODS", peft.METHODS + (toy,))
    monkeypatch.setattr(peft, "PET_TYPES", peft.PET_TYPES + ("toy",))
    table = parameter_table(dict(MODEL, pet_config={"pet_type": "toy", "width": 32}))
    assert table["model.layers.1.toy.scale"].shape == (32,) and table["model.layers.1.toy.scale"].layout == ("mp",)
    assert peft.is_pet_name("model.layers.0.toy.scale") and not peft.is_pet_name("model.layers.0.mlp.linear_fc1.weight")


def test_the_settings_side_runs_without_mindspore():
    code = ("import sys; import mindformers_gptlocal.peft, mindformers_gptlocal.model.params as p; "
            "p.parameter_table(dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, "
            "pet_config=dict(pet_type='adapter', bottleneck_size=8))); "
            "assert 'mindspore' not in sys.modules, 'mindspore loaded'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name,pattern", [
    ("model.prefix_encoder.embedding", r"holds a prefix-tuning prefix \(e.g. 'model.prefix_encoder.embedding'\), .*"
                                       r"convert ms2hf --peft"),
    ("model.layers.0.mlp_adapter.linear_up.weight", r"holds bottleneck adapters \(pet_type: adapter, e.g. "
                                                    r"'model.layers.0.mlp_adapter.linear_up.weight'\), which cannot be "
                                                    r"folded"),
])
def test_lora_merge_refuses_another_methods_tensors_by_that_methods_words(tmp_path, name, pattern):
    """``gptlocal lora merge`` / the PEFT LoRA export ask the registry which tensors they cannot take."""
    import numpy as np
    from mindformers_gptlocal.checkpoint.lora import adapter_tensors
    from mindformers_gptlocal.errors import CheckpointError
    from mindformers_gptlocal.safetensors_io import write_safetensors
    path = tmp_path / "model.safetensors"
    write_safetensors(str(path), {name: np.zeros((2, 2), np.float32),
                                  "model.layers.0.attention.linear_qkv.lora_a": np.zeros((2, 2), np.float32)})
    with pytest.raises(CheckpointError, match=pattern):
        adapter_tensors(str(path))
