"""The kernels' typed arguments: each op's struct in common.h and its namedtuple in kernels/args.py have the same
fields in the same order, every kernel source reads its arguments through its struct (``args_at``, no positional
``config[i]``), and a vector of another length fails the call instead of being read past (the kernels' values
against the plain path: test_*_kernel.py)."""
import os
import re

import numpy as np
import pytest
from mindspore import Tensor

from mindformers_gptlocal.kernels import args, linear

HERE = os.path.dirname(args.__file__)


def _c_structs():
    text = open(os.path.join(HERE, "common.h"), encoding="utf-8").read()
    found = {}
    for name, body in re.findall(r"struct (\w+Args) \{(.*?)\};", text, re.S):
        body = re.sub(r"//[^\n]*", "", body)
        found[name] = [field.strip() for field in body.replace("float", "").replace(";", ",").split(",")
                       if field.strip()]
    return found


def test_structs_match_common_h():
    python = {struct.__name__: list(struct._fields) for struct in args.STRUCTS}
    assert _c_structs() == python
    assert list(args.AttentionArgs(0.125, 1.25, 2, 3, 64, 256).tensor().asnumpy()) == [0.125, 1.25, 2, 3, 64, 256]


def test_every_kernel_reads_its_struct():
    for name in ("cpu_attention.cc", "cpu_linear.cc", "cpu_norm_gelu.cc", "cpu_rms_swiglu.cc", "lora_dropout.cc",
                 "cpu_decode_layer.cc"):
        text = open(os.path.join(HERE, name), encoding="utf-8").read()
        assert "args_at<" in text and not re.search(r"\bconfig\[\d\]|\bcfg\[\d\]", text), name


def test_a_vector_of_another_length_fails_the_call(library, pynative_mode):
    cell = linear.CPULinearGEMM(library, threads=1)
    x, w = Tensor(np.ones((3, 4), np.float32)), Tensor(np.ones((5, 4), np.float32))
    np.testing.assert_array_equal(cell(x, w).asnumpy(), np.full((3, 5), 4.0, np.float32))
    cell.config = Tensor(np.array([1.0, 0.0, 0.0], np.float32))  # three floats: not a LinearArgs (two)
    with pytest.raises(RuntimeError):
        cell(x, w).asnumpy()
