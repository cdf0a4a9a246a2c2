"""The codes Python and C++ share (``kernels/abi/codes.py``): the generated ``cores.h`` spells each enum with Python's
values, no C++ source builds or compares a bare code, and the library's statuses come back by name (the decoder
step's failing layer beside its code, not folded into it)."""
import ctypes
import glob
import os
import re

import numpy as np
import pytest

from mindformers_gptlocal.kernels.abi import build, codegen, codes, table
from mindformers_gptlocal.kernels.abi.aot import call_core
from mindformers_gptlocal.kernels.abi.codes import MlpForm, NormKind, Status, WeightKind

KERNELS = build.CSRC


def test_cores_h_has_each_enum_with_pythons_values():
    header = codegen.header()
    for cls in codes.ENUMS:
        body = re.search(r"struct %s \{\n  enum Code : int32_t \{\n(.*?)\n  \};" % cls.__name__, header, re.S)
        assert body is not None, cls
        found = dict(re.findall(r"(k\w+) = (\d+),", body.group(1)))
        assert found == {codes.c_name(m): str(int(m)) for m in cls}, cls


# a bare code: a status built by arithmetic (10 + status, 100 * (layer + 1) + status), a nonzero status returned as a
# number, a form / kind / norm compared with a number
BARE = [re.compile(p) for p in (r"return \d+ \+", r"\d+ \* \(layer", r"return [1-9]\d*;",
                                r"\b(form|mlp|norm|kind|weights|words_kind|head_kind) [!=]= \d")]


def test_no_cpp_source_spells_a_code_as_a_number():
    sources = glob.glob(os.path.join(KERNELS, "*.cc")) + glob.glob(os.path.join(KERNELS, "*.h"))
    assert len(sources) > 15
    found = [(os.path.basename(path), n, line.strip()) for path in sources
             for n, line in enumerate(open(path, encoding="utf-8"), 1)
             if not line.lstrip().startswith("//") and any(p.search(line) for p in BARE)]
    assert not found, found


def test_names_read_and_describe():
    assert codes.name_of(MlpForm, "swiglu") is MlpForm.SWIGLU
    assert codes.name_of(NormKind, "RMSNorm") is NormKind.RMS_NORM
    assert codes.name_of(WeightKind, "bfloat16") is WeightKind.BFLOAT16
    with pytest.raises(ValueError, match="tanh, quick"):
        codes.name_of(MlpForm, "gelu")
    assert codes.describe(4).startswith("CACHE_INDEX: ")
    assert codes.describe(99) == "status 99 (not a Status)"
    assert set(codes.MESSAGES) == set(Status)


def test_a_core_returns_its_named_status(library):
    """The rope core refuses an odd rotary width by its shape code; the head + loss a label outside the vocabulary by
    the token-id code."""
    lib = ctypes.CDLL(library)
    x, y = np.ones((2, 3, 5, 10), np.float32), np.zeros((2, 3, 5, 10), np.float32)
    cos = np.ones((1, 1, 5, 5), np.float32)
    assert call_core(lib, table.KERNELS["gptlocal_rope_fwd"], x, cos, cos, y,
                     options=table.ThreadOptions(1)) == Status.BAD_SHAPE
    T, H, V = 3, 4, 5
    outputs = (np.zeros(1, np.float32), np.zeros((T, H), np.float32), np.zeros((V, H), np.float32))
    status = call_core(lib, table.KERNELS["gptlocal_head_loss_fwd"], np.ones((T, H), np.float32),
                       np.ones((V, H), np.float32), np.array([0, V, 1], np.int32), np.ones(T, np.float32), *outputs,
                       options=table.HeadLossOptions(1, 0))
    assert status == Status.TOKEN_ID


def _step(lib, layers_ok, token):
    """A two-layer int8 model's step through gptlocal_decoder_step: (status, failed layer). ``layers_ok``: whether
    each layer has its int8 scales (a layer without fails its GEMM)."""
    rng = np.random.default_rng(3)
    H, N, D, I, V, L = 8, 2, 4, 16, 11, 6
    keep = []

    def ptr(array):
        keep.append(array)
        return array.ctypes.data

    def int8(rows, cols):
        return ptr(rng.integers(-127, 128, (rows, cols)).astype(np.int8))

    def f32(*shape):
        return ptr(rng.standard_normal(shape).astype(np.float32))

    model = table.DecoderModel(
        hidden=H, heads=N, groups=N, head_dim=D, inter=I, vocab=V, layers=len(layers_ok), norm=NormKind.RMS_NORM,
        rotary_dim=0, form=MlpForm.RELU, parallel_residual=0, weights=WeightKind.INT8, precision=0, threads=1,
        max_positions=0, words_kind=WeightKind.FLOAT32, head_kind=WeightKind.FLOAT32, epsilon=1e-5, words=f32(V, H),
        words_scale=None, positions=None, final_weight=f32(H), final_bias=None, head=f32(V, H), head_scale=None)
    layers = table.DecoderLayer.array(len(layers_ok))
    for struct, ok in zip(layers, layers_ok):
        struct.scale = 0.5
        struct.norm1_weight, struct.norm2_weight = f32(H), f32(H)
        for name, (rows, cols) in {"qkv": (3 * N * D, H), "proj": (H, N * D), "fc1": (I, H), "fc2": (H, I)}.items():
            setattr(struct, name, int8(rows, cols))
            setattr(struct, name + "_scale", f32(rows) if ok else None)
    keys, values = (np.zeros((len(layers_ok), 1, N, L, D), np.float32) for _ in range(2))
    cache = table.DecoderCache(keys=ptr(keys), values=ptr(values), cos=None, sin=None, slots=1, length=L)
    lib.gptlocal_decoder_workspace.restype = ctypes.c_int64
    work = np.zeros(lib.gptlocal_decoder_workspace(ctypes.byref(model), ctypes.c_int64(1), ctypes.c_int64(1)),
                    np.uint8)
    failed = np.full(1, 7, np.int32)
    logits = np.zeros((1, V), np.float32)
    call = table.DecoderCall(ids=ptr(np.array([[token]], np.int32)), positions=ptr(np.zeros((1, 1), np.int32)),
                             slots=ptr(np.zeros(1, np.int32)), last=ptr(np.zeros(1, np.int32)), batch=1, width=1,
                             logits=logits.ctypes.data, tokens=None, work=work.ctypes.data, work_bytes=work.nbytes,
                             failed_layer=failed.ctypes.data)
    status = lib.gptlocal_decoder_step(ctypes.byref(model), layers, ctypes.byref(cache), ctypes.byref(call))
    return status, int(failed[0]), logits


def test_the_decoder_step_names_its_status_and_the_failing_layer(library):
    lib = ctypes.CDLL(library)
    status, layer, logits = _step(lib, (True, True), 3)
    assert (status, layer) == (Status.OK, -1) and np.isfinite(logits).all() and logits.any()
    assert _step(lib, (True, False), 3)[:2] == (Status.BAD_CALL, 1)  # layer 1's GEMM has no int8 scales
    assert _step(lib, (True, True), 11)[:2] == (Status.TOKEN_ID, -1)  # before any layer
