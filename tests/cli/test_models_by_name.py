"""Models by name: ``--model ORG/NAME`` and ``convert hf2ms --hf-dir ORG/NAME`` from a Hugging Face cache built
here with ``huggingface_hub``'s layout (models--org--name/{blobs, snapshots/<commit>, refs/main}) from a tiny random
``transformers`` GPT-2 saved with save_pretrained; the commands run as subprocesses with HF_HUB_CACHE pointing at it
(and HF_HUB_OFFLINE=1: nothing may reach the network)."""
import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from conftest import save_hf, source_env

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "tiny-org/tiny-gpt2"


def _start(args, env, cwd=None):
    """A gptlocal command started now; ``.communicate()`` later (independent commands overlap: suite time)."""
    return subprocess.Popen([sys.executable, "-m", "mindformers_gptlocal.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)


def _result(proc):
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _gptlocal(args, env, cwd=None):
    return _result(_start(args, env, cwd))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(HF cache folder, environment) holding REPO at COMMIT."""
    root = tmp_path_factory.mktemp("hub")
    saved = root / "saved"
    save_hf(saved, vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    from mindformers_gptlocal.data.tokenizer import train_bpe
    train_bpe(["def f(x):\n    return x\n", "print('hello world')\n"] * 50, 300).model.save(str(saved))
    repo = root / "cache" / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in sorted(os.listdir(saved)):
        data = (saved / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    env = source_env(HF_HUB_CACHE=str(root / "cache"), HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(root / "xdg"),
                     GLOG_v="3")
    env.pop("HF_HOME", None)
    return root, env


def test_an_id_in_the_cache_equals_its_converted_directory(hub, tmp_path):
    """``generate --model ORG/NAME`` converts the snapshot into gpt_local's cache once and prints what the directory
    ``convert hf2ms --hf-dir ORG/NAME`` wrote prints; the bare NAME of the one cached ORG/NAME reuses that conversion;
    a relative path that exists (a copy of the converted directory spelled like an id) wins over an id."""
    root, env = hub
    flags = ["--prompt", "def f(", "--temperature", "0", "--max-new-tokens", "8", "--compile-cache", "off"]
    converted = tmp_path / "converted"
    by_id = _start(["generate", "--model", REPO, *flags], env)  # converts into the cache meanwhile
    done = _gptlocal(["convert", "hf2ms", "--hf-dir", REPO, "--out", str(converted)], env)
    assert done.returncode == 0, done.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(converted))
    # The converted directory's own output, read through a path that is also an id's shape: no id of the cache
    # has that name (test_an_id_absent_from_the_cache_is_one_line), so it can only run as the directory.
    shutil.copytree(converted, tmp_path / "tiny-org" / "absent")
    by_dir = _start(["generate", "--model", "tiny-org/absent", *flags], env, cwd=str(tmp_path))

    by_id = _result(by_id)
    assert by_id.returncode == 0, by_id.stderr
    cached = root / "xdg" / "mindformers_gptlocal" / "hub" / REPO.replace("/", "--") / COMMIT
    assert (cached / "model.safetensors").is_file()
    assert "converting the Hugging Face snapshot" in by_id.stderr and str(cached) in by_id.stderr

    bare = _start(["generate", "--model", REPO.split("/")[1], *flags], env)  # the one cached ORG/tiny-gpt2
    by_dir = _result(by_dir)
    assert by_dir.returncode == 0, by_dir.stderr
    assert by_dir.stdout.startswith("def f(") and len(by_dir.stdout) > len("def f(\n")
    assert by_id.stdout == by_dir.stdout
    bare = _result(bare)
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout == by_dir.stdout and "converting" not in bare.stderr  # converted once, reused


@pytest.mark.parametrize("command", [["generate", "--prompt", "x", "--model"], ["convert", "hf2ms", "--out", "o",
                                                                              "--hf-dir"]])
def test_an_id_absent_from_the_cache_is_one_line(hub, tmp_path, command):
    root, env = hub
    done = _gptlocal([*command, "tiny-org/absent"], env, cwd=str(tmp_path))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "'tiny-org/absent' is not in the local Hugging Face cache" in lines[0]
    assert str(root / "cache") in lines[0] and "huggingface-cli download tiny-org/absent" in lines[0]
    assert os.listdir(tmp_path) == []  # nothing written


def test_a_cached_id_resolves_with_the_network_blocked(tmp_path, monkeypatch):
    """No HF_HUB_OFFLINE here: the Hub's endpoint is a local port that only listens, and no connection may reach
    it; a cached id (and its bare name) resolves from the cache at once."""
    import json
    import socket
    import time
    from huggingface_hub import constants
    from mindformers_gptlocal.checkpoint.hub import resolve_model
    repo = tmp_path / "cache" / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "gpt_local"}))  # used as it is
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
        start = time.monotonic()
        by_id = resolve_model(REPO, log=None)
        bare = resolve_model(REPO.split("/")[1], log=None)  # the one cached ORG/tiny-gpt2
        seconds = time.monotonic() - start
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing connected to the "Hub"
    assert os.path.samefile(by_id, snapshot) and os.path.samefile(bare, snapshot)
    assert seconds < 1.0, seconds
