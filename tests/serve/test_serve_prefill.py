"""The engine's prefill calls (``--max-prefill-tokens``, ``serve/scheduler.py``): prompts written apart from the
decoding rows, at most ``prefill_tokens`` tokens a call, a long prompt in chunks, pad rows repeating a row; by
value against ``model.generate`` (the refill path, ``prefill_tokens=0``, is test_serve_engine.py's), in this
process: prompts of odd lengths, one chunked (40 tokens in chunks of 16), a fifth request that
waits for a slot and joins while the others decode, a seeded sampled request."""
import numpy as np
import pytest

from conftest import TINY, save_tiny_base

CONTEXT = TINY["max_position_embeddings"]  # 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory, start_engine):
    """An Engine on a tiny model driven from this thread: prefill calls of at most 32 tokens."""
    out = save_tiny_base(tmp_path_factory.mktemp("prefill") / "tiny", None, 0)
    return start_engine(out, max_batch_size=4, max_model_len=CONTEXT, prompt_buckets=[16], batch_buckets=[1, 2, 4],
                        prefill_tokens=32)


def test_prefill_calls_equal_generate(engine, serve_all):
    prefill = engine
    # compiled: prefill shapes 1 x 16 and 2 x 16 (64 > 32 tokens: the 40-token prompt goes in chunks), no prompt
    # shape at the full batch; decode at every bucket
    assert prefill.prefill_batches == [1, 2] and prefill.prefill_widths == [16]
    assert [prefill.prompt_widths(b) for b in (1, 2, 4)] == [[16], [16], []] and not prefill.lazy
    rng = np.random.default_rng(5)
    prompt = lambda n: rng.integers(1, TINY["vocab_size"], n).tolist()  # noqa: E731
    greedy = {"temperature": 0}
    sampled = {"temperature": 0.8, "top_k": 20, "seed": 11}
    specs = [(prompt(5), 9, greedy), (prompt(40), 12, greedy), (prompt(11), 7, sampled),
             (prompt(3), 10, greedy), (prompt(17), 6, greedy)]  # the fifth waits for a slot
    model = prefill.model
    ref = []
    for p, n, options in specs:
        extra = {"do_sample": False} if options is greedy else {
            "do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 11}
        ref.append(model.generate([p], max_new_tokens=n, **extra)[0][len(p):])
    before = prefill.stats["prefill_calls"]
    got = serve_all(prefill, specs)
    # the first four: 2 calls of 2 x 16, then the 40-token prompt's 2 more chunks; the fifth's own call later
    assert prefill.stats["prefill_calls"] - before == 5
    assert [tokens for tokens, _, _ in got] == ref
    assert all(finish == "length" and count == len(tokens) for tokens, finish, count in got)


def test_a_negative_max_prefill_tokens_is_one_clear_error(tmp_path):
    from mindformers_gptlocal.cli import args as cli_args
    from mindformers_gptlocal.errors import ConfigError
    from mindformers_gptlocal.serve.app import serve
    (tmp_path / "config.json").write_text("{}")
    options = cli_args.PARSERS["serve"]().parse_args(["--model", str(tmp_path), "--max-prefill-tokens", "-1"])
    with pytest.raises(ConfigError, match=r"--max-prefill-tokens must be 0 .* got -1"):
        serve(options)


def test_the_default_buckets_compile_no_prompt_graph_above_one_row(engine):
    """The defaults (``PREFILL_TOKENS``, ``BATCH_FACTOR``): a lone-row prefill of at most PREFILL_TOKENS tokens,
    decode graphs at 1 and max_batch_size only (a burst of clients fills the largest one; every graph costs RSS)."""
    from mindformers_gptlocal.serve.engine import PREFILL_TOKENS, Engine
    from mindformers_gptlocal.serve.scheduler import BATCH_FACTOR, batch_sizes
    assert batch_sizes(16) == [1, 16] and batch_sizes(8) == [1, 8] and batch_sizes(BATCH_FACTOR * 4) == [
        1, BATCH_FACTOR, BATCH_FACTOR * 4]
    default = Engine(engine.model_dir, max_batch_size=16, max_model_len=CONTEXT)
    default._load()
    assert default.prefill_tokens == PREFILL_TOKENS and default.batches == [1, 16]
    assert default.prefill_batches == [1] and max(default.prefill_widths) <= PREFILL_TOKENS
    assert default.prompt_widths(16) == [] and default.prompt_widths(1) == default.prefill_widths
