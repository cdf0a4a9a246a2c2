"""runtime/graph_cache.py: generate's graphs through MindSpore's compile cache, a stored graph per key.

A second process loads the graphs a writer stored, at other compile numbers than the writer's (the case where
MindSpore's own folder hands back another graph), and generates what the plain path generates; the key changes
with everything that shapes a graph (gpt_local's own sources and the arguments' dtypes included) and stays put for an
equal model; eviction by age and size."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import TINY, source_env

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 8, 30, 7]]  # ragged: both rows padded into one prefill width


def tiny_model(**changes):
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    ms.set_seed(0)
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **changes)))
    model.set_train(False)
    return model


SIDE = """
import json, os, sys
import mindspore as ms
ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
from mindformers_gptlocal.model.config import GPTLocalConfig
from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
from mindformers_gptlocal.runtime.graph_cache import GraphCache
config, root, prompts = json.loads(sys.argv[1])
ms.set_seed(0)
model = GPTLocalForCausalLM(GPTLocalConfig(**config))
model.set_train(False)
cache = model.graph_cache = GraphCache(root, salt="test")
tokens = [model.generate(prompts, max_new_tokens=11, do_sample=False)]
if sys.argv[2] == "read":  # a second model, its own Cells: its cached compiles are 3 and 4, the writer's were 1 and 2
    ms.set_seed(0)
    again = GPTLocalForCausalLM(GPTLocalConfig(**config))
    again.set_train(False)
    again.graph_cache = cache
    tokens.append(again.generate(prompts, max_new_tokens=11, do_sample=False))
