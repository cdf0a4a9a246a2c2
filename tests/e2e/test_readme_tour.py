"""README's tour, line by line, as written and in README's order, in a fresh folder holding what a clone has
(model_configs/, run_scripts/) after the set-up command (its quickstart, made short here). The test only adds flags
that make each line short (fewer bytes, steps and tokens); it never changes a line. Each line must exit 0 and make
what it says, and write no folder the tour does not name."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from conftest import REPO, source_env
from conftest import free_port

# the flags the test adds, by command: (README's `gptlocal X` or script) -> extra arguments; a `gptlocal run` line
# gets its own (run_flags)
SHORTER = {
    "prepare-data": ["--max-bytes", "60000", "--vocab-size", "512"],  # a line with --tokenizer keeps its bytes
    "generate": ["--max-new-tokens", "4", "--compile-cache", "off"],
    "chat": ["--max-new-tokens", "4", "--compile-cache", "off"],
    "serve": ["--warmup-tokens", "16", "--compile-cache", "off", "--max-batch-size", "1"],
    "run_msrun.sh": ["--runner_config.stop_step", "2", "--num_samples", "16"],
}
RESUMED_STEPS = 3  # a line that stops at its own stop_step N gets data for N + 3 steps: the resume line does 3


def tour_heading_and_lines():
    """README's tour heading ('## A 13-line tour') and its bash block, continuation lines joined."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        text = handle.read()
    found = re.search(r"^## A (\d+)-line tour$", text, re.M)
    assert found, "README has no '## A N-line tour' heading"
    section = text[found.start():]
    block = section[section.index("```bash") + len("```bash"):]
    block = block[:block.index("```")]
    return found.group(0), int(found.group(1)), [line.strip() for line in block.replace("\\\n", " ").splitlines()
                                                 if line.strip()]


def tour_lines():
    return tour_heading_and_lines()[2]


def _without_comment(part):
    """A command without its trailing `# ...` comment (a `#` after whitespace, outside quotes)."""
    quote = None
    for index, char in enumerate(part):
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and index and part[index - 1].isspace():
            return part[:index].rstrip()
    return part.rstrip()


def run_flags(part, earlier):
    """The flags a `gptlocal run` command gets: a line that stops at its own `--runner_config.stop_step N` keeps it and
    gets data for RESUMED_STEPS more steps; a `--resume_training` line gets the data its `--output_dir`'s first line
    got (the resume check refuses a changed run); any other line stops after 2 of 4 steps."""
    output_dir = re.search(r"--output_dir (\S+)", part)
    if "--resume_training" in part:
        for line in earlier:
            if output_dir and f"--output_dir {output_dir.group(1)}" in line and "--resume_training" not in line:
                return ["--num_samples", re.search(r"--num_samples (\d+)", shortened(line)).group(1)]
        raise AssertionError(f"no earlier line writes what {part!r} resumes")
    own = re.search(r"--runner_config\.stop_step (\d+)", part)
    if own:
        return ["--num_samples", str(4 * (int(own.group(1)) + RESUMED_STEPS))]
    return ["--runner_config.stop_step", "2", "--num_samples", "16"]


