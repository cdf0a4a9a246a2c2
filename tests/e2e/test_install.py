"""`pip install .` and `pip install -e .` both register gpt_local when a fresh interpreter imports only
mindformers, and neither prints a setuptools warning.

Each install goes into a new virtual environment that sees this one's packages (MindSpore,
MindFormers ...) through a site dir of links, minus any installed copy of this project, so only the
install under test can provide gpt_local. pip reuses its cache for the build requirements.
"""
import os
import re
import subprocess
import sys
import sysconfig

import pytest

from conftest import REPO

CHECK = """
import sys
import mindformers
from mindformers.tools.register import MindFormerConfig, MindFormerModuleType, MindFormerRegister
from mindformers.core.context.build_context import MFContextOperator
import mindformers.core.context
MFContextOperator(MindFormerConfig(use_legacy=False))
config = MindFormerRegister.get_instance_from_cfg(
    {"model_type": "gpt_local", "architectures": ["GPTLocalForCausalLM"], "num_hidden_layers": 2,
     "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 64,
     "seq_length": 64}, MindFormerModuleType.CONFIG)
print("CONFIG", type(config).__name__, config.num_hidden_layers)
print("MODEL", "mcore_GPTLocalForCausalLM" in MindFormerRegister.registry[MindFormerModuleType.MODELS])
print("PREFLIGHT", getattr(mindformers.core.context.build_context, "gptlocal_wrapped", False))
print("FROM", sys.modules["mindformers_gptlocal"].__file__)
"""


def _inherited_site(tmp_path):
    """A folder of links to this environment's packages, without this project's installed files."""
    inherit = tmp_path / "inherit"
    inherit.mkdir()
    site = sysconfig.get_paths()["purelib"]
    for name in os.listdir(site):
        if name.startswith(("mindformers_gptlocal", "__editable__", "mindformers-gptlocal")):
            continue
        os.symlink(os.path.join(site, name), inherit / name)
    return inherit


@pytest.mark.parametrize("editable", [False, True], ids=["pip install .", "pip install -e ."])
def test_install_registers_gpt_local_for_mindformers(tmp_path, editable):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "inherit.pth"), "w", encoding="utf-8") as handle:
        handle.write(f"import site; site.addsitedir({str(_inherited_site(tmp_path))!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                              *(["-e"] if editable else []), REPO], capture_output=True, text=True, env=env,
                             timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    warnings = re.findall(r"[A-Za-z]*Warning\b.*", install.stdout + install.stderr)  # setuptools' classes
    assert not warnings, install.stdout + install.stderr
    check = subprocess.run([python, "-c", CHECK], capture_output=True, text=True, cwd=str(tmp_path), env=env,
                           timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "CONFIG GPTLocalConfig 2" in check.stdout and "MODEL True" in check.stdout, check.stdout + check.stderr
    assert "PREFLIGHT True" in check.stdout, check.stdout
    source = check.stdout.split("FROM ", 1)[1].strip()
    if editable:
        assert source == os.path.join(REPO, "mindformers_gptlocal", "__init__.py")
    else:
        assert source.startswith(purelib), source
