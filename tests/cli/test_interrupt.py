"""SIGINT / SIGTERM end a command (every one but ``run``, which saves and resumes: tests/e2e/test_stop_signals.py)
with one line and the shell's status, 130 / 143, leaving no partial output: real ``gptlocal`` processes, each signalled
once it shows it is in its long phase."""
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import TINY, source_env

FEW_SECONDS = 10  # from the signal to the process's end, on a busy machine (the watcher's own deadline is 3 s)


class Command:
    """``gptlocal ARGS`` in a process of its own, its stdout and stderr read as they come."""

    def __init__(self, *args, cwd):
        self.proc = subprocess.Popen([sys.executable, "-m", "mindformers_gptlocal.cli", *args], cwd=str(cwd),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=source_env())
        self.out, self.err = bytearray(), bytearray()
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, into):
        while True:
            chunk = stream.read1(65536)
            if not chunk:
                return
            into.extend(chunk)

    def wait_for(self, check, what, timeout=300):
        deadline = time.monotonic() + timeout
        while not check():
            assert self.proc.poll() is None, f"ended ({self.proc.returncode}) before {what}: {self.err.decode()[-2000:]}"
            assert time.monotonic() < deadline, f"no {what} in {timeout} s: {self.err.decode()[-2000:]}"
            time.sleep(0.005)

    def signal(self, signum):
        """Send ``signum``; returns (status, seconds from the signal to the end, stderr after the signal)."""
        before = len(self.err)
        sent = time.monotonic()
        self.proc.send_signal(signum)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        seconds = time.monotonic() - sent
        for reader in self.readers:
            reader.join(10)
        return code, seconds, self.err[before:].decode()


def _one_line(err, after, command, signame, writes):
    """The whole stderr holds no traceback and ends with the command's one line (after a progress line's \\r)."""
    text = err.decode()
    assert "Traceback" not in text and text.count("interrupted") == 1, text[-3000:]
    line = after.rsplit("\r", 1)[-1].strip()
    assert "\n" not in line and line.startswith(f"gptlocal: {command} interrupted ({signame})"), after
    assert ("nothing partial was written and any earlier output is as it was" in line) == writes, line


def _partial(folder):
    return [name for name in os.listdir(folder) if ".partial-" in name or ".old-" in name]


