"""Crash-safe checkpoints: SIGKILL training at seeded random moments, many of them inside a save.

Every save is slowed (the monitor's ``test_save_delay``) so kills often land between writing a checkpoint's
temp file and renaming it. After each kill there must be a newest complete checkpoint that
verifies and loads; at the end a resumed run finishes and its last losses equal an
uninterrupted run's. Bounded: at most KILLS kills and BUDGET_S seconds of killing.
"""
import os
import random
import shutil
import signal
import time

import pytest

from mindformers_gptlocal.checkpoint import manifest as ckpt_manifest
from mindformers_gptlocal.errors import CheckpointError
from mindformers_gptlocal.checkpoint.resume import find_resume_checkpoint, resume_info
from conftest import SHARED_CHANGES, SHARED_STEPS, run_launcher, start_run, step_losses, uninterrupted_run
from conftest import write_yaml

STEPS = SHARED_STEPS  # dropout on: conftest's shared YAML, whose uninterrupted losses test_stop_signals uses too
KILLS = 4
BUDGET_S = 150


def _start(yaml_path, cwd, resume, log_path):
    args = ["--config", yaml_path]
    if resume:
        args += ["--resume_training", "True"]
    log = open(log_path, "w")
    return start_run(args, cwd, log), log


def _wait_for_training(proc, log_path, deadline):
    """Until the first step line (compile done) or the process ends."""
    while time.time() < deadline and proc.poll() is None:
        with open(log_path) as handle:
            if "[gptlocal] step" in handle.read():
                return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def killed_run(corpus, tmp_path_factory):
    """Train with repeated SIGKILLs; returns (yaml, cwd, output checkpoint dir, kill records)."""
    tmp = tmp_path_factory.mktemp("crash")
    yaml_path = write_yaml(tmp, corpus, save_delay=0.15, **SHARED_CHANGES)
    ckpt_dir = str(tmp / "output" / "checkpoint")
    rng = random.Random(7)
    records, start = [], time.time()
    while len(records) < KILLS and time.time() - start < BUDGET_S:
        resume = bool(ckpt_manifest.read_manifest(ckpt_dir))
        log_path = str(tmp / f"kill{len(records)}.log")
        proc, log = _start(yaml_path, str(tmp), resume, log_path)
        _wait_for_training(proc, log_path, time.time() + 120)
        time.sleep(rng.uniform(0.0, 1.5))
        finished = proc.poll() is not None
        if not finished:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
        if finished:
            break  # training ended before the kill: nothing left to interrupt
        partials = [n for n in os.listdir(ckpt_dir) if n.startswith(ckpt_manifest.PARTIAL_PREFIX)] \
            if os.path.isdir(ckpt_dir) else []
        try:
            step = int(find_resume_checkpoint(ckpt_dir, log=lambda _: None)[1]["step_num"])
        except CheckpointError:
            assert not records or records[-1]["step"] == 0, records  # killed before the very first save
            step = 0
        records.append({"resumed": resume, "step": step, "partial_left": bool(partials)})
    print("\n[crash test] kills:", records)
    return yaml_path, str(tmp), ckpt_dir, records


def test_each_kill_leaves_a_complete_checkpoint(killed_run):
    _, _, ckpt_dir, records = killed_run
    assert len(records) >= 3, records
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and steps[-1] > steps[0], records  # training advanced across kills
    for entry in ckpt_manifest.read_manifest(ckpt_dir):
        if os.path.exists(os.path.join(ckpt_dir, entry["file"])):
            assert ckpt_manifest.verify(ckpt_dir, entry) is None


def test_resume_after_kills_finishes_like_an_uninterrupted_run(killed_run, corpus, tmp_path, tmp_path_factory):
    yaml_path, cwd, _, records = killed_run
    code, out = run_launcher(["--config", yaml_path, "--resume_training", "True"], cwd=cwd)
    assert code == 0, out[-3000:]
    resumed = step_losses(out)
    assert resumed and f"step {STEPS}/{STEPS}" in out, out[-3000:]

    code, ref = uninterrupted_run(tmp_path_factory, corpus, yaml_path)  # (its checkpoint monitor left out)
    assert code == 0, ref[-3000:]
    reference = step_losses(ref)
    assert len(reference) == STEPS and resumed == reference[-len(resumed):], (resumed, reference)


def test_truncated_and_temp_files_are_never_resumed(killed_run, tmp_path):
    _, _, ckpt_dir, _ = killed_run
    copy = str(tmp_path / "ckpt")
    shutil.copytree(ckpt_dir, copy)
    entries = ckpt_manifest.read_manifest(copy)
    assert len(entries) >= 2
    newest, previous = entries[-1], entries[-2]
    with open(os.path.join(copy, newest["file"]), "r+b") as handle:  # a torn write under the final name
        handle.truncate(newest["bytes"] // 2)
    with open(os.path.join(copy, ckpt_manifest.PARTIAL_PREFIX + "99-x.safetensors"), "wb") as handle:
        handle.write(b"\0" * 100)
    notes = []
    path, info = find_resume_checkpoint(copy, log=notes.append)
    assert os.path.basename(path) == previous["file"] and info["step_num"] == previous["step"]
    assert any("ignoring unfinished temp file" in n for n in notes)
    assert any(newest["file"] in n and "size" in n for n in notes)

    # Without a manifest (MindFormers' stock CheckpointMonitor) the header check still refuses the torn file.
    os.remove(os.path.join(copy, ckpt_manifest.MANIFEST))
    path, _ = find_resume_checkpoint(copy, log=notes.append)
    assert os.path.basename(path) == previous["file"]
    with pytest.raises(CheckpointError, match="truncated"):
        resume_info(os.path.join(copy, newest["file"]))


def test_a_flipped_byte_of_the_same_length_is_a_checksum_mismatch(killed_run, tmp_path):
    """Bit rot keeps the file's length: only the SHA-256 in the manifest can tell, and resume must take the
    previous entry instead."""
    _, _, ckpt_dir, _ = killed_run
    copy = str(tmp_path / "ckpt")
    shutil.copytree(ckpt_dir, copy)
    entries = ckpt_manifest.read_manifest(copy)
    newest, previous = entries[-1], entries[-2]
    path = os.path.join(copy, newest["file"])
    with open(path, "r+b") as handle:
        handle.seek(newest["bytes"] - 3)  # inside the last tensor's data: the header stays valid
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))
    assert os.path.getsize(path) == newest["bytes"]
    assert ckpt_manifest.verify(copy, newest) == "checksum differs from the manifest"
    notes = []
    found, info = find_resume_checkpoint(copy, log=notes.append)
    assert os.path.basename(found) == previous["file"] and info["step_num"] == previous["step"]
    assert any(newest["file"] in n and "checksum" in n for n in notes), notes
