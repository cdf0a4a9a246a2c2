"""Shared fixtures: a small prepared corpus and a tiny model config, made once per session."""
import atexit
import hashlib
import json
import os
import signal
import socket
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from mindformers_gptlocal import yaml_io

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# MindFormers builds its Megatron C++ helper with `make`, calling the `python3` found on PATH; put this
# interpreter's folder first, so it builds however the suite is started (e.g. `.venv/bin/python -m pytest`
# without activating the venv, when PATH's python3 lacks pybind11). Subprocesses inherit it.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
CONFIGS = os.path.join(REPO, "model_configs")
# A pytest-xdist worker is started by `python -c`, so MindSpore (which reads sys.argv[0] when it is imported) finds no
# entry script and gpt_local's compile cache stays off in it ("no entry script on disk"). Give the workers the entry
# script a serial run has, pytest's own __main__.py, before anything imports MindSpore.
if os.environ.get("PYTEST_XDIST_WORKER") and (not sys.argv or sys.argv[0] in ("-c", "")):
    sys.argv[:1] = [os.path.join(os.path.dirname(pytest.__file__), "__main__.py")]


def pytest_configure(config):
    """Under pytest-xdist (``-n 2``, run_scripts/test.sh), build MindFormers' Megatron helper once in the controlling
    process before the workers start: MindFormers runs ``make`` for it at a Megatron dataset's first use, and ``make``
    writes the library in place, so two workers building it at once could load a half-written file. Up to date: a
    no-op. Without xdist nothing is done here (MindFormers builds it at first use, as it always does)."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    import importlib.util
    spec = importlib.util.find_spec("mindformers")
    if spec is None or not spec.submodule_search_locations:
        return
    folder = os.path.join(spec.submodule_search_locations[0], "dataset", "blended_datasets")
    if os.path.isfile(os.path.join(folder, "Makefile")):  # a failed build fails the Megatron tests, with its reason
        subprocess.run(["make", "-s", "-C", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=False)


# The longest test files (measured, longest first), which pytest-xdist hands out first: run_scripts/test.sh gives
# the workers whole files in collection order (--dist loadfile --no-loadscope-reorder), so a long file started late
# would leave one worker running alone at the end (longest first: the last files to start are short). Only the
# order changes; the other files follow in their usual order. Paths relative to tests/. Seconds per file on two
# workers (`--durations=0`, summed): the tour 193, msrun 125, the decode node 112, the native runner 107, stopping 85,
# resume 75, the training layer 65, the planner 64, the launcher 64, crash safety 61, resume guards 59. test_cli
# (19 s) stays third: its compile-cache test needs to be the first in its process to use MindSpore's compile cache
# (it failed, storing nothing, after other files on a worker).
LONGEST_FIRST = (
    "e2e/test_readme_tour.py",
    "e2e/test_msrun.py",
    "cli/test_cli.py",
    "generation/test_decode_layer.py",
    "generation/test_native_runner.py",
    "e2e/test_stop_signals.py",
    "e2e/test_resume.py",
    "model/test_train_layer.py",
    "plan/test_planner.py",
    "e2e/test_launcher_runs.py",
    "e2e/test_crash_safe.py",
    "checkpoint/test_resume_guards.py",
)


def pytest_collection_finish(session):
    """MindSpore runs a full ``gc.collect()`` before every graph compile (mindspore/graph/api.py,
    ``_CellGraphExecutor.compile``); a process that collected the whole suite holds ~700,000 objects (torch,
    transformers, MindFormers, the test modules), ~0.5 s to scan each time. What is alive once collection ends
    (modules, classes, functions) goes to the permanent generation (``gc.freeze``), so those collects scan only what
    the tests make: test_decode_layer.py's tests among the whole suite's collection, 184 -> 154 s."""
    import gc
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """On a pytest-xdist worker, LONGEST_FIRST's files first (every worker sorts the same way, as xdist needs)."""
    if not hasattr(config, "workerinput"):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.relpath(str(item.path), here), len(rank)))
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, seq_length=64, hidden_dropout=0.0, attention_dropout=0.0,
            bos_token_id=0, eos_token_id=0, pad_token_id=0)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """prepare-data output for ~150 KB of stdlib sources: seq 64, a 512-token BPE."""
    from mindformers_gptlocal.data.prepare import prepare
    out = tmp_path_factory.mktemp("corpus") / "data"
    return prepare(out=str(out), seq_length=64, vocab_size=512, max_bytes=150_000, eval_fraction=0.1)


