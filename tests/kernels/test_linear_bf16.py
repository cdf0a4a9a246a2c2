"""Linear's GEMM kernel in bfloat16 (``compute_dtype: bfloat16`` on CPU; cpu_linear.cc ``LinearOptions.precision``):
oneDNN's bf16 GEMM and its emulation against the plain path (``model/layers.py`` ``BF16MatMul``: x and W rounded to
bfloat16 by Casts, float32 MatMul, dy rounded in the backward) by value, forward and both gradients, with and
without the bias, on odd shapes; bf16 against float32 (rounding happens, within bf16's error); the provider's
dtype rule (float32 graph, bf16 GEMMs on CPU only; every graph runs the kernel); the emulation's one line."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from mindformers_gptlocal.kernels import provider
from mindformers_gptlocal.kernels.abi import build, precision
from mindformers_gptlocal.kernels.cells import linear
from mindformers_gptlocal.kernels.cells.linear import BF16MatMul
from mindformers_gptlocal.kernels.provider import KernelProvider
from mindformers_gptlocal.model.layers import Linear, plain_matmul
from references import assert_within_rounding

SHAPES = [(1, 77, 109), (3, 77, 109), (17, 130, 70), (33, 77, 109)]  # K, N not multiples of 16; 33 x 109 x 77: 2 threads


def _round(a):
    """float32 -> nearest bfloat16 (ties to even), as float32 (numpy, bit arithmetic)."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def _values(fn, x, w, b, g, bias):
    args = tuple(Tensor(a) for a in ((x, w, b) if bias else (x, w)))
    grads = ms.grad(lambda *a: (fn(*a) * Tensor(g)).sum(), tuple(range(len(args))))(*args)
    return [fn(*args).asnumpy()] + [t.asnumpy() for t in grads]