print("SIDE", json.dumps([tokens, cache.hits, cache.misses, cache.disabled]))
"""


def test_a_second_process_loads_the_graphs_and_generates_the_same(graph_mode, tmp_path):
    """A writer process compiles and stores generate's prefill and greedy-steps graphs; a second process loads
    them twice, for two models, the second time at other compile numbers than the writer's (MindSpore really
    loads: a compile would rewrite the copy it is given), and generates the plain path's tokens (this process: no
    KV cache, the sequence recomputed per token)."""
    root = tmp_path / "store"
    # one layer: the 8 greedy steps' unrolled graph compiles faster; the compiled runner (on CPU generate's default
    # is the native one, which compiles nothing)
    config = dict(TINY, num_hidden_layers=1, cpu_kernels={"runner": "plain"})
    script = tmp_path / "side.py"  # MindSpore hashes the entry script: a file, not python -c
    script.write_text(SIDE)

    def side(role):
        return subprocess.Popen([sys.executable, str(script), json.dumps([config, str(root), PROMPTS]), role],
                                env=source_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(proc):
        out, err = proc.communicate(timeout=600)
        line = [x for x in out.splitlines() if x.startswith("SIDE ")]
        assert line, out + err[-3000:]
        return json.loads(line[0][5:])
    writer = side("write")
    reference = tiny_model(**config).generate(PROMPTS, max_new_tokens=11, do_sample=False, use_past=False)
    written, hits, misses, why = result(writer)
    assert (hits, misses, why) == (0, 2, None) and written == [reference]
    stored = sorted(p.name.split("-")[0] for p in root.iterdir())
    assert stored == ["anchor", "cachedforward", "greedysteps"]
    assert all((p / "graph.mindir").stat().st_size > 0 for p in root.iterdir())
    loaded, hits, misses, why = result(side("read"))
    assert (hits, misses, why) == (4, 0, None)
    assert loaded == [reference, reference]
    assert sorted(p.name.split("-")[0] for p in root.iterdir()) == stored


def test_key_follows_what_shapes_the_graph(monkeypatch, tmp_path):
    import mindspore as ms
    from mindformers_gptlocal.runtime import graph_cache
    from mindformers_gptlocal.runtime.graph_cache import GraphCache
    from mindformers_gptlocal.model.describe import describe
    from mindformers_gptlocal.runtime.runner import ModelRunner, GreedySteps, prefill_inputs, step_inputs
    cache = GraphCache(tmp_path, salt="a")
    model, twin = tiny_model(), tiny_model()
    for param in twin.get_parameters():  # other weights: a graph holds none (they are bound by name at a load)
        param.set_data(ms.Tensor(np.random.default_rng(1).normal(size=param.shape).astype(np.float32)))

    def prefill_args(batch, fresh=True):
        ids, positions, lengths = prefill_inputs(PROMPTS, batch, 0, 16)
        return step_inputs(ids, positions, lengths - 1) + (fresh,)

    def forward(lm, batch, length):
        return ModelRunner(lm, describe(lm), batch, length).forward

    base = cache.key(forward(model, 2, 64), prefill_args(2))
    assert base == cache.key(forward(twin, 2, 64), prefill_args(2))  # an equal model, other weights: a hit
    int64 = list(prefill_args(2))
    int64[0] = ms.Tensor(int64[0].asnumpy().astype(np.int64))
    changed = {
        "batch": cache.key(forward(model, 3, 64), prefill_args(3)),
        "cache length": cache.key(forward(model, 2, 128), prefill_args(2)),
        "plain prefill": cache.key(forward(model, 2, 64), prefill_args(2, fresh=False)),
        "argument dtype": cache.key(forward(model, 2, 64), tuple(int64)),
        "salt": GraphCache(tmp_path, salt="b").key(forward(model, 2, 64), prefill_args(2)),
        "config": cache.key(forward(tiny_model(layer_norm_epsilon=1e-6), 2, 64), prefill_args(2)),
        "layers": cache.key(forward(tiny_model(num_hidden_layers=3), 2, 64), prefill_args(2)),
    }
    # a part the build picked (GPTLocalBlock.residuals ...): its class is the graph's, beside the plain attributes
    from mindformers_gptlocal.model.gpt import ParallelResiduals
    bound = tiny_model()
    bound.model.layers[0].residuals = ParallelResiduals()
    changed["bound step"] = cache.key(forward(bound, 2, 64), prefill_args(2))
    # gpt_local's own code: another source digest (as a changed .py gives, test_source_digest_...) is another key
    monkeypatch.setitem(graph_cache._PROCESS, "sources",  # pylint: disable=protected-access
                        {graph_cache.package_root(): "another version of the package"})
    changed["sources"] = cache.key(forward(model, 2, 64), prefill_args(2))
    monkeypatch.undo()
    # a layer set to recompute (its flags), a frozen parameter, another version of a Cell class's file outside
    # gpt_local (MindSpore's or MindFormers' code: class_sources)
    recomputed, flagged, frozen = tiny_model(), tiny_model(), tiny_model()
    recomputed.model.layers[0].recompute()
    flagged.model.layers[0].add_flags(output_recompute=True)  # a Cell flag alone (what recompute() sets on its own)
    next(iter(frozen.get_parameters())).requires_grad = False
    changed["recompute"] = cache.key(forward(recomputed, 2, 64), prefill_args(2))
    changed["flag"] = cache.key(forward(flagged, 2, 64), prefill_args(2))
    changed["frozen"] = cache.key(forward(frozen, 2, 64), prefill_args(2))
    files = graph_cache._PROCESS["class_files"]  # pylint: disable=protected-access
    monkeypatch.setitem(files, next(path for path in sorted(files) if "mindspore" in path), "another version")
    changed["class sources"] = cache.key(forward(model, 2, 64), prefill_args(2))
    monkeypatch.undo()
    # the environment beyond MindSpore's MS_* switches is not the graph's (kernels are chosen by config: config.json
    # is the salt)
    monkeypatch.setenv("GPTLOCAL_API_KEY", "not the graph's")
    assert cache.key(forward(model, 2, 64), prefill_args(2)) == base
    runner = ModelRunner(model, describe(model), 2, 64)
    tokens = (ms.Tensor(np.zeros((2, 1), np.int32)), ms.Tensor(np.zeros((2, 1), np.int32)),
              ms.Tensor(np.arange(2, dtype=np.int32)))
    steps = {n: cache.key(GreedySteps(runner.forward, n), tokens) for n in (4, 8)}
    logits = cache.key(GreedySteps(runner.forward, 8, with_logits=True), tokens)
    keys = [base, *changed.values(), steps[4], steps[8], logits]
    assert len(set(keys)) == len(keys), changed


def test_source_digest_changes_with_any_source_file_of_the_package(tmp_path):
    """The key's ``source`` part: a copy of the package has the package's digest; one changed byte in a .py (or a
    kernel's .cc) gives another; files that are not sources (a README) do not count."""
    import shutil
    from mindformers_gptlocal.runtime.graph_cache import package_root, source_digest
    copy = tmp_path / "mindformers_gptlocal"
    shutil.copytree(package_root(), copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
    assert source_digest(str(copy)) == source_digest()
    digests = {source_digest(str(copy))}
    for name in ("runtime/runner.py", "kernels/csrc/kv_write.cc"):
        edited = tmp_path / f"edit-{len(digests)}"
        shutil.copytree(copy, edited)
        path = edited / name
        path.write_bytes(path.read_bytes() + b"\n")
        digests.add(source_digest(str(edited)))
    notes = tmp_path / "notes"
    shutil.copytree(copy, notes)
    (notes / "NOTES.txt").write_text("not a source")
    assert source_digest(str(notes)) == source_digest(str(copy))
    assert len(digests) == 3


def test_prune_keeps_recent_graphs_up_to_the_size_bound(tmp_path):
    from mindformers_gptlocal.errors import ConfigError
    from mindformers_gptlocal.runtime.graph_cache import GraphCache, prune
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
    with pytest.raises(ConfigError, match="--compile-cache-mb 'lots' must be a number >= 0"):
        GraphCache(tmp_path / "other", max_mb="lots")
    with pytest.raises(ConfigError, match="--compile-cache-days -1 must be a number >= 0"):
        GraphCache(tmp_path / "other", days=-1)
    assert GraphCache(tmp_path / "other", days="3", max_mb=5).days == 3.0
    assert GraphCache(tmp_path / "o2").max_mb == 1024.0