def shortened(line, earlier=()):
    """The line with SHORTER's flags added to each of its commands (joined by && or |). A prepare-data line with a
    --tokenizer keeps its --max-bytes: it only tokenizes (quick), and its run needs the rows."""
    parts = []
    for part in _without_comment(line).split(" && "):
        piped = []
        for piece in part.split(" | "):
            words = piece.split()
            key = words[1] if words[0] == "gptlocal" else os.path.basename(words[1]) if words[0] == "bash" else None
            if key == "run":
                extra = run_flags(piece, earlier)
            elif key == "prepare-data" and "--tokenizer" in piece:
                extra = []
            else:
                extra = SHORTER.get(key, [])
            piped.append(" ".join([piece, *extra]))
        parts.append(" | ".join(piped))
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
    quickstart = subprocess.Popen(["bash", "-c", "gptlocal quickstart --steps 2 --max-bytes 60000 --out "
                                   "runs/quickstart"], cwd=str(root), env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
    yield root, env, quickstart
    if quickstart.poll() is None:
        quickstart.kill()
        quickstart.wait()
    shutil.rmtree(root, ignore_errors=True)  # ~500 MB of checkpoints; the suite's disk stays small


def _wait(quickstart, root):
    if quickstart.returncode is not None:
        return
    out, _ = quickstart.communicate(timeout=600)
    assert quickstart.returncode == 0, out[-3000:]
    before, after = map(float, re.search(r"perplexity: (\S+) before -> (\S+) after", out).groups())
    assert before > 0 and after > 0, out[-3000:]  # read from the eval runs' table (not nan)
    assert os.path.isfile(root / "runs" / "quickstart" / "train" / "model" / "model.safetensors")


def test_the_heading_counts_the_lines_and_data_is_git_ignored():
    heading, count, lines = tour_heading_and_lines()
    assert count == len(lines), (heading, len(lines))
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        assert f"(#{heading[3:].lower().replace(' ', '-')})" in handle.read()  # the contents link
    if shutil.which("git") and os.path.isdir(os.path.join(REPO, ".git")):
        ignored = subprocess.run(["git", "check-ignore", "data/gptlocal/train.mindrecord", "output/x",
                                  "mindformers_gptlocal/data/new.py"], cwd=REPO, capture_output=True, text=True)
        assert ignored.stdout.split() == ["data/gptlocal/train.mindrecord", "output/x"], ignored.stdout


def test_every_line_runs_as_written_in_order(clone):
    """Every line in README's order; the quickstart (started with the clone) is waited for by the first line that
    reads its model. Afterwards every folder under data/ and output/ is one the tour names."""
    root, env, quickstart = clone
    lines = tour_lines()
    assert len(lines) >= 10 and all(line.split()[0] in ("gptlocal", "printf", "pip", "curl", "bash") for line in lines)
    folders = [m for line in lines if "--resume_training" not in line for m in re.findall(r"--output_dir (\S+)", line)]
    assert len(set(folders)) == len(folders) >= 4, folders  # each line its own output folder
    server = None
    try:
        for index, line in enumerate(lines):
            if "runs/quickstart" in line:
                _wait(quickstart, root)
            if line.startswith("pip install"):
                import fastapi  # noqa: F401  (the test environment has the [serve] extra already)
                import uvicorn  # noqa: F401
                assert "[serve]" in line
                continue
            if line.startswith("gptlocal serve"):
                assert "/health" in line and '"ready"' in line, line  # the line says to wait for it
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
            started = time.time()
            _check(line, _run(shortened(line, lines[:index]), root, env), root)
            print(f"\n[tour] {time.time() - started:5.1f} s  {line[:90]}")
    finally:
        if server is not None:
            server[0].kill()
            server[0].wait()
    tour = "\n".join(lines)
    assert sorted(os.listdir(root)) == ["data", "model_configs", "output", "run_scripts", "runs"], os.listdir(root)
    for top in ("data", "output"):
        for name in os.listdir(root / top):
            assert f"{top}/{name}" in tour, f"{top}/{name} is written by a tour line but not named by one"


def _check(line, out, root):
    """What each line says it makes."""
    if line.startswith("gptlocal run") and "--resume_training True" in line:
        assert re.search(r"resuming from \S+ \(step 10\)", out), out[-2000:]
        assert f"step {10 + RESUMED_STEPS}/{10 + RESUMED_STEPS}" in out, out[-2000:]
        assert os.path.isfile(root / "output" / "finetune" / "model" / "model.safetensors")
    elif "finetune_gpt_local_tiny_cpu.yaml" in line:
        assert "--runner_config.stop_step 10" in line and "[gptlocal] training done: 10 steps" in out, out[-2000:]
        assert f"step 10/{10 + RESUMED_STEPS}" in out and "10 of the finetune's 23 steps" in line, out[-2000:]
        assert f"stopped at step 10 of {10 + RESUMED_STEPS} by runner_config.stop_step" in out, out[-2000:]
        assert os.path.isfile(root / "output" / "finetune" / "model" / "model.safetensors")  # the step-10 model
        assert "output/finetune/model" in line, line  # and the line says so
        from mindformers_gptlocal.checkpoint import manifest
        entries = manifest.read_manifest(str(root / "output" / "finetune" / "checkpoint"))
        assert entries and entries[-1]["step"] == 10, entries  # what the resume line continues
    elif "pretrain_gpt_local_tiny_cpu.yaml" in line:
        assert "[gptlocal] training done:" in out and len(out.splitlines()) < 40, out[-3000:]
        losses = re.findall(r"\[gptlocal\] step \d+/\d+\s+loss (\S+)", out)
        assert losses and all(len(loss.replace(".", "").lstrip("0")) == 4 for loss in losses), losses  # 4 digits
    elif "eval_gpt_local_tiny_cpu.yaml" in line:
        assert re.search(r"^\s+PPL\s+[0-9.]+", out, re.M), out[-2000:]
        assert "[MS_ALLOC_CONF]" not in out, out[-2000:]
    elif line.startswith("gptlocal generate"):
        assert out.startswith("def main(") and "tokens/s" in out, out[-2000:]
    elif "gptlocal chat" in line:
        assert out.startswith("user: hello\nassistant: "), out[-2000:]
    elif line.startswith("gptlocal convert"):
        assert os.path.isfile(root / "output" / "gptlocal_again" / "model.safetensors")
    elif line.startswith("gptlocal plan"):
        assert "per device" in out or "peak" in out, out[-2000:]
    elif "run_msrun.sh" in line:
        assert "[WARNING]" not in out and "[gptlocal] training done:" in out, out[-3000:]  # rank 0's view only
        losses = re.findall(r"\[gptlocal\] step 2/\d+\s+loss (\S+)", out)
        assert len(losses) == 1 and len(losses[0].replace(".", "").lstrip("0")) == 4, out[-3000:]  # 4 digits
        assert os.path.isfile(root / "output" / "msrun" / "model" / "model.safetensors")
    assert "Traceback" not in out, out[-3000:]


def _start_server(line, root, env):
    """The server started; returns once /health says ready, having checked that /v1/models answered 503 whenever
    /health did (loading)."""
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
        except urllib.error.HTTPError as err:  # 503: loading
            assert err.code == 503, err.code
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).close()
                models = 200
            except urllib.error.HTTPError as models_err:
                models = models_err.code
            health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)) \
                if models == 200 else {}
            assert models == 503 or health.get("status") == "ready", models  # ready in between: fine
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise AssertionError("the server was not ready in 300 s")


def test_the_from_python_example_writes_only_under_output(corpus, tmp_path):
    """README's "From Python" block, as written, next to a tiny runs/quickstart/train/model: it prints its text and
    writes nothing but under output/ (git-ignored), so a clone stays clean."""
    from conftest import save_tiny_base
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        text = handle.read()
    section = text[text.index("## From Python"):]
    block = section[section.index("```python") + len("```python"):]
    block = block[:block.index("```")]
    save_tiny_base(tmp_path / "runs" / "quickstart" / "train" / "model", corpus, seed=0)
    proc = subprocess.run([sys.executable, "-c", block], cwd=str(tmp_path), env=source_env(GLOG_v="3"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("def main("), proc.stdout[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["output", "runs"], os.listdir(tmp_path)
    assert os.path.isfile(tmp_path / "output" / "exported" / "model.safetensors")