@pytest.fixture
def mcore_context():
    """MindFormers' mcore context (use_legacy False) in GRAPH mode for one test, reset after it."""
    import mindspore as ms
    from mindformers.tools.register import MindFormerConfig
    from mindformers.core.context.build_context import MFContextOperator
    MFContextOperator(MindFormerConfig(use_legacy=False))
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=ms.PYNATIVE_MODE)
    MFContextOperator.reset_instance()


@pytest.fixture
def tiny_config():
    from mindformers_gptlocal import GPTLocalConfig
    return GPTLocalConfig(**TINY)


def tiny_yaml(tmp_path, name="pretrain_gpt_local_tiny_cpu.yaml", corpus=None, **changes):
    """A model_configs YAML shrunk to the tiny model and pointed at ``corpus``; ``changes`` are dotted keys."""
    config = yaml_io.load_yaml(os.path.join(CONFIGS, name))
    config["model"]["model_config"].update(TINY)
    config["output_dir"] = str(tmp_path / "output")
    if corpus:
        for section in ("train_dataset", "eval_dataset"):
            if section in config and config[section]["data_loader"]["type"] == "MindDataset":
                key = "train_mindrecord" if section == "train_dataset" else "eval_mindrecord"
                config[section]["data_loader"]["dataset_dir"] = corpus[key]
        if "pretrained_model_dir" in config:
            config["pretrained_model_dir"] = corpus["model_dir"]
        for callback in config.get("callbacks", []):
            if callback["type"] == "GPTLocalSaveModelDir":
                callback["tokenizer_dir"] = corpus["model_dir"]
    for callback in config.get("callbacks") or []:
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["loss_digits"] = 17  # every loss exact: the tests compare runs bit for bit
    for dotted, value in changes.items():
        node = config
        parts = dotted.split("__")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    for section in ("train_dataset", "eval_dataset"):
        if f"{section}_task" in config and section in config:
            config[f"{section}_task"]["dataset_config"] = config[section]
    return yaml_io.dump_yaml(config, str(tmp_path / "run.yaml"))


