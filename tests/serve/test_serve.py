"""`gptlocal serve` through the official `openai` client on 127.0.0.1: tokens equal `model.generate`
(alone and sharing a batch), sampling options, stop/usage/streaming, bad input, disconnects, load.

The server runs as a subprocess on a free port; every wait is bounded (no test can hang)."""
import asyncio
import glob
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from conftest import TINY, source_env  # noqa: E402
from conftest import free_port as _free_port

CONTEXT = 128
MODEL = "tiny-serve"
START_TIMEOUT = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny gpt_local directory with a 512-token BPE trained on a few stdlib files (seconds)."""
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    from mindformers_gptlocal.data.tokenizer import save_model_dir, train_bpe
    out = str(tmp_path_factory.mktemp("serve") / MODEL)
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:40]
    tokenizer = train_bpe((open(f, encoding="utf-8", errors="ignore").read() for f in files), 512)
    save_model_dir(out, tokenizer, CONTEXT)
    ms.set_seed(0)  # fixed weights: exact-equality checks stay away from chance argmax ties
    GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, max_position_embeddings=CONTEXT, seq_length=CONTEXT))
                        ).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve_log") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "mindformers_gptlocal.cli", "serve", "--model", model_dir,
                             "--port", str(port), "--max-batch-size", "8", "--max-queue", "32",
                             "--prompt-buckets", "16,128", "--batch-buckets", "1,8", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env=source_env(GLOG_v="3"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            assert proc.poll() is None, f"server exited: {open(log_path).read()[-3000:]}"
            assert time.monotonic() < deadline, \
                f"server not ready in {START_TIMEOUT} s: {open(log_path).read()[-3000:]}"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)
        log.close()
    print(open(log_path).read()[-2000:])


@pytest.fixture(scope="module")
def reference(model_dir):
    """model.generate on the same directory, in this process (greedy/sampled, EOS = the model's)."""
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalForCausalLM
    ms.set_context(mode=ms.GRAPH_MODE)
    model = GPTLocalForCausalLM.from_pretrained(model_dir)

    def generate(prompts, max_new, **options):
        out = model.generate(prompts, max_new_tokens=max_new, eos_token_id=model.config.eos_token_id, **options)
        return [seq[len(p):] for seq, p in zip(out, prompts)]
    yield generate
    ms.set_context(mode=ms.PYNATIVE_MODE)


def client(base, **kwargs):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60, **kwargs)


def aclient(base):
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def health(base):
    return httpx.get(base + "/health", timeout=10).json()


PROMPTS = [[5, 17, 42, 7, 99, 3, 11], [8, 1], [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310], [77],
           [400, 2, 2, 9], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28], [250, 251], [6, 60]]


def greedy_ids(resp):
    return resp.choices[0].model_extra["token_ids"]


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    state = health(server)
    assert state["status"] == "ready" and state["max_model_len"] == CONTEXT
    assert state["prompt_widths"] == [16, 128] and state["batch_sizes"] == [1, 8]


def test_greedy_equals_generate_alone_and_in_a_full_batch(server, reference):
    """The target joins while 7 others decode (a refill step fused with their decode steps) and still gets
    exactly model.generate's tokens; so do the 7."""
    expected = reference(PROMPTS, 40, do_sample=False)
    api = client(server)
    alone = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                   extra_body={"return_token_ids": True})
    assert greedy_ids(alone) == expected[0][:24]
    assert alone.usage.prompt_tokens == len(PROMPTS[0]) and alone.usage.completion_tokens == len(expected[0][:24])

    before = health(server)
    results, started = {}, threading.Event()

    def other(i):
        stream = api.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=40, temperature=0, stream=True,
                                        extra_body={"return_token_ids": True})
        ids = []
        for chunk in stream:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            if len(ids) >= 3:
                started.set()
        results[i] = ids

    threads = [threading.Thread(target=other, args=(i,)) for i in range(1, 8)]
    for t in threads:
        t.start()
    assert started.wait(60), "the other requests did not start decoding"
    target = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                    extra_body={"return_token_ids": True})
    for t in threads:
        t.join(120)
    assert greedy_ids(target) == expected[0][:24]
    for i in range(1, 8):
        assert results[i] == expected[i], f"request {i}"
    after = health(server)
    tokens = 24 + sum(len(expected[i]) for i in range(1, 8))
    # decode steps were shared, not one per token: 304 tokens in ~50 steps when the 7 arrive together, ~100 when a
    # busy machine staggers their arrival (seen under the suite's second worker), 304 + prefills unshared
    assert after["steps"] - before["steps"] < tokens / 2


