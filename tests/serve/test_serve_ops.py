"""`gptlocal serve` beyond localhost (issue 30): the API key, body and field bounds, --request-timeout,
/metrics, a client that stops reading, and SIGTERM during a stream.

One real `gptlocal serve` subprocess on 127.0.0.1 serves every test here, with one cache slot and a 1024-token
context (so a long request runs for seconds and a second one waits); the last test sends it SIGTERM. Every
loop and wait is bounded."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from conftest import TINY, source_env  # noqa: E402
from conftest import free_port as _free_port  # noqa: E402

MODEL = "tiny-ops"
CONTEXT = 4096
LONG = 4000  # tokens of a request that must outlive the timeouts below: the model runs the compiled runner
# (RUNNER), where 1,000 took < 3 s on 2 quiet cores and 4,000 take several times longer than REQUEST_TIMEOUT (the
# native runner, the CPU default, decodes this tiny model so fast that 4,000 tokens end within it)
RUNNER = {"runner": "plain"}
KEY = "gl-test-7f3a9c1e5b2d"
WRONG = "gl-wrong-0000000000"
MAX_BYTES = 16384
REQUEST_TIMEOUT = 3.0
SHUTDOWN_TIMEOUT = 1.0
START_TIMEOUT = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    out = str(tmp_path_factory.mktemp("serve_ops") / MODEL)
    ms.set_seed(0)
    GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, max_position_embeddings=CONTEXT, seq_length=CONTEXT,
                                              cpu_kernels=RUNNER))).save_pretrained(out)
    return out


class Server:
    def __init__(self, proc, base, log_path):
        self.proc, self.base, self.log_path = proc, base, log_path

    def log(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as handle:
            return handle.read()


@pytest.fixture(scope="module")
def launched(model_dir, tmp_path_factory):
    """The server process, started (the key from GPTLOCAL_API_KEY, the documented way: a flag shows in ps);
    ``server`` waits for it. The in-process test runs first, while it boots."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve_ops_log") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "mindformers_gptlocal.cli", "serve", "--model", model_dir,
                             "--port", str(port), "--max-batch-size", "1", "--batch-buckets", "1",
                             "--prompt-buckets", "16", "--max-request-bytes", str(MAX_BYTES),
                             "--request-timeout", str(REQUEST_TIMEOUT), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                             "--log-level", "info"],
                            stdout=log, stderr=subprocess.STDOUT, env=source_env(GLOG_v="3", GPTLOCAL_API_KEY=KEY))
    try:
        yield Server(proc, f"http://127.0.0.1:{port}", log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        log.close()


@pytest.fixture(scope="module")
def server(launched):
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        assert launched.proc.poll() is None, f"server exited: {launched.log()[-3000:]}"
        assert time.monotonic() < deadline, f"server not ready in {START_TIMEOUT} s: {launched.log()[-3000:]}"
        try:
            if httpx.get(launched.base + "/health", timeout=2).status_code == 200:
                return launched
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def client(base, key=KEY, timeout=60):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=timeout)


AUTH = {"Authorization": f"Bearer {KEY}"}


def health(base):
    return httpx.get(base + "/health", timeout=10).json()


