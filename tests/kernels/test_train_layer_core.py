"""The training layer's typed cores (``cpu_train_layer.cc``) called directly (``aot.call_core``): a call whose tensors
and options disagree with the layout it says (heads that do not divide the projection's width, a QKV weight of
another width, a LayerNorm without its shift, rope over an odd or too wide share of a head, dropout offsets outside
their tables) fails with nothing written; the same call made right runs, and a backward given a ticket its slot does
not hold runs its forward again (counted) and gives the gradients of a paired one, bit for bit. (Its values against
the model's per-op graph: tests/model/test_train_layer.py.)"""
import ctypes

import numpy as np
import pytest

from mindformers_gptlocal.kernels.abi import table
from mindformers_gptlocal.kernels.abi.aot import call_core
from mindformers_gptlocal.kernels.cells import train_layer

FORWARD, BACKWARD = table.KERNELS["gptlocal_train_layer_fwd"], table.KERNELS["gptlocal_train_layer_bwd"]
B, S, H, N, G, I, R = 2, 7, 12, 3, 3, 11, 2
D = H // N
RNG = np.random.default_rng(3)
SLOT = 1 << 20  # far above the slots the model's Cells number from 1


def f32(*shape):
    return (0.5 * RNG.standard_normal(shape)).astype(np.float32)


def inputs(**changes):
    """The forward's inputs by name (GPT-2's layout with rope over the first R channels), ``changes`` replacing some."""
    q = (N + 2 * G) * D
    angles = np.arange(S, dtype=np.float32)[None, None, :, None] * np.float32(0.3)
    values = dict(hidden=f32(B, S, H), mask=np.zeros((1, 1, S, S), np.float32), cos=np.cos(angles).repeat(R, 3),
                  sin=np.sin(angles).repeat(R, 3), attention_t1=np.zeros(1, np.float32),
                  attention_t2=np.zeros(1, np.float32), hidden_t1=np.zeros(1, np.float32),
                  hidden_t2=np.zeros(1, np.float32), offsets=np.zeros(6, np.int32), norm1_w=f32(H), norm1_b=f32(H),
                  qkv_w=f32(q, H), qkv_b=f32(q), proj_w=f32(H, H), proj_b=f32(H), norm2_w=f32(H), norm2_b=f32(H),
                  fc1_w=f32(I, H), fc1_b=f32(I), gate_w=np.zeros((1, H), np.float32),
                  gate_b=np.zeros(1, np.float32), fc2_w=f32(H, I), fc2_b=f32(H))
    values.update(changes)
    return {name: np.ascontiguousarray(value) for name, value in values.items()}


def options(**changes):
    values = dict(epsilon=1e-5, scale=1.0 / np.sqrt(D), attention_dropout_scale=1.0, hidden_dropout_scale=1.0,
                  attention_dropout_mode=0, hidden_dropout_mode=0, heads=N, groups=G, norm=0, mlp=0, bias=1,
                  qkv_bias=1, rope=1, parallel_residual=0, precision=0, threads=2, query_block=4, key_block=5,
                  slot=SLOT)
    values.update(changes)
    return table.TrainLayerOptions(**values)


@pytest.fixture(scope="module")
def lib(library):
    loaded = ctypes.CDLL(library)
    yield loaded
    loaded.gptlocal_train_layer_release(ctypes.c_int32(SLOT))


def forward(lib, values, opts):
    out, ticket = np.full((B, S, H), 7.0, np.float32), np.zeros(2, np.int32)
    return call_core(lib, FORWARD, *values.values(), out, ticket, options=opts), out, ticket


def backward(lib, values, ticket, dout, opts):
    grads = [np.zeros((B, S, H), np.float32)] + [np.zeros_like(values[spec.name[1:]]) for spec in BACKWARD.outputs[1:]]
    status = call_core(lib, BACKWARD, *values.values(), ticket, dout, *grads, options=opts)
    return status, grads


REFUSED = {
    "heads that do not divide the projection": (dict(), dict(heads=5)),
    "a QKV weight of another width": (dict(qkv_w=f32((N + 2 * G) * D + 1, H), qkv_b=f32((N + 2 * G) * D + 1)), {}),
    "LayerNorm without its shift": (dict(norm1_b=np.zeros(1, np.float32), norm2_b=np.zeros(1, np.float32)), {}),
    "rope over an odd share": (dict(cos=np.ones((1, 1, S, 3), np.float32), sin=np.ones((1, 1, S, 3), np.float32)), {}),
    "rope wider than a head": (dict(cos=np.ones((1, 1, S, D + 2), np.float32),
                                    sin=np.ones((1, 1, S, D + 2), np.float32)), {}),
    "dropout without its tables": (dict(), dict(hidden_dropout_mode=1, hidden_dropout_scale=1.25)),
    "dropout offsets outside the tables": (dict(hidden_t1=np.ones(5, np.float32), hidden_t2=np.ones(7, np.float32),
                                                offsets=np.array([0, 0, 5, 0, 0, 0], np.int32)),
                                           dict(hidden_dropout_mode=1, hidden_dropout_scale=1.25)),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_call_that_disagrees_with_its_layout_fails_with_nothing_written(lib, case):
    changes, option_changes = REFUSED[case]
    status, out, ticket = forward(lib, inputs(**changes), options(**option_changes))
    assert status != 0 and np.all(out == 7.0) and np.all(ticket == 0)


def test_a_stale_ticket_runs_the_forward_again_and_gives_the_same_gradients(lib, library):
    values = inputs()
    status, out, ticket = forward(lib, values, options())
    assert status == 0 and np.isfinite(out).all() and ticket[0] == SLOT
    dout = f32(B, S, H)
    before = train_layer.stats(library)
    status, paired = backward(lib, values, ticket, dout, options())
    assert status == 0 and train_layer.stats(library)["recomputed"] == before["recomputed"]
    other = inputs(hidden=f32(B, S, H))
    assert forward(lib, other, options())[0] == 0  # the slot now holds another forward's activations
    status, again = backward(lib, values, ticket, dout, options())
    assert status == 0 and train_layer.stats(library)["recomputed"] == before["recomputed"] + 1
    for got, want in zip(again, paired):
        np.testing.assert_array_equal(got, want)
    assert np.abs(paired[0]).max() > 0 and np.abs(paired[3]).max() > 0  # d hidden, d qkv_w
