"""What the serving tests share. (``tests/serve`` is a package, ``__init__.py``: its conftest is then
``serve.conftest`` and does not take the name ``conftest`` from the suite's ``tests/conftest.py``, which the test
modules import from.)"""
import pytest


def _serve_all(engine, specs):
    """Submit every (prompt, max_tokens, options) at once (``options``: the ``Request`` keywords), step the engine
    from this thread until all are done: [(tokens, finish reason, completion_tokens)] in the order of ``specs``."""
    from mindformers_gptlocal.serve.scheduler import Request
    events = [[] for _ in specs]
    for (prompt, max_tokens, options), sink in zip(specs, events):
        engine.submit(Request(prompt, max_tokens, sink.append, **options))
    for _ in range(500):
        if all(e and e[-1][0] == "done" for e in events):
            break
        engine.step()
    return [([ev[2] for ev in e if ev[0] == "token"], e[-1][1], e[-1][2]["completion_tokens"]) for e in events]


@pytest.fixture
def serve_all():
    """``_serve_all``: run a batch of requests through an engine to the end."""
    return _serve_all


@pytest.fixture(scope="module")
def start_engine():
    """``start(path, check=None, **options)``: an ``Engine`` on the model directory ``path`` (``options``: Engine's
    keywords) loaded, warmed up and ready, driven from the test's thread (no worker thread, no HTTP); ``check(engine)``
    runs between the warm-up and ready. The module's end puts MindSpore back in PYNATIVE mode (an engine compiles its
    graphs in GRAPH mode)."""
    import mindspore as ms
    from mindformers_gptlocal.serve.engine import Engine

    def start(path, check=None, **options):
        engine = Engine(str(path), **options)
        engine._load()
        engine.warm_up()
        if check is not None:
            check(engine)
        engine.ready.set()
        return engine

    try:
        yield start
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
