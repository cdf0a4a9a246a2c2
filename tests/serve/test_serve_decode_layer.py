"""The server's batched decode steps through the decode-layer kernel (``kernels/cells/decode_layer.py``) give the tokens
of the same model served with the plain decode graph (``cpu_kernels: {decode_layer: plain}``), in this process:
five requests of odd prompt lengths (one waits for a slot), prefill calls, decode steps at the full batch and at a
smaller batch bucket whose rows name their cache slots, greedy and a seeded sampled request."""
import numpy as np
import pytest

from conftest import TINY, save_tiny_base

CONTEXT = TINY["max_position_embeddings"]  # 64


@pytest.fixture(scope="module")
def engines(tmp_path_factory, start_engine):
    """(the kernel's engine, the plain engine) on the same weights (the same seed)."""
    root = tmp_path_factory.mktemp("decode_layer")
    options = dict(max_batch_size=4, max_model_len=CONTEXT, prompt_buckets=[16], batch_buckets=[2, 4],
                   prefill_tokens=32)
    # the compiled runner's decode graphs (on CPU the server's default is the native runner)
    fast = start_engine(save_tiny_base(root / "fast", None, 0, cpu_kernels={"decode_layer": "kernel",
                                                                           "runner": "plain"}), **options)
    plain = start_engine(save_tiny_base(root / "plain", None, 0, cpu_kernels={"decode_layer": "plain",
                                                                             "runner": "plain"}), **options)
    return fast, plain


def test_served_tokens_equal_the_plain_decode_graph(engines, serve_all):
    fast, plain = engines
    assert all(layer.decode_kernel is not None for layer in fast.model.model.layers)
    assert all(layer.decode_kernel is None for layer in plain.model.model.layers)
    for (name, a), (_, b) in zip(fast.model.parameters_and_names(), plain.model.parameters_and_names()):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy(), err_msg=name)
    rng = np.random.default_rng(7)
    prompt = lambda n: rng.integers(1, TINY["vocab_size"], n).tolist()  # noqa: E731
    greedy = {"temperature": 0}
    sampled = {"temperature": 0.8, "top_k": 20, "seed": 11}
    # lengths differ so the batch shrinks to the 2-row bucket (rows naming their slots) before the end
    specs = [(prompt(5), 25, greedy), (prompt(21), 6, greedy), (prompt(9), 14, sampled), (prompt(3), 4, greedy),
             (prompt(12), 9, greedy)]  # the fifth waits for a slot
    calls, step = [], fast.cache.step
    fast.cache.step = lambda ids, *rest: calls.append((np.shape(ids), rest[-1])) or step(ids, *rest)
    got = serve_all(fast, specs)
    want = serve_all(plain, specs)
    assert got == want
    assert [count for _, _, count in got] == [n for _, n, _ in specs]
    decodes = [slots for shape, slots in calls if shape[1] == 1]
    assert any(slots is None for slots in decodes)  # the full batch's decode steps
    assert any(slots is not None and len(slots) == 2 for slots in decodes)  # the 2-row bucket's, naming slots
