"""MindSpore's graph-kernel fusion (AKG, ``context.enable_graph_kernel: True``) on the gpt_local train step:
it compiles on CPU with the bundled AKG (needs ``decorator``, an install requirement) and gives the unfused
step's losses. It is off unless a run YAML's ``context`` turns it on (MindSpore's default; the shipped CPU YAMLs leave
it off and ``gptlocal migrate-yaml`` drops it for CPU)."""
import pathlib
import time

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal import GPTLocalForCausalLM, GPTLocalTrainOneStepCell
from mindformers_gptlocal.training.optim import GPTLocalAdamW



def _losses(tiny_config, steps=4):
    ms.set_seed(0)
    model = GPTLocalForCausalLM(tiny_config)
    optimizer = GPTLocalAdamW(model.trainable_params(), learning_rate=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    cell = GPTLocalTrainOneStepCell(model, optimizer, use_clip_grad=True, max_grad_norm=1.0, scale_sense=1.0)
    cell.set_train(True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, tiny_config.vocab_size, (2, 33)).astype(np.int32)
    batch = (Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]), Tensor(np.ones((2, 32), np.int32)),
             Tensor(np.tile(np.arange(32, dtype=np.int32), (2, 1))))
    return [float(cell(*batch)[0]) for _ in range(steps)]


def _akg_kernels_since(started, cwd):
    """AKG's kernel files written since ``started``: in ``akg_kernel_meta/`` of the working directory, or of the
    compile-cache folder where one was in use in this process (MindSpore reads that path once a process and
    writes AKG's kernels there from then on, measured; ``runtime/graph_cache.py``'s staging folder, after a test
    that ran ``gptlocal generate`` in this process)."""
    from mindformers_gptlocal.runtime import graph_cache
    folders = [pathlib.Path(cwd)] + ([pathlib.Path(graph_cache._PROCESS["staging"])]  # pylint: disable=protected-access
                                     if "staging" in graph_cache._PROCESS else [])  # pylint: disable=protected-access
    return [f for d in folders for f in (d / "akg_kernel_meta").glob("*.so") if f.stat().st_mtime >= started - 1]


def test_fused_step_gives_the_unfused_losses(tiny_config, mcore_context, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # AKG writes akg_kernel_meta/ and its logs into the working directory
    assert not ms.get_context("enable_graph_kernel")
    started = time.time()
    plain = _losses(tiny_config)
    ms.set_context(enable_graph_kernel=True)
    try:
        fused = _losses(tiny_config)
    finally:
        ms.set_context(enable_graph_kernel=False)
    assert _akg_kernels_since(started, tmp_path)  # AKG really compiled kernels for this graph
    assert plain[-1] < plain[0]
    np.testing.assert_allclose(fused, plain, rtol=0, atol=1e-5)
