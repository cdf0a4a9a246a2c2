"""Files as the umask says: what staging.write_folder and safetensors_io.atomic_write publish has the mode the
process's umask gives a new file (0644 under 0022, 0600 under 0077) or folder (0755 / 0700), whatever mode the
writer created it with (tempfile's 0600 / 0700, the safetensors writer's 0600, MindRecord's 0600)."""
import contextlib
import os
import stat
import tempfile

import numpy as np
import pytest

from mindformers_gptlocal import staging
from mindformers_gptlocal.errors import DataError
from mindformers_gptlocal.safetensors_io import read_safetensors, write_safetensors

MODES = {0o022: (0o644, 0o755), 0o077: (0o600, 0o700)}


@contextlib.contextmanager
def umask(mask):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("mask", sorted(MODES))
def test_umask_is_read_without_changing_it(mask):
    with umask(mask):
        assert staging.umask() == mask
        assert staging.umask() == mask  # still set
        assert staging.new_mode() == MODES[mask][0] and staging.new_mode(directory=True) == MODES[mask][1]


@pytest.mark.parametrize("mask", sorted(MODES))
def test_write_folder_publishes_every_file_and_folder_with_the_umask_modes(tmp_path, mask):
    file_mode, dir_mode = MODES[mask]

    def build(folder):
        handle, private = tempfile.mkstemp(dir=folder)  # 0600, as tempfile makes it
        os.write(handle, b"x")
        os.close(handle)
        inner = tempfile.mkdtemp(dir=folder)  # 0700
        readonly = os.path.join(inner, "ckpt")
        with open(readonly, "wb") as out:
            out.write(b"y")
        os.chmod(readonly, 0o400)  # MindSpore's checkpoints
        script = os.path.join(folder, "run.sh")
        with open(script, "w", encoding="utf-8") as out:
            out.write("true\n")
        os.chmod(script, 0o700)
        return os.path.basename(private), os.path.basename(inner)

    out = tmp_path / "out"
    with umask(mask):
        private, inner = staging.write_folder(str(out), build, DataError)
    assert mode(out) == dir_mode and mode(out / inner) == dir_mode
    assert mode(out / private) == file_mode and mode(out / inner / "ckpt") == file_mode
    assert mode(out / "run.sh") == dir_mode  # an executable keeps its x bits, as the umask allows
    if mask == 0o022:
        assert mode(out / private) & 0o044 == 0o044  # group and others can read
    else:
        assert mode(out / private) & 0o077 == 0


@pytest.mark.parametrize("mask", sorted(MODES))
def test_a_mindrecord_written_in_a_staged_folder_is_readable_as_the_umask_says(tmp_path, mask):
    from mindspore.mindrecord import FileWriter

    def build(folder):
        writer = FileWriter(os.path.join(folder, "train.mindrecord"), shard_num=1)
        writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]}}, "ids")
        writer.write_raw_data([{"input_ids": np.arange(4, dtype=np.int32)}])
        writer.commit()
        return sorted(os.listdir(folder))

    with umask(mask):
        names = staging.write_folder(str(tmp_path / "data"), build, DataError)
    assert names == ["train.mindrecord", "train.mindrecord.db"]
    for name in names:
        assert mode(tmp_path / "data" / name) == MODES[mask][0], name


@pytest.mark.parametrize("mask", sorted(MODES))
def test_a_safetensors_file_gets_the_umask_mode_and_replaces_atomically(tmp_path, mask):
    path = tmp_path / "model.safetensors"
    with umask(mask):
        write_safetensors(str(path), {"w": np.ones((2, 3), np.float32)})
        assert mode(path) == MODES[mask][0]  # the safetensors writer alone makes 0600
        os.chmod(path, 0o400)
        write_safetensors(str(path), {"w": np.zeros((2, 3), np.float32)})
    assert mode(path) == MODES[mask][0]
    np.testing.assert_array_equal(read_safetensors(str(path))["w"], np.zeros((2, 3), np.float32))
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no temp file left


def test_save_pretrained_writes_a_model_directory_others_can_read(tmp_path):
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    from conftest import TINY
    out = tmp_path / "model"
    with umask(0o022):
        GPTLocalForCausalLM(GPTLocalConfig(**TINY)).save_pretrained(str(out))
    assert mode(out) == 0o755
    for name in os.listdir(out):
        assert mode(out / name) == 0o644, name
