"""The benchmarks' workers run with the thread count asked, even when started from a process that imported
MindSpore (which sets OMP_NUM_THREADS=1 in the C environment), and refuse to measure otherwise."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

BENCH = os.path.join(REPO, "benchmarks")
sys.path.insert(0, BENCH)
import _common as C  # noqa: E402

TINY = json.dumps(dict(C.SHAPES["tiny"], seq=32, batch=1))
THREADS = 2


@pytest.fixture(scope="module")
def mindspore_imported():
    """The condition that broke the old benchmark: this process's C environment says OMP_NUM_THREADS=1."""
    __import__("mindspore")  # sets OMP_NUM_THREADS=1 via setenv
    assert C.c_getenv("OMP_NUM_THREADS") == "1"


@pytest.mark.parametrize("script,args", [
    ("train_throughput.py", ["--torch-worker", TINY, "--steps", "0", "--data", "-"]),
    ("finetune_throughput.py", ["--torch-worker", "tiny", "--lora", "--steps", "0", "--data", "-"]),
    ("train_throughput.py", ["--ms-worker", "-"]),
    ("train_throughput.py", ["--gemm-worker", "torch"]),
    ("kernels.py", ["attention", "--side", "kernel", "--shape", "noop", "--steps", "0", "--worker"]),
    ("kernels.py", ["reduce", "--worker", "--noop"]),
    ("op_profile.py", ["llama", "--worker", "--noop"]),
    ("generate_throughput.py", ["--worker", "ours", "--work", "-"]),
    ("generate_throughput.py", ["--worker", "hf", "--work", "-"]),
    pytest.param("generate_throughput.py", ["--worker", "llamacpp-q8_0", "--work", "-"],
                 marks=pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                          reason="llama-cpp-python (an optional build: generate_throughput.py's "
                                                 "docstring) is not installed")),
    ("memory.py", ["serve", "--noop"]),
    ("serve_throughput.py", ["--ours-server", "-", "16"]),
    ("eval_throughput.py", ["--worker", "ours", "--work", "-"]),
    ("precision_accuracy.py", ["--worker", json.dumps({"threads": THREADS, "model": "-"})]),
])
def test_workers_run_with_the_threads_asked(mindspore_imported, script, args):
    report, _ = C.run_worker(os.path.join(BENCH, script), args + ["--threads", str(THREADS)], THREADS)
    assert report["env"] == {k: str(THREADS) for k in C.THREAD_VARS}
    assert report["runtime_threads"] == THREADS  # torch.get_num_threads() / MindSpore runtime_num_threads


def test_a_worker_refuses_an_inherited_thread_count(mindspore_imported):
    """Started the old way (no env=), the worker inherits OMP_NUM_THREADS=1 from this process's C
    environment, and must refuse rather than measure on one thread."""
    out = subprocess.run([sys.executable, os.path.join(BENCH, "train_throughput.py"), "--torch-worker", TINY,
                          "--steps", "0", "--data", "-", "--threads", str(THREADS)],
                         capture_output=True, text=True, check=False)
    assert out.returncode != 0
    assert "'OMP_NUM_THREADS': '1'" in out.stderr and "differ from --threads 2" in out.stderr


def test_alternate_orders_and_spread():
    calls = []
    results = C.alternate(("a", "b", "c"), 3, lambda side, index: calls.append(side) or (index + 1) * 10)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert results == {"a": [10, 20, 30], "b": [10, 20, 30], "c": [10, 20, 30]}
    assert C.spread([3.0, 1.0, 2.0]) == "2 [1-3]"


def test_read_bandwidth_is_the_bytes_over_the_best_time(monkeypatch):
    """GB/s = the array's bytes over the fastest of the timed sums (the first sum, the touch, is not timed)."""
    ticks = iter([10.0, 10.5, 11.0, 11.25, 12.0, 12.5])  # the timed sums take 0.5, 0.25, 0.5 s
    monkeypatch.setattr(C.time, "perf_counter", lambda: next(ticks))
    assert C.read_bandwidth_gbs(2, megabytes=8, repeats=3) == pytest.approx(8 * (1 << 20) / 0.25 / 1e9)


