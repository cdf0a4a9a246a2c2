"""generate / chat / serve / eval: device, port and network mistakes are one ``gptlocal COMMAND: error:`` line,
exit code 2, before any model loads; FastAPI's own errors answer in the OpenAI error shape."""
import json
import os
import socket
import subprocess
import sys
import time
import types

import pytest

from conftest import source_env


def _cli(*args, cwd, timeout=120):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", *args], cwd=str(cwd),
                          capture_output=True, text=True, env=source_env(), timeout=timeout)
    return proc, time.monotonic() - start


def _one_line(proc, command):
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"gptlocal {command}: error:"), lines[-20:]
    return lines[0]


@pytest.fixture
def model_dir(tmp_path):
    """A folder the server accepts up to the model load (config.json present); the port checks come first."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_local"}))
    return str(folder)


def test_serve_port_out_of_range_fails_at_once(tmp_path, model_dir):
    pytest.importorskip("uvicorn")
    proc, _ = _cli("serve", "--model", model_dir, "--port", "70000", cwd=tmp_path)
    assert "--port 70000 is not a TCP port (0-65535)" in _one_line(proc, "serve")
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_serve_taken_port_fails_before_loading(tmp_path, model_dir):
    pytest.importorskip("uvicorn")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc, _ = _cli("serve", "--model", model_dir, "--port", str(port), cwd=tmp_path)
    line = _one_line(proc, "serve")
    assert f"--port {port} on 127.0.0.1 is already in use" in line


def test_serve_unresolvable_host(tmp_path, model_dir):
    pytest.importorskip("uvicorn")
    proc, _ = _cli("serve", "--model", model_dir, "--host", "no-such-host.invalid", cwd=tmp_path)
    assert "--host no-such-host.invalid cannot be resolved" in _one_line(proc, "serve")


def _app():
    from mindformers_gptlocal.serve.app import create_app
    engine = types.SimpleNamespace(failed=None, ready=types.SimpleNamespace(is_set=lambda: False), adapter_names=[],
                                   max_batch_size=1, batches=[1], max_model_len=64, widths=[16], lazy=set())
    return create_app(engine, "m")


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/completions", 405), ("GET", "/nope", 404),
                                                ("DELETE", "/v1/chat/completions", 405)])
def test_fastapi_errors_in_the_openai_shape(method, path, status):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    resp = TestClient(_app()).request(method, path)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == str(status)
    assert path in error["message"]


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "eval"])
def test_device_without_a_backend_is_one_line(tmp_path, model_dir, command):
    import mindspore as ms
    if ms.hal.is_available("GPU"):
        pytest.skip("this machine has a GPU backend")
    extra = {"generate": ["--prompt", "x"], "eval": ["--tasks", "gl_choice"]}.get(command, [])
    proc, _ = _cli(command, "--model", model_dir, "--device-target", "GPU", *extra, cwd=tmp_path)
    line = _one_line(proc, command)
    assert "--device-target GPU, but this MindSpore has no usable GPU backend; pass --device-target CPU" in line


@pytest.fixture(scope="module")
def tiny_model(corpus, tmp_path_factory):
    """A tiny random-weight model directory with the corpus' tokenizer (64 positions)."""
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    from conftest import TINY
    out = str(tmp_path_factory.mktemp("cmd") / "model")
    ms.set_seed(0)
    GPTLocalForCausalLM(GPTLocalConfig(**TINY)).save_pretrained(out, tokenizer_dir=corpus["model_dir"])
    return out


def test_generate_prompt_longer_than_the_context_is_not_echoed(tmp_path, tiny_model):
    prompt = "def main(x):\n" * 60  # well past the 64 positions
    proc, _ = _cli("generate", "--model", tiny_model, "--prompt", prompt, "--compile-cache", "off", cwd=tmp_path)
    line = _one_line(proc, "generate")
    assert "exceeds" in line and proc.stdout == ""


def test_generate_ends_with_a_tokens_per_second_line(tmp_path, tiny_model):
    import re
    proc, _ = _cli("generate", "--model", tiny_model, "--prompt", "def", "--max-new-tokens", "5", "--stream",
                   "--temperature", "0", "--compile-cache", "off", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("def")
    assert re.search(r"^\[gptlocal\] [1-5] new tokens in [0-9.]+ s \([0-9.]+ tokens/s", proc.stderr, re.M), \
        proc.stderr[-2000:]
    assert "[WARNING]" not in proc.stdout + proc.stderr  # MindSpore's warnings stay off the terminal


def test_chat_output_never_has_two_empty_lines_in_a_row():
    import io
    from mindformers_gptlocal.cli.main import SqueezedBlankLines
    out = io.StringIO()
    stream = SqueezedBlankLines(out)
    for piece in ["\n\n", "hel", "lo\n\n\n\n\n", "x\n", "\n", "\n", "y", "\n"]:
        stream.write(piece)
    assert out.getvalue() == "hello\n\nx\n\ny\n"


def test_eval_offline_task_is_one_line_at_once(tmp_path, tiny_model):
    """A built-in task whose data set is not cached, the Hub unreachable: one line at once. With --include-path
    naming a folder of other tasks: the built-in task is still found (the folder alone is indexed only when it holds
    every task asked for)."""
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text("task: mine\ndataset_path: json\noutput_type: loglikelihood\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", "eval", "--model", tiny_model, "--tasks",
                           "hellaswag", "--include-path", str(tasks), "--limit", "2"], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=300,
                          env=source_env(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf")))
    seconds = time.monotonic() - start
    line = _one_line(proc, "eval")
    assert "not in the local Hugging Face cache" in line and "127.0.0.1:9 cannot be reached" in line
    assert seconds < 120  # no minute of retries (lm-eval's own import and task index take most of this)
