"""While the model loads, /v1/models answers 503 as /health and the completion routes do: a client that lists the
models first (as OpenAI's clients do) waits for the same "ready" as one that polls /health."""
import threading
import types

import pytest


def test_models_answer_503_while_loading_then_the_list():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from mindformers_gptlocal.serve.app import create_app
    engine = types.SimpleNamespace(ready=threading.Event(), failed=None, adapter_names=[], max_model_len=64,
                                   max_batch_size=1, batches=[1], widths=[16], lazy=set(), warmup_seconds=0.0,
                                   snapshot=lambda: {})
    client = TestClient(create_app(engine, "tiny"))
    for route in ("/health", "/v1/models"):
        answer = client.get(route)
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "5", (route, answer.text)
    assert "loading" in client.get("/v1/models").json()["error"]["message"]
    engine.failed = "no weights"
    assert "no weights" in client.get("/v1/models").json()["error"]["message"]
    engine.failed = None
    engine.ready.set()
    assert client.get("/health").status_code == 200
    listed = client.get("/v1/models")
    assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["tiny"], listed.text