def test_run_py_names_every_benchmark_and_runs_a_part():
    """benchmarks/run.py is the one entry point: every script here but the shared helpers (and the ones other work
    removes) is a part of a suite, the listed commands are those run, and extra arguments reach the script."""
    import run
    scripts = {script for _, parts in run.SUITES.values() for _, script, _ in parts}
    here = {name for name in os.listdir(BENCH) if name.endswith(".py")}
    assert scripts <= here
    # besides the shared helpers, every script is a part of a suite
    assert here - scripts <= {"_common.py", "run.py", "eval_tasks.py"}
    out = subprocess.run([sys.executable, os.path.join(BENCH, "run.py"), "train", "--part", "small", "--dry-run",
                          "--rounds", "1"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("== train/small: python benchmarks/train_throughput.py --shapes small --rounds 2 --steps 5 "
                           "--warmup 2 --ours-bf16 --torch-variants compile,sdpa+fused-bf16,compile-bf16 --rounds 1")
    listed = subprocess.run([sys.executable, os.path.join(BENCH, "run.py"), "--list"], capture_output=True, text=True,
                            check=True).stdout
    assert all(f"python benchmarks/{script}" in listed for script in scripts)
    bad = subprocess.run([sys.executable, os.path.join(BENCH, "run.py"), "train", "--part", "huge"],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "suite train has no part 'huge'; its parts: tiny, small, llama" in bad.stderr


def test_run_py_runs_the_part_with_keep(tmp_path, capfd):
    """A part really runs (train's torch worker with zero steps) and ``--keep`` reaches ``_common``."""
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nsys.path.insert(0, %r)\nimport _common as C\nprint('keep', C.KEEP, sys.argv[1:])\n"
                     % BENCH)
    import run
    run.SUITES["probe"] = ("test", [("p", str(probe), "--x 1")])
    try:
        code = run.main(["probe", "--keep", "--y", "2"])
    finally:
        del run.SUITES["probe"]
    assert code == 0
    assert "keep True ['--x', '1', '--y', '2']" in capfd.readouterr().out


def test_run_py_waits_for_the_previous_parts_load_before_the_next(tmp_path, capfd, monkeypatch):
    """The second part starts once the 1-min load average (still counting the first part's workers) is below the
    BUSY line; the first part does not wait; a load that stays high is waited for at most ``limit`` s."""
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nprint('part', sys.argv[1:])\n")
    import run
    readings = iter([1.9, 1.4, 0.8])  # after the first part: two polls, then below 0.5 x 2 CPUs
    monkeypatch.setattr(run.C, "load_average", lambda: next(readings))
    monkeypatch.setattr(run.C, "busy_line", lambda: 1.0)
    monkeypatch.setattr(run.time, "sleep", lambda seconds: None)
    monkeypatch.setitem(run.SUITES, "probe", ("test", [("a", str(probe), "--a"), ("b", str(probe), "--b")]))
    assert run.main(["probe"]) == 0
    out = capfd.readouterr().out
    assert out.index("part ['--a']") < out.index("== waited") < out.index("part ['--b']")
    assert "1-min load now 0.8" in out and next(readings, None) is None
    monkeypatch.setattr(run.C, "load_average", lambda: 3.0)
    assert run.settle(limit=0.05, poll=0.01) >= 1  # returns after the limit, load still high


def test_performance_doc_commands_are_run_py_suites_and_parts():
    """Every command docs/performance.md gives to regenerate a figure is a benchmarks/run.py line naming a suite
    (and parts) that exist, and every job's table has one."""
    import re
    import run
    text = open(os.path.join(REPO, "docs", "performance.md"), encoding="utf-8").read()
    commands = re.findall(r"python benchmarks/run\.py ([a-z][a-z-]*)((?: --part [a-z0-9-]+)*)", text)
    assert commands
    for suite, parts in commands:
        assert suite in run.SUITES, suite
        names = [part for part, _, _ in run.SUITES[suite][1]]
        for part in re.findall(r"--part ([a-z0-9-]+)", parts):
            assert part in names, (suite, part)
    for suite in ("train", "long", "lora", "generate", "serve", "eval"):
        assert f"`python benchmarks/run.py {suite}`" in text, suite
    scripts = set(re.findall(r"python benchmarks/(\w+\.py)", text)) - {"run.py"}
    assert all(os.path.isfile(os.path.join(BENCH, name)) for name in scripts), scripts


def test_no_benchmark_names_a_variable_the_package_does_not_read():
    """The benchmarks choose kernels (and the rest) through the model config, never through the environment: every
    ``GPTLOCAL_*`` name a script holds is one the package reads (where caches go, the server's key)."""
    import re
    package = set()
    for root, _, files in os.walk(os.path.join(REPO, "mindformers_gptlocal")):
        for name in files:
            if name.endswith(".py"):
                package |= set(re.findall(r"GPTLOCAL_[A-Z_]+", open(os.path.join(root, name), encoding="utf-8").read()))
    package |= set(re.findall(r"GPTLOCAL_[A-Z_]+", open(os.path.join(REPO, "mindformers_gptlocal_autoregister.py"),
                                                         encoding="utf-8").read()))
    assert "GPTLOCAL_KERNEL_CACHE" in package  # the scan reads the package
    found = {}
    for name in sorted(os.listdir(BENCH)):
        if name.endswith(".py"):
            names = set(re.findall(r"GPTLOCAL_[A-Z_]+", open(os.path.join(BENCH, name), encoding="utf-8").read()))
            if names - package:
                found[name] = sorted(names - package)
    assert not found, found


def test_plain_sides_set_cpu_kernels_in_the_model_config(tmp_path):
    """Each benchmark's plain side asks for its plain ops through model_config.cpu_kernels (valid values, the ops
    its docstring names); the kernels sides leave the default."""
    import train_throughput
    import finetune_throughput
    import generate_throughput
    from mindformers_gptlocal import yaml_io
    from mindformers_gptlocal.kernels.provider import read_cpu_kernels
    corpus = tmp_path / "train.mindrecord"
    (tmp_path / "train.mindrecord.rows").write_text("8")
    shape = dict(C.SHAPES["tiny"], seq=32, batch=1)

    def model_config(side, extra=None):
        path = train_throughput.side_yaml(side, shape, 2, str(corpus), str(tmp_path), side, THREADS, extra)
        return yaml_io.load_yaml(path)["model"]["model_config"]

    plain = model_config("ours_plain", {"attention_block_size": 64})
    assert dict(plain["cpu_kernels"]) == {"layer_norm": "plain", "bias_gelu": "plain"}
    assert plain["attention_block_size"] == 64  # the other extra keys stay
    assert "cpu_kernels" not in model_config("ours")
    modes = read_cpu_kernels(finetune_throughput.PLAIN_DROPOUT["cpu_kernels"])
    assert [op for op, mode in modes.items() if mode == "plain"] == ["lora_dropout"]
    assert read_cpu_kernels(generate_throughput.SIDE_KERNELS["ours-matmul"])["linear"] == "plain"
    assert set(generate_throughput.SIDE_KERNELS) == {"ours-compiled", "ours-int8-compiled", "ours-bf16-compiled",
                                                     "ours-matmul", "ours-plain-decode", "ours-int8-plain-decode",
                                                     "ours-decode-kernel", "ours-bf16-decode-kernel",
                                                     "ours-plain-rms-swiglu"}
    # every side that names a kernel of the compiled graphs runs the compiled runner (runner: plain); ours: native
    for side, kernels in generate_throughput.SIDE_KERNELS.items():
        assert read_cpu_kernels(kernels)["runner"] == "plain", side
    for side in ("ours-compiled", "ours-int8-compiled", "ours-bf16-compiled"):  # the runner, nothing else
        modes = read_cpu_kernels(generate_throughput.SIDE_KERNELS[side])
        assert [op for op, mode in modes.items() if mode != "auto"] == ["runner"]

    def off(side):  # the ops a side turns off, besides the runner's graphs
        return sorted(op for op, mode in read_cpu_kernels(generate_throughput.SIDE_KERNELS[side]).items()
                      if mode == "plain" and op != "runner")
    for side in ("ours-plain-decode", "ours-int8-plain-decode"):  # the decode-layer kernel off, nothing else
        assert off(side) == ["decode_layer"]
    modes = read_cpu_kernels(generate_throughput.SIDE_KERNELS["ours-decode-kernel"])  # forced on, the rest auto
    assert {op: mode for op, mode in modes.items() if mode != "auto"} == {"decode_layer": "kernel", "runner": "plain"}
    assert generate_throughput.LINEAR_KERNEL == {"rows": "auto", "always": "kernel", "off": "plain"}
    assert off("ours-plain-rms-swiglu") == ["rms_norm", "swiglu"]
    llama = dict(C.SHAPES["llama-tiny"], seq=32, batch=1)
    path = train_throughput.side_yaml("ours_plain", llama, 2, str(corpus), str(tmp_path), "llama_plain", THREADS)
    assert dict(yaml_io.load_yaml(path)["model"]["model_config"]["cpu_kernels"]) == {"rms_norm": "plain",
                                                                                      "swiglu": "plain"}


def test_op_profile_plain_op_is_a_cpu_kernels_op():
    """``--plain-op``: the plain variant sets those cpu_kernels ops to plain, the kernels variant to kernel (as the old
    switch's 0 / 1); lora-plaindrop adds lora_dropout plain; a name that is no op is refused, exit 2."""
    import op_profile as P
    from mindformers_gptlocal.kernels.provider import KernelProvider
    assert P.cpu_kernels(["layer_norm", "bias_gelu"], False) == {"layer_norm": "plain", "bias_gelu": "plain"}
    assert P.cpu_kernels(["linear"], True) == {"linear": "kernel"}
    assert P.cpu_kernels(["layer_norm"], True, plain_dropout=True) == {"layer_norm": "kernel", "lora_dropout": "plain"}
    plain = KernelProvider(P.cpu_kernels(["linear"], False), device_target="CPU")
    assert plain.linear_gemm(__import__("mindspore").float32) == (None, None)
    assert KernelProvider(P.cpu_kernels(["linear"], True), device_target="CPU").uses("linear")
    bad = subprocess.run([sys.executable, os.path.join(BENCH, "op_profile.py"), "train", "--plain-op", "layernorm"],
                         capture_output=True, text=True, check=False, env=C.worker_env(THREADS))
    assert bad.returncode == 2 and "--plain-op: layernorm not an op of model_config.cpu_kernels" in bad.stderr


def test_llama_style_training_shape_is_one_model_on_both_sides(tmp_path):
    """The training benchmark's Llama-style shape: our YAML builds gpt_local's Llama-style layers (rope, grouped-query
    attention, SwiGLU, RMSNorm, no biases, untied head), HF's side builds LlamaForCausalLM, both with the parameter
    count ``_common.params_count`` gives (the MFU's 6N); the PyTorch worker trains the tiny variant a step, fp32 and
    under bf16 autocast."""
    import train_throughput
    from mindformers_gptlocal import yaml_io
    from mindformers_gptlocal.model.config import GPTLocalConfig
    from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
    corpus = tmp_path / "train.mindrecord"
    (tmp_path / "train.mindrecord.rows").write_text("8")
    shape = dict(C.SHAPES["llama-tiny"], seq=32, batch=1)
    path = train_throughput.side_yaml("ours", shape, 2, str(corpus), str(tmp_path), "llama", THREADS)
    config = dict(yaml_io.load_yaml(path)["model"]["model_config"])
    assert {k: config[k] for k in C.LLAMA_KEYS} == C.LLAMA_KEYS
    assert (config["num_query_groups"], config["intermediate_size"], config["num_attention_heads"]) == (2, 688, 8)
    values = {k: v for k, v in config.items() if k not in ("type", "model_type", "architectures", "auto_register")}
    ours = GPTLocalForCausalLM(GPTLocalConfig(**values))
    assert sum(p.size for p in ours.get_parameters()) == C.params_count(shape)
    windows = tmp_path / "windows.npy"
    np.save(windows, np.random.default_rng(0).integers(0, shape["vocab"], (4, shape["seq"] + 1)))
    for variant in ("sdpa+fused", "sdpa+fused-bf16"):
        report, _ = C.run_worker(os.path.join(BENCH, "train_throughput.py"),
                                 ["--torch-worker", json.dumps(shape), "--variant", variant, "--steps", "1", "--data",
                                  str(windows), "--threads", str(THREADS)], THREADS)
        assert report["trainable"] == C.params_count(shape) and len(report["step_times"]) == 1
        assert np.isfinite(report["last_loss"])
