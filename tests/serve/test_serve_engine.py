"""The engine (``serve/engine.py`` running ``serve/scheduler.py``'s calls) against ``model.generate``, greedy, by
value, in this process (refills; the 64-token refill compiled on first use, ``warmup_tokens``): odd prompt lengths
and max_tokens, an EOS, a request that runs to the cache's last row, and a fifth request that waits for a slot
and joins while the others decode."""
import numpy as np
import pytest

from conftest import TINY, save_tiny_base

CONTEXT = TINY["max_position_embeddings"]  # 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory, start_engine):
    """A tiny model served by an Engine driven from this thread (no worker thread, no HTTP)."""
    out = save_tiny_base(tmp_path_factory.mktemp("chunks") / "tiny", None, 0)

    def lazy_refill(engine):  # the 4 x 64 refill compiles on its first use
        assert engine.lazy == {(4, CONTEXT)}

    return start_engine(out, check=lazy_refill, max_batch_size=4, max_model_len=CONTEXT, prompt_buckets=[16],
                        batch_buckets=[4], warmup_tokens=64)


def test_engine_equals_generate(engine, serve_all):
    rng = np.random.default_rng(3)
    prompt = lambda n: rng.integers(1, TINY["vocab_size"], n).tolist()  # noqa: E731
    greedy = {"temperature": 0}
    specs = [(prompt(5), 13, greedy), (prompt(11), 21, greedy), (prompt(40), 30, greedy),  # to the cache's last row
             (prompt(3), 19, greedy), (prompt(7), 9, greedy)]  # the fifth waits for a slot
    ref = [engine.model.generate([p], max_new_tokens=min(n, CONTEXT - len(p)), do_sample=False)[0][len(p):]
           for p, n, _ in specs]
    eos = ref[1][6]  # request 1 ends at its EOS
    specs[1] = (specs[1][0], specs[1][1], dict(greedy, eos=(eos,)))
    ref[1] = engine.model.generate([specs[1][0]], max_new_tokens=21, do_sample=False, eos_token_id=eos)[0][11:]
    assert ref[1][-1] == eos and len(ref[1]) < 21

    plain = serve_all(engine, specs)
    for (tokens, finish, count), want, (_, max_tokens, _) in zip(plain, ref, specs):
        assert tokens == want and count == len(want)
        assert finish == ("stop" if want[-1:] == [eos] else "length")
    assert not engine.lazy  # the 40-token prompt's refill compiled when first needed
    assert len(plain[2][0]) == CONTEXT - 40  # ended "length" at the cache's last row, before max_tokens
