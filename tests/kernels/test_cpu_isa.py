"""The GEMM choices by the ISA oneDNN sees (``common.h`` ``bf16_gemm_fast``, ``s8_gemm_exact``, on oneDNN's
``dnnl_cpu_isa_t`` bit masks, read by ``dnnl_get_effective_cpu_isa``): the rules for every ISA oneDNN names, given;
and here, that the library's choices follow them: precision 1 runs oneDNN's bf16 GEMM only where its kernels are
fast (a bf16 GEMM of a few hundred rows takes at most a few times the float32 one: oneDNN's reference bf16 GEMM,
what a CPU below AVX-512 gets from it, takes ~100 times), the int8 product oneDNN's s8s8s32 only where it is exact
(test_cores.py has its values)."""
import ctypes
import time

import numpy as np
import pytest

from mindformers_gptlocal.kernels import table
from mindformers_gptlocal.kernels.aot import call_core

# oneDNN's dnnl_cpu_isa_t (oneapi/dnnl/dnnl_types.h): each ISA's bits a superset of those below it on its branch
ISAS = {"default": 0x0, "sse41": 0x1, "avx": 0x3, "avx2": 0x7, "avx2_vnni": 0xF, "avx2_vnni_2": 0x1F,
        "avx512_core": 0x27, "avx512_core_vnni": 0x67, "avx512_core_bf16": 0xE7, "avx512_core_fp16": 0x1EF,
        "avx512_core_amx": 0xFEF, "avx512_core_amx_fp16": 0x1FEF}
BF16_FAST = {"avx512_core", "avx512_core_vnni", "avx512_core_bf16", "avx512_core_fp16", "avx512_core_amx",
             "avx512_core_amx_fp16"}
INT8_EXACT = {"avx2_vnni", "avx2_vnni_2", "avx512_core_vnni", "avx512_core_bf16", "avx512_core_fp16",
              "avx512_core_amx", "avx512_core_amx_fp16"}


@pytest.fixture(scope="module")
def lib(library):
    handle = ctypes.CDLL(library)
    for rule in (handle.gptlocal_bf16_gemm_fast, handle.gptlocal_int8_gemm_exact):
        rule.argtypes = [ctypes.c_int]
    return handle


@pytest.mark.parametrize("name", ISAS)
def test_the_rules_for_each_isa(lib, name):
    """bf16: oneDNN's GEMM kernels from avx512_core on (bf16 emulated in AVX-512 below avx512_core_bf16); below,
    its reference GEMM. int8: exact with VNNI, AVX2's or AVX-512's; AVX2 and avx512_core saturate int16 pair sums."""
    assert lib.gptlocal_bf16_gemm_fast(ISAS[name]) == (name in BF16_FAST)
    assert lib.gptlocal_int8_gemm_exact(ISAS[name]) == (name in INT8_EXACT)


def test_this_cpu_follows_the_rules(lib):
    isa = lib.gptlocal_cpu_isa()
    assert lib.gptlocal_linear_bf16_native() == lib.gptlocal_bf16_gemm_fast(isa)
    assert lib.gptlocal_int8_method(0) == (2 if lib.gptlocal_int8_gemm_exact(isa) else 1)


def _best_time(call, repeats=5):
    call()  # warm: buffers, the worker pool, oneDNN's first-call setup
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def test_a_bf16_gemm_takes_a_few_times_the_float32_one(lib):
    """384 x 512 x 512 on one thread at precision 1 (compute_dtype bfloat16: oneDNN's bf16 GEMM or its emulation,
    as this CPU gets it) against precision 0: under 8 times (the emulation rounds both operands and runs sgemm;
    the native GEMM is faster than sgemm; oneDNN's reference bf16 GEMM took ~100 times here)."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((384, 512)).astype(np.float32), rng.standard_normal((512, 512)).astype(np.float32)
    y = np.zeros((384, 512), np.float32)
    kernel = table.KERNELS["gptlocal_linear_fwd"]
    times = [_best_time(lambda p=precision: call_core(lib, kernel, x, w, None, y, options=table.LinearOptions(1, p)))
             for precision in (0, 1)]
    assert times[1] < 8 * times[0], times