def _data(shape):
    rows, k, n = shape
    rng = np.random.default_rng(rows * 1000 + k)
    return (rng.standard_normal((rows, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32),
            rng.standard_normal(n).astype(np.float32), rng.standard_normal((rows, n)).astype(np.float32))


def _plain(bias):
    matmul = BF16MatMul()
    return (lambda x, w, b: matmul(x, w) + b) if bias else matmul


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_kernel_and_emulation_match_the_plain_path(library, pynative_mode, shape, bias):
    """y, dx, dW (, db) of the kernel (oneDNN's bf16 GEMM) and of its forced emulation equal BF16MatMul's (+ Add)
    up to the order of float32 sums, and the float64 product of the rounded operands: within float32's rounding
    of sums of that length over the sums of |products| (``assert_within_rounding``), whatever order oneDNN's
    ISA sums in."""
    x, w, b, g = _data(shape)
    rows, k, n = shape
    want = _values(_plain(bias), x, w, b, g, bias)
    xr, wr, gr = (_round(a).astype(np.float64) for a in (x, w, g))
    exact = [xr @ wr.T + (b if bias else 0), gr @ wr, gr.T @ xr] + ([g.astype(np.float64).sum(0)] if bias else [])
    ax, aw, ag = np.abs(xr), np.abs(wr), np.abs(gr)
    magnitudes = [ax @ aw.T + (np.abs(b) if bias else 0), ag @ aw, ag.T @ ax, np.abs(g).astype(np.float64).sum(0)]
    lengths = [k + 1, n, rows, rows]
    for emulate in (False, True):
        kernel = linear.CPULinearGEMM(library, threads=2, precision="bfloat16", emulate=emulate)
        got = _values(kernel, x, w, b, g, bias)
        for name, actual, expected, precise, magnitude, length in zip(("y", "dx", "dw", "db"), got, want, exact,
                                                                      magnitudes, lengths):
            assert_within_rounding(actual, expected, magnitude, length, name=f"{name} {emulate}")
            assert_within_rounding(actual, precise, magnitude, length, sides=1, name=f"{name} {emulate} f64")


@pytest.mark.parametrize("shape", SHAPES[1:3])
def test_bf16_rounds_and_stays_within_bf16_error(library, pynative_mode, shape):
    """The bf16 kernel's y, dx, dW differ from float32's (the rounding happens) by at most bf16's error: two
    roundings of 2^-9 relative each, against the sum of |products|."""
    x, w, b, g = _data(shape)
    bf16 = _values(linear.CPULinearGEMM(library, threads=2, precision="bfloat16"), x, w, b, g, True)
    fp32 = _values(linear.CPULinearGEMM(library, threads=2), x, w, b, g, True)
    ax, aw, ag = (np.abs(a).astype(np.float64) for a in (x, w, g))
    bounds = [ax @ aw.T, ag @ aw, ag.T @ ax]
    for name, low, full, bound in zip(("y", "dx", "dw"), bf16, fp32, bounds):
        difference = np.abs(low - full)
        assert difference.max() > 0, name
        assert np.all(difference <= 2.0 ** -7 * bound + 1e-4), (name, float((difference / (bound + 1e-9)).max()))
    np.testing.assert_array_equal(bf16[3], fp32[3])  # db: dy's column sums, float32 either way


def test_round_matches_mindspore_cast(pynative_mode):
    """The rounding the kernel does (to nearest, ties to even) is MindSpore's Cast to bfloat16 (the plain path's):
    checked on ties and near-ties."""
    base = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    bits = base.view(np.uint32) & np.uint32(0xFFFF0000)
    ties = np.concatenate([bits | np.uint32(0x8000), bits | np.uint32(0x7FFF), bits | np.uint32(0x8001)])
    values = np.concatenate([base, ties.view(np.float32)])
    cast = ops.cast(ops.cast(Tensor(values), ms.bfloat16), ms.float32).asnumpy()
    np.testing.assert_array_equal(cast, _round(values))


def test_provider_dtype_rule():
    """On CPU bfloat16 computes in float32 between ops with bf16 GEMMs (the kernel in every graph: rows 0), not in
    a parallel build; GPU/Ascend keep the config's dtypes and no GEMM rule; float32 is unchanged."""
    cpu = KernelProvider(compute_dtype="bfloat16", device_target="CPU")
    assert (cpu.gemm_dtype, cpu.graph_dtype("bfloat16"), cpu.graph_dtype(ms.bfloat16)) == ("bfloat16",) + ("float32",) * 2
    assert cpu.graph_dtype("float16") == "float16"
    gemm, rule = cpu.linear_gemm(ms.float32)
    assert rule == provider.EVERY_GRAPH and gemm.precision == "bfloat16"
    assert cpu.linear_gemm(ms.float32, head=True)[1] == provider.EVERY_GRAPH
    assert KernelProvider(compute_dtype="bfloat16", device_target="CPU", parallel=True).gemm_dtype is None
    assert KernelProvider(compute_dtype=ms.bfloat16, device_target="CPU").gemm_dtype == "bfloat16"
    for target in ("Ascend", "GPU"):
        other = KernelProvider(compute_dtype="bfloat16", device_target=target)
        assert (other.gemm_dtype, other.graph_dtype("bfloat16")) == (None, "bfloat16")
    fp32 = KernelProvider(device_target="CPU")
    assert fp32.gemm_dtype is None and fp32.linear_gemm(ms.float32)[1] == provider.LINEAR_RULE
    assert fp32.linear_gemm(ms.float32)[0].precision == "float32"
    plain = KernelProvider({"linear": "plain"}, compute_dtype="bfloat16", device_target="CPU")
    assert plain.linear_gemm(ms.float32) == (None, None) and isinstance(plain_matmul(plain), BF16MatMul)
    assert type(plain_matmul(fp32)).__name__ == "MatMul"
    layer = Linear(77, 109, 0.5, ms.float32, ms.float32, kernels=cpu)
    assert layer.gemm_rule == provider.EVERY_GRAPH and isinstance(layer.matmul, BF16MatMul)
    with pytest.raises(ValueError, match="precision"):
        linear.CPULinearGEMM("unused", precision="int4")


def test_emulated_cpu_says_so_once(library, monkeypatch, capsys):
    """Where oneDNN has no fast bf16 GEMM (below AVX-512, or the library capped there: ``cpu_kernels.isa``;
    test_cpu_isa.py has the rule) the kernel runs the emulation (precision 2) and one line per process says so."""
    monkeypatch.setattr(precision, "_EMULATED", set())
    build.apply_isa("avx2", library)
    try:
        first = linear.CPULinearGEMM(library, threads=1, precision="bfloat16")
        second = linear.CPULinearGEMM(library, threads=1, precision="bfloat16")
    finally:
        build.apply_isa("auto", library)
    assert list(first.config.asnumpy()) == list(second.config.asnumpy()) == [1.0, 2.0]
    err = capsys.readouterr().err
    assert err.count("compute_dtype bfloat16 is emulated") == 1, err