def source_env(**extra):
    """Environment for subprocesses that import this working tree, not an older installed copy."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


class Launch:
    """``gptlocal run ARGS`` (or another ``command`` line) started now in a subprocess; ``result()`` waits and returns
    (exit code, its stdout then its stderr), and sets ``returncode``, ``stdout`` and ``stderr`` as
    ``subprocess.run`` would. Start two independent runs before asking for either result and they overlap: a tiny
    run spends most of its time importing MindFormers and compiling, on about one core, and the machine has two.
    The output goes to temporary files, not pipes, so a run is never held up waiting for its output to be read.
    ``result()`` may be called again: the same answer.

    A ``gptlocal run`` without ``env`` changes is a child forked from this pytest process's zygote
    (tests/forked_launch.py), which has imported MindSpore and MindFormers once: ~6 s less a run. ``fresh=True``
    starts a new interpreter instead, as a user's shell does, for the checks that are about the process's start
    (what its console shows before the first gpt_local line, its memory from zero, signals held before MindSpore
    is imported: tests/e2e/test_stop_signals.py starts its own). ``script``: ``python SCRIPT ARGS`` instead (e.g.
    MindFormers' own launcher), forked from the zygote as well. ``file_size_limit``: the forked child's RLIMIT_FSIZE
    (bytes; SIGXFSZ ignored, so a write past it fails with EFBIG: a full disk)."""

    def __init__(self, args, cwd, env=None, command=None, fresh=False, script=None, file_size_limit=None):
        self._files = [tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") for _ in range(2)]
        if command is None and not env and not fresh:
            self.proc = _Zygote.launch(list(args) if script else ["run", *args], cwd, self._files, script,
                                       file_size_limit)
            return
        assert file_size_limit is None, "file_size_limit: forked launches only"
        self.proc = subprocess.Popen(command or [sys.executable, "-m", "mindformers_gptlocal.cli", "run", *args],
                                     cwd=cwd, env=source_env(**(env or {})), stdout=self._files[0],
                                     stderr=self._files[1])

    def result(self, timeout=600):
        if self._files:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
            for handle in self._files:
                handle.seek(0)
            self.stdout, self.stderr = (handle.read() for handle in self._files)
            for handle in self._files:
                handle.close()
            self._files, self.returncode = [], self.proc.returncode
        return self.returncode, self.stdout + self.stderr


class _Forked:
    """The part of ``subprocess.Popen`` ``Launch`` uses, for a child of the zygote (tests/forked_launch.py)."""

    def __init__(self, pid, status):
        self.pid, self._status, self.returncode = pid, status, None

    def poll(self):
        if self.returncode is None and os.path.exists(self._status):
            with open(self._status) as handle:
                self.returncode = int(handle.read())
            os.remove(self._status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("gptlocal run (forked)", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum):
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """One zygote per pytest process, started at the first ``Launch`` that can use it."""
    proc = None

    @classmethod
    def launch(cls, argv, cwd, files, script=None, file_size_limit=None):
        if cls.proc is None or cls.proc.poll() is not None:
            home = tempfile.mkdtemp(prefix="gptlocal-zygote-")
            atexit.register(cls._end, home)
            cls.proc = subprocess.Popen(
                [sys.executable, os.path.join(REPO, "tests", "forked_launch.py"),
                 os.path.join(REPO, "mindformers_gptlocal", "cli", "__main__.py")],
                cwd=home, env=source_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=open(os.path.join(home, "zygote.log"), "w"), text=True)
            ready = cls.proc.stdout.readline()
            if ready != "ready\n":
                with open(os.path.join(home, "zygote.log")) as log:
                    raise AssertionError(f"the zygote did not start: {ready!r}\n{log.read()[-3000:]}")
        status = tempfile.mktemp(prefix="gptlocal-status-")
        paths = [f"/proc/{os.getpid()}/fd/{handle.fileno()}" for handle in files]
        cls.proc.stdin.write(json.dumps({"argv": [str(a) for a in argv], "cwd": os.path.abspath(cwd or os.getcwd()),
                                         "out": paths[0], "err": paths[1], "status": status,
                                         "script": script and str(script),
                                         "file_size_limit": file_size_limit}) + "\n")
        cls.proc.stdin.flush()
        return _Forked(int(cls.proc.stdout.readline()), status)

    @classmethod
    def _end(cls, home):
        """At the pytest process's exit: the zygote ends at the end of its input; its folder goes."""
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.stdin.close()
            try:
                cls.proc.wait(30)
            except subprocess.TimeoutExpired:
                cls.proc.kill()
        shutil.rmtree(home, ignore_errors=True)


def run_launcher(args, cwd, env=None, timeout=600, fresh=False):
    """``gptlocal run ARGS`` in a subprocess (a fresh interpreter with ``fresh``, or with ``env`` changes; else a
    zygote's child); returns (exit code, combined output)."""
    return Launch(args, cwd, env, fresh=fresh).result(timeout)


def start_run(args, cwd, log):
    """``gptlocal run ARGS`` started in a zygote's child (see Launch), stdout and stderr appended to the open file
    ``log``; returns an object with ``subprocess.Popen``'s pid, poll, wait, send_signal and kill."""
    return _Zygote.launch(["run", *args], cwd, [log, log])


def launch_in_process(args, cwd, capsys, monkeypatch):
    """``gptlocal run ARGS`` through the CLI's own ``main`` in this process, for runs the pre-flight refuses
    (nothing is built, no MindSpore context is set): the same code and output as ``run_launcher`` without a
    subprocess that spends ~7 s importing MindFormers. Returns (exit code, combined output)."""
    from mindformers_gptlocal.cli.main import main
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = main(["run", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def step_losses(output):
    """Losses from GPTLocalThroughputMonitor lines, in step order."""
    return [float(x) for x in re.findall(r"\[gptlocal\] step \d+/\d+\s+loss (\S+)", output)]


# --- one tiny training run shared by the files that need "the default CPU YAML trained 20 steps" ----------------
TRAINED_STEPS = 20


@pytest.fixture(scope="session")
def tiny_trained_run(corpus, tmp_path_factory):
    """The shipped tiny CPU YAML (GPTLocalAdamW, its own callbacks but the checkpoint monitor) trained TRAINED_STEPS
    steps at lr 3e-3 through the launcher, printing every step: {"out": launcher output, "losses": step losses,
    "model_dir": the model directory its GPTLocalSaveModelDir wrote}. One launch (conftest's uninterrupted_run, so
    one for both xdist workers) serves test_launcher_runs (eval, predict, finetune from it), test_optim (the fast
    side of the fast-vs-plain loss curve) and test_bf16_training (the float32 side)."""
    tmp = tmp_path_factory.mktemp("tiny_trained")
    yaml_path = tiny_yaml(tmp, corpus=corpus, train_dataset__data_loader__num_samples=TRAINED_STEPS * 4,
                          lr_schedule__learning_rate=3e-3)
    config = yaml_io.load_yaml(yaml_path)
    assert config["optimizer"]["type"] == "GPTLocalAdamW", config["optimizer"]  # test_optim's fast side
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["per_print_times"] = 1
    yaml_io.dump_yaml(config, yaml_path)
    code, out, folder = _stored_run(tmp_path_factory, corpus, yaml_path, fresh=True)
    assert code == 0, out[-3000:]
    return {"out": out, "losses": step_losses(out), "model_dir": os.path.join(str(folder), "output", "model")}


# --- uninterrupted reference runs, one per YAML content for the whole session (every xdist worker) --------------
CORPUS_FILES = ("train.mindrecord", "train.mindrecord.db", "eval.mindrecord", "eval.mindrecord.db",
                "megatron/train_text_document.bin", "megatron/train_text_document.idx", "model/config.json",
                "model/tokenizer.json", "model/tokenizer_config.json", "model/tokenizer_id")


def _corpus_fingerprint(folder):
    """sha256 of the prepared corpus's files (CORPUS_FILES: not meta.json, which holds its paths and timing, nor
    the index caches a Megatron run writes beside them later): prepare-data writes the same bytes in every worker,
    so the same fingerprint names the same data wherever it is."""
    digest = hashlib.sha256()
    for name in CORPUS_FILES:
        with open(os.path.join(folder, name), "rb") as handle:
            digest.update(name.encode() + b"\0" + hashlib.sha256(handle.read()).digest())
    return digest.hexdigest()


def _reference_key(config, corpus_folder):
    """The run's identity: the YAML without output_dir and without its checkpoint monitors (where and whether
    checkpoints are saved changes no loss), the corpus named by its content rather than its path."""
    config = dict(config)
    config.pop("output_dir", None)
    config["callbacks"] = [c for c in config.get("callbacks") or [] if not c["type"].endswith("CheckpointMonitor")]
    fingerprint = _corpus_fingerprint(corpus_folder)

    def named(value):
        if isinstance(value, dict):
            return {key: named(item) for key, item in value.items()}
        if isinstance(value, list):
            return [named(item) for item in value]
        if isinstance(value, str) and value.startswith(corpus_folder + os.sep):
            return f"<corpus {fingerprint}>" + value[len(corpus_folder):]
        return value
    return hashlib.sha256(json.dumps(named(config), sort_keys=True, default=str).encode()).hexdigest()[:20]


# The tiny CPU YAML with dropout on (hidden and attention 0.1) for SHARED_STEPS steps: the run that
# test_stop_signals, test_crash_safe and test_resume (MindRecord) stop, kill and resume, so its uninterrupted
# losses are run once for the three (uninterrupted_run).
SHARED_STEPS = 40
SHARED_CHANGES = dict(model__model_config__hidden_dropout=0.1, model__model_config__attention_dropout=0.1,
                      train_dataset__data_loader__num_samples=4 * SHARED_STEPS)


def megatron_changes(corpus, steps):
    """The tiny Megatron YAML's changes (``tiny_yaml``) for a ``steps``-step run on the corpus's .bin/.idx, dropout
    on and a dynamic loss scale (4096, doubling every 3 clean steps): test_resume's exact resume, whose
    uninterrupted run test_launcher_runs' Megatron run is (uninterrupted_run)."""
    prefix = os.path.join(os.path.dirname(corpus["train_mindrecord"]), "megatron", "train_text_document")
    return dict(model__model_config__hidden_dropout=0.1, model__model_config__attention_dropout=0.1,
                train_dataset__data_loader__sizes=[4 * steps, 0, 0],
                train_dataset__data_loader__config__seq_length=64,
                train_dataset__data_loader__config__data_path=["1", prefix],
                runner_wrapper__scale_sense={"type": "DynamicLossScaleUpdateCell", "loss_scale_value": 4096,
                                             "scale_factor": 2, "scale_window": 3})


def uninterrupted_run(tmp_path_factory, corpus, yaml_path):
    """(exit code, output) of ``gptlocal run --config YAML`` run once per session for every test that compares
    against the same YAML's uninterrupted losses: the YAML's content (checkpoint monitors and output_dir left out,
    ``_reference_key``) keys a store on disk shared by the xdist workers (loadfile: separate processes), a file lock
    making the first asker run it and the others wait for its result. The run saves no checkpoint."""
    return _stored_run(tmp_path_factory, corpus, yaml_path)[:2]


def _stored_run(tmp_path_factory, corpus, yaml_path, fresh=False):
    """uninterrupted_run's (exit code, output, the folder it ran in: its output_dir is folder/output); ``fresh``: in a
    new interpreter (Launch)."""
    from filelock import FileLock
    base = tmp_path_factory.getbasetemp()
    store = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "uninterrupted_runs"
    store.mkdir(exist_ok=True)
    config = yaml_io.load_yaml(str(yaml_path))
    key = _reference_key(config, os.path.dirname(corpus["train_mindrecord"]))
    result, folder = store / f"{key}.json", store / key
    with FileLock(str(store / f"{key}.lock"), timeout=1200):
        if not result.exists():
            folder.mkdir(exist_ok=True)
            config["output_dir"] = str(folder / "output")
            config["callbacks"] = [c for c in config.get("callbacks") or []
                                   if not c["type"].endswith("CheckpointMonitor")]
            path = yaml_io.dump_yaml(config, str(folder / "run.yaml"))
            code, out = run_launcher(["--config", path], cwd=str(folder), fresh=fresh)
            with open(str(result) + ".tmp", "w", encoding="utf-8") as handle:
                json.dump({"code": code, "out": out}, handle)
            os.replace(str(result) + ".tmp", result)
    with open(result, encoding="utf-8") as handle:
        saved = json.load(handle)
    return saved["code"], saved["out"], folder


# --- shared by several test files (were imported from one test file by another) ---
def snapshot(folder, skip=()):
    """relative path -> sha256 of every file under ``folder``, but those under a top-level folder named in ``skip``
    (e.g. MindFormers' ``log``): a folder's content by value, to show a refused run wrote nothing."""
    result = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if os.path.relpath(path, folder).split(os.sep)[0] not in skip:
                with open(path, "rb") as handle:
                    result[os.path.relpath(path, folder)] = hashlib.sha256(handle.read()).hexdigest()
    return result


def write_yaml(tmp_path, corpus, name="pretrain_gpt_local_tiny_cpu.yaml", monitor="GPTLocalCheckpointMonitor",
               keep=2, save_delay=0.0, **changes):
    """A tiny run printing every step and saving a checkpoint every step (keeping ``keep``) with ``monitor``;
    ``save_delay``: seconds each save waits before its rename (the monitor's ``test_save_delay``: kill tests)."""
    tmp_path.mkdir(exist_ok=True)
    yaml_path = tiny_yaml(tmp_path, name, corpus=corpus, **changes)
    config = yaml_io.load_yaml(yaml_path)
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["per_print_times"] = 1
        if callback["type"] == "GPTLocalCheckpointMonitor":
            callback.update(type=monitor, save_checkpoint_steps=1, keep_checkpoint_max=keep)
            if monitor != "GPTLocalCheckpointMonitor":
                callback.pop("stop_on_signal", None)  # gpt_local's key: MindFormers' own monitor refuses it
            if save_delay:
                callback["test_save_delay"] = save_delay
    return yaml_io.dump_yaml(config, yaml_path)


def save_tiny_base(path, corpus, seed, **changes):
    """A tiny gpt_local model directory at ``path`` (TINY with ``changes``, random weights from ``seed``, the corpus
    tokenizer, or none with ``corpus`` None) to finetune or serve from; returns the path as a string."""
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    ms.set_seed(seed)
    GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **changes))).save_pretrained(
        str(path), tokenizer_dir=None if corpus is None else corpus["model_dir"])
    return str(path)


