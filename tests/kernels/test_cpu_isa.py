"""The library's one CPU-ISA decision (``common.h`` ``IsaTier``; ``model_config.cpu_kernels.isa``,
``build.apply_isa``): capped at each tier this CPU has (the ``isa_tier`` fixture), the decision says so, the GEMM
choices follow the capped ISA, and the decoder's Linear (float32, bfloat16 and int8 weights: rows_plain, rows_avx2,
int8_rows_plain, int8_rows_avx2) equals the plain product by value at every tier; oneDNN itself capped in a fresh
process (dnnl_set_max_cpu_isa); the key's values. The GEMM choices by the ISA oneDNN sees (``bf16_gemm_fast``,
``s8_gemm_exact``, on oneDNN's ``dnnl_cpu_isa_t`` bit masks, read by ``dnnl_get_effective_cpu_isa``): the rules for
every ISA oneDNN names, given; and here, that the library's choices follow them: precision 1 runs oneDNN's bf16 GEMM
only where its kernels are fast (a bf16 GEMM of a few hundred rows takes at most a few times the float32 one:
oneDNN's reference bf16 GEMM, what a CPU below AVX-512 gets from it, takes ~100 times), the int8 product oneDNN's
s8s8s32 only where it is exact (test_cores.py has its values)."""
import ctypes
import subprocess
import sys
import time

import numpy as np
import pytest

from mindformers_gptlocal import GPTLocalConfig
from mindformers_gptlocal.errors import ConfigError
from mindformers_gptlocal.kernels.abi import build, table
from mindformers_gptlocal.kernels.abi.aot import call_core
from mindformers_gptlocal.kernels.provider import KernelProvider
from mindformers_gptlocal.model.quantization import quantize_rows
from conftest import ISA_TIERS, REPO, TINY, source_env
from references import assert_within_rounding, int8_linear_reference

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
    for rule in (handle.gptlocal_bf16_gemm_fast, handle.gptlocal_int8_gemm_exact, handle.gptlocal_isa):
        rule.argtypes = [ctypes.c_int]
    handle.gptlocal_decoder_linear.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
    return handle


# the loops' widest tier (our code has scalar, AVX2 and AVX-512 versions); above it only oneDNN's ISA differs
LOOPS = ("scalar", "avx2", "avx512")
TIER_MASKS = {"scalar": ISAS["sse41"], "avx2": ISAS["avx2"], "avx512": ISAS["avx512_core"],
              "avx512_bf16": ISAS["avx512_core_bf16"], "amx": ISAS["avx512_core_amx"]}


def test_each_tier_is_the_decision_and_the_gemm_choices_follow_it(lib, isa_tier):
    """Capped at a tier: the loops run min(tier, the CPU's flags, avx512), oneDNN's ISA as the choices read it is
    within the tier's mask, and the bf16 / int8 choices follow that capped ISA (below avx512: the bf16 emulation;
    without VNNI: the int8 dot loop)."""
    decision = build.isa_decision()
    index = ISA_TIERS.index
    assert decision["cap"] == isa_tier
    assert decision["loops"] == LOOPS[min(index(isa_tier), index(decision["cpu"]), 2)]
    assert decision["onednn"] == ISA_TIERS[min(index(isa_tier), index(decision["onednn_cpu"]))]
    isa = lib.gptlocal_cpu_isa()
    assert isa & TIER_MASKS[isa_tier] == isa  # nothing above the cap
    assert lib.gptlocal_linear_bf16_native() == lib.gptlocal_bf16_gemm_fast(isa) == (
        index(decision["onednn"]) >= index("avx512"))
    assert lib.gptlocal_int8_method(0) == (2 if lib.gptlocal_int8_gemm_exact(isa) else 1)


def _decoder_linear(lib, kind, x, w, scale, b, n):
    """The decoder's Linear (cpu_decoder.cc ``linear``) of weight ``kind`` (0 float32, 1 bfloat16 bits, 2 int8)."""
    y = np.full((x.shape[0], n), np.nan, np.float32)
    pointer = lambda a: None if a is None else a.ctypes.data  # noqa: E731
    status = lib.gptlocal_decoder_linear(kind, 2 if kind == 1 else 0, 2, pointer(w), pointer(scale), pointer(b),
                                         pointer(x), pointer(y), *x.shape, n)
    assert status == 0
    return y


