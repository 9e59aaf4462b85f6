"""What `specstack serve` does with each request field, and with requests that do not arrive well.

Every field of the OpenAI completions and chat schemas and of llama-server's request schema is either
honoured or refused with a 400 naming it: never a 200 that ignored it.  Types are strict.  A stop
string's tokens are no part of the answer.  A body that stops arriving is a 408, a head too large a 431.
All through real HTTP against a server in this process (served with the settings `specstack serve` uses).
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from specstack.sampling import MAX_LOGPROBS
from specstack.server.app import Limits, create_app
from specstack.server.roles import default_roles
from test_serve import KEY, PROMPT, Server, spawn_server

AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_TIMEOUT_S = 1.0  # this module's server gives a body this long to arrive


class ServeServer(Server):
    """``test_serve.Server`` with the uvicorn settings that `specstack serve` passes (the head limit)."""

    def __init__(self, app) -> None:
        super().__init__(app)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    **app.state.http_options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)


@pytest.fixture(scope="module")
def server():
    app = create_app(default_roles(parallel=2, exact="on"),
                     Limits(max_tokens=512, max_body_bytes=64_000, body_timeout_s=BODY_TIMEOUT_S),
                     api_key=KEY, max_queue=8)
    with ServeServer(app) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


# -- item 7: the whole schema ------------------------------------------------------------------------------

BOTH, COMPLETIONS, CHAT = ("completions", "chat"), ("completions",), ("chat",)
ABSENT = object()


@dataclass(frozen=True)
class SchemaField:
    """One documented request field: a value that does something, a value of the wrong type, and (when the
    schema has one) a value that changes nothing.  ``honoured``: the server does it (200), else a 400 naming it."""

    name: str
    value: Any
    wrong: Any
    neutral: Any = ABSENT
    honoured: bool = False
    routes: tuple[str, ...] = BOTH
    extra: dict[str, Any] = field(default_factory=dict)  # what ``value`` needs beside it
    wrong_param: str | None = None  # the field a wrong type is reported at, when nested


# From the OpenAI API reference (completions, chat completions), llama-server's README (/completion options,
# which its OpenAI routes take too, and its chat options) and vLLM's repetition_penalty: written here from
# the documents, not from the server's own tables, so a field the server forgets fails.
SCHEMA = [
    # OpenAI completions
    SchemaField("model", "any-name", 5, honoured=True),
    SchemaField("prompt", [1, 2, 3], [1.0, 2.0], honoured=True, routes=COMPLETIONS),
    SchemaField("best_of", 2, "2", neutral=1, routes=COMPLETIONS),
    SchemaField("echo", True, "yes", neutral=False, honoured=True, routes=COMPLETIONS),
    SchemaField("frequency_penalty", 0.5, "0.5", neutral=0, honoured=True),
    SchemaField("logit_bias", {"5": 10}, "x", neutral={}, honoured=True),
    SchemaField("logprobs", 2, True, honoured=True, routes=COMPLETIONS),
    SchemaField("max_tokens", 2, True, honoured=True),
    SchemaField("n", 2, 2.0, neutral=1, honoured=True),
    SchemaField("presence_penalty", 0.5, "0.5", neutral=0, honoured=True),
    SchemaField("seed", 7, "7", honoured=True),
    SchemaField("stop", "\n", 5, honoured=True),
    SchemaField("stream", True, "yes", neutral=False, honoured=True),
    SchemaField("stream_options", {"include_usage": True}, {"include_usage": "yes"}, honoured=True,
                extra={"stream": True}, wrong_param="stream_options.include_usage"),
    SchemaField("suffix", "return x\n", 5, neutral="", routes=COMPLETIONS),
    SchemaField("temperature", 0.5, "hot", honoured=True),
    SchemaField("top_p", 0.9, "0.9", neutral=1, honoured=True),
    SchemaField("user", "user-1", 5, honoured=True),
    SchemaField("max_completion_tokens", 2, "2", routes=COMPLETIONS),  # a chat field: refused, not ignored
    # OpenAI chat
    SchemaField("messages", [{"role": "user", "content": "def f("}], "def f(", honoured=True, routes=CHAT),
    SchemaField("audio", {"voice": "alloy", "format": "wav"}, "alloy", routes=CHAT),
    SchemaField("function_call", "auto", 5, neutral="none", routes=CHAT),
    SchemaField("functions", [{"name": "f", "parameters": {}}], "f", neutral=[], routes=CHAT),
    SchemaField("logprobs", True, "yes", neutral=False, honoured=True, routes=CHAT),
    SchemaField("max_completion_tokens", 2, 2.0, honoured=True, routes=CHAT),
    SchemaField("metadata", {"team": "a"}, "team", neutral={}, routes=CHAT),
    SchemaField("modalities", ["text", "audio"], "text", neutral=["text"], routes=CHAT),
    SchemaField("parallel_tool_calls", False, "no", neutral=True, honoured=True, routes=CHAT),
    SchemaField("prediction", {"type": "content", "content": "def f(x):"}, "def f(x):", routes=CHAT),
    SchemaField("prompt_cache_key", "prefix-1", 5, honoured=True, routes=CHAT),
    SchemaField("reasoning_effort", "low", 5, honoured=True, routes=CHAT),  # a template variable, as llama-server
    SchemaField("response_format", {"type": "json_object"}, "json", neutral={"type": "text"}, honoured=True,
                routes=CHAT),
    SchemaField("safety_identifier", "user-1", 5, honoured=True, routes=CHAT),
    SchemaField("service_tier", "flex", 5, neutral="auto", routes=CHAT),
    SchemaField("store", True, "yes", neutral=False, routes=CHAT),
    SchemaField("tool_choice", "auto", 5, neutral="none", honoured=True, routes=CHAT),
    SchemaField("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "f", neutral=[],
                honoured=True, routes=CHAT),
    SchemaField("top_logprobs", 2, "2", honoured=True, routes=CHAT, extra={"logprobs": True}),
    SchemaField("verbosity", "low", 5, routes=CHAT),
    SchemaField("web_search_options", {}, "x", routes=CHAT),
    # llama-server /completion options
    SchemaField("dynatemp_range", 0.5, "0.5", neutral=0.0),
    SchemaField("dynatemp_exponent", 2.0, "2", neutral=1.0),
    SchemaField("top_k", 5, 5.5, neutral=0, honoured=True),
    SchemaField("min_p", 0.1, "0.1", neutral=0.0, honoured=True),
    SchemaField("n_predict", 2, 2.0, honoured=True),
    SchemaField("n_indent", 4, "4", neutral=0),
    SchemaField("n_keep", 5, "5", neutral=0),
    SchemaField("n_cmpl", 2, "2", honoured=True),
    SchemaField("n_cache_reuse", 256, True, neutral=0),
    SchemaField("typical_p", 0.5, "0.5", neutral=1.0),
    SchemaField("typ_p", 0.5, "0.5", neutral=1.0),
    SchemaField("repeat_penalty", 1.1, "1.1", neutral=1.0, honoured=True),
    SchemaField("repeat_last_n", 128, "64", neutral=64, honoured=True),
    SchemaField("dry_multiplier", 0.8, "0.8", neutral=0.0),
    SchemaField("dry_base", 2.0, "2", neutral=1.75),
    SchemaField("dry_allowed_length", 3, 2.5, neutral=2),
    SchemaField("dry_penalty_last_n", 128, "128", neutral=-1),
    SchemaField("dry_sequence_breakers", ["\n"], "\n", neutral=["\n", ":", "\"", "*"]),
    SchemaField("xtc_probability", 0.5, "0.5", neutral=0.0),
    SchemaField("xtc_threshold", 0.2, "0.2", neutral=0.1),
    SchemaField("mirostat", 2, True, neutral=0),
    SchemaField("mirostat_tau", 3.0, "3", neutral=5.0),
    SchemaField("mirostat_eta", 0.2, "0.2", neutral=0.1),
    SchemaField("grammar", 'root ::= "a"', 5, neutral="", honoured=True),
    SchemaField("json_schema", {"type": "string"}, "string", honoured=True),
    SchemaField("ignore_eos", True, "yes", neutral=False, honoured=True),
    SchemaField("n_probs", 2, "2", neutral=0),
    SchemaField("min_keep", 2, "2", neutral=0),
    SchemaField("t_max_predict_ms", 100, "100", neutral=0),
    SchemaField("id_slot", 0, "0", neutral=-1, honoured=True),
    SchemaField("cache_prompt", False, "no", neutral=True, honoured=True),
    SchemaField("return_tokens", True, "yes", neutral=False),
    SchemaField("samplers", ["temperature", "top_k"], 5,
                neutral=["dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]),
    SchemaField("timings_per_token", True, "yes", neutral=False, honoured=True),  # timings in progress chunks and at the end
    SchemaField("return_progress", True, 1, neutral=False, honoured=True),
    SchemaField("speculative.n_max", 3, "3", honoured=True),
    SchemaField("speculative.n_min", 2, "2", honoured=True),
    SchemaField("sse_ping_interval", 5, "5"),
    SchemaField("post_sampling_probs", True, 1, neutral=False, honoured=True),  # logprobs from the sampled distribution
    SchemaField("response_fields", ["content"], "content", neutral=[]),
    SchemaField("lora", [{"id": 0, "scale": 0.5}], "x", neutral=[]),
    SchemaField("image_data", [{"data": "AA==", "id": 1}], "x", neutral=[]),
    SchemaField("multimodal_data", ["AA=="], "x", neutral=[]),
    # llama-server chat options
    SchemaField("chat_template", "chatml", 5, routes=CHAT),
    SchemaField("chat_template_kwargs", {"enable_thinking": False}, "x", neutral={}, honoured=True, routes=CHAT),
    SchemaField("add_generation_prompt", False, "no", neutral=True, honoured=True, routes=CHAT),
    SchemaField("continue_final_message", True, "yes", neutral=False, honoured=True, routes=CHAT,
                extra={"add_generation_prompt": False}),
    SchemaField("verbose", True, "yes", neutral=False, honoured=True),
    SchemaField("reasoning_format", "deepseek", 5, neutral="auto", honoured=True),
    SchemaField("reasoning_control", True, "yes", neutral=False, routes=CHAT),
    # vLLM
    SchemaField("repetition_penalty", 1.2, "1.2", neutral=1.0, honoured=True),
    SchemaField("min_tokens", 2, "2", neutral=0, honoured=True),
    SchemaField("stop_token_ids", [13], "13", neutral=[], honoured=True),
    # specstack's own
    SchemaField("speculative", {"k_policy": "fixed", "k": 3}, {"k": "3"}, honoured=True, wrong_param="speculative.k"),
]


def base_body(route: str) -> dict[str, Any]:
    if route == "chat":
        return {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 2, "temperature": 0}
    return {"prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0}


def answer(http: httpx.Client, route: str, fields: dict[str, Any]) -> tuple[int, str | None, str]:
    """Status, error param and error message of a request with ``fields`` over the route's base body."""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = http.post(path, json={**base_body(route), **fields})
    if r.status_code == 200:
        return 200, None, ""
    err = r.json()["error"]
    return r.status_code, err["param"], err["message"]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_every_schema_field_is_honoured_or_refused_by_name(http, route):
    """Walk the documented schemas: each field's working value is a 200 when the server does it and a 400
    naming it when not, its wrong type is a 400 naming it, and its do-nothing value is a 200."""
    wrong: list[str] = []
    for f in (f for f in SCHEMA if route in f.routes):
        status, param, message = answer(http, route, {**f.extra, f.name: f.value})
        if f.honoured and status != 200:
            wrong.append(f"{f.name}={f.value!r}: honoured, but got {status} {message}")
        if not f.honoured and (status, param) != (400, f.name):
            wrong.append(f"{f.name}={f.value!r}: not honoured, so 400 naming it; got {status} param={param}")
        status, param, _ = answer(http, route, {**f.extra, f.name: f.wrong})
        if (status, param) != (400, f.wrong_param or f.name):
            wrong.append(f"{f.name}={f.wrong!r}: wrong type, so 400 naming it; got {status} param={param}")
        if f.neutral is not ABSENT:
            status, _, message = answer(http, route, {f.name: f.neutral})
            if status != 200:
                wrong.append(f"{f.name}={f.neutral!r} changes nothing, so 200; got {status} {message}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_an_unknown_field_is_refused_as_openai_does(http, route):
    status, param, message = answer(http, route, {"frequency_penalties": 0.5})
    assert (status, param) == (400, "frequency_penalties")
    assert message == "Unrecognized request argument supplied: frequency_penalties"


def test_refusals_say_why_and_what_would_do(http):
    _, _, message = answer(http, "completions", {"dry_multiplier": 0.8})
    assert "not implemented" in message and "or send 0" in message


@pytest.mark.parametrize("samplers, extra, ok", [
    (["top_k", "top_p", "min_p", "temperature"], {"top_k": 5}, True),
    ("kpmt", {"top_p": 0.9}, True),  # llama-server's one-letter form
    (["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"], {}, True),
    (["top_p", "temperature"], {}, True),  # top_k and min_p left out, and off anyway
    (["top_p", "temperature"], {"top_k": 5}, True),  # top_k left out of the chain: off, as in llama-server
    (["min_p", "top_k", "temperature"], {}, False),  # another order than this server's
    (["top_k", "top_k", "temperature"], {}, False),
    (["top_k", "infill"], {}, False),
    (["top_k", "temperature"], {"repeat_penalty": 1.2}, True),  # penalties left out of the chain: off
    (["penalties", "top_k", "temperature"], {"repeat_penalty": 1.2}, True),
    (["top_k", "penalties", "temperature"], {"repeat_penalty": 1.2}, False),  # penalties come first here
    (["magic"], {}, False),
])
def test_a_samplers_chain_is_honoured_when_its_order_is_the_one_applied(http, samplers, extra, ok):
    status, param, _ = answer(http, "completions", {"samplers": samplers, **extra})
    assert (status, param) == ((200, None) if ok else (400, "samplers"))


def test_llama_server_names_are_honoured(http, client):
    """n_predict is max_tokens and n_cmpl is n, as llama-server reads them; disagreeing pairs are a 400."""
    r = http.post("/v1/completions", json={"prompt": PROMPT, "n_predict": 5, "n_cmpl": 2, "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] == 10 and len(r["choices"]) == 2
    status, param, _ = answer(http, "completions", {"max_tokens": 4, "n_predict": 5})
    assert (status, param) == (400, "n_predict")
    status, param, _ = answer(http, "completions", {"n": 2, "n_cmpl": 3})
    assert (status, param) == (400, "n_cmpl")
    status, param, _ = answer(http, "completions", {"n_predict": -1})
    assert (status, param) == (400, "n_predict")


# -- item 8: strict types ----------------------------------------------------------------------------------

@pytest.mark.parametrize("route, fields, param", [
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"stream": 1}, "stream"),
    ("chat", {"stream": "true"}, "stream"),
    ("completions", {"echo": "yes"}, "echo"),
    ("completions", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("completions", {"prompt": [1.0, 2.0]}, "prompt"),
    ("completions", {"prompt": [True, False]}, "prompt"),
    ("completions", {"speculative": {"n_min": "2"}}, "speculative.n_min"),
    ("completions", {"speculative": {"n_min": 2.0}}, "speculative.n_min"),
    ("completions", {"speculative": {"n_min": True}}, "speculative.n_min"),
    ("completions", {"speculative": {"drafter": "draft-model", "p_min": "0.5"}}, "speculative.p_min"),
    ("completions", {"speculative": {"drafter": "suffix", "min_token_prob": "0.1"}}, "speculative.min_token_prob"),
    ("completions", {"speculative": {"drafter": "cascade:suffix,prompt-lookup", "cascade_min_len": "3"}},
     "speculative.cascade_min_len"),
    ("completions", {"speculative": {"drafter": "suffix", "tree": 1}}, "speculative.tree"),
])
def test_loose_types_are_400s_naming_the_field(http, route, fields, param):
    status, got, message = answer(http, route, fields)
    assert (status, got) == (400, param), message


def test_strict_types_still_take_what_is_right(http):
    """Integers for float options (JSON has one number type), and the right types everywhere."""
    for fields in ({"speculative": {"drafter": "draft-model", "p_min": 0}}, {"prompt": [1, 2, 3], "echo": False},
                   {"speculative": {"drafter": "prompt-lookup", "n_min": 2}}, {"stream": False, "temperature": 0}):
        assert answer(http, "completions", fields)[0] == 200, fields


# -- issue 37 items 10 and 12: strict types in messages and tools; n_probs by its name --------------------

TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
CONVERSATION = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
DROP = object()


def conversation(i: int, **keys: Any) -> dict[str, Any]:
    """Chat fields: CONVERSATION and its tool, with message ``i``'s ``keys`` set (``DROP``: left out)."""
    messages = [dict(m) for m in CONVERSATION]
    messages[i] = {k: v for k, v in {**messages[i], **keys}.items() if v is not DROP}
    return {"messages": messages, "tools": [TOOL]}


def schema_format(**keys: Any) -> dict[str, Any]:
    """A json_schema response_format with ``keys`` in its ``json_schema`` object."""
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {}, **keys}}}


