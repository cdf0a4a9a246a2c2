"""model/graph_cache.py: generate's graphs through MindSpore's compile cache, a stored graph per key.

A reader loads the graphs a writer stored, at other compile positions than the writer's (the case where
MindSpore's own folder hands back another graph), and generates what an uncached model generates; the key
changes with everything that shapes a graph and stays put for an equal model; eviction by age and size."""
import os
import time

import numpy as np
import pytest

from conftest import TINY

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 8, 30, 7]]  # ragged: both rows padded into one prefill width


def tiny_model(seed=0, **changes):
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    ms.set_seed(seed)
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **changes)))
    model.set_train(False)
    return model


def test_loaded_graphs_generate_as_compiled_ones(graph_mode, tmp_path):
    from mindformers_gptlocal.model.graph_cache import GraphCache
    root = tmp_path / "store"
    plain = tiny_model(num_hidden_layers=1)  # one layer: the 8 greedy steps' unrolled graph compiles in half the time
    reference = plain.generate(PROMPTS, max_new_tokens=11, do_sample=False)
    writer = tiny_model(num_hidden_layers=1)  # a second model: its own Cells, compiled again, this time stored
    writer.graph_cache = GraphCache(root, salt="test")
    written = writer.generate(PROMPTS, max_new_tokens=11, do_sample=False)
    assert written == reference
    assert (writer.graph_cache.hits, writer.graph_cache.misses) == (0, 2)  # the prefill and the greedy steps
    stored = sorted(p.name for p in root.iterdir())
    assert [name.split("-")[0] for name in stored] == ["greedysteps", "kvcache"]
    assert all((root / name / "graph.mindir").stat().st_size > 0 for name in stored)

    reader = tiny_model(num_hidden_layers=1)
    reader.graph_cache = GraphCache(root, salt="test")
    # this process has made its cached compiles 0 and 1 already: the reader's are 2 and 3, not where MindSpore
    # wrote them, so only the store (not MindSpore's own folder) can hand it the right graph
    loaded = reader.generate(PROMPTS, max_new_tokens=11, do_sample=False)
    assert (reader.graph_cache.hits, reader.graph_cache.misses) == (2, 0)
    assert loaded == reference
    assert sorted(p.name for p in root.iterdir()) == stored


def test_key_follows_what_shapes_the_graph(monkeypatch, tmp_path):
    import mindspore as ms
    from mindformers_gptlocal.model.graph_cache import GraphCache
    from mindformers_gptlocal.model.kv_cache import GreedySteps, KVCache, prefill_inputs, step_inputs
    cache = GraphCache(tmp_path, salt="a")
    model, twin = tiny_model(), tiny_model()
    for param in twin.get_parameters():  # other weights: a graph holds none (they are bound by name at a load)
        param.set_data(ms.Tensor(np.random.default_rng(1).normal(size=param.shape).astype(np.float32)))

    def prefill_args(batch, fresh=True):
        ids, positions, lengths = prefill_inputs(PROMPTS, batch, 0, 16)
        return step_inputs(ids, positions, lengths - 1) + (fresh,)

    base = cache.key(KVCache(model, 2, 64), prefill_args(2))
    assert base == cache.key(KVCache(twin, 2, 64), prefill_args(2))  # an equal model, other weights: a hit
    changed = {
        "batch": cache.key(KVCache(model, 3, 64), prefill_args(3)),
        "cache length": cache.key(KVCache(model, 2, 128), prefill_args(2)),
        "plain prefill": cache.key(KVCache(model, 2, 64), prefill_args(2, fresh=False)),
        "salt": GraphCache(tmp_path, salt="b").key(KVCache(model, 2, 64), prefill_args(2)),
        "config": cache.key(KVCache(tiny_model(layer_norm_epsilon=1e-6), 2, 64), prefill_args(2)),
        "layers": cache.key(KVCache(tiny_model(num_hidden_layers=3), 2, 64), prefill_args(2)),
    }
    monkeypatch.setenv("GPTLOCAL_DECODE_ATTENTION_KERNEL", "1")
    changed["switch"] = cache.key(KVCache(model, 2, 64), prefill_args(2))
    monkeypatch.delenv("GPTLOCAL_DECODE_ATTENTION_KERNEL")
    monkeypatch.setenv("GPTLOCAL_COMPILE_CACHE_DAYS", "3")  # the cache's own bounds are not the graph's
    assert cache.key(KVCache(model, 2, 64), prefill_args(2)) == base
    kv = KVCache(model, 2, 64)
    tokens = (ms.Tensor(np.zeros((2, 1), np.int32)), ms.Tensor(np.zeros((2, 1), np.int32)))
    steps = {n: cache.key(GreedySteps(kv, n), tokens) for n in (4, 8)}
    logits = cache.key(GreedySteps(kv, 8, with_logits=True), tokens)
    keys = [base, *changed.values(), steps[4], steps[8], logits]
    assert len(set(keys)) == len(keys), changed


def test_prune_keeps_recent_graphs_up_to_the_size_bound(tmp_path, monkeypatch):
    from mindformers_gptlocal.errors import ConfigError
    from mindformers_gptlocal.model.graph_cache import GraphCache, prune
    now = time.time()
    ages = {"old": 20, "a": 0.1, "b": 1, "c": 2, "d": 3}  # days since last use
    for name, days in ages.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "graph.mindir").write_bytes(b"x" * 400_000)
        os.utime(folder, (now - days * 86400,) * 2)
    removed = prune(str(tmp_path), days=14, max_mb=1.2, now=now)  # room for three 0.4 MB graphs
    assert sorted(removed) == ["d", "old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]
    assert prune(str(tmp_path), days=1.5, max_mb=100, now=now) == ["c"]
    monkeypatch.setenv("GPTLOCAL_COMPILE_CACHE_MB", "lots")
    with pytest.raises(ConfigError, match="GPTLOCAL_COMPILE_CACHE_MB='lots'"):
        GraphCache(tmp_path / "other")
