"""Generation's rules, written once in ``generation/``: when a sequence stops (``stopping.StopRule``) and the
temperature rule (``sampling.sampling_options``); the host decode loop and the server's scheduler stop the same
sequence at the same token, and the CLI, the server and the eval read a temperature the same way. No model: the
logits are scripted."""
import argparse

import numpy as np
import pytest

from mindformers_gptlocal.evaluation.harness import GPTLocalLM
from mindformers_gptlocal.generation.defaults import CLI, SERVE
from mindformers_gptlocal.generation.loop import decode_loop, resolve_options
from mindformers_gptlocal.generation.sampling import sampling_options
from mindformers_gptlocal.generation.stopping import StopRule
from mindformers_gptlocal.runtime.detokenizer import Detokenizer
from mindformers_gptlocal.serve.scheduler import Request, Scheduler

VOCAB = 30


def text_of(ids):
    return "".join(chr(ord("a") + t % 26) for t in ids)


def picking(token, rows=1):
    out = np.zeros((rows, VOCAB), np.float32)
    out[:, token] = 1.0
    return out


def test_the_rule_eos_then_stop_string_then_budget():
    rule = StopRule([7, 9], budget=3)
    assert rule.is_eos(9) and not rule.is_eos(8)
    assert rule.finish(8, 1) is None and rule.finish(8, 2, matched=False) is None
    assert rule.finish(8, 3) == "length" and rule.finish(8, 4) == "length"
    assert rule.finish(7, 1) == "stop" and rule.finish(8, 1, matched=True) == "stop"
    assert rule.finish(9, 3) == "stop" and rule.finish(8, 3, matched=True) == "stop"  # stop beats the budget


def loop_tokens(prompt, script, max_new, eos, stop):
    """``decode_loop`` over logits that pick ``script`` one by one, with a stop-string check as ``gptlocal generate``
    has (the runtime's Detokenizer)."""
    text = Detokenizer(text_of, stop)
    picks = iter(script)

    def stop_when(rows, generated):
        assert rows == [0]
        text.update(generated[0])
        return [text.stopped]

    def step(tokens, positions):
        return picking(next(picks))
    options = resolve_options(None, eos_token_id=eos)
    out = decode_loop([prompt], max_new, options, np.random.default_rng(0), picking(next(picks)), step,
                      stop_when if stop else None)
    return out[0][len(prompt):]


def server_tokens(prompt, script, max_tokens, eos, stop, max_model_len=64):
    scheduler = Scheduler(max_batch_size=1, max_queue=2, batches=[1], decode=text_of)
    scheduler.configure(max_model_len=max_model_len, widths=[16, 64], prefill_tokens=0)
    events = []
    scheduler.add(Request(prompt, max_tokens, events.append, temperature=0, stop=stop, eos=eos))
    picks = iter(script)
    while (call := scheduler.schedule()) is not None:
        scheduler.update(call, picking(next(picks), call.batch))
    return [e[2] for e in events if e[0] == "token"], events[-1][1]


@pytest.mark.parametrize("script,max_new,eos,stop,expect,reason", [
    ([1, 2, 3, 4, 5, 6], 4, [], [], [1, 2, 3, 4], "length"),
    ([1, 2, 7, 4, 5, 6], 5, [7], [], [1, 2, 7], "stop"),
    ([1, 2, 3, 7, 5, 6], 4, [7], [], [1, 2, 3, 7], "stop"),  # EOS as the last token the budget allows: "stop"
    ([1, 2, 3, 4, 5, 6], 6, [], ["de"], [1, 2, 3, 4], "stop"),  # "bcde" holds the stop string "de"
    ([1, 2, 3, 4, 5, 6], 6, [4], ["de"], [1, 2, 3, 4], "stop"),  # EOS 4 ("e" were it text): EOS comes first
    ([1, 2, 3, 4, 5, 6], 1, [1], [], [1], "stop"),
])
def test_the_host_loop_and_the_server_stop_at_the_same_token(script, max_new, eos, stop, expect, reason):
    prompt = [10, 11]
    assert loop_tokens(prompt, script, max_new, eos, stop) == expect
    tokens, finish = server_tokens(prompt, script, max_new, eos, stop)
    assert (tokens, finish) == (expect, reason)


def test_the_server_ends_at_the_caches_last_row():
    tokens, finish = server_tokens([10, 11, 12], list(range(1, 20)), 16, [], [], max_model_len=8)
    assert (tokens, finish) == ([1, 2, 3, 4, 5], "length")  # 3 prompt rows + 5 new = the 8 rows of the cache


@pytest.mark.parametrize("temperature,do_sample,sampled", [
    (0.0, True, False), (0, True, False), (0.7, True, True), (1.0, False, False), (2.0, True, True),
])
def test_the_temperature_rule(temperature, do_sample, sampled):
    options = sampling_options(temperature, 5, 0.9, do_sample=do_sample)
    if sampled:
        assert options == {"do_sample": True, "temperature": float(temperature), "top_k": 5, "top_p": 0.9}
    else:
        assert options == {"do_sample": False}
    assert sampling_options(temperature, do_sample=do_sample) == (
        {"do_sample": True, "temperature": float(temperature)} if sampled else {"do_sample": False})


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.3])
def test_the_cli_the_server_and_the_eval_read_a_temperature_alike(temperature):
    from mindformers_gptlocal.cli.generate import sampling
    cli = sampling(argparse.Namespace(max_new_tokens=8, temperature=temperature, top_k=CLI["top_k"],
                                      top_p=CLI["top_p"], seed=3, repetition_penalty=1.0))
    served = Request([1], 4, [].append, temperature=temperature).options
    evaluated = GPTLocalLM._generation_options({"temperature": temperature, "do_sample": True, "top_k": 4})
    sampled = temperature > 0
    assert cli["do_sample"] == served["do_sample"] == evaluated["do_sample"] == sampled
    if sampled:
        assert cli["temperature"] == served["temperature"] == evaluated["temperature"] == temperature
        assert cli["seed"] == 3 and (served["top_k"], served["top_p"]) == (SERVE["top_k"], SERVE["top_p"])
    else:
        assert "seed" not in cli and not {"temperature", "top_k", "top_p"} & (set(cli) | set(served) | set(evaluated))
    # lm-eval's gen_kwargs sample only when do_sample is set too
    assert GPTLocalLM._generation_options({"temperature": temperature}) == {"do_sample": False}