def finetune_resumes_exactly(tmp_path, corpus, steps, half, **changes):
    """The finetune YAML with ``changes`` run through the launcher ``steps`` steps uninterrupted (tmp_path/full),
    saving every step and keeping every checkpoint, then resumed in a new process from its step-``half`` checkpoint
    (``--load_checkpoint full/output/checkpoint --resume_training <that file> --output_dir tmp_path/resumed``: the
    route of tests/e2e/test_resume_shipped.py; a run stopped by ``runner_config.stop_step`` and resumed with
    ``--resume_training True`` is tests/e2e/test_resume.py's, so the stopped run these tests once launched too is
    left out). Asserts both runs exit 0 and the resumed run, announced at step ``half``, repeats the rest bit for
    bit (shared by the LoRA, adapter and prefix-tuning tests). Returns {"out": the full run's output, "losses": its
    losses, "model_dir": its model directory, "stopped_names": the tensor names of its step-``half`` checkpoint}."""
    from mindformers_gptlocal.checkpoint import manifest
    from mindformers_gptlocal.safetensors_io import tensor_shapes
    full = write_yaml(tmp_path / "full", corpus, "finetune_gpt_local_tiny_cpu.yaml", keep=steps, **changes)
    code, out = run_launcher(["--config", full], cwd=str(tmp_path / "full"))
    assert code == 0, out[-3000:]
    reference = step_losses(out)
    assert len(reference) == steps, reference
    checkpoints = tmp_path / "full" / "output" / "checkpoint"
    saved = {entry["step"]: entry["file"] for entry in manifest.read_manifest(str(checkpoints))}
    assert sorted(saved) == list(range(1, steps + 1)), saved
    stopped = set(tensor_shapes(str(checkpoints / saved[half])))
    code, second = run_launcher(["--config", full, "--load_checkpoint", str(checkpoints), "--resume_training",
                                 saved[half], "--output_dir", str(tmp_path / "resumed")], cwd=str(tmp_path / "full"))
    assert code == 0, second[-3000:]
    assert f"(step {half})" in second, second[-3000:]
    assert step_losses(second) == reference[half:], (step_losses(second), reference)
    return dict(out=out, losses=reference, model_dir=tmp_path / "full" / "output" / "model", stopped_names=stopped)


