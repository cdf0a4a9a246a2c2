"""Resumes that would go wrong are refused with one clear error, and a full disk loses nothing.

One tiny run stopped at step N of 2N (saving every step) is made once; each test works on its own
copy of it: a YAML that changed what the run is, a disk that fills up during a save (a file-size
limit, RLIMIT_FSIZE, on the resumed process), and a run resumed after it already finished.
"""
import os
import shutil

import pytest

from mindformers_gptlocal import yaml_io
from mindformers_gptlocal.checkpoint import manifest as ckpt_manifest
from conftest import Launch, launch_in_process, run_launcher, step_losses
from conftest import snapshot, write_yaml

N = 3



@pytest.fixture(scope="module")
def stopped_run(corpus, tmp_path_factory):
    """(folder, yaml) of a run stopped after N of its 2N steps, and its uninterrupted losses."""
    tmp = tmp_path_factory.mktemp("stopped")
    yaml_path = write_yaml(tmp, corpus, train_dataset__data_loader__num_samples=8 * N)
    code, out = run_launcher(["--config", yaml_path, "--runner_config.stop_step", str(N)], cwd=str(tmp))
    assert code == 0, out[-3000:]
    assert len(step_losses(out)) == N
    return tmp


def _copy(stopped_run, tmp_path):
    shutil.copytree(stopped_run, tmp_path / "run")
    config = yaml_io.load_yaml(str(tmp_path / "run" / "run.yaml"))
    config["output_dir"] = str(tmp_path / "run" / "output")
    yaml_io.dump_yaml(config, str(tmp_path / "run" / "run.yaml"))
    return tmp_path / "run"


def _resume(run, *flags, **popen):
    return run_launcher(["--config", str(run / "run.yaml"), "--resume_training", "True", *flags], cwd=str(run),
                        **popen)


def _resume_refused(run, capsys, monkeypatch, *flags):
    """A resume the pre-flight refuses, in this process (conftest.launch_in_process: no subprocess start)."""
    return launch_in_process(["--config", str(run / "run.yaml"), "--resume_training", "True", *flags], str(run),
                             capsys, monkeypatch)


def test_changed_batch_size_and_data_are_refused_naming_each_key(stopped_run, tmp_path, corpus, capsys, monkeypatch):
    run = _copy(stopped_run, tmp_path)
    before = snapshot(run / "output" / "checkpoint")
    code, out = _resume_refused(run, capsys, monkeypatch, "--runner_config.batch_size", "2",
                                "--train_dataset.batch_size", "2", "--train_dataset_dir", corpus["eval_mindrecord"])
    assert code == 2, out[-3000:]
    assert "Traceback" not in out
    assert "runner_config.batch_size is 2 now but was 4" in out, out[-2000:]
    assert "train_dataset.data_loader.dataset_dir is" in out and "eval" in out
    assert "global batch size is 2 now but was 4" in out
    assert snapshot(run / "output" / "checkpoint") == before


def test_changed_model_size_is_refused_before_anything_is_built(stopped_run, tmp_path, capsys, monkeypatch):
    run = _copy(stopped_run, tmp_path)
    code, out = _resume_refused(run, capsys, monkeypatch, "--model.model_config.num_hidden_layers", "3")
    assert code == 2 and "Traceback" not in out, out[-3000:]
    assert "model.model_config.num_hidden_layers is 3 now but was 2" in out, out[-2000:]


def _run_limited(run, limit, *flags):
    """The resume in a process whose files may not grow past ``limit`` bytes (RLIMIT_FSIZE: a full disk)."""
    return Launch(["--config", str(run / "run.yaml"), "--resume_training", "True", *flags], cwd=str(run),
                  file_size_limit=limit).result()


