"""A training run's step graph through the compile cache (``runner_wrapper.compile_cache``, ``mf/wrapper.py``
``step_cache``, on by default for a one-process gpt_local run: ``mf/run_yaml.py`` ``configure_compile_cache``): the
second run of the same YAML loads the graph the first stored and trains to the very same losses (each run's first
progress line says whether its step graph was compiled or loaded, and how long that took); a run of another
model stores its own graph; a run with the cache off stores nothing; bad values stop the run before it is built."""
import os
import re

import pytest

from mindformers_gptlocal import yaml_io
from mindformers_gptlocal.errors import ConfigError
from mindformers_gptlocal.mf.run_yaml import configure_compile_cache
from conftest import Launch, launch_in_process, step_losses, write_yaml

STEPS = 4


def _graphs(store):
    """{step graph folder name: (inode, mtime) of its stored graph} in ``store``."""
    found = {}
    for name in sorted(os.listdir(store)) if os.path.isdir(store) else ():
        path = os.path.join(store, name, "graph.mindir")
        if name.startswith("gptlocaltrainonestepcell-") and os.path.isfile(path):
            found[name] = (os.stat(path).st_ino, os.stat(path).st_mtime_ns)
    return found


def _yaml(folder, corpus, store, **changes):
    path = write_yaml(folder, corpus, train_dataset__data_loader__num_samples=4 * STEPS, **changes)
    config = yaml_io.load_yaml(path)
    config["runner_wrapper"]["compile_cache"] = store
    return yaml_io.dump_yaml(config, path)


def test_a_second_run_loads_the_stored_step_graph_and_trains_the_same(corpus, tmp_path):
    store = str(tmp_path / "store")
    first = Launch(["--config", _yaml(tmp_path / "first", corpus, store)], cwd=str(tmp_path / "first"))
    other_store = str(tmp_path / "other_store")  # another model (3 layers), overlapping the first run
    other = Launch(["--config", _yaml(tmp_path / "other", corpus, other_store, model__model_config__num_hidden_layers=3)],
                   cwd=str(tmp_path / "other"))
    code, out = first.result()
    assert code == 0, out[-3000:]
    stored = _graphs(store)
    assert len(stored) == 1, os.listdir(store)
    assert re.search(r"\[gptlocal\] step 1/\d+ .*  \(step graph compiled in \d+\.\d s\)\n", out), out[-3000:]

    code, again = Launch(["--config", _yaml(tmp_path / "again", corpus, store)], cwd=str(tmp_path / "again")).result()
    assert code == 0, again[-3000:]
    assert "compile cache off" not in again, again[-3000:]
    assert re.search(r"\[gptlocal\] step 1/\d+ .*  \(step graph loaded from the compile cache in \d+\.\d s\)\n",
                     again), again[-3000:]  # said on the launch's first line only
    assert again.count("(step graph ") == 1, again[-3000:]
    assert _graphs(store) == stored  # loaded, not compiled and stored again (a store rewrites the file)
    assert step_losses(again) == step_losses(out) and len(step_losses(out)) == STEPS  # bit for bit

    code, out = other.result()
    assert code == 0, out[-3000:]
    assert len(_graphs(other_store)) == 1 and set(_graphs(other_store)) != set(stored)  # its own key


def test_the_default_and_each_value(tmp_path):
    def configured(wrapper, **top):
        config = dict(top, runner_wrapper=wrapper)
        configure_compile_cache(config)
        return config["runner_wrapper"].get("compile_cache")

    assert configured({"type": "GPTLocalTrainOneStepCell"}) == "on"  # one process: on unless written
    assert configured({"type": "GPTLocalTrainOneStepCell"}, use_parallel=True) is None  # msrun: off
    assert configured({"type": "GPTLocalTrainOneStepCell", "compile_cache": False}) == "off"
    assert configured({"type": "GPTLocalTrainOneStepCell", "compile_cache": True}) == "on"
    assert configured({"type": "GPTLocalTrainOneStepCell", "compile_cache": "off"}) == "off"
    assert configured({"type": "MFTrainOneStepCell"}) is None  # not ours: untouched
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for bad in (str(a_file), 3, ""):
        with pytest.raises(ConfigError, match="runner_wrapper.compile_cache"):
            configured({"type": "GPTLocalTrainOneStepCell", "compile_cache": bad})


def test_the_step_cache_is_made_only_in_graph_mode(tmp_path):
    import mindspore as ms
    from mindformers_gptlocal.mf.wrapper import step_cache
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        assert step_cache("off") is None and step_cache(None) is None
        cache = step_cache(str(tmp_path / "store"))
        assert cache.root == str(tmp_path / "store") and "mindformers" in cache.salt
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert step_cache(str(tmp_path / "store")) is None  # PyNative compiles no step graph


def test_a_file_as_the_store_stops_the_run_before_anything_is_written(corpus, tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    path = _yaml(tmp_path / "run", corpus, str(a_file))
    code, out = launch_in_process(["--config", path], str(tmp_path / "run"), capsys, monkeypatch)
    assert code == 2, out
    assert "runner_wrapper.compile_cache" in out and "is a file" in out, out
    assert not os.path.exists(tmp_path / "run" / "output" / "checkpoint")