def free_port():
    """A free TCP port on 127.0.0.1 (for a test server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def save_hf(path, seed=0, **overrides):
    """A random Hugging Face GPT-2 (non-trivial biases and norms) saved to ``path``; returns the torch model."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # non-trivial biases and norms, so every layout mistake shows
        for name, param in model.named_parameters():
            if "ln_" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="session")
def library():
    """gpt_local's CPU kernel library, compiled once per test session (or found in the user's cache)."""
    from mindformers_gptlocal.kernels.abi import build
    path, reason = build.library()
    assert path is not None, reason
    return path


ISA_TIERS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")  # kernels/abi/build.py ISAS but auto


@pytest.fixture(params=ISA_TIERS)
def isa_tier(request, library):
    """The kernel library capped at each ISA tier in turn (``model_config.cpu_kernels.isa``, ``build.apply_isa``),
    skipped above what this CPU has (its flags for our loops, oneDNN's own ISA above avx512); the cap lifted after.
    Yields the tier's name: every path of the library is tested by value on any machine that can run it."""
    from mindformers_gptlocal.kernels.abi import build
    decision = build.isa_decision(library)
    best = max(build.ISAS.index(decision["cpu"]), build.ISAS.index(decision["onednn_cpu"]))
    if ISA_TIERS.index(request.param) > best:
        pytest.skip(f"this CPU has no {request.param} (it has up to {build.ISAS[best]})")
    build.apply_isa(request.param, library)
    try:
        yield request.param
    finally:
        build.apply_isa("auto", library)


def _in_mode(mode):
    import mindspore as ms
    before = ms.get_context("mode")
    ms.set_context(mode=mode)
    yield
    ms.set_context(mode=before)


@pytest.fixture
def graph_mode():
    """GRAPH mode for one test, then whatever mode was set before."""
    import mindspore as ms
    yield from _in_mode(ms.GRAPH_MODE)


@pytest.fixture
def pynative_mode():
    """PYNATIVE mode for one test (whatever an earlier test of the session left), then the mode before."""
    import mindspore as ms
    yield from _in_mode(ms.PYNATIVE_MODE)

