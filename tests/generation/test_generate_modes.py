"""``model.generate`` from a plain script, whatever MindSpore's global mode (issue 52, item 3): in PyNative (MindSpore's
default, README's "From Python") it gives the tokens GRAPH mode gives, through either runner: the native one needs no
mode at all, and the compiled one runs its graphs compiled (``runtime/runner.py`` ``compiled_call``: its Cells hold
compiled graphs afterwards) and leaves the caller's PyNative mode as it was."""
import mindspore as ms
import pytest

from mindformers_gptlocal import GPTLocalConfig
from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
from conftest import TINY

PROMPTS = [[5, 17, 42, 7], [8, 1, 300]]


@pytest.mark.parametrize("runner", ["native", "compiled"])
def test_pynative_and_graph_mode_give_the_same_tokens(runner, pynative_mode):  # pylint: disable=unused-argument
    ms.set_seed(0)
    changes = {} if runner == "native" else dict(cpu_kernels={"runner": "plain"})
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **changes)))
    options = dict(max_new_tokens=12, do_sample=False)
    pynative = model.generate(PROMPTS, **options)
    assert ms.get_context("mode") == ms.PYNATIVE_MODE  # the caller's mode, as it was
    sampled = model.generate(PROMPTS, max_new_tokens=12, do_sample=True, top_k=20, seed=3)
    runner_of = model.kv_cache(len(PROMPTS), 16 + 12)
    assert model._kv_caches.kind == runner  # pylint: disable=protected-access
    if runner == "compiled":  # the calls ran compiled: MindSpore's record of the runner's compiled graphs
        assert len(runner_of.compile_cache) >= 1 and sum(len(g.compile_cache) for g in runner_of._greedy.values())
    ms.set_context(mode=ms.GRAPH_MODE)
    assert model.generate(PROMPTS, **options) == pynative
    assert model.generate(PROMPTS, max_new_tokens=12, do_sample=True, top_k=20, seed=3) == sampled
