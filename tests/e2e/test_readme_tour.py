"""README's tour, line by line, as written, in a fresh folder holding what a clone has (model_configs/, run_scripts/)
after the set-up command (its quickstart, made short here). Each line runs after every line README puts before it
that writes what it reads or writes (its flags and its YAML say which: ``paths``); lines independent of each other
run at the same time, two at once (the machine's two cores). The test only adds flags that make each line short
(fewer bytes, steps and tokens); it never changes a line. Each line must exit 0 and make what it says, and write no
folder the tour does not name."""
import concurrent.futures
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


def _checked(quickstart):
    return getattr(quickstart, "checked", False)


def _wait(quickstart, root):
    """The quickstart waited for (once) and what it made checked."""
    if _checked(quickstart):
        return
    out, _ = quickstart.communicate(timeout=600)
    assert quickstart.returncode == 0, out[-3000:]
    before, after = map(float, re.search(r"perplexity: (\S+) before -> (\S+) after", out).groups())
    assert before > 0 and after > 0, out[-3000:]  # read from the eval runs' table (not nan)
    assert os.path.isfile(root / "runs" / "quickstart" / "train" / "model" / "model.safetensors")
    quickstart.checked = True


def test_the_heading_counts_the_lines_and_data_is_git_ignored():
    heading, count, lines = tour_heading_and_lines()
    assert count == len(lines), (heading, len(lines))
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        assert f"(#{heading[3:].lower().replace(' ', '-')})" in handle.read()  # the contents link
    if shutil.which("git") and os.path.isdir(os.path.join(REPO, ".git")):
        ignored = subprocess.run(["git", "check-ignore", "data/gptlocal/train.mindrecord", "output/x",
                                  "mindformers_gptlocal/data/new.py"], cwd=REPO, capture_output=True, text=True)
        assert ignored.stdout.split() == ["data/gptlocal/train.mindrecord", "output/x"], ignored.stdout


LANES = 2  # lines running at once, the quickstart counted while it runs: one per core (a tiny line is mostly
# importing MindFormers and compiling, on about one core)


def paths(line, root):
    """(what the line reads, what it writes): folders and files relative to the clone, from its flags, its YAML's
    data and checkpoint keys (base_config merged) and prepare-data's default output folder."""
    from mindformers_gptlocal import yaml_io
    reads, writes = set(), set()
    for part in _without_comment(line).replace(" | ", " && ").split(" && "):
        words = part.split()
        flags = dict(zip(words, words[1:]))
        for flag in ("--model", "--ms-dir", "--hf-dir", "--tokenizer", "--load_checkpoint", "--config"):
            if flag in flags:
                reads.add(flags[flag])
        for flag in ("--output_dir", "--out"):
            if flag in flags:
                writes.add(flags[flag])
        if words[:2] == ["gptlocal", "prepare-data"] and "--out" not in flags:
            writes.add("data/gptlocal")  # prepare-data's default --out
        if "--resume_training" in flags:
            reads.add(flags["--output_dir"])
        if words[0] == "bash" and words[1].endswith("run_msrun.sh"):
            with open(root / words[1], encoding="utf-8") as handle:  # each rank's log: the script's LOG_DIR default
                writes.add(re.search(r"LOG_DIR:-([^}]+)", handle.read()).group(1))
        config = flags.get("--config") or (words[3] if words[0] == "bash" and len(words) > 3 else None)
        if config:
            reads.add(config)
            yaml = yaml_io.load_yaml(str(root / config))
            found = [yaml.get("load_checkpoint"), yaml.get("pretrained_model_dir")]
            found += [(yaml.get(section) or {}).get("data_loader", {}).get("dataset_dir")
                      for section in ("train_dataset", "eval_dataset")]
            found += [callback.get("tokenizer_dir") for callback in yaml.get("callbacks") or []]
            reads.update(path for path in found if isinstance(path, str) and path)
    return {os.path.normpath(path) for path in reads}, {os.path.normpath(path) for path in writes}


def _overlaps(one, other):
    return any(a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep) for a in one for b in other)


def conflict(first, second):
    """Whether two lines' (reads, writes) touch: one writes what the other reads or writes."""
    return _overlaps(first[1], second[0] | second[1]) or _overlaps(second[1], first[0])


