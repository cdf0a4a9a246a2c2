"""``gptlocal serve``: an OpenAI-compatible HTTP API (FastAPI + uvicorn) over the batching ``Engine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` = server-sent events,
ending ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (503 until every compiled shape is warm, and
after SIGTERM), ``GET /metrics`` (Prometheus text). ``ops.py`` adds the API key, the body limit, the send
timeout, the metrics and the SIGTERM drain (see there).
The HTTP side is async; every model call runs on the engine's one worker thread (MindSpore runs a
model from one thread); a request that is not streamed gets its events in one hand-off to the event loop when
it ends (a stream: one per token), so the loop's thread does not wake, and take the GIL, per generated token.
Bad input is a 400 with OpenAI's error body ``{"error": {"message", "type",
"param", "code"}}`` naming the field; a full queue is a 429 with ``Retry-After``. ``--request-timeout``: a
request still generating at its deadline (from arrival) ends with ``finish_reason: "length"`` and what it has;
one still waiting for a slot gets a 504 (a stream: an ``error`` event).

``n`` > 1: n choices (index 0..n-1; stream chunks carry theirs), one engine request each, choice i seeded
``seed + i`` (so each is reproducible, and choice 0 is what ``n: 1`` gives); usage counts the prompt once.

Extensions (as vLLM's): ``top_k`` (default 0: off, as OpenAI has none); ``repetition_penalty`` (Hugging Face's,
default 1: off; OpenAI's ``frequency_penalty``/``presence_penalty`` are subtractive and not supported); ``ignore_eos``;
``"return_token_ids": true`` adds ``prompt_token_ids`` and each choice's ``token_ids`` (the generated ids,
EOS included when it ended the text).
"""
import asyncio
import json
import logging
import os
import time
import uuid

from .ops import Metrics, OpsMiddleware, State, exposure_warning, graceful_server
from .protocol import RequestError, parse_request
from .engine import Engine, EngineNotReady
from .scheduler import QueueFull, Request

log = logging.getLogger("gptlocal.serve")
RETRY_AFTER_S = 1


def error_response(status, message, param=None, code=None, kind="invalid_request_error", headers=None):
    from fastapi.responses import JSONResponse
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error"}