@pytest.mark.parametrize("rows", [1, 3, 6])  # the few-row GEMMs' rows: one, a partial tile of 4, a tile and more
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_the_decoders_linear_equals_the_plain_product_at_each_tier(lib, isa_tier, kind, rows):
    """x W^T + b through the decoder's few-row GEMMs at each tier (K 77: a tail after the vector blocks, N 37 with
    two threads): float32 and bf16 weights within float32's rounding of the float64 product (x rounded to bf16 for a
    bf16 weight, as the GEMM does), int8 equal to the int8 scheme's numpy reference exactly (the products summed in
    int32 exactly at every tier)."""
    inner, outer = 77, 37
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    w = rng.standard_normal((outer, inner)).astype(np.float32)
    b = rng.standard_normal(outer).astype(np.float32)
    if kind == "int8":
        quantized, scale = quantize_rows(w)
        got = _decoder_linear(lib, 2, x, np.ascontiguousarray(quantized), scale.astype(np.float32), b, outer)
        np.testing.assert_array_equal(got, int8_linear_reference(x, quantized, scale, b))
        return
    if kind == "bfloat16":
        bits = _bf16_bits(w)
        got = _decoder_linear(lib, 1, x, bits, None, b, outer)
        x, w = _bf16_value(_bf16_bits(x)), _bf16_value(bits)
    else:
        got = _decoder_linear(lib, 0, x, w, None, b, outer)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    assert_within_rounding(got, x64 @ w64.T + b, np.abs(x64) @ np.abs(w64).T + np.abs(b), inner + 1, sides=1,
                           name=f"{kind} {isa_tier}")


def _bf16_bits(a):
    """float32 -> bfloat16 bits, to nearest even (common.h bf16_bits)."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_onednn_itself_is_capped_in_a_fresh_process(library):
    """A process that caps the library before oneDNN's first use caps oneDNN's own kernels (dnnl_set_max_cpu_isa):
    oneDNN then reports the tier, and its sgemm (the decoder's Linear from 9 rows) is right there."""
    script = (
        "import numpy as np, ctypes\n"
        "from mindformers_gptlocal.kernels.abi import build\n"
        f"decision = build.apply_isa('scalar', {library!r})\n"
        "assert decision['onednn_cpu'] == decision['onednn'] == decision['loops'] == 'scalar', decision\n"
        f"lib = ctypes.CDLL({library!r})\n"
        "rng = np.random.default_rng(0)\n"
        "x, w = rng.standard_normal((9, 50)).astype(np.float32), rng.standard_normal((20, 50)).astype(np.float32)\n"
        "y = np.zeros((9, 20), np.float32)\n"
        "lib.gptlocal_decoder_linear.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3\n"
        "assert lib.gptlocal_decoder_linear(0, 0, 1, w.ctypes.data, None, None, x.ctypes.data, y.ctypes.data, 9, 50,"
        " 20) == 0\n"
        "exact = x.astype(np.float64) @ w.T.astype(np.float64)\n"
        "bound = 50 * 2.0 ** -24 / (1 - 50 * 2.0 ** -24) * (np.abs(x).astype(np.float64) @ np.abs(w).T)\n"
        "assert (np.abs(y - exact) <= bound).all()\n"
        "print(build.describe_isa())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                          env=source_env(), timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "isa scalar: loops scalar, oneDNN scalar" in done.stdout


def test_the_isa_key(library):
    """``cpu_kernels: {isa: ...}`` beside the ops: read by the provider and applied to the library (the last
    model built sets it); another value is one ConfigError naming the key and the values."""
    try:
        provider = KernelProvider({"isa": "scalar", "linear": "kernel"}, device_target="CPU")
        assert provider.isa == "scalar" and provider.modes["linear"] == "kernel"
        assert build.isa_decision(library)["loops"] == "scalar"
        assert KernelProvider("auto", device_target="CPU").isa == "auto"
        assert build.isa_decision(library)["cap"] == "auto"  # an auto model after a capped one lifts the cap
    finally:
        build.apply_isa("auto", library)
    with pytest.raises(ConfigError, match="cpu_kernels.isa is 'avx3'; set one of auto, scalar, avx2"):
        KernelProvider({"isa": "avx3"}, device_target="CPU")
    assert GPTLocalConfig(**dict(TINY, cpu_kernels={"isa": "avx2", "linear": "plain"})).cpu_kernels == {
        "isa": "avx2", "linear": "plain"}  # config.json keeps it
    with pytest.raises(ConfigError, match="cpu_kernels.isa is 'avx3'"):
        GPTLocalConfig(**dict(TINY, cpu_kernels={"isa": "avx3"}))


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
