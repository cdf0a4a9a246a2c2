"""README's tour, line by line, as written, in a fresh folder holding what a clone has (model_configs/,
run_scripts/) after the set-up command (its quickstart, made short here). The test only adds flags that make
each line short (fewer bytes, steps and tokens); it never changes a line. Each line must exit 0 and make what
it says."""
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest

from conftest import REPO, source_env
from conftest import free_port

# the flags the test adds, by command: (README's `gptlocal X` or script) -> extra arguments
SHORTER = {
    "prepare-data": ["--max-bytes", "60000", "--vocab-size", "512"],
    "run": ["--runner_config.stop_step", "2", "--num_samples", "16"],
    "generate": ["--max-new-tokens", "4", "--compile-cache", "off"],
    "chat": ["--max-new-tokens", "4", "--compile-cache", "off"],
    "serve": ["--warmup-tokens", "16", "--compile-cache", "off", "--max-batch-size", "1"],
    "run_msrun.sh": ["--runner_config.stop_step", "2", "--num_samples", "16"],
}


def tour_lines():
    """README's tour: the bash block after '## A ten-line tour', continuation lines joined."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        text = handle.read()
    section = text[text.index("## A ten-line tour"):]
    block = section[section.index("```bash") + len("```bash"):]
    block = block[:block.index("```")]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _without_comment(part):
    """A command without its trailing `# ...` comment (a `#` after whitespace, outside quotes)."""
    quote = None
    for index, char in enumerate(part):
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and index and part[index - 1].isspace():
            return part[:index].rstrip()
    return part.rstrip()


def shortened(line):
    """The line with SHORTER's flags added to each of its commands (joined by &&)."""
    parts = []
    for part in line.split(" && "):
        part = _without_comment(part)
        words = part.split()
        key = words[1] if words[0] == "gptlocal" else os.path.basename(words[1]) if words[0] == "bash" else None
        parts.append(" ".join([part, *SHORTER.get(key, [])]))
    return " && ".join(parts)


def _run(line, cwd, env, timeout=600):
    proc = subprocess.run(["bash", "-c", line], cwd=str(cwd), env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (line, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A folder with what a fresh clone has, after the set-up command's quickstart (made short)."""
    root = tmp_path_factory.mktemp("tour")
    for folder in ("model_configs", "run_scripts"):
        shutil.copytree(os.path.join(REPO, folder), root / folder)
    env = source_env(GLOG_v="3", MASTER_PORT=str(free_port()))
    # started now, waited for by the first line that needs its model (the lines before it overlap with it)
    quickstart = subprocess.Popen(["bash", "-c", "gptlocal quickstart --steps 2 --max-bytes 60000 --out runs/quickstart"],
                                  cwd=str(root), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield root, env, quickstart
    if quickstart.poll() is None:
        quickstart.kill()
        quickstart.wait()
    shutil.rmtree(root, ignore_errors=True)  # ~500 MB of checkpoints; the suite's disk stays small


def _wait(quickstart, root):
    out, _ = quickstart.communicate(timeout=600)
    assert quickstart.returncode == 0, out[-3000:]
    before, after = map(float, re.search(r"perplexity: (\S+) before -> (\S+) after", out).groups())
    assert before > 0 and after > 0, out[-3000:]  # read from the eval runs' table (not nan)
    assert os.path.isfile(root / "runs" / "quickstart" / "train" / "model" / "model.safetensors")


def test_every_line_runs_as_written(clone):
    """README's order within each of its two independent chains (the quickstart's model: generate, chat,
    finetune, resume; the data the tour prepares: train, eval, serve, convert, plan, msrun); the chains run
    side by side (no line of one reads what the other writes) to keep the test short."""
    root, env, quickstart = clone
    lines = tour_lines()
    assert len(lines) >= 10 and all(line.split()[0] in ("gptlocal", "printf", "pip", "curl", "bash") for line in lines)
    folders = [m for line in lines if "--resume_training" not in line for m in re.findall(r"--output_dir (\S+)", line)]
    assert len(set(folders)) == len(folders) >= 4, folders  # each line its own output folder
    quickstart_chain = [line for line in lines if "runs/quickstart" in line or "output/finetune" in line]
    data_chain = [line for line in lines if line not in quickstart_chain]
    assert quickstart_chain and data_chain
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        chains = [pool.submit(_run_chain, quickstart_chain, root, env, quickstart),
                  pool.submit(_run_chain, data_chain, root, env, None)]
        for chain in chains:
            chain.result()
    for folder in ("pretrain", "finetune"):
        assert os.path.isfile(root / "output" / folder / "model" / "model.safetensors"), folder


def _run_chain(lines, root, env, quickstart):
    server = None
    if quickstart is not None:
        _wait(quickstart, root)
    try:
        for line in lines:
            if line.startswith("pip install"):
                import fastapi  # noqa: F401  (the test environment has the [serve] extra already)
                import uvicorn  # noqa: F401
                assert "[serve]" in line
                continue
            if line.startswith("gptlocal serve"):
                port = int(re.search(r"--port (\d+)", line).group(1))
                server = _start_server(shortened(line).replace(f"--port {port}", f"--port {free_port()}"), root,
                                       env)
                continue
            if line.startswith("curl"):
                assert server is not None
                out = _run(_without_comment(line).replace("localhost:8000", f"localhost:{server[1]}"), root, env)
                assert json.loads(out)["choices"][0]["text"] is not None
                server[0].send_signal(signal.SIGTERM)
                server[0].wait(60)
                server = None
                continue
            _check(line, _run(shortened(line), root, env), root)
    finally:
        if server is not None:
            server[0].kill()
            server[0].wait()


def _check(line, out, root):
    """What each line says it makes."""
    if line.startswith("gptlocal run") and "--resume_training True" in line:
        assert "resuming from" in out, out[-2000:]
    elif "pretrain_gpt_local_tiny_cpu.yaml" in line:
        assert "[gptlocal] training done:" in out and len(out.splitlines()) < 40, out[-3000:]
    elif "eval_gpt_local_tiny_cpu.yaml" in line:
        assert re.search(r"^\s+PPL\s+[0-9.]+", out, re.M), out[-2000:]
    elif line.startswith("gptlocal generate"):
        assert out.startswith("def main(") and "tokens/s" in out, out[-2000:]
    elif line.startswith("gptlocal convert"):
        assert os.path.isfile(root / "output" / "gptlocal_again" / "model.safetensors")
    elif line.startswith("gptlocal plan"):
        assert "per device" in out or "peak" in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]


def _start_server(line, root, env):
    port = int(re.search(r"--port (\d+)", line).group(1))
    proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=str(root), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if json.load(resp).get("status") == "ready":
                    return proc, port
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise AssertionError("the server was not ready in 300 s")
