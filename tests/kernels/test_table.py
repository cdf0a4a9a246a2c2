"""The kernel table (kernels/abi/table.py, spec.py) and what the build generates from it (codegen.py, aot.h): an options
value packs into the int32 words of its C struct (floats as their float32 bits); the generated entry points accept
exactly the calls the table describes and fail the others (a parameter count, a dtype, a rank, the options' length or
dtype: 1; a dim that disagrees with another use of its name or a fixed length: 2), as ``Kernel.bind`` says in Python;
every kernel's core is defined in the source the table names and the library exports every symbol; a table change
changes the cache key; an entry that does not fit is refused when the table is made. (The kernels' values against the
plain path: test_*_kernel.py; their cores called directly: test_cores.py.)"""
import ctypes
import os
import re

import numpy as np
import pytest
from mindspore import Tensor

from mindformers_gptlocal.kernels.abi import build, codegen, table
from mindformers_gptlocal.kernels.abi.aot import DirectCall
from mindformers_gptlocal.kernels.abi.spec import Kernel, Options, Table, tensors
from mindformers_gptlocal.kernels.cells import linear

HERE = build.CSRC


def test_an_options_value_is_its_structs_words():
    value = table.AttentionOptions(0.125, 1.25, 2, 3, 64, 256)
    words = value.array()
    assert words.dtype == np.int32 and words.shape == (6,)
    assert list(words[:2].view(np.float32)) == [0.125, 1.25] and list(words[2:]) == [2, 3, 64, 256]
    assert list(value.tensor().asnumpy()) == list(words)
    struct = value.struct()
    assert ctypes.sizeof(struct) == 24 and (struct.scale, struct.dropout_mode, struct.key_block) == (0.125, 2, 256)
    assert table.LinearOptions(None, 1).threads >= 1  # threads left None: kernel_threads()
    with pytest.raises(TypeError, match="precision not given"):
        table.LinearOptions(2)
    header = codegen.header()
    assert "struct AttentionOptions {\n  float scale;\n  float dropout_scale;\n  int32_t dropout_mode;" in header


def test_every_core_is_defined_in_its_source_and_exported(library):
    for kernel in table.TABLE.cores:
        text = open(os.path.join(HERE, kernel.source), encoding="utf-8").read()
        assert re.search(rf"\b{kernel.core_symbol}\b", text), (kernel.core, kernel.source)
    lib = ctypes.CDLL(library)
    assert all(hasattr(lib, name) for name in build.SYMBOLS)
    assert "InPlaceScatterNdUpdate" in build.SYMBOLS and "gptlocal_core_linear_fwd" in build.SYMBOLS


def _status(symbol, arrays, options):
    """The entry point's status on ``arrays`` (its inputs, then its outputs) and ``options`` (after the inputs)."""
    lib = ctypes.CDLL(build.library()[0])
    inputs = len(arrays) - len(table.KERNELS[symbol].outputs)
    return DirectCall(getattr(lib, symbol), [*arrays[:inputs], options, *arrays[inputs:]]).call()


def _python_status(kernel, arrays):
    """What ``Kernel.bind`` says of the same tensors: 0, or 1 / 2 as the adapter."""
    has_optional = len(arrays) == len(kernel.tensors)
    try:
        kernel.bind([a.shape for a in arrays], has_optional)
    except ValueError as error:
        return 1 if "rank" in str(error) else 2
    return 0


