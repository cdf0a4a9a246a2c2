"""The kernel provider (kernels/provider.py): ``model_config.cpu_kernels`` read and checked (one ConfigError naming
the key and the allowed values), the same key through config.json and ``from_model_dir(**overrides)``, each op's
choice by mode, device and parallel build, a ``plain`` model with no kernel anywhere, and no environment read to choose
one. The values of every fast path against the plain one: the kernels' own tests (test_*_kernel.py,
test_kv_write.py)."""
import glob
import json
import os

import mindspore as ms
import pytest
from mindspore import ops

import mindformers_gptlocal
from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.errors import ConfigError
from mindformers_gptlocal.kernels.provider import OPS, KernelProvider, read_cpu_kernels
from conftest import TINY

PACKAGE = os.path.dirname(mindformers_gptlocal.__file__)


def test_values_and_refusals():
    assert read_cpu_kernels(None) == read_cpu_kernels("auto") == dict.fromkeys(OPS, "auto")
    assert read_cpu_kernels("plain") == dict.fromkeys(OPS, "plain")
    assert read_cpu_kernels({"linear": "kernel"}) == dict(dict.fromkeys(OPS, "auto"), linear="kernel")
    with pytest.raises(ConfigError, match=r"model_config.cpu_kernels is 'fast'; set one of auto, kernel, plain"):
        read_cpu_kernels("fast")
    with pytest.raises(ConfigError, match=r"model_config.cpu_kernels is True"):
        read_cpu_kernels(True)
    with pytest.raises(ConfigError, match=r"model_config.cpu_kernels.flash is not an op; the ops are attention, "):
        read_cpu_kernels({"flash": "plain"})
    with pytest.raises(ConfigError, match=r"model_config.cpu_kernels.attention is 0; set one of auto, kernel, plain"):
        read_cpu_kernels({"attention": 0})
    with pytest.raises(ConfigError, match=r"model_config.cpu_kernels.layer_norm is 'off'"):
        GPTLocalConfig(**TINY, cpu_kernels={"layer_norm": "off"})


def test_the_key_through_config_json_and_overrides(tmp_path):
    config = GPTLocalConfig(**TINY, cpu_kernels={"attention": "plain"})
    assert config.to_dict()["cpu_kernels"] == {"attention": "plain"}
    with open(tmp_path / "config.json", "w", encoding="utf-8") as handle:
        json.dump(config.to_dict(), handle)
    assert GPTLocalConfig.from_model_dir(str(tmp_path)).cpu_kernels == {"attention": "plain"}
    assert GPTLocalConfig.from_model_dir(str(tmp_path), cpu_kernels="plain").cpu_kernels == "plain"
    del_key = {k: v for k, v in config.to_dict().items() if k != "cpu_kernels"}  # an older config.json
    with open(tmp_path / "config.json", "w", encoding="utf-8") as handle:
        json.dump(del_key, handle)
    assert GPTLocalConfig.from_model_dir(str(tmp_path)).cpu_kernels == "auto"


def test_choices_by_mode_device_and_parallel_build():
    auto = KernelProvider("auto", device_target="CPU")
    assert all(auto.uses(op) for op in OPS)
    assert not any(KernelProvider("plain", device_target="CPU").uses(op) for op in OPS)
    assert not any(KernelProvider("kernel", device_target="Ascend").uses(op) for op in OPS)
    assert isinstance(KernelProvider("auto", device_target="GPU").kv_write(), ops.ScatterNdUpdate)
    parallel = KernelProvider("auto", parallel=True, device_target="CPU")
    assert [op for op in OPS if parallel.uses(op)] == ["lora_dropout", "kv_write", "composed_ops"]
    assert parallel.linear_gemm(ms.float32) == (None, None) and parallel.layer_norm(1e-5, ms.float32) is None
    only = KernelProvider({"swiglu": "plain"}, device_target="CPU")
    assert [op for op in OPS if not only.uses(op)] == ["swiglu"]
    assert auto.linear_gemm(ms.float16) == (None, None) and auto.rms_norm(1e-6, ms.float32, ms.float16) is None


def _kernel_cells(model):
    """Names of the model's Cells and attributes that are gpt_local kernels (or choose one)."""
    found = []
    for name, cell in model.cells_and_names():
        for attr in ("kernel", "bias_gelu", "swiglu", "gemm", "decode_kernel"):
            if getattr(cell, attr, None) is not None:
                found.append(f"{name}.{attr}")
        if getattr(cell, "composed_tanh_gelu", False) or getattr(cell, "broadcast_bias", False):
            found.append(f"{name}.composed")
        if isinstance(getattr(cell, "scatter_update", None), ops.Custom):
            found.append(f"{name}.scatter_update")
    return found


@pytest.mark.parametrize("arch", [{}, dict(position_embedding_type="rope", normalization="RMSNorm", hidden_act="swiglu",
                                           add_bias_linear=False, num_query_groups=2)],
                         ids=["gpt2", "llama"])
def test_a_plain_model_has_no_kernel_anywhere(library, arch):
    pet = dict(pet_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.1, target_modules=".*linear_fc2",
               freeze_include=["*"], freeze_exclude=["*lora*"])
    fast = GPTLocalForCausalLM(GPTLocalConfig(**TINY, **arch, pet_config=pet))
    plain = GPTLocalForCausalLM(GPTLocalConfig(**TINY, **arch, pet_config=pet, cpu_kernels="plain"))
    assert _kernel_cells(fast) and plain.head_gemm is None
    assert _kernel_cells(plain) == []
    assert type(plain.model.layers[0].mlp.linear_fc2.lora_dropout).__name__ == "CounterDropout"
    assert type(fast.model.layers[0].mlp.linear_fc2.lora_dropout).__name__ == "CPULoRADropout"


def test_model_code_reads_no_environment():
    """The layers ask the provider; no file of model/, of the kernels' Cells or the provider reads an environment
    variable (build.py reads where the cache goes)."""
    readers = []
    kernels = glob.glob(os.path.join(PACKAGE, "kernels", "**", "*.py"), recursive=True)  # its sub-folders too
    for path in glob.glob(os.path.join(PACKAGE, "model", "*.py")) + kernels:
        if os.path.basename(path) == "build.py":
            continue
        text = open(path, encoding="utf-8").read()
        if "os.environ" in text or "getenv" in text:
            readers.append(os.path.relpath(path, PACKAGE))
    assert readers == [], readers