def add_error_shape(app):
    """FastAPI's own answers (an unknown route 404, a wrong method 405, a body it cannot validate 422, any
    HTTPException) in the OpenAI error shape, like every answer of ours."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):  # pylint: disable=unused-argument
        kind = ERROR_TYPES.get(exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request_error")
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions, /health"
        return error_response(exc.status_code, message, code=str(exc.status_code), kind=kind,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):  # pylint: disable=unused-argument
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or "body"
        return error_response(422, f"{where}: {first.get('msg', 'invalid')}", param=where, code="422")


def bind_port(host, port):
    """The server's listening socket, bound before the model loads, so a port out of range, taken or not
    allowed, or a host that is not this machine's, stops the command at once with one line (uvicorn is handed
    this socket: nothing can take the port between the check and the start)."""
    import errno
    import socket
    from ..errors import ConfigError
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a TCP port (0-65535); e.g. --port 8000.")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as err:
        raise ConfigError(f"--host {host} cannot be resolved ({err}); give an address of this machine, e.g. "
                          f"127.0.0.1 or 0.0.0.0.") from err
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        reason = {errno.EADDRINUSE: "is already in use (another server?); stop it or pass another --port",
                  errno.EACCES: "needs privileges on this machine (ports below 1024); pass --port 8000 or another "
                                "above 1023",
                  errno.EADDRNOTAVAIL: f"cannot be bound: --host {host} is not an address of this machine"}
        raise ConfigError(f"--port {port} on {host} {reason.get(err.errno, f'cannot be bound ({err.strerror})')}."
                          ) from err
    return sock


def load_tokenizer(model_dir):
    """(tokenizers.Tokenizer or None, chat template or None) from the model directory (``model/loader.py``)."""
    from ..model.loader import read_tokenizer
    return read_tokenizer(model_dir)


def create_app(engine, model_name, tokenizer=None, chat_template=None, state=None):
    """The FastAPI app; ``state`` (``ops.State``) holds the key, limits and timeouts (default: none but the
    body limit of 1 MiB and a send timeout of 30 s)."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    state = state or State()
    state.metrics = metrics = Metrics(engine, state)
    app = FastAPI(title="gptlocal serve")
    app.state.ops = state
    app.add_middleware(OpsMiddleware, state=state)
    add_error_shape(app)
    created = int(time.time())

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503,
                                headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
        if engine.failed:
            return JSONResponse({"status": "failed", "error": engine.failed}, status_code=503)
        if not engine.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        return {"status": "ready", "model": model_name, "max_batch_size": engine.max_batch_size,
                "adapters": engine.adapter_names,
                "batch_sizes": engine.batches,
                "max_model_len": engine.max_model_len, "prompt_widths": engine.widths,
                "compile_on_first_use": sorted(engine.lazy),
                "warmup_seconds": round(engine.warmup_seconds, 2), **engine.snapshot()}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        if not engine.ready.is_set():  # as /health: a client that lists models first waits for the same 200
            return error_response(503, f"the model is not ready: {engine.failed or 'loading'}", kind="server_error",
                                  headers={"Retry-After": "5"})
        names = [model_name] + engine.adapter_names
        return {"object": "list", "data": [dict({"id": name, "object": "model", "created": created,
                                                 "owned_by": "gptlocal", "max_model_len": engine.max_model_len},
                                                **({"parent": model_name} if name != model_name else {}))
                                           for name in names]}

    @app.post("/v1/completions")
    async def completions(http_request: HTTPRequest):
        return await handle(http_request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: HTTPRequest):
        return await handle(http_request, chat=True)

    async def handle(http_request, chat):
        if state.draining:
            return error_response(503, "the server is shutting down; retry on another replica or after it "
                                  "restarts.", kind="server_error", code="shutting_down",
                                  headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
        if not engine.ready.is_set():
            return error_response(503, f"the model is not ready: {engine.failed or 'loading'}", kind="server_error",
                                  headers={"Retry-After": "5"})
        try:
            body = json.loads(await http_request.body())
        except (ValueError, UnicodeDecodeError, RecursionError) as err:  # RecursionError: nested too deep
            return error_response(400, f"the request body is not valid JSON: {err}", param="body",
                                  code="invalid_json")
        served = (model_name, *engine.adapter_names)
        try:
            spec = parse_request(body, chat, served, tokenizer, chat_template, engine.config.vocab_size,
                                 engine.max_model_len, engine.config.eos_token_id)
        except RequestError as err:
            return error_response(404 if err.code == "model_not_found" else 400, str(err), param=err.param,
                                  code=err.code)
        loop = asyncio.get_running_loop()
        queue = asyncio.Queue()
        n = spec["n"]
        held = None if spec["stream"] else []  # a whole reply: its events reach the loop in one hand-off
        ended = [0]  # choices whose last event came (the engine's one worker thread counts them)

        def put_all(events):
            for event in events:
                queue.put_nowait(event)

        def deliverer(index):
            def deliver(event):
                if held is not None:  # not streamed: wake the event loop (its thread takes the GIL) once, at the end
                    held.append((index, event))
                    if event[0] not in ("done", "expired"):
                        return
                    ended[0] += 1
                    if ended[0] < n:
                        return
                try:
                    if held is None:
                        loop.call_soon_threadsafe(queue.put_nowait, (index, event))
                    else:
                        loop.call_soon_threadsafe(put_all, list(held))
                except RuntimeError:  # the event loop is gone (the server stopped): nobody reads this request
                    for request in requests:
                        request.cancelled = True
            return deliver

        requests = []  # one engine Request per choice; choice i seeded seed + i (each reproducible alone)
        for index in range(n):
            request = Request(spec["prompt"], spec["max_tokens"], None,
                              temperature=spec["temperature"], top_p=spec["top_p"], top_k=spec["top_k"],
                              seed=None if spec["seed"] is None else spec["seed"] + index, stop=spec["stop"],
                              eos=spec["eos"], repetition_penalty=spec["repetition_penalty"])
            request.emit = metrics.emitter(request, deliverer(index))
            if body["model"] != model_name:  # a --lora adapter
                request.adapter = 1 + engine.adapter_names.index(body["model"])
            if state.request_timeout:
                request.deadline = request.arrived + state.request_timeout
            requests.append(request)
        try:
            for request in requests:
                engine.submit(request)
        except QueueFull as err:
            for request in requests:  # the choices already queued go too
                request.cancelled = True
            return error_response(429, f"the server is busy: {err}; retry after {RETRY_AFTER_S} s.",
                                  kind="rate_limit_error", code="queue_full",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        except EngineNotReady as err:
            for request in requests:
                request.cancelled = True
            return error_response(503, f"the model is not ready: {err}", kind="server_error",
                                  headers={"Retry-After": "5"})
        http_request.scope.setdefault("gptlocal.requests", []).extend(requests)  # a send timeout cancels them
        state.live.update(requests)
        reply = Reply(chat, body["model"], spec, requests, state)
        events = _events(requests, queue, http_request, state)
        if spec["stream"]:
            return StreamingResponse(reply.stream(events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for event in events:
            reply.add(*event)
        if reply.expired:
            return error_response(*reply.expired_error(), kind="server_error",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        if reply.finish is None:  # the client went away
            return error_response(499, "client closed the request", kind="server_error")
        return reply.body()

    return app


async def _events(requests, queue, http_request, state):
    """The engine's events ``(choice index, event)`` for the ``requests`` of one HTTP request (one per choice),
    until each has ended; a disconnected client (or any early exit, e.g. one choice expired) cancels them all."""
    running = set(range(len(requests)))
    try:
        while running:
            try:
                item = await asyncio.wait_for(queue.get(), 0.5)
            except asyncio.TimeoutError:
                if await http_request.is_disconnected():
                    return
                continue
            yield item
            if item[1][0] in ("done", "expired"):
                running.discard(item[0])
    finally:
        for request in requests:
            state.live.discard(request)
        for index in running:
            requests[index].cancelled = True
            if state.metrics is not None:
                state.metrics.finished.labels("cancelled").inc()


class _Choice:
    __slots__ = ("text", "tokens", "finish", "usage")

    def __init__(self):
        self.text, self.tokens, self.finish, self.usage = [], [], None, None


class Reply:
    """OpenAI response bodies and stream chunks for one request: ``n`` choices (index 0..n-1), one engine Request
    each; usage counts the prompt once and every choice's tokens."""

    def __init__(self, chat, model_name, spec, requests, state):
        self.chat, self.model, self.spec, self.requests, self.state = chat, model_name, spec, requests, state
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [_Choice() for _ in requests]
        self.expired = False

    @property
    def finish(self):
        """The first choice's finish reason once every choice has ended, else None."""
        if any(c.finish is None for c in self.choices):
            return None
        return self.choices[0].finish

    @property
    def usage(self):
        if any(c.usage is None for c in self.choices):
            return None
        completion = sum(c.usage["completion_tokens"] for c in self.choices)
        prompt = self.choices[0].usage["prompt_tokens"]
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def expired_error(self):
        """(status, message, param, code) for a request that never got a slot before its deadline."""
        if self.state.draining:
            return 503, "the server shut down before this request got a slot.", None, "shutting_down"
        return (504, f"the request waited --request-timeout {self.state.request_timeout:g} s for a free slot; "
                     f"retry later.", None, "timeout")

    def add(self, index, event):
        choice = self.choices[index]
        if event[0] == "token":
            choice.text.append(event[1])
            choice.tokens.append(event[2])
        elif event[0] == "expired":
            self.expired = True
        else:
            choice.finish, choice.usage = event[1], event[2]
            if len(event) > 3:  # ended at its deadline: the text held back so far
                choice.text.append(event[3])

    def _choice(self, index):
        choice = self.choices[index]
        text = "".join(choice.text)
        if self.chat:
            out = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": choice.finish}
        else:
            out = {"index": index, "text": text, "logprobs": None, "finish_reason": choice.finish}
        if self.spec["return_token_ids"]:
            out["token_ids"] = choice.tokens
        return out

    def body(self):
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model,
               "choices": [self._choice(i) for i in range(len(self.choices))], "usage": self.usage}
        if self.spec["return_token_ids"]:
            out["prompt_token_ids"] = self.spec["prompt"]
        return out

    def _chunk(self, index=0, text=None, finish=None, tokens=None, role=False, usage=None, choices=True):
        if not choices:
            body_choices = []
        elif self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            body_choices = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]
        else:
            body_choices = [{"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}]
        if tokens is not None and self.spec["return_token_ids"] and body_choices:
            body_choices[0]["token_ids"] = tokens
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": body_choices}
        if usage is not None:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    async def stream(self, events):
        if self.chat:
            for index in range(len(self.choices)):
                yield self._chunk(index, role=True)
        async for index, event in events:
            if event[0] == "token":
                if event[1] or self.spec["return_token_ids"]:
                    yield self._chunk(index, text=event[1], tokens=[event[2]])
            elif event[0] == "expired":
                _, message, _, code = self.expired_error()
                error = {"message": message, "type": "server_error", "param": None, "code": code}
                yield f"data: {json.dumps({'error': error})}\n\n"  # the openai client raises APIError
                return
            else:
                if len(event) > 3 and event[3]:
                    yield self._chunk(index, text=event[3], tokens=[])
                self.add(index, event)
                yield self._chunk(index, finish=event[1], tokens=[])
        if self.finish is not None:
            if self.spec["include_usage"]:
                yield self._chunk(usage=self.usage, choices=False)
            yield "data: [DONE]\n\n"


def serve(options):
    """``gptlocal serve``: start the engine (load + warm-up on its thread) and uvicorn; blocks until stopped."""
    import uvicorn
    from ..errors import ConfigError
    from ..model.loader import check_model_dir
    model_dir = options.model
    for key in ("max_batch_size", "max_queue", "max_request_bytes", "warmup_tokens"):
        if getattr(options, key) < 1:
            raise ConfigError(f"--{key.replace('_', '-')} must be at least 1, got {getattr(options, key)}.")
    prefill_tokens = getattr(options, "max_prefill_tokens", None)
    if prefill_tokens is not None and prefill_tokens < 0:
        raise ConfigError(f"--max-prefill-tokens must be 0 (prompts join the decode call) or a positive number of "
                          f"tokens per prefill call, got {prefill_tokens}.")
    for key in ("request_timeout", "send_timeout", "shutdown_timeout"):
        if getattr(options, key) < 0 or (key == "send_timeout" and options.send_timeout == 0):
            raise ConfigError(f"--{key.replace('_', '-')} must be a positive number of seconds"
                              f"{' (0: no limit)' if key == 'request_timeout' else ''}, got {getattr(options, key)}.")
    from .protocol import chat_template
    chosen = getattr(options, "chat_template", None)
    if chosen:
        chat_template(chosen, None)  # a bad --chat-template: one line before the port and the model
    sock = bind_port(options.host, options.port)  # before anything loads
    try:
        check_model_dir(model_dir, "--model", tokenizer=False)  # before anything starts (no tokenizer: token ids only)
    except Exception:
        sock.close()
        raise
    api_key = options.api_key or os.environ.get("GPTLOCAL_API_KEY") or None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    warning = exposure_warning(options.host, api_key)
    if warning:
        log.warning(warning)
    tokenizer, template = load_tokenizer(model_dir)
    template = chat_template(chosen, template)
    if tokenizer is None:
        log.warning("gptlocal serve: %s has no tokenizer.json: prompts must be token ids, texts come back empty",
                    model_dir)
    widths = [int(w) for w in options.prompt_buckets.split(",")] if options.prompt_buckets else None
    batches = [int(b) for b in options.batch_buckets.split(",")] if options.batch_buckets else None
    name = options.served_model_name or os.path.basename(os.path.normpath(model_dir))
    adapters = None
    if getattr(options, "lora", None):
        from ..safetensors_io import resolve_weights_file, tensor_shapes
        from .adapters import parse_lora_options, read_adapters
        adapters, lines = read_adapters(model_dir, parse_lora_options(options.lora, name),
                                        tensor_shapes(resolve_weights_file(model_dir)))
        for line in lines:
            log.info("gptlocal serve: --lora %s", line)
    engine = Engine(model_dir, max_batch_size=options.max_batch_size, max_queue=options.max_queue,
                    max_model_len=options.max_model_len, device_target=options.device_target,
                    prompt_buckets=widths, tokenizer=tokenizer, batch_buckets=batches, adapters=adapters,
                    warmup_tokens=getattr(options, "warmup_tokens", None), prefill_tokens=prefill_tokens,
                    compile_cache=getattr(options, "compile_cache", "off"),
                    compile_cache_bounds=(getattr(options, "compile_cache_days", None),
                                          getattr(options, "compile_cache_mb", None)))
    engine.start()
    state = State(api_key=api_key, max_request_bytes=options.max_request_bytes, send_timeout=options.send_timeout,
                  request_timeout=options.request_timeout, shutdown_timeout=options.shutdown_timeout)
    app = create_app(engine, name, tokenizer, template, state)
    log.info("gptlocal serve: model %r on http://%s:%d (ready when /health says so; API key %s)", name,
             options.host, options.port, "required" if api_key else "off")
    server = graceful_server(uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level),
                             state, engine)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()
    # The interpreter's last garbage collection over MindSpore's graphs took 6-7.6 s of a shutdown (busy
    # machine); frozen objects are skipped by it: 2.6 s. Nothing of the server is left to finalize.
    import gc
    gc.freeze()
    return 0
