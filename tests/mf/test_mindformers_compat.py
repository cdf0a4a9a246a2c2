"""Every MindFormers/MindSpore patch checks its target: it passes on the installed MindFormers, and a stand-in
module with the target moved, renamed or re-signed fails the check naming the patch (no silent skip)."""
import importlib
import sys
import types
import warnings

import pytest

import mindformers  # noqa: F401  (registers gpt_local: the patches are applied)
from mindformers_gptlocal.mf import compat
from mindformers_gptlocal.errors import CompatError, ConfigError, GPTLocalCompatWarning, GPTLocalError

TARGETS = [(patch.name, index) for patch in compat.PATCHES for index in range(len(patch.targets))]


def test_written_for_the_installed_versions_and_every_patch_checks_out():
    import mindspore
    installed = {"mindformers": mindformers.__version__, "mindspore": mindspore.__version__}
    assert installed in compat.SUPPORTED and compat.WRITTEN_FOR == compat.SUPPORTED[0]
    assert compat.WRITTEN_FOR == {"mindformers": "1.9.0", "mindspore": "2.9.0"}  # the default install (setup.cfg)
    assert compat.check_all() == {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert compat.verify() == {}
        compat.require()
    assert not [w for w in caught if issubclass(w.category, GPTLocalCompatWarning)]
    assert len({p.name for p in compat.PATCHES}) == len(compat.PATCHES) >= 13


def _without(target):
    """import_module that hands out a stand-in for ``target.module`` lacking the target's last attribute."""
    real = importlib.import_module(target.module)
    if not target.attr:
        def missing(name):
            if name == target.module:
                raise ImportError(f"No module named {name!r}")
            return importlib.import_module(name)
        return missing
    parts = target.attr.split(".")
    stand_in = types.ModuleType(target.module)
    stand_in.__dict__.update({k: v for k, v in vars(real).items() if k != parts[0]})
    if len(parts) == 2:  # a class lacking one attribute: a copy of its (whole, inherited) namespace without it
        cls = getattr(real, parts[0])
        namespace = {k: v for c in reversed(cls.__mro__[:-1]) for k, v in vars(c).items()
                     if k not in (parts[1], "__dict__", "__weakref__")}
        setattr(stand_in, parts[0], type(cls.__name__, (), namespace))
    return lambda name: stand_in if name == target.module else importlib.import_module(name)


def _resigned(target):
    """import_module whose stand-in target takes one more parameter than the patch was written for."""
    real = importlib.import_module(target.module)
    parts = target.attr.split(".")

    def moved(*args, new_flag=None, **kwargs):
        return None
    stand_in = types.ModuleType(target.module)
    stand_in.__dict__.update(vars(real))
    if len(parts) == 1:
        setattr(stand_in, parts[0], moved)
    else:
        setattr(stand_in, parts[0], type(parts[0], (getattr(real, parts[0]),), {parts[1]: moved}))
    return lambda name: stand_in if name == target.module else importlib.import_module(name)


@pytest.mark.parametrize("name,index", TARGETS, ids=[f"{n}:{i}" for n, i in TARGETS])
def test_a_moved_target_fails_its_patch_by_name(name, index):
    patch = compat.BY_NAME[name]
    if not patch.applies():
        pytest.skip(f"'{name}' is for MindFormers {', '.join(patch.only)} only")
    target = patch.targets[index]
    assert compat.check_target(target) == []  # the installed one is where the patch expects it
    problems = compat.check_patch(patch, _without(target))
    assert problems, f"{name}: removing {target.module}.{target.attr} went unnoticed"
    spot = target.module + (f".{target.attr}" if target.attr else "")
    assert any(target.module in p for p in problems), problems
    text = compat.message(name, problems)
    assert f"'{name}'" in text and spot.split(".")[-1] in text
    assert "mindformers 1.9.0 + mindspore 2.9.0 (or 1.8.0 + 2.7.2)" in text
    if target.params is not None or target.includes:
        assert compat.check_patch(patch, _resigned(target)), f"{name}: a new signature went unnoticed"


def test_an_attribute_no_longer_assigned_is_noticed():
    """``assigns``: the instance attributes a patch reads must still be set by the target's source."""
    target = compat.Target("mindformers.core.callback.callback", "CheckpointMonitor.__init__",
                           assigns=("meta_json", "no_such_attribute"))
    problems = compat.check_target(target)
    assert problems == ["mindformers.core.callback.callback.CheckpointMonitor.__init__ no longer sets "
                        "self.no_such_attribute"]


def test_the_model_returns_as_many_losses_as_the_installed_mcore_step_unpacks(monkeypatch):
    """MindFormers 1.9's grads_for_mcore unpacks (lm_loss, mtp_loss, aux_loss, indexer_loss), 1.8's the first three:
    the model's training tuple follows the installed one, and a count that differs fails 'mcore training outputs'
    by name (unnoticed, it was MindSpore's "TupleGetItem evaluator index ... got 3" at the first compile)."""
    from mindformers.wrapper import wrapper as real
    assert compat.mcore_train_outputs("1.8.0") == 3 and compat.mcore_train_outputs("1.9.0") == 4
    assert compat.mcore_train_outputs("1.10.1") == 4 and compat.mcore_train_outputs("") == 3  # no MindFormers
    unpacked = 4 if mindformers.__version__.startswith("1.9.") else 3
    assert compat.mcore_train_outputs() == unpacked
    patch = compat.BY_NAME["mcore training outputs"]
    assert patch.required and compat.check_patch(patch) == []
    monkeypatch.setattr(compat, "mcore_train_outputs", lambda version=None: unpacked - 1)
    problems = compat.check_patch(patch)
    assert len(problems) == 1 and f"unpacks {unpacked} losses" in problems[0], problems
    assert f"returns {unpacked - 1}" in problems[0] and "mcore_train_outputs" in problems[0]
    monkeypatch.undo()

    class Starred(real.MFTrainOneStepCell):
        def grads_for_mcore(self, scaling_sens, *inputs):
            lm_loss, mtp_loss, *_ = self.network(*inputs)
            return lm_loss + mtp_loss, None, None
    stand_in = types.ModuleType(real.__name__)
    stand_in.__dict__.update(vars(real))
    stand_in.MFTrainOneStepCell = Starred
    problems = compat.check_patch(patch, lambda name: stand_in if name == real.__name__ else
                                  importlib.import_module(name))
    assert len(problems) == 1 and "no longer unpacks" in problems[0], problems


def test_the_model_training_tuple_has_the_installed_length():
    """The training construct itself (PYNATIVE, tiny): as many outputs as mcore_train_outputs, the loss first."""
    import numpy as np
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM  # MindFormers' classes (mf/model.py)
    from conftest import TINY
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    model.set_train(True)
    out = model(ms.Tensor(np.arange(17, dtype=np.int32).reshape(1, 17) % 100))
    assert len(out) == compat.mcore_train_outputs() == model.train_outputs and float(out[0].asnumpy()) > 0
    assert all(float(extra.asnumpy()) == 0.0 for extra in out[1:])


def test_a_version_scoped_patch_is_checked_and_applied_only_there():
    """'resume from a checkpoint file' is for MindFormers 1.9 (1.8 has no checkpoint_config migration): checked and
    applied there, neither checked nor warned about on 1.8."""
    patch = compat.BY_NAME["resume from a checkpoint file"]
    assert patch.only == ("1.9",) and patch.applies("1.9.0") and not patch.applies("1.8.0")
    from mindformers.trainer import trainer
    on_19 = mindformers.__version__.startswith("1.9.")
    assert getattr(trainer, "convert_checkpoint_config", None) is None or \
        getattr(trainer.convert_checkpoint_config, "gptlocal_wrapped", False) == on_19
    assert "resume from a checkpoint file" not in compat.check_all()


def test_a_gpt_local_resume_from_a_file_passes_mindformers_19_checkpoint_check(tmp_path):
    """MindFormers 1.9 refuses a resume whose load_checkpoint is a file ("checkpoint_path is not a directory"); for a
    gpt_local config the wrapped convert_checkpoint_config accepts it, another model's config is refused as before."""
    if not mindformers.__version__.startswith("1.9."):
        pytest.skip("MindFormers 1.9's checkpoint_config migration")
    from mindformers.tools.register import MindFormerConfig
    from mindformers.trainer import trainer, utils
    from conftest import CONFIGS
    weights = tmp_path / "gpt_local_rank_0-1_3.safetensors"
    weights.write_bytes(b"x")
    config = MindFormerConfig(f"{CONFIGS}/pretrain_gpt_local_tiny_cpu.yaml")
    config.load_checkpoint, config.resume_training, config.output_dir = str(weights), True, str(tmp_path)
    trainer.convert_checkpoint_config(config)
    assert config.checkpoint.load_path == str(weights) and utils.is_hf_checkpoint.__name__ == "is_hf_checkpoint"
    other = MindFormerConfig(**{"model": {"model_config": {"type": "LlamaConfig"}}, "load_checkpoint": str(weights),
                                "resume_training": True, "output_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="is not a directory"):
        trainer.convert_checkpoint_config(other)


def test_the_config_keeps_its_pet_and_parallel_config():
    """MindFormers 1.9's PretrainedConfig.__init__ assigns pet_config (None) and parallel_config (its default) itself:
    GPTLocalConfig's own values must survive it (LoRA was silently off, the layout the default one)."""
    from mindformers_gptlocal import GPTLocalConfig  # on MindFormers' PretrainedConfig (mf/model.py)
    from conftest import TINY
    lora = dict(pet_type="lora", lora_rank=4, lora_alpha=8, target_modules=".*linear_qkv", freeze_include=["*"],
                freeze_exclude=["*lora*"])
    config = GPTLocalConfig(**dict(TINY, pet_config=lora, parallel_config={"data_parallel": 2, "model_parallel": 1}))
    assert config.pet_spec() is not None and config.pet_spec().rank == 4
    assert config.parallel_config.data_parallel == 2


@pytest.fixture
def moved_patch(monkeypatch):
    """The process's verdict with one patch's target moved (as verify() on another MindFormers would find it)."""
    def move(name):
        monkeypatch.setitem(compat._STATE, "problems", {name: ["a.b is gone ('b' not found)"]})
        monkeypatch.setitem(compat._STATE, "warned", False)
    return move


def test_verify_warns_once_per_moved_patch_and_the_preflight_stops(moved_patch):
    moved_patch("finished run refused")
    with pytest.warns(GPTLocalCompatWarning, match="'finished run refused'.*a.b is gone"):
        compat.verify()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        compat.verify()
    assert not again
    from mindformers.tools.register import MindFormerConfig
    from mindformers_gptlocal.mf.run_yaml import preflight
    from conftest import CONFIGS
    config = MindFormerConfig(f"{CONFIGS}/pretrain_gpt_local_tiny_cpu.yaml")
    with pytest.raises(CompatError, match="'finished run refused'.*set `gptlocal_compat: warn` at the run YAML"):
        preflight(config)
    config.gptlocal_compat = "warn"  # the registration warning only: the pre-flight goes on to its other checks
    try:
        preflight(config)
    except CompatError:
        pytest.fail("gptlocal_compat: warn still stops the pre-flight at the moved patch")
    except GPTLocalError:
        pass  # a later check (the test's folder holds no run's data)
    config.gptlocal_compat = "lenient"
    with pytest.raises(ConfigError, match="gptlocal_compat: 'lenient' is not a mode; use strict .* or warn"):
        preflight(config)


def test_a_fallback_patch_does_not_stop_the_preflight(moved_patch):
    assert compat.BY_NAME["barrier users"].required is False
    moved_patch("barrier users")
    with pytest.warns(GPTLocalCompatWarning, match="falls back"):
        compat.require()
    assert not compat.ok("barrier users")


def test_checkpoint_rotation_needs_the_private_method():
    calls = []

    class Manager:
        def remove_oldest_ckpoint_file(self):
            calls.append("original")
    manager = Manager()
    original = compat.defer_checkpoint_rotation(manager, lambda: calls.append("deferred"))
    manager.remove_oldest_ckpoint_file()
    original()
    assert calls == ["deferred", "original"]
    with pytest.raises(CompatError, match="'deferred checkpoint rotation'.*object has no remove_oldest_ckpoint_file"):
        compat.defer_checkpoint_rotation(object(), lambda: None)


def test_every_loaded_mindformers_barrier_is_the_cpu_one():
    """No hand list to go stale: after registration no loaded mindformers module still binds MindSpore's barrier,
    and every listed user is among those found."""
    from mindspore.communication import comm_func
    assert getattr(comm_func.barrier, "gptlocal_wrapped", False)
    original = comm_func.barrier.__wrapped__
    assert compat.barrier_bound_modules(original) == []
    bound = compat.barrier_bound_modules(comm_func.barrier)
    assert set(compat.BARRIER_USERS) <= set(bound)


def test_the_registration_patches_are_in_place():
    import mindformers.core.context
    import mindformers.dataset.handler as handlers
    from mindformers.trainer import base_trainer
    from mindformers_gptlocal.mf.data_handler import GPTLocalInstructHandler
    assert all(getattr(m.build_context, "gptlocal_wrapped", False)
               for m in (mindformers, mindformers.core, mindformers.core.context))
    assert handlers.GPTLocalInstructHandler is GPTLocalInstructHandler
    assert getattr(base_trainer.check_runner_config, "gptlocal_wrapped", False)
    for name in ("_reset_wrapper_for_pipeline_parallel", "_reset_wrapper_for_grad_accu"):
        assert getattr(getattr(base_trainer.BaseTrainer, name), "gptlocal_wrapped", False)


def test_bleu_patch_notices_a_bleu_module_that_needs_more_of_nltk(tmp_path):
    """The .pth hook loads nltk's BLEU module under bare packages: that holds only while it imports nltk.util alone."""
    check = compat.BY_NAME["BLEU without nltk's package"].extra
    assert check(importlib.import_module) == []
    (tmp_path / "translate").mkdir()
    (tmp_path / "translate" / "bleu_score.py").write_text("import math\nfrom nltk.util import ngrams\n")
    assert check(importlib.import_module, str(tmp_path)) == []
    (tmp_path / "translate" / "bleu_score.py").write_text("from nltk.util import ngrams\nfrom nltk.tokenize import x\n")
    assert check(importlib.import_module, str(tmp_path)) == [
        "nltk.translate.bleu_score now imports nltk.tokenize, not only nltk.util"]