@pytest.mark.parametrize("route, fields, param", [
    ("chat", conversation(1, tool_calls="notalist"), "messages[1].tool_calls"),
    ("chat", conversation(1, tool_calls=[{"bogus": 1}]), "messages[1].tool_calls[0].id"),
    ("chat", conversation(1, tool_calls=[{**CALL, "bogus": 1}]), "messages[1].tool_calls[0].bogus"),
    ("chat", conversation(1, tool_calls=[{**CALL, "function": {"name": "add", "arguments": {}}}]),
     "messages[1].tool_calls[0].function.arguments"),
    ("chat", conversation(1, tool_calls=DROP), "messages[1].content"),  # an assistant message says something
    ("chat", conversation(2, tool_call_id=5), "messages[2].tool_call_id"),
    ("chat", conversation(2, tool_call_id=DROP), "messages[2].tool_call_id"),
    ("chat", conversation(0, content=DROP), "messages[0].content"),
    ("chat", conversation(0, content=None), "messages[0].content"),
    ("chat", conversation(0, color="red"), "messages[0].color"),
    ("chat", conversation(0, tool_calls=[CALL]), "messages[0].tool_calls"),  # only an assistant calls
    ("chat", conversation(0, tool_call_id="call_1"), "messages[0].tool_call_id"),  # only a tool message answers
    ("chat", conversation(0, role="function"), "messages[0].role"),
    ("chat", conversation(1, refusal="I will not"), "messages[1].refusal"),
    ("chat", {"tools": [{**TOOL, "strict": True}]}, "tools[0]"),  # strict belongs inside function
    ("chat", {"tools": [{**TOOL, "function": {**TOOL["function"], "strict": "yes"}}]}, "tools[0].function.strict"),
    ("chat", schema_format(strict="yes"), "response_format.json_schema.strict"),
    ("chat", schema_format(name="a b!"), "response_format.json_schema.name"),
    ("chat", schema_format(name="n" * 65), "response_format.json_schema.name"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_messages_and_tools_are_strict_too(http, route, fields, param):
    """Each of these was accepted and rewritten or dropped (a call with no id rendered as no call at all)."""
    status, got, message = answer(http, route, fields)
    assert (status, got) == (400, param), message
    assert param.rsplit(".", 1)[-1].split("[")[0] in message, message


@pytest.mark.parametrize("fields", [
    conversation(1),
    conversation(1, content="", name="coder", refusal=None, reasoning_content="adding"),
    conversation(2, name="add"),
    {"messages": [{"role": "developer", "content": "Be terse."}, *CONVERSATION[:1]]},
    {"tools": [{**TOOL, "function": {**TOOL["function"], "strict": True}}]},
    schema_format(strict=False, name="Answer_v-2", description="any JSON object"),
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": None}}},  # llama-server's
])
def test_what_openai_sends_back_still_passes(http, fields):
    """A conversation as OpenAI's client sends it back: the assistant's calls, the tool's answer, nulls."""
    status, _, message = answer(http, "chat", fields)
    assert status == 200, message


@pytest.mark.parametrize("n_probs", [-1, MAX_LOGPROBS + 1])
def test_completion_names_n_probs(http, n_probs):
    """llama-server's /completion reads n_probs as logprobs; its range error named logprobs, with no param."""
    r = http.post("/completion", json={"prompt": "def f(", "n_predict": 2, "n_probs": n_probs})
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (400, "n_probs"), error
    assert "n_probs" in error["message"] and "logprobs" not in error["message"], error


# -- item 10: 400s name the right field, and speak of request fields -------------------------------------

@pytest.mark.parametrize("drafter", ["rest", "cascade:"])
def test_a_drafter_that_cannot_run_names_speculative_drafter_without_cli_flags(http, drafter):
    status, param, message = answer(http, "completions", {"speculative": {"drafter": drafter}})
    assert (status, param) == (400, "speculative.drafter"), message
    assert "--" not in message, message  # no command-line flags in an API answer


def test_a_drafter_that_cannot_run_is_named_in_a_stream_too(http):
    r = http.post("/v1/completions", json={"prompt": "x", "stream": True, "speculative": {"drafter": "rest"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.drafter"


def test_a_chat_prompt_too_long_names_messages(http):
    status, param, message = answer(http, "chat", {"messages": [{"role": "user", "content": "x " * 2000}]})
    assert (status, param) == (400, "messages") and "messages" in message


@pytest.mark.parametrize("route, fields, param", [
    ("chat", {"max_completion_tokens": 1_000_000_000}, "max_completion_tokens"),
    ("chat", {"max_completion_tokens": 1e9}, "max_completion_tokens"),
    ("chat", {"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ("completions", {"n_predict": 100_000}, "n_predict"),
    ("completions", {"n_cmpl": 99}, "n_cmpl"),
])
def test_limits_name_the_field_that_was_sent(http, route, fields, param):
    status, got, message = answer(http, route, {"max_tokens": None, **fields})
    assert (status, got) == (400, param), message


# -- item 25: a stop string's tokens are no part of the answer --------------------------------------------

def completion(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(http: httpx.Client, **fields: Any) -> tuple[str, list[str], dict[str, Any]]:
    """Text, logprobs tokens and usage of a streamed completion."""
    text, tokens, usage = "", [], None
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **fields}
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice["text"]
                tokens += (choice.get("logprobs") or {}).get("tokens", [])
    return text, tokens, usage


def test_stop_tokens_are_left_out_of_logprobs_and_usage(http):
    whole = completion(http, logprobs=1)["choices"][0]
    tokens, text = whole["logprobs"]["tokens"], whole["text"]
    end = tokens.index("\n")  # the first line ends at a token boundary: a one-token stop string there
    assert "".join(tokens[:end]) == text[: text.index("\n")]
    for stop, kept in (("\n", end), (")\n_", end - 1)):  # one stop token, then three (")", "\n", "_")
        r = completion(http, logprobs=1, stop=stop)
        choice = r["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] == text[: text.index(stop)]
        assert choice["logprobs"]["tokens"] == tokens[:kept] and "".join(tokens[:kept]) == choice["text"]
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["logprobs"]["text_offset"]) == kept
        assert r["usage"]["completion_tokens"] == kept
        assert streamed(http, logprobs=1, stop=stop) == (choice["text"], tokens[:kept], r["usage"])


def test_a_stop_inside_a_token_keeps_that_token(http):
    """A stop string that begins inside a token: the token shows in the text, so it is counted."""
    whole = completion(http, logprobs=0)["choices"][0]
    tokens = whole["logprobs"]["tokens"]
    i = next(i for i, t in enumerate(tokens) if len(t.strip()) > 2)
    stop = tokens[i][2:] + tokens[i + 1]  # from the middle of token i on
    r = completion(http, logprobs=0, stop=stop)
    choice = r["choices"][0]
    assert choice["text"] == "".join(tokens[:i]) + tokens[i][:2]
    assert choice["logprobs"]["tokens"] == tokens[: i + 1] and r["usage"]["completion_tokens"] == i + 1


def test_chat_logprobs_leave_the_stop_out_too(client):
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=30, temperature=0, logprobs=True)
    content = whole.choices[0].message.content
    at = next(i for i, c in enumerate(content) if i > 0 and not c.isalnum() and c not in content[:i])
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=30, temperature=0, logprobs=True,
                                       stop=content[at])
    text, tokens = r.choices[0].message.content, [t.token for t in r.choices[0].logprobs.content]
    assert text == content[:at] and "".join(tokens).startswith(text)
    assert len("".join(tokens[:-1])) < len(text)  # every token counted shows in the text
    assert len(tokens) == r.usage.completion_tokens


# -- item 16: bodies that never arrive, heads that are too large ------------------------------------------

def raw_request(server, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection and read the answer until the server closes it."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Authorization: Bearer {KEY}", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_body_short_of_its_content_length_is_408(server):
    body = b'{"prompt": "def f(", "max_tokens": 2}'
    answer = raw_request(server, head("/v1/completions", {"Content-Length": str(len(body) + 10)}) + body)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_an_unfinished_chunked_body_is_408(server):
    chunk = b'{"prompt": "def f(",'
    data = head("/v1/completions", {"Transfer-Encoding": "chunked"}) + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    assert raw_request(server, data).startswith(b"HTTP/1.1 408 ")  # the last chunk never comes


def test_a_whole_body_still_works_on_the_same_server(http):
    r = http.post("/v1/completions", content=b'{"prompt": "def f(", "max_tokens": 2}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 200


@pytest.mark.parametrize("size", [200_000, 10 << 20])
def test_a_head_over_the_limit_is_431(server, size):
    r = httpx.get(server.url + "/health", headers={"X-Padding": "a" * size}, timeout=60)
    assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"


def test_a_pipelined_request_over_the_limit_is_431(server):
    """A second request sent with the first arrives whole in one read, past the protocol's check as it arrives."""
    first = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    second = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 40_000 + b"\r\n\r\n"
    answers = raw_request(server, first + second).split(b"HTTP/1.1 ")[1:]
    assert [a[:3] for a in answers] == [b"200", b"431"]


def test_ordinary_headers_pass(server):
    assert httpx.get(server.url + "/health", headers={"X-Padding": "a" * 8000}).status_code == 200


def test_specstack_serve_runs_with_the_head_limit():
    """The real command serves with the same settings (its uvicorn.run passes them)."""
    proc, url = spawn_server("--exact", "on", "-np", "1", "--max-queue", "1")
    try:
        assert httpx.get(url + "/health", headers={"X-Padding": "a" * 200_000}, timeout=60).status_code == 431
        assert httpx.get(url + "/health").status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


# -- item 17: the auth scheme is case-insensitive ---------------------------------------------------------

@pytest.mark.parametrize("value, status", [(f"bearer {KEY}", 200), (f"BEARER {KEY}", 200), (f"Bearer  {KEY}", 200),
                                           (f"Basic {KEY}", 401), ("bearer wrong", 401), (KEY, 401)])
def test_the_bearer_scheme_is_case_insensitive(server, value, status):
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": value}).status_code == status
