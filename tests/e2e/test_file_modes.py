"""A trained model a server under another account can load: `gptlocal run` under umask 0022 writes the model
directory, the checkpoints and their folder readable by group and others (0644 / 0755), and under umask 0077 by
the owner only (0600 / 0700); MindSpore alone writes checkpoints 0400 in a 0700 folder, the safetensors writer the
model 0600."""
import os
import shlex
import stat
import sys

from conftest import Launch, write_yaml

STEPS = 3


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_training_run_writes_its_files_as_the_umask_says(corpus, tmp_path):
    runs = {}
    for mask in ("022", "077"):
        folder = tmp_path / mask
        yaml_path = write_yaml(folder, corpus, train_dataset__data_loader__num_samples=4 * STEPS)
        line = f"umask {mask} && exec {shlex.quote(sys.executable)} -m mindformers_gptlocal.cli run --config " \
               f"{shlex.quote(yaml_path)}"
        runs[mask] = (folder, Launch([], cwd=str(folder), command=["bash", "-c", line]))  # both run at once
    for mask, (folder, launch) in runs.items():
        code, out = launch.result()
        assert code == 0, out[-3000:]
        file_mode, dir_mode = (0o644, 0o755) if mask == "022" else (0o600, 0o700)
        model = folder / "output" / "model"
        checkpoints = folder / "output" / "checkpoint"
        saved = sorted(name for name in os.listdir(checkpoints) if name.endswith(".safetensors"))
        assert len(saved) == 2, os.listdir(checkpoints)  # keep_checkpoint_max 2 of the 3 saves
        assert _mode(model) == dir_mode and _mode(checkpoints) == dir_mode, mask
        for path in [model / name for name in os.listdir(model)] + [checkpoints / name for name in saved] + \
                [checkpoints / "manifest.json"]:
            assert _mode(path) == file_mode, (mask, path, oct(_mode(path)))
        readable_by_others = _mode(model / "model.safetensors") & 0o044 == 0o044
        assert readable_by_others == (mask == "022")
