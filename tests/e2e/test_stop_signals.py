"""Stopping safely: SIGINT / SIGTERM during training finish the step, save a checkpoint, name it and the command that
resumes, and exit 130 / 143; the resumed run's losses equal an uninterrupted run's step for step (dropout on: its
state is in the checkpoint; shuffled data: its position too). The checkpoint monitor saves every 100,000 steps as
the shipped YAMLs do, so the checkpoint is the stop's own. Two-rank msrun runs: tests/e2e/test_msrun.py.

The slip after a Ctrl-C, the same line again without --resume_training, is refused before its first step, the
stopped run's files byte for byte as they were, and so is it on the finished run (both launchers);
--overwrite_output_dir True then starts over (tests/preflight/test_earlier_run.py: the same on made-up files)."""
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from conftest import SHARED_CHANGES, SHARED_STEPS, Launch, launch_in_process, snapshot, source_env, step_losses
from conftest import tiny_yaml, uninterrupted_run
from mindformers_gptlocal import yaml_io
from mindformers_gptlocal.checkpoint import manifest as ckpt_manifest

STEPS = SHARED_STEPS
SIGNAL_AFTER = 4  # the signal is sent once this step's line is out


def _yaml(folder, corpus, save_delay=0.0):
    folder.mkdir(exist_ok=True)
    path = tiny_yaml(folder, corpus=corpus, **SHARED_CHANGES)
    config = yaml_io.load_yaml(path)
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["per_print_times"] = 1
        if callback["type"] == "GPTLocalCheckpointMonitor":
            assert callback["save_checkpoint_steps"] == 100000 and callback["stop_on_signal"] is True
            if save_delay:
                callback["test_save_delay"] = save_delay
    return yaml_io.dump_yaml(config, path)


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """The run the stopped ones are compared with: conftest's uninterrupted_run, once for the session (the same YAML
    as test_crash_safe's and test_resume's MindRecord run)."""
    folder = tmp_path_factory.mktemp("stop") / "full"
    return uninterrupted_run(tmp_path_factory, corpus, _yaml(folder, corpus))


def _reference_losses(uninterrupted):
    code, full = uninterrupted
    assert code == 0, full[-3000:]
    losses = step_losses(full)
    assert len(losses) == STEPS
    return losses


