"""What ``gptlocal serve`` needs beyond 127.0.0.1: the API key, the request-body limit, the per-send timeout,
Prometheus ``/metrics`` and the SIGTERM drain. ``app.py`` wires them in; nothing here touches the model.

* ``OpsMiddleware`` (plain ASGI, outermost): counts every response by route and status; answers 401 for a
  missing/wrong ``Authorization: Bearer`` key on every route but ``/health`` (compared in constant time, the
  key never logged); answers 413 for a body above ``--max-request-bytes`` from its ``Content-Length`` before
  reading it, or as soon as a chunked body passes the limit, and hands the app the body read; and bounds each
  ``send`` to ``--send-timeout`` seconds. A client that stops reading shows up in uvicorn as a ``send`` that
  never returns: once the socket buffers and the transport's 64 KiB high-water mark are full, uvicorn's
  ``send`` awaits ``flow.drain()`` until the peer reads. The timed-out send cancels the request's generation
  (its slot is free at the engine's next step) and ends the response.
* ``Metrics``: a ``prometheus_client`` registry of its own (one per app) with the names in ``docs/serving.md``.
* ``GracefulServer``: a ``uvicorn.Server`` whose SIGTERM/SIGINT starts ``drain`` (503 + Retry-After for new
  requests, running ones finish or are ended at ``--shutdown-timeout``) instead of closing at once; the
  process then ends with one line and 128 + the signal's number (143, 130). A second signal exits at once.
"""
import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import time

log = logging.getLogger("gptlocal.serve")
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
OPEN_ROUTES = ("/health",)
# seconds: a few ms (a tiny model's step) to a minute (a long prompt's prefill on a busy CPU)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
CLOSE_OUT_S = 1.0  # after the drain: uvicorn's graceful close of what is left, then tasks are cancelled


