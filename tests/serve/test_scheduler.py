"""serve/scheduler.py alone, no model: which tokens each call runs (the engine only builds arrays from it and runs
them), and how a call's logits advance the requests. The engine over a real model: test_serve_engine.py and
test_serve_prefill.py."""
import numpy as np

from mindformers_gptlocal.serve.scheduler import Request, Scheduler

VOCAB = 50


def logits_picking(tokens):
    """Logits [len(tokens), VOCAB] whose argmax (greedy) is each row's token."""
    out = np.zeros((len(tokens), VOCAB), np.float32)
    out[np.arange(len(tokens)), tokens] = 1.0
    return out


def test_prefill_chunks_then_decode_steps_and_a_stop_string():
    scheduler = Scheduler(max_batch_size=4, max_queue=8, batches=[1, 2, 4], decode=lambda ids: "".join(
        chr(ord("a") + t % 26) for t in ids))
    scheduler.configure(max_model_len=64, widths=[16, 32, 64], prefill_tokens=32)
    assert scheduler.prefill_batches == [1, 2] and scheduler.prefill_widths == [16, 32]
    events = [[], []]
    long_prompt, short_prompt = list(range(1, 41)), [7, 8, 9]
    scheduler.add(Request(long_prompt, 3, events[0].append, temperature=0))
    scheduler.add(Request(short_prompt, 5, events[1].append, temperature=0, stop=["cd"]))

    first = scheduler.schedule()  # first come, first served: the long prompt's first 32 tokens alone (2 x 32 > 32)
    assert (first.kind, first.batch, first.width, first.slots) == ("prefill", 1, 32, [0])
    assert first.writes == [(0, long_prompt[:32], 0, 31)]
    scheduler.update(first, logits_picking([0]))  # the prompt is not complete: nothing sampled
    assert events == [[], []]

    second = scheduler.schedule()  # its last 8 and the short prompt: a 2 x 16 prefill, each row at its position
    assert (second.kind, second.batch, second.width, second.slots) == ("prefill", 2, 16, [0, 1])
    assert second.writes == [(0, long_prompt[32:], 32, 7), (1, short_prompt, 0, 2)]
    scheduler.update(second, logits_picking([4, 2]))  # both complete: the short one samples 2 ("c")
    assert [e[2] for e in events[0]] == [4]
    assert [e[:3] for e in events[1]] == [("token", "", 2)]  # "c" may start the stop string "cd": held back

    third = scheduler.schedule()  # both decode, one token each at its own position: batch bucket 2
    assert (third.kind, third.batch, third.width, third.slots) == ("decode", 2, 1, [0, 1])
    assert third.writes == [(0, [4], 40, 0), (1, [2], 3, 0)]
    scheduler.update(third, logits_picking([5, 3]))  # the short one writes "d": "cd" is its stop string
    assert events[1][-1][0] == "done" and events[1][-1][1] == "stop"
    assert "".join(e[1] for e in events[1] if e[0] == "token") == ""  # cut before the stop string
    fourth = scheduler.schedule()
    assert (fourth.kind, fourth.batch, fourth.writes) == ("decode", 1, [(0, [5], 41, 0)])
    scheduler.update(fourth, logits_picking([6]))
    assert events[0][-1][:2] == ("done", "length") and [e[2] for e in events[0][:-1]] == [4, 5, 6]
    assert scheduler.schedule() is None and scheduler.snapshot()["completed"] == 2


def test_refills_join_the_busy_rows_in_one_call():
    scheduler = Scheduler(max_batch_size=2, max_queue=8, batches=[2])
    scheduler.configure(max_model_len=64, widths=[16, 64], prefill_tokens=0)  # refills
    sink = []
    scheduler.add(Request([1, 2, 3], 4, sink.append, temperature=0))
    call = scheduler.schedule()
    assert (call.kind, call.width, call.writes) == ("refill", 16, [(0, [1, 2, 3], 0, 2), (1, [], 0, 0)])
    scheduler.update(call, logits_picking([9, 0]))
    scheduler.add(Request([4, 5], 4, [].append, temperature=0))
    call = scheduler.schedule()  # the new prompt in slot 1; slot 0's token 9 at its position 3, repeated
    assert call.kind == "refill" and call.writes == [(0, [9] * 16, 3, 0), (1, [4, 5], 0, 1)]