def _interrupted(command, cwd, signum, again_after=None):
    """``command`` started in ``cwd``, sent ``signum`` once its step SIGNAL_AFTER is printed (and again
    ``again_after`` seconds later, if given); returns (exit code, output, seconds from the signal to the end)."""
    log_path = os.path.join(cwd, f"interrupted-{signum}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=cwd, env=source_env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            if re.search(rf"\[gptlocal\] step {SIGNAL_AFTER}/", open(log_path).read()):
                break
            time.sleep(0.05)
        assert proc.poll() is None, open(log_path).read()[-3000:]
        proc.send_signal(signum)
        sent = time.time()
        if again_after is not None:
            time.sleep(again_after)
            proc.send_signal(signum)
        code = proc.wait(300)
    return code, open(log_path).read(), time.time() - sent



REFUSED = "holds a training run: newest checkpoint "


def _stopped_at(out, signame):
    """(step, checkpoint file, resume command) from the stop's line."""
    found = re.search(rf"\[gptlocal\] stopped after step (\d+) \({signame}\): checkpoint (\S+); resume: (.+)$", out,
                      re.M)
    assert found, out[-3000:]
    return int(found.group(1)), found.group(2), found.group(3)


def test_sigint_during_gptlocal_run_saves_exits_130_and_resumes_exactly(corpus, tmp_path, uninterrupted, capsys,
                                                                       monkeypatch):
    """Ctrl-C through `gptlocal run`: the launcher holds the signals before MindSpore starts, so SIGINT is seen as
    SIGINT (MindSpore's own handler would turn it into SIGTERM); the printed command resumes it. The same line
    without --resume_training, on the stopped run and on the finished one, is refused with their files intact;
    --overwrite_output_dir True starts over."""
    yaml_path = _yaml(tmp_path / "part", corpus)
    code, out, _ = _interrupted([sys.executable, "-m", "mindformers_gptlocal.cli", "run", "--config", yaml_path],
                                str(tmp_path / "part"), signal.SIGINT)
    assert code == 130, out[-3000:]
    assert "[gptlocal] SIGINT: finishing the current step" in out and "Traceback" not in out, out[-3000:]
    step, saved, resume = _stopped_at(out, "SIGINT")
    assert SIGNAL_AFTER <= step < STEPS, out[-3000:]
    checkpoints = str(tmp_path / "part" / "output" / "checkpoint")
    entries = ckpt_manifest.read_manifest(checkpoints)
    assert [e["step"] for e in entries] == [step] and saved.endswith(entries[0]["file"]), entries  # the stop's own
    assert ckpt_manifest.verify(checkpoints, entries[0]) is None
    assert not os.path.exists(tmp_path / "part" / "output" / "model")  # a stopped run is not finished
    assert resume == f"gptlocal run --config {yaml_path} --resume_training True", resume

    losses = _reference_losses(uninterrupted)
    assert step_losses(out) == losses[:step]
    output = tmp_path / "part" / "output"
    for state in ("stopped", "finished"):  # the same line again, without --resume_training: refused, nothing lost
        before = snapshot(output, skip=("log",))
        code, refused = launch_in_process(["--config", yaml_path], str(tmp_path / "part"), capsys, monkeypatch)
        assert code == 2 and refused.count("\n") == 1, (state, refused)
        newest = entries[0]["file"] if state == "stopped" else f"{entries[0]['file'].split('-')[0]}-1_{STEPS}."
        assert f"output_dir {output} {REFUSED}{output / 'checkpoint' / newest}" in refused, (state, refused)
        assert snapshot(output, skip=("log",)) == before, state
        if state == "stopped":
            words = shlex.split(resume)
            assert words[:2] == ["gptlocal", "run"]
            code, resumed = Launch(words[2:], cwd=str(tmp_path / "part")).result()
            assert code == 0, resumed[-3000:]
            assert f"(step {step})" in resumed, resumed[-3000:]
            print(f"\n[stop test] SIGINT after step {step}: resumed losses {step_losses(resumed)} == uninterrupted "
                  f"{losses[step:]}")
            assert step_losses(resumed) == losses[step:]
            model = snapshot(output / "model")

    # starting over takes the word: the earlier run's checkpoints and model directory are replaced by the new run's
    code, again = Launch(["--config", yaml_path, "--overwrite_output_dir", "True", "--runner_config.stop_step", "2"],
                         cwd=str(tmp_path / "part")).result()
    assert code == 0, again[-3000:]
    assert f"[gptlocal] overwrite_output_dir: removed the earlier run in {output} (newest checkpoint: step {STEPS})" \
        in again, again[-3000:]
    assert step_losses(again) == losses[:2]
    entries = ckpt_manifest.read_manifest(str(output / "checkpoint"))
    assert [e["step"] for e in entries] == [2], entries
    assert [n for n in os.listdir(output / "checkpoint") if n.endswith(".safetensors")] == [entries[0]["file"]]
    assert snapshot(output / "model")["model.safetensors"] != model["model.safetensors"]


MINDFORMERS_LAUNCHER = """import sys
# The body of MindFormers' run_mindformer.py for a train run: config, --resume_training, output path, context, Trainer.
from mindformers.tools.register import MindFormerConfig
from mindformers.core.context import build_context
from mindformers.trainer import Trainer
from mindformers.utils.file_utils import set_output_path
config = MindFormerConfig(sys.argv[1])
if "--resume_training" in sys.argv:
    config.resume_training = True
set_output_path(config.output_dir)
build_context(config)
Trainer(config).train()
print("TRAINED")
"""


def test_sigterm_under_mindformers_own_launcher_saves_exits_143_and_resumes_exactly(corpus, tmp_path, uninterrupted):
    """SIGTERM (a scheduler's preemption) under MindFormers' own launcher: gpt_local's callback handles it there too;
    nothing after Trainer.train() runs, the process ends with 143. The launch again without --resume_training, on
    the stopped run and on the finished one, is refused (the pre-flight in build_context) with their files intact."""
    yaml_path = _yaml(tmp_path / "part", corpus)
    script = tmp_path / "run_mindformer.py"
    script.write_text(MINDFORMERS_LAUNCHER)
    code, out, _ = _interrupted([sys.executable, str(script), yaml_path], str(tmp_path / "part"), signal.SIGTERM)
    assert code == 143, out[-3000:]
    assert "TRAINED" not in out and "Traceback" not in out, out[-3000:]
    step, _, resume = _stopped_at(out, "SIGTERM")
    assert resume == f"python {script} {yaml_path} --resume_training True", resume

    losses = _reference_losses(uninterrupted)
    assert step_losses(out) == losses[:step]
    output = tmp_path / "part" / "output"
    for state in ("stopped", "finished"):  # the launch again without --resume_training: refused, nothing lost
        before = snapshot(output, skip=("log",))
        code, refused = Launch([yaml_path], cwd=str(tmp_path / "part"), script=script).result()
        assert code != 0 and "TRAINED" not in refused, (state, refused[-3000:])
        assert f"output_dir {output} {REFUSED}" in refused and "[gptlocal] step 1/" not in refused, refused[-3000:]
        assert snapshot(output, skip=("log",)) == before, state
        if state == "stopped":
            code, resumed = Launch([yaml_path, "--resume_training"], cwd=str(tmp_path / "part"),
                                   script=script).result()
            assert code == 0 and "TRAINED" in resumed, resumed[-3000:]
            print(f"\n[stop test] SIGTERM after step {step}: resumed losses {step_losses(resumed)} == uninterrupted "
                  f"{losses[step:]}")
            assert step_losses(resumed) == losses[step:]


def test_a_second_signal_stops_at_once_and_leaves_no_torn_checkpoint(corpus, tmp_path):
    """The stop's save is slowed to 20 s (the monitor's test_save_delay); a second SIGINT 1 s into it ends the
    process at once with 130: its temp file is not a checkpoint, and the next run removes it."""
    yaml_path = _yaml(tmp_path / "run", corpus, save_delay=20)
    code, out, seconds = _interrupted([sys.executable, "-m", "mindformers_gptlocal.cli", "run", "--config",
                                       yaml_path], str(tmp_path / "run"), signal.SIGINT, again_after=1.0)
    assert code == 130, out[-3000:]
    assert seconds < 10, seconds  # not the 20 s save
    assert "[gptlocal] SIGINT again: stopping now" in out and "stopped after step" not in out, out[-3000:]
    checkpoints = tmp_path / "run" / "output" / "checkpoint"
    assert not ckpt_manifest.read_manifest(str(checkpoints))
    assert [n for n in os.listdir(checkpoints) if n.startswith(ckpt_manifest.PARTIAL_PREFIX)]
