"""``gptlocal serve``: an OpenAI-compatible HTTP API (FastAPI + uvicorn) over the batching ``Engine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` = server-sent events,
ending ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (503 until every compiled shape is warm).
The HTTP side is async; every model call runs on the engine's one worker thread (MindSpore runs a
model from one thread). Bad input is a 400 with OpenAI's error body ``{"error": {"message", "type",
"param", "code"}}`` naming the field; a full queue is a 429 with ``Retry-After``.

Extensions (as vLLM's): ``top_k`` (default 0: off, as OpenAI has none); ``ignore_eos``;
``"return_token_ids": true`` adds ``prompt_token_ids`` and each choice's ``token_ids`` (the generated ids,
EOS included when it ended the text).
"""
import asyncio
import json
import logging
import os
import time
import uuid

from .protocol import RequestError, parse_request
from .scheduler import Engine, EngineNotReady, QueueFull, Request

log = logging.getLogger("gptlocal.serve")
RETRY_AFTER_S = 1


def error_response(status, message, param=None, code=None, kind="invalid_request_error", headers=None):
    from fastapi.responses import JSONResponse
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def load_tokenizer(model_dir):
    """(tokenizers.Tokenizer or None, chat template or None) from the model directory."""
    tokenizer, template = None, None
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(path):
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(path)
    config = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as handle:
            template = json.load(handle).get("chat_template")
    return tokenizer, template


def create_app(engine, model_name, tokenizer=None, chat_template=None):
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="gptlocal serve")
    created = int(time.time())

    @app.get("/health")
    async def health():
        if engine.failed:
            return JSONResponse({"status": "failed", "error": engine.failed}, status_code=503)
        if not engine.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        return {"status": "ready", "model": model_name, "max_batch_size": engine.max_batch_size,
                "batch_sizes": engine.batches,
                "max_model_len": engine.max_model_len, "prompt_widths": engine.widths,
                "warmup_seconds": round(engine.warmup_seconds, 2), **engine.snapshot()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "gptlocal", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(http_request: HTTPRequest):
        return await handle(http_request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: HTTPRequest):
        return await handle(http_request, chat=True)

    async def handle(http_request, chat):
        if not engine.ready.is_set():
            return error_response(503, f"the model is not ready: {engine.failed or 'loading'}", kind="server_error",
                                  headers={"Retry-After": "5"})
        try:
            body = json.loads(await http_request.body())
        except (ValueError, UnicodeDecodeError) as err:
            return error_response(400, f"the request body is not valid JSON: {err}", param="body",
                                  code="invalid_json")
        try:
            spec = parse_request(body, chat, model_name, tokenizer, chat_template, engine.config.vocab_size,
                                 engine.max_model_len, engine.config.eos_token_id)
        except RequestError as err:
            return error_response(400, str(err), param=err.param, code=err.code)
        loop = asyncio.get_running_loop()
        queue = asyncio.Queue()
        request = Request(spec["prompt"], spec["max_tokens"],
                          lambda event: loop.call_soon_threadsafe(queue.put_nowait, event),
                          temperature=spec["temperature"], top_p=spec["top_p"], top_k=spec["top_k"],
                          seed=spec["seed"], stop=spec["stop"], eos=spec["eos"])
        try:
            engine.submit(request)
        except QueueFull as err:
            return error_response(429, f"the server is busy: {err}; retry after {RETRY_AFTER_S} s.",
                                  kind="rate_limit_error", code="queue_full",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        except EngineNotReady as err:
            return error_response(503, f"the model is not ready: {err}", kind="server_error",
                                  headers={"Retry-After": "5"})
        reply = Reply(chat, model_name, spec, request)
        events = _events(request, queue, http_request)
        if spec["stream"]:
            return StreamingResponse(reply.stream(events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for event in events:
            reply.add(event)
        if reply.finish is None:  # the client went away
            return error_response(499, "client closed the request", kind="server_error")
        return reply.body()

    return app


async def _events(request, queue, http_request):
    """The engine's events for ``request``; a disconnected client (or any early exit) cancels it."""
    done = False
    try:
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), 0.5)
            except asyncio.TimeoutError:
                if await http_request.is_disconnected():
                    return
                continue
            yield event
            if event[0] == "done":
                done = True
                return
    finally:
        if not done:
            request.cancelled = True


class Reply:
    """OpenAI response bodies and stream chunks for one request."""

    def __init__(self, chat, model_name, spec, request):
        self.chat, self.model, self.spec, self.request = chat, model_name, spec, request
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text, self.tokens, self.finish, self.usage = [], [], None, None

    def add(self, event):
        if event[0] == "token":
            self.text.append(event[1])
            self.tokens.append(event[2])
        else:
            self.finish, self.usage = event[1], event[2]

    def _choice(self, text, finish, tokens):
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if self.spec["return_token_ids"]:
            choice["token_ids"] = tokens
        return choice

    def body(self):
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model,
               "choices": [self._choice("".join(self.text), self.finish, self.tokens)], "usage": self.usage}
        if self.spec["return_token_ids"]:
            out["prompt_token_ids"] = self.spec["prompt"]
        return out

    def _chunk(self, text=None, finish=None, tokens=None, role=False, usage=None, choices=True):
        if not choices:
            body_choices = []
        elif self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            body_choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        else:
            body_choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
        if tokens is not None and self.spec["return_token_ids"] and body_choices:
            body_choices[0]["token_ids"] = tokens
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": body_choices}
        if usage is not None:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    async def stream(self, events):
        if self.chat:
            yield self._chunk(role=True)
        async for event in events:
            if event[0] == "token":
                if event[1] or self.spec["return_token_ids"]:
                    yield self._chunk(text=event[1], tokens=[event[2]])
            else:
                self.finish, self.usage = event[1], event[2]
                yield self._chunk(finish=self.finish, tokens=[])
                if self.spec["include_usage"]:
                    yield self._chunk(usage=self.usage, choices=False)
        if self.finish is not None:
            yield "data: [DONE]\n\n"


def serve(options):
    """``gptlocal serve``: start the engine (load + warm-up on its thread) and uvicorn; blocks until stopped."""
    import uvicorn
    from ..errors import ConfigError
    model_dir = options.model
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ConfigError(f"--model {model_dir} has no config.json; give a gpt_local model directory "
                          f"(training output, `gptlocal convert hf2ms`, or save_pretrained).")
    for key in ("max_batch_size", "max_queue"):
        if getattr(options, key) < 1:
            raise ConfigError(f"--{key.replace('_', '-')} must be at least 1, got {getattr(options, key)}.")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    tokenizer, template = load_tokenizer(model_dir)
    if tokenizer is None:
        log.warning("gptlocal serve: %s has no tokenizer.json: prompts must be token ids, texts come back empty",
                    model_dir)
    widths = [int(w) for w in options.prompt_buckets.split(",")] if options.prompt_buckets else None
    batches = [int(b) for b in options.batch_buckets.split(",")] if options.batch_buckets else None
    engine = Engine(model_dir, max_batch_size=options.max_batch_size, max_queue=options.max_queue,
                    max_model_len=options.max_model_len, device_target=options.device_target,
                    prompt_buckets=widths, tokenizer=tokenizer, batch_buckets=batches)
    engine.start()
    name = options.served_model_name or os.path.basename(os.path.normpath(model_dir))
    app = create_app(engine, name, tokenizer, template)
    log.info("gptlocal serve: model %r on http://%s:%d (ready when /health says so)", name, options.host,
             options.port)
    try:
        uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level)
    finally:
        engine.stop()
    return 0
