"""What a hostile-request probe found in `specstack serve` (issue 55 item 4), each case as it was sent.

Paths that answered without the API key, constraints that were accepted and then matched nothing (an invalid
``pattern``, ``root ::= []``), messages that did not say what was wrong (``temperature: NaN``, a schema nested 500
deep, ``{"$ref": "#"}``, a NUL byte or ``\\U7fffffff`` in a grammar), an alias list read as a string, a host checked
only after the model loaded, the chat fallback for a GGUF without a template (chatml, as llama-server), and an
image on Anthropic's route answered 500.  The server runs in this process (``TestClient``) on the bundled pair.
"""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from specstack.server.app import Limits, create_app
from specstack.server.roles import default_roles

KEY = "probe-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def app():
    """The bundled pair behind an API key, in this process; ready once /health says so."""
    server = create_app(default_roles(parallel=1, exact="off", k_policy="fixed"), Limits(max_tokens=64), api_key=KEY)
    with TestClient(server) as client:
        deadline = time.time() + 300
        while client.get("/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.1)
        yield client


# -- 1. only llama-server's public endpoints answer without the key ----------------------------------------------

@pytest.mark.parametrize("method, path, body", [
    ("POST", "/chat/completions/input_tokens", CHAT),  # llama-server's aliases without /v1
    ("POST", "/responses/input_tokens", {"input": "hi"}),
    ("GET", "/metrics", None),  # llama-server's /metrics needs the key too
    ("GET", "/openapi.json", None),
    ("GET", "/nothing", None),  # an unknown path: 401 before 404, as llama-server
])
def test_only_llama_servers_public_endpoints_answer_without_the_key(app, method, path, body):
    r = app.request(method, path, json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text[:200])
    assert app.request(method, path, json=body, headers=AUTH).status_code in (200, 404)


def test_health_and_the_page_stay_open(app):
    for path in ("/health", "/v1/health", "/"):  # server-http.cpp's public_endpoints: /health, /v1/health, the UI
        assert app.get(path).status_code == 200, path