F = np.float32
CALLS = {  # (symbol, its tensors but the options: inputs then outputs) -> the adapter's status
    "linear": ("gptlocal_linear_fwd", [np.ones((3, 4), F), np.ones((5, 4), F), np.zeros((3, 5), F)], 0),
    "linear+bias": ("gptlocal_linear_fwd", [np.ones((3, 4), F), np.ones((5, 4), F), np.ones(5, F),
                                            np.zeros((3, 5), F)], 0),
    "inner dims disagree": ("gptlocal_linear_fwd", [np.ones((3, 4), F), np.ones((5, 6), F), np.zeros((3, 5), F)], 2),
    "output of another width": ("gptlocal_linear_fwd", [np.ones((3, 4), F), np.ones((5, 4), F),
                                                        np.zeros((3, 6), F)], 2),
    "bias of another width": ("gptlocal_linear_fwd", [np.ones((3, 4), F), np.ones((5, 4), F), np.ones(4, F),
                                                      np.zeros((3, 5), F)], 2),
    "a rank-3 input": ("gptlocal_linear_fwd", [np.ones((1, 3, 4), F), np.ones((5, 4), F), np.zeros((3, 5), F)], 1),
    "bias required": ("gptlocal_linear_fwd_bias", [np.ones((3, 4), F), np.ones((5, 4), F), np.zeros((3, 5), F)], 1),
    "leading axes": ("gptlocal_layernorm_fwd", [np.ones((2, 3, 8), F), np.ones(8, F), np.ones(8, F),
                                                np.zeros((2, 3, 8), F), np.zeros((2, 3), F), np.zeros((2, 3), F)], 0),
    "leading axes of another count": ("gptlocal_layernorm_fwd", [np.ones((2, 3, 8), F), np.ones(8, F), np.ones(8, F),
                                                                 np.zeros((2, 3, 8), F), np.zeros(5, F),
                                                                 np.zeros((2, 3), F)], 2),
    "a vector, no leading axes": ("gptlocal_rmsnorm_fwd", [np.ones(8, F), np.ones(8, F), np.zeros(8, F),
                                                           np.zeros((), F)], 0),
    "a scalar of rank 1": ("gptlocal_square_sum_fwd", [np.ones((4, 5), F), np.zeros(1, F)], 0),
    "a total of two elements": ("gptlocal_square_sum_fwd", [np.ones((4, 5), F), np.zeros(2, F)], 2),
}


@pytest.mark.parametrize("case", CALLS)
def test_the_entry_point_binds_as_the_table_says(library, case):
    symbol, arrays, want = CALLS[case]
    kernel = table.KERNELS[symbol]
    options = kernel.options(*([1] * kernel.options.words)).array()
    assert _status(symbol, arrays, options) == want
    if case != "bias required":  # one tensor fewer than the table without the optional one: the count is wrong
        assert _python_status(kernel, arrays) == want


def test_options_of_another_length_or_dtype_fail_the_call(library, pynative_mode):
    x, w, y = np.ones((3, 4), F), np.ones((5, 4), F), np.zeros((3, 5), F)
    assert _status("gptlocal_linear_fwd", [x, w, y], table.LinearOptions(1, 0).array()) == 0
    assert _status("gptlocal_linear_fwd", [x, w, y], np.array([1, 0, 0], np.int32)) == 1
    assert _status("gptlocal_linear_fwd", [x, w, y], np.array([1, 0], np.float32)) == 1
    assert _status("gptlocal_linear_fwd", [x.astype(np.float64), w, y], table.LinearOptions(1, 0).array()) == 1
    cell = linear.CPULinearGEMM(library, threads=1)
    np.testing.assert_array_equal(cell(Tensor(x), Tensor(w)).asnumpy(), np.full((3, 5), 4.0, np.float32))
    cell.config = Tensor(np.array([1, 0, 0], np.int32))  # three words: not a LinearOptions (two)
    with pytest.raises(RuntimeError):
        cell(Tensor(x), Tensor(w)).asnumpy()


def test_a_token_output_is_set_after_the_core(library):
    w, m, v, g = (np.full(7, value, F) for value in (1.0, 0.0, 0.0, 0.5))
    scalars = [np.array([value], F) for value in (0.1, 0.9, 0.999, 1e-8, 0.0)]
    token = np.full(1, 7, np.int32)
    assert _status("gptlocal_adamw_fwd", [w, m, v, g, *scalars, token], table.ThreadOptions(1).array()) == 0
    assert token[0] == 0 and np.all(w < 1.0)  # the parameter written in place


def test_the_cache_key_follows_the_table(monkeypatch):
    before = build.cache_key("g++ 12.2.0")
    generated = codegen.generated()
    monkeypatch.setattr(codegen, "generated", lambda: dict(generated, **{codegen.HEADER: generated[codegen.HEADER]
                                                                         + "// changed\n"}))
    assert build.cache_key("g++ 12.2.0") != before