def metrics(base):
    """{(name, labels tuple): value} of every sample /metrics serves."""
    text = httpx.get(base + "/metrics", headers=AUTH, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def local_engine(model_dir, launched):
    """An engine in this process (one slot, a 256-token cache) for the tests that drive the ASGI app
    directly; it loads while the server process boots."""
    import mindspore as ms
    from mindformers_gptlocal.serve.engine import Engine
    engine = Engine(model_dir, max_batch_size=1, max_model_len=256, prompt_buckets=[16], batch_buckets=[1])
    try:
        engine.start()
        assert engine.ready.wait(START_TIMEOUT) and not engine.failed, engine.failed
        yield engine
    finally:
        engine.stop()
        ms.set_context(mode=ms.PYNATIVE_MODE)


async def acall_app(app, body, send_hook=None):
    """One POST /v1/completions through the ASGI ``app``: (messages sent, scope). The client stays connected
    and silent after its body; ``send_hook(message)`` (async) runs inside each ``send``."""
    body = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent, given = [], []

    async def receive():
        if not given:
            given.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # still connected, sending nothing

    async def send(message):
        sent.append(message)
        if send_hook is not None:
            await send_hook(message)

    await asyncio.wait_for(app(scope, receive, send), 60)
    return sent, scope


def call_app(app, body, send_hook=None):
    return asyncio.run(acall_app(app, body, send_hook))


def wait_idle(engine):
    deadline = time.monotonic() + 10
    while (engine.snapshot()["active"] or engine.snapshot()["queued"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.snapshot()


def test_a_client_that_stops_reading_is_dropped_and_its_slot_freed(local_engine):
    """In-process (the stall must come before the generation ends, and a tiny model's whole stream fits in
    the socket buffers): the app under a ``send`` that stops returning at the first SSE chunk, as uvicorn's
    does for a peer that stopped reading (it awaits ``flow.drain()`` once its transport passes the 64 KiB
    high-water mark). The response ends after --send-timeout, the generation is cancelled mid-way and the
    engine's one slot is free."""
    from mindformers_gptlocal.serve.app import create_app
    from mindformers_gptlocal.serve.ops import State
    engine = local_engine
    before = engine.snapshot()
    app = create_app(engine, MODEL, state=State(send_timeout=0.05))

    async def stall(message):
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the peer stopped reading
    start = time.monotonic()
    # (return_token_ids: this directory has no tokenizer, so only the ids make a chunk per token)
    sent, scope = call_app(app, {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 250, "temperature": 0,
                                 "stream": True, "ignore_eos": True, "return_token_ids": True}, stall)
    assert time.monotonic() - start < 10
    assert sent[0]["status"] == 200
    request = scope["gptlocal.requests"][0]
    assert request.cancelled
    state = wait_idle(engine)
    assert state["active"] == 0 and state["cancelled"] == before["cancelled"] + 1
    assert state["completed"] == before["completed"]
    assert 1 <= len(request.tokens) < 250  # 250 tokens take 0.25-5 s here; the stall ended it in ~0.05


def test_a_request_that_waits_past_its_timeout_is_a_504(local_engine):
    """The one slot is held by a request with no deadline (250 tokens: 0.25-5 s here); two through the app
    with --request-timeout 0.05 wait for it, are dropped from the queue at their deadline (504; a stream:
    an SSE error event), and the slot holder is unaffected."""
    from mindformers_gptlocal.serve.app import create_app
    from mindformers_gptlocal.serve.ops import State
    from mindformers_gptlocal.serve.scheduler import Request
    engine = local_engine
    before = engine.snapshot()
    app = create_app(engine, MODEL, state=State(request_timeout=0.05))
    events = []
    holder = Request([5, 6, 7], 250, events.append, temperature=0, eos=[])
    engine.submit(holder)
    try:
        deadline = time.monotonic() + 30
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()

        async def both():
            return await asyncio.gather(acall_app(app, {"model": MODEL, "prompt": [9], "max_tokens": 4}),
                                        acall_app(app, {"model": MODEL, "prompt": [9], "max_tokens": 4,
                                                        "stream": True}))
        (sent, _), (streamed, _) = asyncio.run(both())
        assert 0.04 <= time.monotonic() - start < 10
        assert not any(e[0] == "done" for e in events)  # the holder was generating all along
        assert sent[0]["status"] == 504
        error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
        assert error["code"] == "timeout" and "--request-timeout 0.05" in error["message"]
        assert streamed[0]["status"] == 200
        chunks = b"".join(m.get("body", b"") for m in streamed[1:]).decode()
        assert json.loads(chunks.split("data: ", 1)[1].split("\n\n")[0])["error"]["code"] == "timeout"
        assert "[DONE]" not in chunks
    finally:
        holder.cancelled = True
    state = wait_idle(engine)
    assert state["expired"] == before["expired"] + 2 and state["active"] == 0


def test_the_key_is_required_on_every_route_but_health(server):
    with pytest.raises(openai.AuthenticationError) as caught:
        client(server.base, key=WRONG).models.list()
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(server.base, key=WRONG).completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/metrics"), ("GET", "/nowhere")):
        resp = httpx.request(method, server.base + path, json={"model": MODEL}, timeout=10)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.json()["error"]["type"] == "invalid_request_error" and "missing" in resp.json()["error"]["message"]
        assert resp.headers["www-authenticate"] == "Bearer"
    resp = httpx.get(server.base + "/v1/models", headers={"Authorization": f"Basic {KEY}"}, timeout=10)
    assert resp.status_code == 401  # the key under another scheme is not a bearer token
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200

    api = client(server.base)
    assert [m.id for m in api.models.list().data] == [MODEL]
    done = api.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4


def test_an_oversize_body_is_a_413_before_it_is_read(server):
    api = client(server.base)
    with pytest.raises(openai.APIStatusError) as caught:
        api.completions.create(model=MODEL, prompt="x" * (MAX_BYTES + 1), max_tokens=2)
    assert caught.value.status_code == 413
    assert caught.value.body["param"] == "body" and str(MAX_BYTES) in caught.value.body["message"]

    def chunks():  # no Content-Length: refused once the bytes read pass the limit
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": [1'
        for _ in range(MAX_BYTES // 1000 + 1):
            yield b", 1" * 500
        yield b"]}"
    resp = httpx.post(server.base + "/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    # just under the limit is parsed as usual (here: a 400 naming the over-long prompt, not a 413)
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=MODEL, prompt=[7] * (MAX_BYTES // 3 - 50), max_tokens=2)  # < 16 KB
    assert caught.value.param == "prompt"


@pytest.mark.parametrize("body, param", [
    (dict(prompt=[1, 2], stop=["x" * 257]), "stop"),
    (dict(prompt=[1, 2], stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(prompt=[1, 2], logit_bias={"5": 100}), "logit_bias"),
    (dict(messages=[{"role": "user", "content": ""}] * 257), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": ""}] * 65}]), "messages[0].content"),
], ids=["stop-string-too-long", "five-stop-strings", "logit_bias", "257-messages", "65-content-parts"])
def test_lists_and_maps_are_bounded_by_field(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = httpx.post(server.base + path, json=dict(model=MODEL, max_tokens=2, **body), headers=AUTH, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_json_nested_too_deep_is_a_400(server):
    resp = httpx.post(server.base + "/v1/completions", content=b"[" * 5000, headers=AUTH, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "body"


def test_metrics_count_a_request(server):
    before = metrics(server.base)
    api = client(server.base)
    done = api.completions.create(model=MODEL, prompt=[5, 17, 42], max_tokens=9, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = metrics(server.base)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)
    assert delta("gptlocal_http_requests_total", route="/v1/completions", status="200") == 1
    assert delta("gptlocal_http_requests_total", route="/metrics", status="200") == 1  # the first scrape
    assert delta("gptlocal_prompt_tokens_total") == done.usage.prompt_tokens == 3
    assert delta("gptlocal_generation_tokens_total") == done.usage.completion_tokens == 9
    assert delta("gptlocal_request_finish_total", reason="length") == 1
    assert delta("gptlocal_time_to_first_token_seconds_count") == 1
    assert delta("gptlocal_time_per_output_token_seconds_count") == 8
    assert delta("gptlocal_request_duration_seconds_count") == 1
    assert 0 < delta("gptlocal_time_to_first_token_seconds_sum") <= delta("gptlocal_request_duration_seconds_sum")
    assert after[("gptlocal_requests_running", ())] == 0 and after[("gptlocal_requests_waiting", ())] == 0
    assert after[("gptlocal_slots", ())] == 1 and after[("gptlocal_draining", ())] == 0
    # the engine's steps by phase: 1 prefill + 8 decode calls ran the model; sampling and sending took some time
    phases = {phase: delta("gptlocal_engine_step_seconds_total", phase=phase) for phase in ("schedule", "model",
                                                                                            "update")}
    assert all(seconds > 0 for seconds in phases.values()), phases
    assert phases["model"] < delta("gptlocal_request_duration_seconds_sum"), phases


def test_a_timeout_ends_the_request_and_frees_its_slot(server):
    """A LONG-token request is still generating at --request-timeout: it ends "length" with what it has; the
    one slot is free again and the next request completes."""
    api = client(server.base)
    before = health(server.base)
    start = time.monotonic()
    cut = api.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=LONG, temperature=0,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
    elapsed = time.monotonic() - start
    assert cut.choices[0].finish_reason == "length"
    assert 0 < cut.usage.completion_tokens < LONG
    assert len(cut.choices[0].model_extra["token_ids"]) == cut.usage.completion_tokens
    assert REQUEST_TIMEOUT - 0.2 <= elapsed < REQUEST_TIMEOUT + 10
    state = health(server.base)
    assert state["active"] == 0 and state["expired"] == before["expired"] + 1
    follow = api.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert follow.choices[0].finish_reason == "length" and follow.usage.completion_tokens == 8
    assert follow.choices[0].model_extra["token_ids"] == cut.choices[0].model_extra["token_ids"][:8]  # greedy


def test_exposure_warning_beyond_loopback_only():
    from mindformers_gptlocal.serve.ops import exposure_warning, is_loopback
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.4", "example.org"))
    line = exposure_warning("0.0.0.0", None)
    assert "0.0.0.0" in line and "GPTLOCAL_API_KEY" in line and "\n" not in line
    assert exposure_warning("0.0.0.0", "k") is None and exposure_warning("127.0.0.1", None) is None


def test_sigterm_during_a_stream(server):
    """SIGTERM while a LONG-token stream runs and two requests wait for the one slot: new requests get
    503 + Retry-After at once, the stream ends cleanly (finish_reason "length", then [DONE]) at
    --shutdown-timeout, the waiting ones get a 503 (a stream: an error event), and the process exits 0. The key
    never reached the log. (Last in this file: it ends the module's server.)"""
    api = client(server.base)
    stream = api.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=LONG, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    waiting = {}

    def second():
        try:
            waiting["result"] = client(server.base).completions.create(model=MODEL, prompt=[9], max_tokens=4)
        except openai.APIStatusError as err:
            waiting["result"] = err

    def third():  # a waiting stream: its 200 is sent, so the 503 comes as an SSE error event
        try:
            waiting["stream"] = list(client(server.base).completions.create(model=MODEL, prompt=[9], max_tokens=4,
                                                                              stream=True))
        except openai.APIError as err:
            waiting["stream"] = err
    threads = [threading.Thread(target=second), threading.Thread(target=third)]
    chunks, ids, signalled = [], [], None
    for chunk in stream:
        chunks.append(chunk)
        ids += chunk.choices[0].model_extra.get("token_ids") or []
        if len(chunks) == 3:
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 30
            while health(server.base)["queued"] < 2:
                assert time.monotonic() < deadline, "the other requests did not queue"
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            deadline = time.monotonic() + 10
            while True:  # the drain starts on the server's next loop turn
                refused = httpx.post(server.base + "/v1/completions", headers=AUTH, timeout=10,
                                     json={"model": MODEL, "prompt": [1], "max_tokens": 2})
                if refused.status_code == 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            assert int(refused.headers["retry-after"]) >= 1
            assert httpx.get(server.base + "/health", timeout=10).status_code == 503
    ended = time.monotonic() - signalled
    assert chunks[-1].choices[0].finish_reason == "length"  # ended by the drain: the iterator saw [DONE]
    assert 0 < len(ids) < LONG and ended < SHUTDOWN_TIMEOUT + 5
    for thread in threads:
        thread.join(30)
    assert isinstance(waiting["result"], openai.APIStatusError), waiting
    assert waiting["result"].status_code == 503 and waiting["result"].body["code"] == "shutting_down"
    assert isinstance(waiting["stream"], openai.APIError) and "shut down" in str(waiting["stream"]), waiting
    code = server.proc.wait(60)
    exited = time.monotonic() - signalled
    log = server.log()
    assert code == 143 and "gptlocal: serve interrupted (SIGTERM)." in log, log[-3000:]
    assert exited < SHUTDOWN_TIMEOUT + 30, exited  # drain + close-out + MindSpore's teardown on a busy machine
    assert "shutdown-timeout" in log and "POST /v1/completions" in log  # the log did record the requests
    assert KEY not in log and WRONG not in log
    print(f"SIGTERM -> stream ended {ended:.1f} s, process exited {exited:.1f} s (busy machine, indicative)")