@pytest.fixture(scope="module")
def full_disk_then_resumed(stopped_run, tmp_path_factory):
    """A copy of the stopped run resumed with a disk that fills up during its first save (refused, nothing
    changed), then resumed again with space: it trains to the end. test_resuming_a_finished_run_is_one_clear_line
    starts from this finished run (the refused attempt left the checkpoint folder byte for byte as it was, which
    the full-disk test asserts), so the resume to the end is launched once for both tests."""
    run = _copy(stopped_run, tmp_path_factory.mktemp("full_disk"))
    folder = run / "output" / "checkpoint"
    size = ckpt_manifest.read_manifest(str(folder))[-1]["bytes"]
    before = snapshot(folder)
    limited = _run_limited(run, size // 2)
    after_refusal = snapshot(folder)
    foreign = _foreign_checkpoints(folder)
    resumed = _resume(run)
    return {"run": run, "folder": folder, "size": size, "before": before, "limited": limited,
            "after_refusal": after_refusal, "resumed": resumed, "foreign": foreign}


def _foreign_checkpoints(folder):
    """Two checkpoints of other runs beside the stopped run's, named like its own and older than all: one no
    manifest lists, one listed with another run_id. MindSpore's rotation removed the folder's oldest file."""
    newest = ckpt_manifest.read_manifest(str(folder))[-1]
    prefix = newest["file"].rsplit("-", 1)[0]
    foreign = {}
    for name, run_id in ((f"{prefix}-9_1.safetensors", None), (f"{prefix}-9_0.safetensors", "another-run")):
        shutil.copyfile(folder / newest["file"], folder / name)
        os.utime(folder / name, (1, 1))
        if run_id:
            ckpt_manifest.record(str(folder), str(folder / name), 0, run_id=run_id)
        foreign[name] = snapshot(folder)[name]
    return foreign


def test_full_disk_during_a_save_keeps_the_previous_checkpoint_and_stops_clearly(full_disk_then_resumed):
    folder, size = full_disk_then_resumed["folder"], full_disk_then_resumed["size"]
    code, out = full_disk_then_resumed["limited"]
    assert code == 2, out[-3000:]
    assert "Traceback" not in out.split("gptlocal run: error:")[-1]
    message = out.split("gptlocal run: error:")[-1]
    assert f"(step {N + 1}) could not be written to {folder}" in message, message
    assert f"about {size / 1e6:,.1f} MB" in message and "previous checkpoint" in message
    # no partial file left, manifest and files unchanged
    assert full_disk_then_resumed["after_refusal"] == full_disk_then_resumed["before"]
    # and the run resumes from that checkpoint once there is space
    code, out = full_disk_then_resumed["resumed"]
    assert code == 0, out[-3000:]
    assert f"(step {N})" in out
    # keep_checkpoint_max (2) kept the run's newest two; the other runs' files are untouched
    entries = ckpt_manifest.read_manifest(str(folder))
    assert sorted(e["step"] for e in entries if e.get("run_id") != "another-run") == [2 * N - 1, 2 * N], entries
    files = snapshot(folder)
    assert {name: files.get(name) for name in full_disk_then_resumed["foreign"]} == \
        full_disk_then_resumed["foreign"]
    assert len([name for name in files if name.endswith(".safetensors")]) == 4, sorted(files)


def test_full_disk_with_on_save_error_continue_trains_on(stopped_run, tmp_path):
    run = _copy(stopped_run, tmp_path)
    config = yaml_io.load_yaml(str(run / "run.yaml"))
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalCheckpointMonitor":
            callback["on_save_error"] = "continue"
    yaml_io.dump_yaml(config, str(run / "run.yaml"))
    folder = run / "output" / "checkpoint"
    before = snapshot(folder)
    code, out = _run_limited(run, ckpt_manifest.read_manifest(str(folder))[-1]["bytes"] // 2)
    assert code == 0, out[-3000:]
    assert len(step_losses(out)) == N  # every remaining step trained
    assert out.count("on_save_error: continue") == N
    assert snapshot(folder) == before


def test_resuming_a_finished_run_is_one_clear_line(full_disk_then_resumed):
    run = full_disk_then_resumed["run"]  # the stopped run, resumed to its end
    code, out = full_disk_then_resumed["resumed"]
    assert code == 0, out[-3000:]
    assert len(step_losses(out)) == N and f"step {2 * N}/{2 * N}" in out, out[-3000:]
    before = snapshot(run / "output")
    code, out = _resume(run)
    assert code == 2, out[-3000:]
    assert "Traceback" not in out and "initial_epoch" not in out
    assert f"training already complete at step {2 * N} of {2 * N}" in out, out[-2000:]
    assert "raise runner_config.epochs or pass a new output_dir" in out
    after = snapshot(run / "output")
    assert {k: v for k, v in after.items() if "log" not in k} == {k: v for k, v in before.items() if "log" not in k}


# --- many ranks: which step every rank resumes from (files made here, no training) ----------------------------

def _rank_checkpoints(root, steps_per_rank, run=None):
    """checkpoint/rank_<r>/ folders holding whole, manifest-recorded files at the given steps."""
    import numpy as np
    from safetensors.numpy import save_file
    for rank, steps in steps_per_rank.items():
        folder = root / f"rank_{rank}"
        folder.mkdir(parents=True)
        for step in steps:
            path = folder / f"gpt_local_rank_{rank}-1_{step}.safetensors"
            save_file({"step_num": np.array(step, np.int32), "epoch_num": np.array(1, np.int32),
                       "w": np.full(4, rank, np.float32)}, str(path))
            ckpt_manifest.record(str(folder), str(path), step, run=run)


def test_ranks_resume_from_the_newest_step_all_hold(tmp_path):
    from mindformers_gptlocal.checkpoint.resume import common_rank_checkpoint
    _rank_checkpoints(tmp_path, {0: [2, 3, 4], 1: [2, 3]})  # rank 1 died before its step-4 save finished
    notes = []
    name, step, info = common_rank_checkpoint(str(tmp_path), 1, log=notes.append)
    assert (name, step, info["step_num"]) == ("gpt_local_rank_1-1_3.safetensors", 3, 3)
    assert any("rank 0 has a newer checkpoint (step 4)" in note for note in notes), notes


def test_a_rank_without_the_step_or_its_folder_is_named(tmp_path):
    from mindformers_gptlocal.checkpoint.resume import common_rank_checkpoint
    from mindformers_gptlocal.errors import CheckpointError
    _rank_checkpoints(tmp_path, {0: [4], 1: [2]})
    with pytest.raises(CheckpointError, match=r"share no complete checkpoint step \(newest per rank: \{'0': 4, "
                                              r"'1': 2\}\)"):
        common_rank_checkpoint(str(tmp_path), 0, log=lambda _: None)
    with pytest.raises(CheckpointError, match="rank 1 has no complete checkpoint at step 4"):
        common_rank_checkpoint(str(tmp_path), 0, wanted="gpt_local_rank_0-1_4.safetensors", log=lambda _: None)
    with pytest.raises(CheckpointError, match="rank 2 has no checkpoint folder"):
        common_rank_checkpoint(str(tmp_path), 2, log=lambda _: None)
    # a damaged file does not count as held
    (tmp_path / "rank_1" / "gpt_local_rank_1-1_2.safetensors").write_bytes(b"x" * 10)
    with pytest.raises(CheckpointError, match="share no complete checkpoint step"):
        common_rank_checkpoint(str(tmp_path), 0, log=lambda _: None)
