"""OpenAI's Responses API on ``specstack serve`` (issue 41 item 3), as llama-server offers it: the text and
function-tool subset translated onto the chat path.  The official ``openai`` client (``client.responses.create``)
against the real Gemma 3 270M: llama.cpp's own test's requests, a stream's typed events, a function call and its
round trip, a thinking model's reasoning item (DeepSeek-R1's template, a grammar-forced output), and the fields
that cannot be honoured refused naming them.  The translation alone is tested on bodies."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from specstack.server.responses import ApiError
from specstack.server.responses_api import chat_body

R1 = Path(__file__).parent / "fixtures" / "chat_templates" / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"], "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 16}}}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}
BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


@pytest.fixture(scope="module")
def server():
    from test_gemma import _gemma_path
    from test_serve import Server

    from specstack.server.app import Limits, create_app
    from specstack.server.roles import Role

    gemma = Role(name="gemma", model=_gemma_path(), ctx=1024, parallel=1, chat_template="gemma", exact="on", threads=1)
    r1 = Role(name="r1", model=_gemma_path(), ctx=1024, parallel=1, chat_template=str(R1), exact="on", threads=1)
    with Server(create_app([gemma, r1], Limits(max_tokens=64))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_the_translation_onto_a_chat_request():
    chat = chat_body({"model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "top_k": 3, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 4}'},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4 degrees."}]}],
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}, "reasoning": {"effort": "low"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {"role": "assistant", "reasoning_content": "Call it.", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 4}'},
        {"role": "assistant", "content": [{"type": "text", "text": "4 degrees."}]}]
    assert chat["max_tokens"] == 9 and chat["top_k"] == 3 and chat["reasoning_effort"] == "low"
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    assert chat_body({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "computer_call"}]}, "input[0]"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"messages": []}, "messages"),
    ({"input": None}, "input"),
])
def test_what_cannot_be_honoured_is_refused_naming_it(body, param):
    with pytest.raises(ApiError) as e:
        chat_body({"input": "hi", **body})
    assert json.loads(e.value.response.body)["error"]["param"] == param


def test_llama_cpps_request_with_the_openai_client(client):
    """llama.cpp's test_responses_with_openai_library: a resp_ id, a msg_ item, the text; and the same text as
    the chat completion of the same messages (the instructions a system message first)."""
    res = client.responses.create(model="gemma", input=BOOK, max_output_tokens=8, temperature=0)
    assert res.id.startswith("resp_") and res.object == "response"
    assert res.output[0].type == "message" and res.output[0].id.startswith("msg_")
    assert res.output_text and res.usage.output_tokens <= 8 and res.usage.input_tokens > 0
    assert res.status in ("completed", "incomplete")
    chat = client.chat.completions.create(model="gemma", messages=BOOK, max_tokens=8, temperature=0)
    assert res.output_text == chat.choices[0].message.content
    both = client.responses.create(model="gemma", instructions="Book", input="What is the best book",
                                   max_output_tokens=8, temperature=0)
    assert both.output_text == res.output_text


def test_a_stream_s_events_as_llama_server_sends_them(client):
    stream = client.responses.create(model="gemma", input=BOOK, max_output_tokens=8, temperature=0, stream=True)
    kinds, text, msg_id, completed = [], "", None, None
    for ev in stream:
        kinds.append(ev.type)
        if ev.type == "response.output_item.added":
            msg_id = ev.item.id
        if ev.type in ("response.content_part.added", "response.output_text.delta", "response.output_text.done",
                       "response.content_part.done"):
            assert ev.item_id == msg_id
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type == "response.completed":
            completed = ev.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta") \
        < kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
    assert msg_id.startswith("msg_") and completed.output[0].id == msg_id and completed.output_text == text != ""


def test_a_function_call_and_its_round_trip(client):
    res = client.responses.create(model="gemma", input="What is the weather in Paris?", tools=[TOOL],
                                  tool_choice="required", max_output_tokens=48, temperature=0)
    (call,) = [item for item in res.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    events = list(client.responses.create(model="gemma", input="What is the weather in Paris?", tools=[TOOL],
                                          tool_choice="required", max_output_tokens=48, temperature=0, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert [(d.name, d.arguments) for d in done] == [(call.name, call.arguments)] and args == call.arguments
    answer = client.responses.create(model="gemma", tools=[TOOL], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21, "sky": "sunny"}'}])
    assert answer.status in ("completed", "incomplete") and answer.output


def test_a_thinking_model_s_reasoning_item(client):
    grammar = 'root ::= "Two and two." "</think>" "\\n\\n" "It is 4."'
    res = client.responses.create(model="r1", input="2+2?", max_output_tokens=32, temperature=0,
                                  extra_body={"grammar": grammar})
    assert [item.type for item in res.output] == ["reasoning", "message"]
    assert res.output[0].id.startswith("rs_") and res.output[0].content[0].text == "Two and two."
    assert res.output_text == "It is 4." and res.status == "completed"
    events = list(client.responses.create(model="r1", input="2+2?", max_output_tokens=32, temperature=0, stream=True,
                                          extra_body={"grammar": grammar}))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Two and two."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is 4."


def test_refusals_over_http_name_the_responses_field(server):
    for body, param in (({"max_output_tokens": "8"}, "max_output_tokens"),
                        ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
                        ({"previous_response_id": "resp_x"}, "previous_response_id"),
                        ({"frequency_penalties": 1}, "frequency_penalties")):
        r = httpx.post(server.url + "/v1/responses", json={"model": "gemma", "input": "hi", **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(server.url + "/responses", json={"model": "gemma", "input": "hi", "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "response"


def test_input_tokens_counts_the_prompt_the_response_would_run(server):
    """llama-server's /v1/responses/input_tokens: the rendered prompt's tokens, as chat's own count gives them."""
    body = {"model": "gemma", "instructions": "Be brief.", "input": "Hello world"}
    counts = [httpx.post(server.url + path, json=body, timeout=30) for path in
              ("/v1/responses/input_tokens", "/responses/input_tokens")]
    chat = httpx.post(server.url + "/v1/chat/completions/input_tokens", timeout=30, json={
        "model": "gemma", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hello world"}]})
    assert [r.status_code for r in counts] == [200, 200] and chat.status_code == 200
    assert counts[0].json()["input_tokens"] == counts[1].json()["input_tokens"] == chat.json()["input_tokens"] > 4
    longer = httpx.post(server.url + "/v1/responses/input_tokens", timeout=30,
                        json={**body, "input": "Hello world, and a much longer question about the weather"})
    assert longer.json()["input_tokens"] > counts[0].json()["input_tokens"]
    bad = httpx.post(server.url + "/v1/responses/input_tokens", json={"model": "gemma", "input": 3}, timeout=30)
    assert bad.status_code == 400