def _gpt2_folder(folder, vocab=50257, hidden=384, layers=2, positions=256):
    """A Hugging Face GPT-2 folder of random weights (GPT-2's vocabulary: about 80 MB), written with numpy."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32)
    tensors = {"wte.weight": rand(vocab, hidden), "wpe.weight": rand(positions, hidden),
               "ln_f.weight": np.ones(hidden, np.float32), "ln_f.bias": np.zeros(hidden, np.float32)}
    for i in range(layers):
        for name, shape in (("ln_1.weight", (hidden,)), ("ln_1.bias", (hidden,)), ("ln_2.weight", (hidden,)),
                            ("ln_2.bias", (hidden,)), ("attn.c_attn.weight", (hidden, 3 * hidden)),
                            ("attn.c_attn.bias", (3 * hidden,)), ("attn.c_proj.weight", (hidden, hidden)),
                            ("attn.c_proj.bias", (hidden,)), ("mlp.c_fc.weight", (hidden, 4 * hidden)),
                            ("mlp.c_fc.bias", (4 * hidden,)), ("mlp.c_proj.weight", (4 * hidden, hidden)),
                            ("mlp.c_proj.bias", (hidden,))):
            tensors[f"h.{i}.{name}"] = rand(*shape)
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab, "n_embd": hidden,
        "n_layer": layers, "n_head": 4, "n_positions": positions, "n_ctx": positions}))
    return folder


def _big_text(path, size):
    """``size`` bytes of code-like lines in one file: one document, many pieces."""
    rng = np.random.default_rng(1)
    words = np.array("def return self value import class for while if else print alpha beta gamma 42 (x) :".split())
    lines, total = [], 0
    while total < size:
        line = ("    " * int(rng.integers(0, 3))) + " ".join(rng.choice(words, int(rng.integers(1, 12))))
        lines.append(line)
        total += len(line) + 1
    path.write_text("\n".join(lines))
    return path


def test_prepare_data_large_file_sigint_while_tokenizing(tmp_path):
    """One 2 MB text file (one document): a SIGINT once the tokenize progress shows ends it within seconds (the file
    is read and tokenized in pieces), one line, 130; the staging folder is gone and the earlier --out as it was."""
    source = _big_text(tmp_path / "big.txt", 2_000_000)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "earlier.txt").write_text("earlier data")
    command = Command("prepare-data", "--input", str(source), "--out", "out", "--overwrite", "--vocab-size", "300",
                      "--seq-length", "64", cwd=tmp_path)
    command.wait_for(lambda: b"tokenize:" in command.err, "tokenize progress")
    code, seconds, after = command.signal(signal.SIGINT)
    assert code == 130, command.err.decode()[-3000:]
    assert seconds < FEW_SECONDS, seconds
    _one_line(command.err, after, "prepare-data", "SIGINT", writes=True)
    assert b"tokenize: 1/1" not in command.err and command.out == b""  # stopped while tokenizing: no summary
    assert _partial(tmp_path) == [] and os.listdir(tmp_path / "out") == ["earlier.txt"]
    assert (tmp_path / "out" / "earlier.txt").read_text() == "earlier data"


def test_convert_sigint_while_writing(tmp_path):
    """convert hf2ms of an 80 MB GPT-2 folder, SIGINT once the staging folder holds its weights file: one line,
    130, no staging folder, the earlier --out (replaced only by --overwrite) as it was."""
    hf = _gpt2_folder(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "earlier.txt").write_text("earlier model")
    command = Command("convert", "hf2ms", "--hf-dir", str(hf), "--out", "out", "--overwrite", cwd=tmp_path)
    command.wait_for(lambda: glob.glob(str(tmp_path / "out.partial-*" / "model.safetensors")),
                     "weights in a staging folder")  # --overwrite: out.partial-PID.partial-PID/ (one inside the other)
    code, seconds, after = command.signal(signal.SIGINT)
    assert code == 130, command.err.decode()[-3000:]
    assert seconds < FEW_SECONDS, seconds
    _one_line(command.err, after, "convert", "SIGINT", writes=True)
    assert b"wrote" not in command.out
    assert _partial(tmp_path) == [] and os.listdir(tmp_path / "out") == ["earlier.txt"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, corpus):
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    out = str(tmp_path_factory.mktemp("interrupt_model") / "model")
    GPTLocalForCausalLM(GPTLocalConfig(**TINY)).save_pretrained(out, tokenizer_dir=corpus["model_dir"])
    return out


@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_generate_signal_while_generating(model_dir, tmp_path, signum, status):
    """generate with many samples, signalled once the second sample prints: one line, 128 + the signal."""
    command = Command("generate", "--model", model_dir, "--prompt", "def f(", "--num-samples", "100000",
                      "--max-new-tokens", "8", cwd=tmp_path)
    command.wait_for(lambda: b"--- sample 2/" in command.out, "a second sample")
    code, seconds, after = command.signal(signum)
    assert code == status, command.err.decode()[-3000:]
    assert seconds < FEW_SECONDS, seconds
    _one_line(command.err, after, "generate", signal.Signals(signum).name, writes=False)
    assert b"new tokens in" not in command.err  # no summary: it stopped
    assert os.listdir(tmp_path) == []


STUCK = """
import hashlib, sys
from mindformers_gptlocal.cli.interrupt import Catch, Interrupted
from mindformers_gptlocal.staging import write_folder
from mindformers_gptlocal.training.stop import exit_status

def build(folder):
    open(folder + "/started", "w").close()
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 10 ** 9)  # minutes in C, no Python instruction in between
    return 0

with Catch("convert") as catch:
    try:
        write_folder(sys.argv[1], build, RuntimeError)
    except Interrupted as err:
        catch.report(err.signum)
        sys.exit(exit_status(err.signum))
print("finished")
"""


def test_a_command_stuck_in_native_code_ends_within_the_grace(tmp_path):
    """The main thread deep in one C call never reaches a Python instruction: the watcher ends the process 3 s
    after the signal with the line and 143, and removes the staging folder."""
    proc = subprocess.Popen([sys.executable, "-c", STUCK, str(tmp_path / "out")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=source_env(), cwd=str(tmp_path))
    staging = tmp_path / f"out.partial-{proc.pid}"
    deadline = time.monotonic() + 120
    while not os.path.exists(staging / "started"):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
        time.sleep(0.01)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    seconds = time.monotonic() - sent
    assert proc.returncode == 143, err.decode()
    assert 2.5 < seconds < FEW_SECONDS, seconds  # the grace (3 s), not the C call's minutes
    assert err.decode() == "gptlocal: convert interrupted (SIGTERM); nothing partial was written and any earlier " \
                           "output is as it was.\n"
    assert out == b"" and os.listdir(tmp_path) == []
