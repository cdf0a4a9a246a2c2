"""Linear's GEMM kernel with the bias inside (kernels/linear.py, cpu_linear.cc) against MindSpore's MatMul + Add (the
plain path of model/layers.py Linear) and float64, forward and gradients, on odd shapes; Linear and the output head
choosing it by their compiled graph's static row count (inference only by default, every graph with
GPTLOCAL_LINEAR_KERNEL=1, never with =0); the switch's values."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.errors import ConfigError
from mindformers_gptlocal.kernels import linear
from mindformers_gptlocal.model import cpu_kernels
from mindformers_gptlocal.model.layers import Linear, use_gemm
from conftest import TINY

IN, OUT = 77, 45  # not multiples of 8


def _close(actual, expected, name):
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(actual, expected, atol=1e-5 * scale, rtol=0, err_msg=name)


@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize("threads", [1, 2])
def test_bias_inside_matches_matmul_add_and_float64(library, pynative_mode, rows, threads):
    """x W^T + b in one kernel call, and dx, dW, db, against MatMul + Add and float64; 2 threads split 45 columns
    into uneven 16-column blocks (the bias copied per block)."""
    rng = np.random.default_rng(rows)
    x, w = rng.standard_normal((rows, IN)).astype(np.float32), rng.standard_normal((OUT, IN)).astype(np.float32)
    b, weight = rng.standard_normal(OUT).astype(np.float32), rng.standard_normal((rows, OUT)).astype(np.float32)
    args = tuple(Tensor(a) for a in (x, w, b))
    kernel = linear.CPULinearGEMM(library, threads=threads)
    matmul = ops.MatMul(transpose_b=True)

    def grads(fn):
        value = fn(*args)
        got = ms.grad(lambda *a: (fn(*a) * Tensor(weight)).sum(), (0, 1, 2))(*args)
        return [value.asnumpy()] + [g.asnumpy() for g in got]

    got, want = grads(kernel), grads(lambda x_, w_, b_: matmul(x_, w_) + b_)
    x64, w64, g64 = (a.astype(np.float64) for a in (x, w, weight))
    exact = [x64 @ w64.T + b, g64 @ w64, g64.T @ x64, g64.sum(0)]
    for name, actual, expected, precise in zip(("y", "dx", "dw", "db"), got, want, exact):
        _close(actual, expected, name + " vs MindSpore")
        _close(actual, precise, name + " vs float64")
    _close(kernel(args[0], args[1]).asnumpy(), x64 @ w64.T, "y without bias")  # the four-parameter call still


class _Marked(linear.CPULinearGEMM):
    """The real kernel, its output doubled: tells which path a compiled graph took (values alone cannot: both
    paths agree to 1e-6)."""

    def construct(self, x, weight, bias=None):
        return 2.0 * super().construct(x, weight, bias)


def _linears(library, monkeypatch, flag, **kwargs):
    """(Linear built with GPTLOCAL_LINEAR_KERNEL=flag (None: unset), its gemm marked; the same Linear with =0)."""
    rng = np.random.default_rng(7)
    made = []
    for value in (flag, "0"):
        if value is None:
            monkeypatch.delenv("GPTLOCAL_LINEAR_KERNEL", raising=False)
        else:
            monkeypatch.setenv("GPTLOCAL_LINEAR_KERNEL", value)
        made.append(Linear(IN, OUT, 0.5, ms.float32, ms.float32, **kwargs))
    kernel, plain = made
    assert plain.gemm is None and kernel.gemm is not None
    kernel.gemm = _Marked(library)
    for p, q in zip(kernel.get_parameters(), plain.get_parameters()):
        value = Tensor(rng.standard_normal(p.shape).astype(np.float32))
        p.set_data(value)
        q.set_data(value)
    return kernel, plain


def test_linear_picks_the_kernel_by_static_rows_in_inference(library, graph_mode, monkeypatch):
    """Default: compiled inference graphs of >= LINEAR_GEMM_ROWS rows run the kernel (bias inside), fewer rows and
    training graphs MatMul; values equal the plain Linear's, [B, S, in] inputs counted as B * S rows."""
    threshold = cpu_kernels.LINEAR_GEMM_ROWS
    kernel, plain = _linears(library, monkeypatch, None)
    assert kernel.gemm_rows == threshold
    rng = np.random.default_rng(1)
    for train, shape in ((False, (threshold - 1, 1, IN)), (False, (3, 11, IN)), (True, (3, 11, IN))):
        kernel.set_train(train)
        plain.set_train(train)
        x = Tensor(rng.standard_normal(shape).astype(np.float32))
        factor = 2.0 if not train and int(np.prod(shape[:-1])) >= threshold else 1.0
        _close(kernel(x).asnumpy(), factor * plain(x).asnumpy(), f"train={train} shape={shape}")  # 2 (x W^T + b)


def test_always_and_never(library, pynative_mode, monkeypatch):
    """GPTLOCAL_LINEAR_KERNEL=1: the kernel in every graph, one row and training too; =0 builds none; anything else
    is refused naming the variable."""
    kernel, plain = _linears(library, monkeypatch, "1")
    assert kernel.gemm_rows == 0
    x = Tensor(np.random.default_rng(2).standard_normal((1, IN)).astype(np.float32))
    for train in (False, True):
        kernel.set_train(train)
        plain.set_train(train)
        _close(kernel(x).asnumpy(), 2.0 * plain(x).asnumpy(), f"train={train}")
    assert [use_gemm(rows_at, False, 5) for rows_at in (None, 0, 5, 6)] == [False, True, True, False]
    assert [use_gemm(rows_at, True, 99) for rows_at in (None, 0, 5)] == [False, True, False]
    monkeypatch.setenv("GPTLOCAL_LINEAR_KERNEL", "yes")
    with pytest.raises(ConfigError, match="GPTLOCAL_LINEAR_KERNEL='yes'"):
        cpu_kernels.linear_gemm_kernel()


def test_tiny_model_prefill_and_decode_match_matmul(graph_mode, monkeypatch):
    """A tiny GPT-2's KV-cache prefill (3 x 16 rows: the kernel in every Linear; the head on the 3 last rows) and its
    forward over 3 x 11 tokens (the head's 33 rows too, if at least HEAD_GEMM_ROWS) give the plain model's logits."""
    config = GPTLocalConfig(**dict(TINY, max_position_embeddings=64, seq_length=64))
    monkeypatch.delenv("GPTLOCAL_LINEAR_KERNEL", raising=False)
    ms.set_seed(0)
    model = GPTLocalForCausalLM(config)
    monkeypatch.setenv("GPTLOCAL_LINEAR_KERNEL", "0")
    ms.set_seed(0)
    plain = GPTLocalForCausalLM(config)
    layer = model.model.layers[0]
    assert layer.attention.linear_qkv.gemm_rows == cpu_kernels.LINEAR_GEMM_ROWS
    assert model.head_gemm_rows == cpu_kernels.HEAD_GEMM_ROWS and plain.head_gemm is None
    rng = np.random.default_rng(3)
    prompts = rng.integers(1, TINY["vocab_size"], (3, 11)).tolist()
    out = {}
    for name, m in (("kernel", model), ("plain", plain)):
        m.set_train(False)
        cache = m.kv_cache(3, 16)
        first = cache.prefill(prompts)
        full = m(Tensor(np.array(prompts, np.int32)))
        out[name] = [first, full.asnumpy()]
    for what, a, b in zip(("prefill", "forward"), out["kernel"], out["plain"]):
        _close(a, b, what)