def is_loopback(host):
    """True for 127.0.0.0/8, ::1 and "localhost"; False for 0.0.0.0, :: and every other address or name."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host, api_key):
    """The one line ``serve`` logs when it listens beyond loopback with no key (None otherwise)."""
    if api_key or is_loopback(host):
        return None
    return (f"gptlocal serve: listening on {host} without an API key: anyone who reaches this port can use the "
            f"model; set GPTLOCAL_API_KEY (or --api-key) and put a TLS reverse proxy in front (docs/serving.md).")


def _digest(value):
    return hashlib.sha256(value).digest()


def _error_body(message, kind, code, param=None):
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


async def _send_json(send, status, body, headers=()):
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class SendTimeout(Exception):
    """A response ``send`` waited longer than --send-timeout: the client stopped reading."""


class _PhaseSeconds:
    """gptlocal_engine_step_seconds_total{phase}: the engine's seconds in each phase of its steps (``Engine.step``):
    schedule (the next call and its inputs), model (the runner's call), update (sampling, detokenizing, sending);
    model's share of the sum is the accelerator's (or the CPU kernels') share of serving."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily
        family = CounterMetricFamily("gptlocal_engine_step_seconds", "Seconds the engine spent in each phase of its "
                                     "steps: schedule, model (the runner's call), update (sampling, detokenizing, "
                                     "sending)", labels=["phase"])
        for phase, seconds in dict(self.engine.phase_seconds).items():
            family.add_metric([phase], seconds)
        yield family


class Metrics:
    """The server's Prometheus metrics (``prometheus_client``, a registry of this app's own)."""

    def __init__(self, engine, state):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("gptlocal_http_requests", "HTTP responses by route and status code",
                                ["route", "status"], registry=registry)
        self.finished = Counter("gptlocal_request_finish", "Generations ended, by finish_reason "
                                "(stop, length, timeout: expired waiting for a slot, cancelled: the client left)",
                                ["reason"], registry=registry)
        self.prompt_tokens = Counter("gptlocal_prompt_tokens", "Prompt tokens prefilled", registry=registry)
        self.generation_tokens = Counter("gptlocal_generation_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram("gptlocal_time_to_first_token_seconds", "Arrival (body parsed) to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("gptlocal_time_per_output_token_seconds", "Time between a request's consecutive "
                              "tokens", buckets=TOKEN_BUCKETS, registry=registry)
        self.e2e = Histogram("gptlocal_request_duration_seconds", "Arrival to the last token (generations that "
                             "finished)", buckets=LATENCY_BUCKETS, registry=registry)
        Gauge("gptlocal_requests_waiting", "Requests queued for a cache slot", registry=registry
              ).set_function(lambda: engine.snapshot()["queued"])
        Gauge("gptlocal_requests_running", "Cache slots generating", registry=registry
              ).set_function(lambda: engine.snapshot()["active"])
        Gauge("gptlocal_slots", "Cache slots (--max-batch-size)", registry=registry).set(engine.max_batch_size)
        Gauge("gptlocal_draining", "1 after SIGTERM: new requests get 503", registry=registry
              ).set_function(lambda: float(state.draining))
        registry.register(_PhaseSeconds(engine))

    def exposition(self):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def emitter(self, request, deliver):
        """The engine's ``emit`` for ``request`` (called on the engine thread): observe, then ``deliver``."""
        last = [None]

        def emit(event):
            now = time.perf_counter()
            if event[0] == "token":
                if last[0] is None:
                    self.ttft.observe(now - request.arrived)
                    self.prompt_tokens.inc(len(request.prompt))
                else:
                    self.tpot.observe(now - last[0])
                last[0] = now
                self.generation_tokens.inc()
            elif event[0] == "done":
                self.finished.labels(event[1]).inc()
                self.e2e.observe(now - request.arrived)
            elif event[0] == "expired":
                self.finished.labels("timeout").inc()
            deliver(event)
        return emit


class State:
    """What the middleware, the routes and the drain share."""

    def __init__(self, api_key=None, max_request_bytes=1 << 20, send_timeout=30.0, request_timeout=None,
                 shutdown_timeout=30.0):
        self.key_digest = _digest(api_key.encode()) if api_key else None
        self.max_request_bytes = max_request_bytes
        self.send_timeout = send_timeout
        self.request_timeout = request_timeout or None
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self.inflight = 0
        self.live = set()  # engine Requests not yet done (the drain ends them at its deadline)
        self.metrics = None

    def authorized(self, header):
        if self.key_digest is None:
            return True
        scheme, _, presented = (header or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(_digest(presented.strip().encode()), self.key_digest)

    async def drain(self, engine, server):
        """SIGTERM: refuse new requests, let the running ones finish until --shutdown-timeout, end the rest
        (running: finish_reason "length"; waiting: 503), then let uvicorn close."""
        self.draining = True
        start = time.monotonic()
        deadline = start + self.shutdown_timeout
        log.info("gptlocal serve: shutting down: %d request(s) running or waiting; new ones get 503 (at most "
                 "%g s)", len(self.live), self.shutdown_timeout)
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.live:
            log.warning("gptlocal serve: --shutdown-timeout %g s reached: ending %d request(s)",
                        self.shutdown_timeout, len(self.live))
            for request in list(self.live):
                request.deadline = 0.0  # the engine ends it at its next step
            end = time.monotonic() + CLOSE_OUT_S
            while self.inflight and time.monotonic() < end:
                await asyncio.sleep(0.05)
        log.info("gptlocal serve: drained in %.1f s", time.monotonic() - start)
        server.should_exit = True


class OpsMiddleware:
    """Plain ASGI middleware (see the module docstring): status counts, key, body limit, send timeout."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = [0]

        async def timed_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            try:
                await asyncio.wait_for(send(message), state.send_timeout)
            except asyncio.TimeoutError:
                raise SendTimeout from None

        state.inflight += 1
        requests = scope.setdefault("gptlocal.requests", [])
        try:
            headers = dict(scope["headers"])
            if scope["path"] not in OPEN_ROUTES and not state.authorized(
                    headers.get(b"authorization", b"").decode("latin-1")):
                missing = b"authorization" not in headers
                message = ("missing API key: send 'Authorization: Bearer KEY' (the server's --api-key / "
                           "GPTLOCAL_API_KEY)." if missing else
                           "incorrect API key: the Authorization header does not carry this server's key.")
                return await _send_json(timed_send, 401, _error_body(message, "invalid_request_error",
                                                                     "invalid_api_key"),
                                        [(b"www-authenticate", b"Bearer")])
            body = await self._read_body(scope, receive, headers, timed_send)
            if body is None:
                return
            replayed = [False]

            async def replay():
                if not replayed[0]:
                    replayed[0] = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, timed_send)
        except SendTimeout:
            for request in requests:
                request.cancelled = True
            log.warning("gptlocal serve: %s %s: the client read nothing for --send-timeout %g s; response "
                        "ended, generation cancelled", scope["method"], scope["path"], state.send_timeout)
        finally:
            state.inflight -= 1
            if state.metrics is not None:
                state.metrics.requests.labels(route, str(status[0])).inc()

    async def _read_body(self, scope, receive, headers, send):
        """The whole body, or None after a 413/400 went out (the limit is checked before anything is parsed)."""
        limit = self.state.max_request_bytes

        async def too_large(size):
            text = (f"the request body is {size} bytes; this server takes at most {limit} bytes "
                    f"(--max-request-bytes).")
            await _send_json(send, 413, _error_body(text, "invalid_request_error", "request_too_large", "body"),
                             [(b"connection", b"close")])

        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _send_json(send, 400, _error_body(f"Content-Length {declared!r} is not a number.",
                                                        "invalid_request_error", "invalid_header", "body"))
                return None
            if size > limit:
                await too_large(size)
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await too_large(f"more than {limit}")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def graceful_server(config, state, engine):
    """A uvicorn.Server whose first SIGTERM/SIGINT drains (``State.drain``), then raised again once it is down."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        loop = None
        signalled = False

        async def startup(self, sockets=None):
            GracefulServer.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame):
            if not self._captured_signals:  # uvicorn raises it again once the server is down: `gptlocal: serve
                self._captured_signals.append(sig)  # interrupted (SIGTERM).` and 143 (cli/interrupt.py)
            if self.signalled or self.loop is None:  # a second signal, or one before start-up: close now
                self.force_exit = self.signalled
                self.should_exit = True
                return
            self.signalled = True
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(state.drain(engine, self)))

    config.timeout_graceful_shutdown = CLOSE_OUT_S
    return GracefulServer(config)
