"""A model directory with compute_dtype bfloat16 served on CPU: the engine loads it (bf16 GEMM kernel in its
prefill and decode graphs) and its greedy answers equal the loaded model's own ``generate``."""
import numpy as np
import pytest

from conftest import TINY, save_tiny_base


@pytest.fixture(scope="module")
def engine(tmp_path_factory, start_engine):
    out = save_tiny_base(tmp_path_factory.mktemp("bf16") / "tiny", None, 0, compute_dtype="bfloat16")
    return start_engine(out, max_batch_size=2, max_model_len=TINY["max_position_embeddings"], prompt_buckets=[16],
                        batch_buckets=[2])


def test_bf16_engine_equals_generate(engine, serve_all):
    assert engine.model.config.compute_dtype == "bfloat16" and engine.model.head_gemm.precision == "bfloat16"
    rng = np.random.default_rng(4)
    specs = [(rng.integers(1, TINY["vocab_size"], n).tolist(), m, {"temperature": 0}) for n, m in ((5, 9), (12, 7))]
    want = [engine.model.generate([p], max_new_tokens=m, do_sample=False)[0][len(p):] for p, m, _ in specs]
    got = serve_all(engine, specs)
    assert [tokens for tokens, _, _ in got] == want
