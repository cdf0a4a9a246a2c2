"""A training run never lands silently on an earlier one in its output_dir (checkpoints or a model directory): the
pre-flight refuses it, naming the newest checkpoint and step and the choices, and writes nothing; ``--resume_training
True`` continues it; ``overwrite_output_dir: True`` removes the earlier run first (rank 0 all of it, every other rank
its own folder). Made-up files here, no training: the launches that train are in tests/e2e/test_stop_signals.py."""
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import launch_in_process, snapshot, tiny_yaml
from mindformers_gptlocal import yaml_io
from mindformers_gptlocal.checkpoint import manifest as ckpt_manifest
from mindformers_gptlocal.checkpoint.resume import earlier_run
from mindformers_gptlocal.mf.run_yaml import start_over



def _checkpoints(folder, steps, listed=True):
    folder.mkdir(parents=True, exist_ok=True)
    for step in steps:
        path = folder / f"gpt_local-1_{step}.safetensors"
        save_file({"step_num": np.array(step, np.int32), "w": np.zeros(4, np.float32)}, str(path))
        if listed:
            ckpt_manifest.record(str(folder), str(path), step)


def _model_dir(path):
    path.mkdir(parents=True)
    save_file({"w": np.zeros(4, np.float32)}, str(path / "model.safetensors"))


def test_what_an_earlier_run_left_is_found_the_same_by_every_rank(tmp_path):
    out = tmp_path / "out"
    assert earlier_run(str(out)) is None
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / f"{ckpt_manifest.PARTIAL_PREFIX}1-gpt_local-1_9.safetensors").write_bytes(b"x")
    (out / "log").mkdir()
    assert earlier_run(str(out)) is None  # an unfinished temp file and logs are no run
    _checkpoints(out / "checkpoint" / "rank_0", [4, 12])
    _checkpoints(out / "checkpoint" / "rank_1", [4, 12])
    found = earlier_run(str(out))
    assert (found.checkpoint, found.step, found.model_dirs) == (
        str(out / "checkpoint" / "rank_0" / "gpt_local-1_12.safetensors"), 12, [])
    _model_dir(out / "final")
    assert earlier_run(str(out), ("model", "final")).model_dirs == [str(out / "final")]
    model_only = tmp_path / "model_only"
    _model_dir(model_only / "model")
    found = earlier_run(str(model_only))
    assert (found.checkpoint, found.step, found.model_dirs) == (None, None, [str(model_only / "model")])


@pytest.fixture
def earlier(corpus, tmp_path):
    """A tiny training YAML whose output_dir holds an earlier run: checkpoints at steps 3 and 6 (one recorded in the
    manifest, one from MindFormers' stock monitor: named only) and its model directory."""
    yaml_path = tiny_yaml(tmp_path, corpus=corpus)
    out = tmp_path / "output"
    _checkpoints(out / "checkpoint", [3])
    _checkpoints(out / "checkpoint", [6], listed=False)
    _model_dir(out / "model")
    return yaml_path, out


def test_a_new_run_on_an_earlier_one_is_refused_naming_its_newest_checkpoint(earlier, tmp_path, capsys, monkeypatch):
    yaml_path, out = earlier
    before = snapshot(out)
    code, text = launch_in_process(["--config", yaml_path], str(tmp_path), capsys, monkeypatch)
    assert code == 2, text
    line = text.strip()
    assert "\n" not in line and "Traceback" not in line, text
    assert line.startswith(f"gptlocal run: error: output_dir {out} holds a training run: newest checkpoint "
                           f"{out / 'checkpoint' / 'gpt_local-1_6.safetensors'} (step 6), model directory "
                           f"{out / 'model'}"), line
    assert "--resume_training True" in line and "--overwrite_output_dir True" in line and "new --output_dir" in line
    assert snapshot(out) == before and sorted(os.listdir(out)) == ["checkpoint", "model"]  # nothing written


def test_overwrite_with_resume_loading_what_it_deletes_or_resuming_another_run_is_refused(earlier, tmp_path, capsys, monkeypatch):
    yaml_path, out = earlier
    before = snapshot(out)
    code, text = launch_in_process(["--config", yaml_path, "--overwrite_output_dir", "True", "--resume_training",
                                    "True"], str(tmp_path), capsys, monkeypatch)
    assert code == 2 and "resume_training and overwrite_output_dir are both set" in text, text
    code, text = launch_in_process(["--config", yaml_path, "--overwrite_output_dir", "True", "--load_checkpoint",
                                    str(out / "model")], str(tmp_path), capsys, monkeypatch)
    assert code == 2 and f"load_checkpoint {out / 'model'} is inside what overwrite_output_dir deletes" in text, text
    other = tmp_path / "other_run" / "checkpoint"  # resuming another run's checkpoints into this output_dir
    _checkpoints(other, [2])
    code, text = launch_in_process(["--config", yaml_path, "--resume_training", "True", "--load_checkpoint",
                                    str(other)], str(tmp_path), capsys, monkeypatch)
    assert code == 2 and f"output_dir {out} holds another training run: newest checkpoint " in text, text
    assert f"resuming {other} into it would replace its model directory" in text, text
    config = yaml_io.load_yaml(yaml_path)
    config["overwrite_output_dir"] = "yes"
    yaml_io.dump_yaml(config, yaml_path)
    code, text = launch_in_process(["--config", yaml_path], str(tmp_path), capsys, monkeypatch)
    assert code == 2 and "overwrite_output_dir is 'yes'; use True" in text, text
    assert snapshot(out) == before


class _Config(dict):
    __getattr__ = dict.get


def test_overwrite_removes_the_earlier_run_rank_0_all_other_ranks_their_own(tmp_path, monkeypatch):
    out = tmp_path / "out"
    for rank in (0, 1, 2):  # an earlier run of three ranks; this one has two
        _checkpoints(out / "checkpoint" / f"rank_{rank}", [5])
    _model_dir(out / "model")
    (out / "log").mkdir()
    config = _Config(run_mode="train", output_dir=str(out), overwrite_output_dir=True)
    lines = []
    monkeypatch.delenv("RANK_ID", raising=False)
    monkeypatch.setenv("MS_ROLE", "MS_SCHED")  # msrun's scheduler runs the launcher too: it removes nothing
    start_over(config, lines.append)
    assert earlier_run(str(out)).model_dirs == [str(out / "model")] and len(os.listdir(out / "checkpoint")) == 3
    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    monkeypatch.setenv("RANK_ID", "1")
    start_over(config, lines.append)
    assert sorted(os.listdir(out / "checkpoint")) == ["rank_0", "rank_2"] and not lines
    monkeypatch.setenv("RANK_ID", "0")
    start_over(config, lines.append)
    assert sorted(os.listdir(out)) == ["log"] and earlier_run(str(out)) is None
    assert len(lines) == 1 and lines[0].startswith(f"[gptlocal] overwrite_output_dir: removed the earlier run in "
                                                   f"{out} (newest checkpoint: step 5)"), lines
    start_over(_Config(config, overwrite_output_dir=False), lines.append)  # nothing to do: nothing said
    assert len(lines) == 1
