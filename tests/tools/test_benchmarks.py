"""The benchmarks' workers run with the thread count asked, even when started from a process that imported
MindSpore (which sets OMP_NUM_THREADS=1 in the C environment), and refuse to measure otherwise."""
import json
import os
import subprocess
import sys

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
    ("attention_kernel.py", ["--worker", "kernel", "noop", "--steps", "0"]),
    ("llama_style_vs_transformers.py", ["--worker", "ours", "--dir", "-"]),
    ("train_gemms.py", ["--rounds", "0"]),
    ("serve_memory.py", ["--worker", "--noop"]),
    ("graph_heap.py", ["--worker", "mul", "1", ""]),
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
