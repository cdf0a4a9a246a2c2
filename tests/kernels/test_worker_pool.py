"""The kernels' worker pool (common.h ``gptlocal::WorkerPool``: threads started once and woken per parallel part):
results by value on two threads, calls from two threads at once (one finds the pool busy and starts its own
threads), many calls in a row, and a forked child (the parent's pool threads do not exist there) computing the same.
Called through the library's C entry points (the AOT signature MindSpore uses), with numpy as the reference."""
import ctypes
import os
import select
import signal
import threading

import numpy as np
import pytest

from mindformers_gptlocal.kernels.abi.aot import DirectCall
from mindformers_gptlocal.kernels.abi.table import LinearOptions


@pytest.fixture(scope="module")
def library():
    from mindformers_gptlocal.kernels.abi import build
    path, why = build.library()
    if path is None:
        pytest.skip(why)
    return ctypes.CDLL(path)


def linear(library, x, w, threads):
    """gptlocal_linear_fwd(x, w, LinearOptions(threads, float32)) -> x w^T, as MindSpore calls it."""
    args = LinearOptions(threads, 0).array()
    y = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    assert DirectCall(library.gptlocal_linear_fwd, [x, w, args, y]).call() == 0
    return y


def case(seed, rows, out, inner):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, inner), np.float32), rng.standard_normal((out, inner), np.float32)


def close(got, x, w):
    want = x.astype(np.float64) @ w.astype(np.float64).T
    return np.allclose(got, want, rtol=1e-4, atol=1e-3 * np.sqrt(x.shape[1]))


def within_float32_dot_bound(got, x, w):
    """Each of got = x w^T is a float32 sum of its K products in some order: within gamma_K * sum_k |x_k w_k| of the
    exact value, gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and Stability, 3.1), whatever the order."""
    inner = x.shape[1]
    gamma = inner * 2.0 ** -24 / (1 - inner * 2.0 ** -24)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    spread = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    return bool(np.all(np.abs(got - exact) <= gamma * spread))


@pytest.mark.parametrize("rows,out,inner", [(1, 1040, 300), (7, 33, 4096), (64, 768, 768), (3, 5000, 64)])
def test_two_threads_give_one_result_call_after_call(library, rows, out, inner):
    """Column blocks on the pool's threads: many calls in a row at two threads (the pool reused) give one result bit
    for bit (each block one GEMM, the blocks fixed by the thread count: no sum crosses threads, none depends on
    scheduling), within float32's bound of the exact product, as one thread's is. One thread's and two threads'
    may differ in the last bits: oneDNN sums a column's K products in an order it picks by the block's shape (at
    7 x 33 x 4096, two threads' second block is one column wide and runs oneDNN's gemv kernel: on AVX2 it sums in
    another order than the 33-column GEMM of one thread; on the AVX-512 machine this test was written on the two
    agreed)."""
    x, w = case(rows + out, rows, out, inner)
    one, two = linear(library, x, w, 1), linear(library, x, w, 2)
    assert within_float32_dot_bound(one, x, w) and within_float32_dot_bound(two, x, w)
    for _ in range(20):
        assert np.array_equal(linear(library, x, w, 2), two)


def test_calls_from_two_threads_at_once(library):
    """Two callers at once (ctypes lets go of the GIL): whichever finds the pool busy starts its own threads; every
    result is right."""
    cases = [case(seed, 16, 1536, 512) for seed in range(2)]
    wants = [linear(library, x, w, 1) for x, w in cases]
    failures = []

    def caller(index):
        x, w = cases[index]
        for _ in range(30):
            if not np.array_equal(linear(library, x, w, 2), wants[index]):
                failures.append(index)

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join(120)
    assert not any(thread.is_alive() for thread in callers) and failures == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_computes_with_a_pool_of_its_own(library):
    """The parent has used the pool; a forked child (a data loader's worker, a launcher) gets a new one: its calls
    finish with the parent's numbers instead of waiting for threads that did not survive the fork."""
    x, w = case(9, 32, 2048, 256)
    want = linear(library, x, w, 2)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one byte, 1 where every call gave the parent's numbers
        os.close(read)
        ok = all(np.array_equal(linear(library, x, w, 2), want) for _ in range(5))
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 60)
    if not ready:  # a child waiting for its parent's threads: fail, not hang
        os.kill(pid, signal.SIGKILL)
    answer = os.read(read, 1) if ready else b""
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert answer == b"1" and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