def test_sampling_options_equal_generate_with_the_same_seed(server, reference):
    api = client(server)
    for temperature, top_p, top_k in ((0.8, 0.9, 0), (1.3, 1.0, 0), (1.0, 1.0, 20)):
        got = api.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=temperature,
                                     top_p=top_p, seed=123, extra_body={"return_token_ids": True, "top_k": top_k})
        want = reference([PROMPTS[2]], 16, do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k,
                         seed=123)[0]
        assert greedy_ids(got) == want
    other = api.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0, seed=124,
                                   extra_body={"return_token_ids": True, "top_k": 20})
    assert greedy_ids(other) != want


def test_text_stop_usage_stream_and_chat(server, model_dir, reference):
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    api = client(server)
    prompt = "def main(args):\n    return"
    ids = tokenizer.encode(prompt).ids
    expected = reference([ids], 30, do_sample=False)[0]
    full = api.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
    text = tokenizer.decode([t for t in expected if t != 0])
    assert full.choices[0].text == text
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(ids), len(expected))
    assert full.choices[0].finish_reason == ("stop" if expected[-1] == 0 else "length")

    streamed = api.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stream=True,
                                      stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == len(expected)

    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = api.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop, "@@@"])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < len(expected)

    chat_prompt = "User: hello\nAssistant:"  # the plain template (no chat_template in tokenizer_config.json)
    chat_ids = tokenizer.encode(chat_prompt).ids
    want = reference([chat_ids], 12, do_sample=False)[0]
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=12,
                                       temperature=0)
    want_text = tokenizer.decode([t for t in want if t != 0])
    want_text = want_text.split("\nUser:")[0]
    assert chat.choices[0].message.content == want_text
    assert chat.usage.prompt_tokens == len(chat_ids)


def test_n_choices_seeded_greedy_streamed_and_repetition_penalty(server, model_dir, reference):
    """n > 1: choices indexed 0..n-1; with a seed, choice i is model.generate with seed + i (so reproducible and
    choice 0 is the n=1 answer); greedy n gives n equal choices; a stream's chunks carry their choice's index and
    join to the same texts; usage counts the prompt once. ``repetition_penalty`` is model.generate's (HF's)."""
    api = client(server)
    extra = {"return_token_ids": True, "top_k": 20}
    seeded = api.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=123, n=3,
                                    extra_body=extra)
    assert [c.index for c in seeded.choices] == [0, 1, 2]
    got = [c.model_extra["token_ids"] for c in seeded.choices]
    for i in range(3):
        assert got[i] == reference([PROMPTS[2]], 12, do_sample=True, temperature=1.0, top_k=20, seed=123 + i)[0]
    assert len({tuple(g) for g in got}) > 1  # sampled choices differ
    assert seeded.usage.prompt_tokens == len(PROMPTS[2])
    assert seeded.usage.completion_tokens == sum(len(g) for g in got)
    again = api.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=123, n=3,
                                   extra_body=extra)
    assert [c.model_extra["token_ids"] for c in again.choices] == got

    greedy = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, n=4,
                                    extra_body={"return_token_ids": True})
    want = reference([PROMPTS[0]], 10, do_sample=False)[0]
    assert [c.model_extra["token_ids"] for c in greedy.choices] == [want] * 4

    messages = [{"role": "user", "content": "hello"}]
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=7, n=2)
    stream = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=7, n=2,
                                         stream=True, stream_options={"include_usage": True})
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens

    penalised = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                       extra_body={"return_token_ids": True, "repetition_penalty": 1.8})
    want = reference([PROMPTS[0]], 16, do_sample=False, repetition_penalty=1.8)[0]
    assert greedy_ids(penalised) == want
    assert want != reference([PROMPTS[0]], 16, do_sample=False)[0]  # the penalty changed the greedy tokens


