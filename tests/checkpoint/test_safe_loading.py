"""No pickle from a user-provided path is ever unpickled without an explicit opt-in.

Each test hands a pickle whose loading would create a marker file (code execution) to one of our
loading routes and checks that it is refused with a clear error and the marker never appears.
"""
import json
import os
import pickle
import re

import pytest

from mindformers_gptlocal.errors import CheckpointError, GPTLocalError
from conftest import REPO, tiny_yaml


class _Payload:
    """Unpickling this runs open(marker, 'w'): proof that a loader executed code from the file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _evil(path, marker):
    with open(path, "wb") as handle:
        pickle.dump({"wte.weight": _Payload(str(marker))}, handle)
    return str(path)


def test_training_routes_refuse_a_pickle_checkpoint(tmp_path, corpus):
    from mindformers_gptlocal.cli.launcher import load_config
    from mindformers_gptlocal.mf.run_yaml import preflight
    marker = tmp_path / "pwned"
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    routes = {"file": _evil(tmp_path / "pytorch_model.bin", marker),
              "folder": os.path.dirname(_evil(model_dir / "pytorch_model.bin", marker)),
              "renamed": _evil(tmp_path / "weights.safetensors", marker)}
    for name, path in routes.items():
        for mode, extra in (("finetune", []), ("train", ["--resume_training", "True"]), ("eval", [])):
            yaml_path = tiny_yaml(tmp_path, corpus=corpus, run_mode=mode)
            config = load_config(["--config", yaml_path, "--load_checkpoint", path, *extra])
            with pytest.raises(GPTLocalError):
                preflight(config, log=lambda _: None)
            assert not marker.exists(), f"{name}/{mode} executed the pickle"


def test_weights_reader_refuses_a_pickle(tmp_path):
    from mindformers_gptlocal.safetensors_io import read_safetensors
    from mindformers_gptlocal.checkpoint.resume import resume_info
    marker = tmp_path / "pwned"
    path = _evil(tmp_path / "model.safetensors", marker)
    with pytest.raises(CheckpointError):
        read_safetensors(path)
    with pytest.raises(CheckpointError):
        resume_info(path)
    assert not marker.exists()


def test_convert_needs_allow_pickle_for_a_pickle(tmp_path):
    from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms
    marker = tmp_path / "pwned"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 8, "n_embd": 4, "n_layer": 1,
                                                "n_head": 1, "n_positions": 8}))
    _evil(hf / "pytorch_model.bin", marker)
    with pytest.raises(CheckpointError, match="--allow-pickle"):
        hf_to_ms(str(hf), str(tmp_path / "out"))
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_source_has_no_unguarded_unpickling():
    """Audit: the only unpickling call is the HF converter's torch.load, weights-only unless --allow-pickle."""
    package = os.path.join(REPO, "mindformers_gptlocal")
    found = []
    for root, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(root, name), encoding="utf-8").read()
                for pattern in (r"pickle\.loads?\(", r"allow_pickle\s*=\s*True", r"torch\.load\(", r"dill\.",
                                r"joblib\.load", r"trust_remote_code\s*=\s*True"):
                    found += [(name, m.group(0)) for m in re.finditer(pattern, text)]
    assert found == [("weights_io.py", "torch.load(")], found
    text = open(os.path.join(package, "checkpoint", "weights_io.py"), encoding="utf-8").read()
    assert "weights_only=not allow_pickle" in text