def test_an_entry_that_does_not_fit_is_refused():
    one = Options("OneOptions", "threads: int", "")
    other = Options("OtherOptions", "threads: int", "")
    forward = Kernel("f", "x.cc", "x: f32[*T, H]", "y: f32[*T, H]", one, "", backward="b")
    with pytest.raises(ValueError, match="dz: not d \\+ an input"):
        Table([forward, Kernel("b", "x.cc", "x: f32[*T, H], dy: f32[*T, H]", "dz: f32[*T, H]", one, "")])
    with pytest.raises(ValueError, match="input q: not one of f's names"):
        Table([forward, Kernel("b", "x.cc", "q: f32[*T, H], dy: f32[*T, H]", "dx: f32[*T, H]", one, "")])
    with pytest.raises(ValueError, match="takes f's options"):
        Table([forward, Kernel("b", "x.cc", "x: f32[*T, H], dy: f32[*T, H]", "dx: f32[*T, H]", other, "")])
    plan = forward.gradient_plan(Kernel("b", "x.cc", "dy: f32[*T, H], x: f32[*T, H]", "dx: f32[*T, H]", one, ""))
    assert plan == ((3, 0, 1), (0, -1))  # dy: the output's gradient (x, options, y, dy), then x; dx for x
    with pytest.raises(ValueError, match="core c declared otherwise"):
        Table([Kernel("a", "x.cc", "x: f32[N]", "y: f32[N]", one, "", core="c"),
               Kernel("b", "x.cc", "x: i32[N]", "y: f32[N]", one, "", core="c")])
    with pytest.raises(ValueError, match="only in the optional tensor"):
        Kernel("a", "x.cc", "x: f32[N], b: f32[M]?", "y: f32[N]", one, "")
    with pytest.raises(ValueError, match="first dim only"):
        tensors("x: f32[N, *T]")
    with pytest.raises(ValueError, match="dtype one of"):
        tensors("x: f64[N]")


def test_each_kernel_names_the_op_that_chooses_it():
    """Every entry's ``op`` is a ``model_config.cpu_kernels`` op (or None: no model op runs it yet), every op but
    composed_ops (MindSpore's ops in other forms) has kernels, and the provider's list says where they are."""
    from mindformers_gptlocal.kernels.provider import OPS  # pylint: disable=import-outside-toplevel
    ops = {entry.op for entry in table.TABLE.entries} - {None}
    assert ops == set(OPS) - {"composed_ops"}
    assert OPS["layer_norm"].endswith("(kernels/csrc/cpu_layernorm.cc)") and "kernels/" not in OPS["composed_ops"]


def test_a_bprop_is_one_backward_call_written_out():
    """The bprop generated from the table calls the backward once on the tensors it names and returns each input's
    gradient, zeros for the options, with no loop: MindSpore compiles one per primitive instance, and a generic
    bprop made GPT-2 small's training graph ~8 s slower to compile."""
    from mindformers_gptlocal.kernels.abi import aot
    forward = table.TABLE.kernel("gptlocal_layernorm_fwd")
    source = aot.bprop_source(forward, table.TABLE.kernel(forward.backward))
    assert source.splitlines()[1:4] == [
        "    def bprop(x, gamma, beta, options, out, dout):",
        "        found = backward(x, gamma, out[1], out[2], dout[0], options)",
        "        return found[0], found[1], found[2], zeros_like(options),"]
    rope = table.TABLE.kernel("gptlocal_rope_fwd")  # one output each way: no indexing
    assert "found = backward(dout, cos, sin, options)\n        return found, zeros_like(cos)," in \
        aot.bprop_source(rope, table.TABLE.kernel(rope.backward))
    clash = Kernel("gptlocal_x_fwd", "cpu_x.cc", "x: f32[N], out: f32[N]", "y: f32[N]", table.LayerNormOptions, "x",
                   backward="gptlocal_x_bwd")
    backward = Kernel("gptlocal_x_bwd", "cpu_x.cc", "x: f32[N], dy: f32[N]", "dx: f32[N]", table.LayerNormOptions,
                      "x")
    with pytest.raises(ValueError, match="gptlocal_x_fwd inputs out: names its bprop uses"):
        aot.bprop_source(clash, backward)