@pytest.mark.parametrize("kwargs, param", [
    (dict(prompt=list(range(1, CONTEXT + 1)), max_tokens=1), "prompt"),
    (dict(prompt=[1, 2, 3], max_tokens=0), "max_tokens"),
    (dict(prompt=[1, 2, 3], max_tokens=CONTEXT), "max_tokens"),
    (dict(prompt=[1, 2, 512], max_tokens=4), "prompt"),
    (dict(prompt=[1, 2, 3], max_tokens=4, temperature=5), "temperature"),
    (dict(prompt=[1, 2, 3], max_tokens=4, n=0), "n"),
    (dict(prompt=[1, 2, 3], max_tokens=4, n=129), "n"),
    (dict(prompt=[1, 2, 3], max_tokens=4, extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(prompt=[1, 2, 3], max_tokens=4, frequency_penalty=0.5), "frequency_penalty"),
], ids=["prompt-too-long", "max_tokens-0", "max_tokens-too-many", "token-beyond-vocab", "temperature", "n-0",
        "n-too-many", "repetition_penalty-0", "frequency_penalty"])
def test_bad_input_is_a_400_naming_the_field(server, kwargs, param):
    kwargs = dict(dict(model=MODEL), **kwargs)
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(**kwargs)
    assert caught.value.status_code == 400 and caught.value.param == param
    assert caught.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_a_404_naming_the_field(server):
    with pytest.raises(openai.NotFoundError) as caught:  # OpenAI's status for a model it does not serve
        client(server).completions.create(model="gpt-4", prompt=[1, 2, 3], max_tokens=4)
    assert caught.value.param == "model" and caught.value.body["code"] == "model_not_found"
    assert caught.value.body["type"] == "invalid_request_error" and repr(MODEL) in caught.value.body["message"]


def test_malformed_json_is_a_400(server):
    # the openai client cannot send malformed JSON; httpx (its transport) does
    resp = httpx.post(server + "/v1/completions", content=b'{"model": "tiny", "prompt": ', timeout=10,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "body"


def test_disconnect_mid_stream_frees_the_slot(server):
    before = health(server)
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server + "/v1/completions",
                         json={"model": MODEL, "prompt": [5, 6], "max_tokens": CONTEXT - 2, "temperature": 0,
                               "stream": True, "return_token_ids": True}) as resp:
            seen = 0
            for line in resp.iter_lines():
                seen += line.startswith("data:")
                if seen >= 2:
                    break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = health(server)
        if state["active"] == 0 and state["cancelled"] > before["cancelled"]:
            break
        time.sleep(0.2)
    assert state["active"] == 0 and state["cancelled"] == before["cancelled"] + 1
    assert state["completed"] == before["completed"]


def test_load_then_a_burst_beyond_the_queue(server, reference):
    """32 clients x 4 requests: every one completes with its own prompt's tokens, none lost or duplicated.
    Then 120 at once with room for 32 waiting (+ 8 slots): the rest get 429 + Retry-After, the server
    stays up and every accepted request is right."""
    expected = reference(PROMPTS, 24, do_sample=False)

    async def one(api, k, max_tokens):
        prompt = k % len(PROMPTS)
        resp = await api.completions.create(model=MODEL, prompt=PROMPTS[prompt], max_tokens=max_tokens, temperature=0,
                                            extra_body={"return_token_ids": True})
        return prompt, resp

    async def load():
        api = aclient(server)

        async def client_loop(c):
            return [await one(api, c * 4 + r, 8) for r in range(4)]
        try:
            return await asyncio.wait_for(asyncio.gather(*(client_loop(c) for c in range(32))), 240)
        finally:
            await api.close()

    results = [r for per_client in asyncio.run(load()) for r in per_client]
    assert len(results) == 128 and len({resp.id for _, resp in results}) == 128
    for prompt, resp in results:
        assert greedy_ids(resp) == expected[prompt][:8]

    async def burst():
        api = aclient(server)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(api, k, 24) for k in range(120)),
                                                         return_exceptions=True), 240)
        finally:
            await api.close()

    outcomes = asyncio.run(burst())
    done = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    assert len(done) + len(refused) == 120, [o for o in outcomes if isinstance(o, BaseException)][:3]
    assert refused and all(int(r.response.headers["retry-after"]) >= 1 for r in refused)
    assert len({resp.id for _, resp in done}) == len(done) >= 32  # at least a full queue was taken
    for prompt, resp in done:
        assert greedy_ids(resp) == expected[prompt]
    state = health(server)
    assert state["status"] == "ready" and state["active"] == 0 and state["queued"] == 0


def test_a_missing_model_directory_is_one_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", "serve", "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=source_env(GLOG_v="3"))
    assert proc.returncode == 2 and "has no config.json" in proc.stderr, proc.stderr[-2000:]


def test_chat_template_flag(model_dir, tmp_path):
    """--chat-template FILE: chat requests are rendered with it (no plain-form stop added); 'plain' is the
    built-in form; a file that is not there is one line, exit 2, before the port is bound or the model loads."""
    from tokenizers import Tokenizer
    from mindformers_gptlocal.serve.protocol import PLAIN_CHAT_STOP, chat_template, parse_request
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    own = parse_request(body, True, MODEL, tokenizer, chat_template(str(path), "{{ 'directory' }}"), 512, CONTEXT, 0)
    assert own["prompt"] == tokenizer.encode("[user] hello\n[assistant]").ids and own["stop"] == []
    plain = parse_request(body, True, MODEL, tokenizer, chat_template("plain", "{{ 'directory' }}"), 512, CONTEXT, 0)
    assert plain["prompt"] == tokenizer.encode("User: hello\nAssistant:").ids and plain["stop"] == [PLAIN_CHAT_STOP]
    assert chat_template(None, "{{ 'directory' }}") == "{{ 'directory' }}"  # not given: the directory's own
    proc = subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", "serve", "--model", model_dir,
                           "--chat-template", str(tmp_path / "none.jinja"), "--port", str(_free_port())],
                          capture_output=True, text=True, timeout=120, env=source_env(GLOG_v="3"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and "is neither a file nor a built-in template" in proc.stderr
