"""What a llama-server user gets from `specstack serve` with no flags (issue 55 item 1), over real HTTP.

A request without ``max_tokens`` used to get 16 tokens (OpenAI's legacy completions default), which cut every
agent framework's tool call short (finish ``length``, ``tool_calls: None``); llama-server's default is -1, to
the end of text or of the context.  And ``/v1/*`` sampled with OpenAI's 1 / off / off / off where llama-server
(and specstack's own ``/props``) say 0.8 / 40 / 0.95 / 0.05.  The limits here are the ones `serve`'s own flags
build, parsed from an empty command line, so a changed flag default fails these tests too.
"""

from __future__ import annotations

import httpx
import pytest

from specstack.cli import build_parser
from specstack.commands.serve import request_limits
from specstack.server.app import Limits, create_app
from specstack.server.roles import default_roles
from test_serve import Server

CTX = 160  # a small slot, so a generation without max_tokens reaches the context's end quickly
PROMPT = "import os\n\n\ndef read_lines(path):\n"
LLAMA_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def serve_limits(*argv: str) -> Limits:
    """The request limits `specstack serve ARGV` would run with."""
    return request_limits(build_parser().parse_args(["serve", *argv]), Limits)


@pytest.fixture(scope="module")
def http():
    app = create_app(default_roles(parallel=1, ctx=CTX), serve_limits())
    with Server(app) as s, httpx.Client(base_url=s.url, timeout=300) as client:
        yield client


def test_serves_flags_default_to_llama_servers_unbounded_answer():
    limits = serve_limits()
    assert (limits.default_max_tokens, limits.max_tokens) == (-1, 0)
    assert serve_limits("-n", "64").default_max_tokens == 64
    assert serve_limits("--max-tokens", "100").max_tokens == 100


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    ("/completion", {"prompt": PROMPT}),
])
def test_a_request_without_max_tokens_runs_to_the_end_of_the_context(http, path, body):
    r = http.post(path, json={**body, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    answer = r.json()
    if path == "/completion":
        used, stop = answer["tokens_evaluated"] + answer["tokens_predicted"], answer["stop_type"]
        assert stop == "limit" and answer["truncated"] is True  # llama-server's flag for the context's end
    else:
        used = answer["usage"]["total_tokens"]
        assert answer["choices"][0]["finish_reason"] == "length"
    n_ctx = http.get("/props").json()["default_generation_settings"]["n_ctx"]
    assert used >= n_ctx - 2 > 16  # the slot's context, not 16 tokens, ended it


def test_v1_routes_sample_with_llama_servers_defaults(http):
    """The settings a /v1 request without sampling fields ran with (llama-server's ``__verbose``), equal to what
    /props says a request gets."""
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "verbose": True})
    assert r.status_code == 200, r.text
    settings = r.json()["__verbose"]["generation_settings"]
    assert {k: settings[k] for k in LLAMA_SAMPLING} == LLAMA_SAMPLING
    props = http.get("/props").json()["default_generation_settings"]["params"]
    assert {k: props[k] for k in LLAMA_SAMPLING} == LLAMA_SAMPLING
    assert props["n_predict"] == -1
    short = http.post("/completion", json={"prompt": PROMPT, "n_predict": 2}).json()
    assert short["stop_type"] == "limit" and short["truncated"] is False  # n_predict, not the context, ended it
