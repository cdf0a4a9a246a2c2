"""The server's engine on an int8 model directory (``gptlocal quantize``): greedy replies equal the int8 model's
``generate``, batched."""
import numpy as np
import pytest

from conftest import TINY, save_tiny_base

CONTEXT = TINY["max_position_embeddings"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, start_engine):
    from mindformers_gptlocal.quantize import quantize_model
    root = tmp_path_factory.mktemp("serve_int8")
    base = save_tiny_base(root / "fp32", None, 4)
    quantize_model(base, str(root / "int8"), "int8", log=lambda line: None)
    return start_engine(root / "int8", max_batch_size=2, max_model_len=CONTEXT, prompt_buckets=[16],
                        batch_buckets=[2])


def test_int8_engine_equals_generate(engine, serve_all):
    assert engine.model.head_int8 is not None  # the int8 model, not a float one
    rng = np.random.default_rng(5)
    specs = [(rng.integers(1, TINY["vocab_size"], n).tolist(), m, {"temperature": 0}) for n, m in ((5, 9), (11, 7))]
    ref = [engine.model.generate([p], max_new_tokens=m, do_sample=False)[0][len(p):] for p, m, _ in specs]
    got = serve_all(engine, specs)
    for (tokens, _, count), want in zip(got, ref):
        assert tokens == want and count == len(want)