def test_every_line_runs_as_written_in_order(clone):
    """Every line as written, each started once every earlier line it depends on (one writes what the other reads or
    writes: ``paths``) has ended, in README's order otherwise; independent lines overlap, LANES at a time, the
    quickstart (started with the clone) counted until the first line reading its model waits for it. So every
    line still runs after each line README puts before it that makes what it reads. Afterwards every folder under
    data/ and output/ is one the tour names."""
    root, env, quickstart = clone
    lines = tour_lines()
    assert len(lines) >= 10 and all(line.split()[0] in ("gptlocal", "printf", "pip", "curl", "bash") for line in lines)
    folders = [m for line in lines if "--resume_training" not in line for m in re.findall(r"--output_dir (\S+)", line)]
    assert len(set(folders)) == len(folders) >= 4, folders  # each line its own output folder
    steps = []  # (the line's index, what it does, (reads, writes)) in README's order
    for index, line in enumerate(lines):
        if line.startswith("pip install"):
            import fastapi  # noqa: F401  (the test environment has the [serve] extra already)
            import uvicorn  # noqa: F401
            assert "[serve]" in line
        elif line.startswith("gptlocal serve"):
            assert "/health" in line and '"ready"' in line, line  # the line says to wait for it
            assert lines[index + 1].startswith("curl"), lines[index + 1]  # the next line asks it, from another shell
            steps.append((index, lambda line=line, index=index: _serve_and_ask(line, lines[index + 1], root, env),
                          paths(line, root)))
        elif not line.startswith("curl"):
            steps.append((index, lambda line=line, index=index: _line(line, lines[:index], root, env),
                          paths(line, root)))
    assert any(_overlaps({os.path.normpath("runs/quickstart")}, reads) for _, _, (reads, _) in steps)
    quickstart_paths = (set(), {os.path.normpath("runs/quickstart")})
    order = []  # the lines' indexes as they started
    with concurrent.futures.ThreadPoolExecutor(LANES) as pool:
        running = {}  # future -> step
        waiting = list(steps)
        while waiting or running:
            if not _checked(quickstart) and quickstart.poll() is not None:
                _wait(quickstart, root)
            for step in list(waiting):
                if len(running) + (not _checked(quickstart)) >= LANES:
                    break
                earlier = [other for other in steps if other[0] < step[0]
                           and (other in waiting or other in running.values())]
                if any(conflict(other[2], step[2]) for other in earlier) or \
                        not _checked(quickstart) and conflict(quickstart_paths, step[2]):
                    continue
                waiting.remove(step)
                order.append(step[0])
                running[pool.submit(step[1])] = step
            if not running:  # every line left reads the quickstart's model
                _wait(quickstart, root)
                continue
            done, _ = concurrent.futures.wait(running, timeout=None if _checked(quickstart) else 1,
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                running.pop(future)
                future.result()  # a failed line fails the test here, with its own message
    print(f"\n[tour] lines in the order started: {order}")
    tour = "\n".join(lines)
    assert sorted(os.listdir(root)) == ["data", "model_configs", "output", "run_scripts", "runs"], os.listdir(root)
    for top in ("data", "output"):
        for name in os.listdir(root / top):
            assert f"{top}/{name}" in tour, f"{top}/{name} is written by a tour line but not named by one"


def _line(line, earlier, root, env):
    started = time.time()
    _check(line, _run(shortened(line, earlier), root, env), root)
    print(f"\n[tour] {time.time() - started:5.1f} s  {line[:90]}")


def _serve_and_ask(line, curl, root, env):
    """The server started and ready, then asked by the curl line (from another shell), then stopped."""
    port = int(re.search(r"--port (\d+)", line).group(1))
    server = _start_server(shortened(line).replace(f"--port {port}", f"--port {free_port()}"), root, env)
    try:
        out = _run(_without_comment(curl).replace("localhost:8000", f"localhost:{server[1]}"), root, env)
        assert json.loads(out)["choices"][0]["text"] is not None
        server[0].send_signal(signal.SIGTERM)
        server[0].wait(60)
    finally:
        if server[0].poll() is None:
            server[0].kill()
            server[0].wait()


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
