"""Anthropic's Messages API on ``specstack serve`` as llama-server offers it (``POST /v1/messages``, streamed and
whole, ``/v1/messages/count_tokens``), Vertex AI's prediction route, and the Responses stream's llama-server
telemetry, over real HTTP on the bundled pair.  The official ``anthropic`` client reads the answers; a streamed
and a whole answer under speculation are plain decoding's, drafts accepted; a thinking model's blocks (DeepSeek-R1's
template, a grammar-forced output) and a forced tool call come back as Anthropic's blocks with their indices.
The translation alone is tested on bodies."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest

from specstack.server.anthropic_api import billing_header, chat_body
from specstack.server.app import Limits, create_app
from specstack.server.chat import chat_tokens, load_template, render
from specstack.server.responses import ApiError
from specstack.server.roles import Role, default_roles
from specstack.server.vertex import VertexParams, aliases, request_format, vertex_params
from test_llama_server_api import plain
from test_serve import PROMPT, Server

R1 = Path(__file__).parent / "fixtures" / "chat_templates" / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TOOL = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER}
DRAFT = {"drafter": "draft-model", "k_policy": "fixed", "k": 6}
THINK = 'root ::= "Two and two." "</think>" "\\n\\n" "It is 4."'


@pytest.fixture(scope="module")
def server():
    """The bundled pair, and the bundled target under DeepSeek-R1's template (a model that thinks); Vertex AI's
    prediction route on.  --exact on: outputs are compared with plain decoding token for token."""
    coder = default_roles(parallel=2, exact="on")[0]
    r1 = Role(name="r1", parallel=1, exact="on", chat_template=str(R1))
    app = create_app([coder, r1], Limits(max_tokens=256), vertex_ai=VertexParams(health_route="/vertex-health"))
    with Server(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300, **kw)


def sse(server, body: dict, path: str = "/v1/messages") -> list[dict]:
    """A stream's events' data, each checked to name its own SSE event."""
    events, kind = [], None
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert kind is None or data["type"] == kind
                events.append(data)
    return events


# -- the translation -------------------------------------------------------------------------------------------

def test_the_translation_onto_a_chat_request():
    chat, budget = chat_body({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "stop_sequences": ["END"], "top_k": 3, "metadata": {"user_id": "u1"}, "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 64}, "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": ""},
                                              {"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                          "content": [{"type": "text", "text": "no "}, {"type": "text", "text": "data"}]},
                                         {"type": "text", "text": "Try again."}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "no data"},
        {"role": "user", "content": [{"type": "text", "text": "Try again."}]}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                               "description": "The weather in a city."}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False and chat["stop"] == ["END"] and chat["user"] == "u1"
    assert chat["max_tokens"] == 9 and chat["top_k"] == 3 and budget == 64
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat_body({"messages": []})[0] == {"messages": [], "max_tokens": 4096}  # llama-server's default
    assert chat_body({"messages": [], "tool_choice": {"type": "any"}})[0]["tool_choice"] == "required"


def test_claude_code_s_billing_stamp_is_made_constant():
    """The stamp changes every request: left as it is, no prompt prefix would be reused past it."""
    stamped = "x-anthropic-billing-header: cc_version=2.1; cc_entrypoint=cli; cch=a5145;You are Claude Code."
    assert billing_header(stamped) == "x-anthropic-billing-header: cc_version=2.1; cc_entrypoint=cli; cch=fffff;You " \
                                      "are Claude Code."
    assert billing_header("You are helpful. cch=a5145;") == "You are helpful. cch=a5145;"


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"messages": [], "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"messages": [], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [], "thinking": {"type": "on"}}, "thinking.type"),
    ({"messages": [], "metadata": {"tags": ["a"]}}, "metadata"),
    ({"messages": [], "service_tier": "priority"}, "service_tier"),
    ({"messages": [], "system": 3}, "system"),
    ({"messages": [], "n": 2}, "n"),
])
def test_what_cannot_be_taken_is_a_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as err:
        chat_body(body)
    payload = json.loads(err.value.response.body)
    assert err.value.response.status_code == 400 and payload["error"]["param"] == param


# -- over HTTP ---------------------------------------------------------------------------------------------------

def test_the_official_client_whole_streamed_and_counted(client):
    msg = client.messages.create(model="pycoder-6m", max_tokens=12, extra_body={"temperature": 0}, system="Be brief.",
                                 messages=[{"role": "user", "content": "Say hello"}])
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "text"
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 12 and msg.usage.input_tokens > 0
    assert msg.id.startswith("msg_") and "timings" not in msg.model_dump()
    with client.messages.stream(model="pycoder-6m", max_tokens=12, extra_body={"temperature": 0}, system="Be brief.",
                                messages=[{"role": "user", "content": "Say hello"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == msg.content[0].text and final.stop_reason == "max_tokens"
    counted = client.messages.count_tokens(model="pycoder-6m", system="Be brief.",
                                           messages=[{"role": "user", "content": "Say hello"}])
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_whole_and_streamed_answers_under_speculation_are_plain_decoding(server, target):
    """Greedy under the draft model: the text is plain decoding's of the chat prompt, and drafts were accepted."""
    messages = [{"role": "user", "content": PROMPT}]
    ids = chat_tokens(render(messages, load_template(Role(name="x").model)), target)
    expected = target.detokenize(plain(target, ids, 40).output_ids)
    body = {"model": "pycoder-6m", "max_tokens": 40, "temperature": 0, "messages": messages, "speculative": DRAFT}
    whole = post(server, "/v1/messages", body).json()
    assert whole["content"] == [{"type": "text", "text": expected}] and whole["stop_reason"] == "max_tokens"
    assert whole["speculative"]["by_source"]["draft-model"]["accepted"] > 0
    events = sse(server, body)
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == expected
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert delta["usage"]["output_tokens"] == 40 and delta["speculative"]["by_source"]["draft-model"]["accepted"] > 0
    assert [e["type"] for e in events][:2] == ["message_start", "content_block_start"]
    assert [e["type"] for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences_end_the_turn_naming_the_sequence(server):
    body = {"model": "pycoder-6m", "max_tokens": 64, "temperature": 0, "messages": [{"role": "user", "content": PROMPT}]}
    text = post(server, "/v1/messages", body).json()["content"][0]["text"]
    stop = text[5:8]
    r = post(server, "/v1/messages", {**body, "stop_sequences": [stop]}).json()
    assert r["stop_reason"] == "stop_sequence" and r["stop_sequence"] == stop
    assert r["content"][0]["text"] == text[:text.index(stop)]


def test_a_thinking_model_s_blocks_whole_and_streamed(server):
    body = {"model": "r1", "max_tokens": 32, "temperature": 0, "grammar": THINK,
            "messages": [{"role": "user", "content": "2+2?"}]}
    whole = post(server, "/v1/messages", body).json()
    assert whole["content"] == [{"type": "thinking", "thinking": "Two and two.", "signature": ""},
                                {"type": "text", "text": "It is 4."}]
    events = sse(server, body)
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert "".join(e["delta"].get("thinking", "") for e in deltas) == "Two and two."
    assert [e["delta"]["type"] for e in deltas if e["index"] == 0][-1] == "signature_delta"
    assert "".join(e["delta"].get("text", "") for e in deltas if e["index"] == 1) == "It is 4."
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]


def test_a_thinking_budget_is_taken_only_where_nothing_can_exceed_it(server):
    body = {"max_tokens": 16, "messages": [{"role": "user", "content": "2+2?"}],
            "thinking": {"type": "enabled", "budget_tokens": 8}}
    r = post(server, "/v1/messages", {**body, "model": "r1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking.budget_tokens"
    assert post(server, "/v1/messages", {**body, "model": "pycoder-6m"}).status_code == 200  # no thinking there
    big = {**body, "model": "r1", "thinking": {"type": "enabled", "budget_tokens": 16}}
    assert post(server, "/v1/messages", big).status_code == 200


def test_a_forced_tool_call_as_a_tool_use_block(server):
    body = {"model": "pycoder-6m", "max_tokens": 64, "temperature": 0, "tools": [TOOL],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    whole = post(server, "/v1/messages", body).json()
    (call,) = [b for b in whole["content"] if b["type"] == "tool_use"]
    assert whole["stop_reason"] == "tool_use" and call["name"] == "get_weather" and set(call["input"]) == {"city"}
    events = sse(server, body)
    (start,) = [e for e in events if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"]
    parts = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
             and e["index"] == start["index"]]
    assert json.loads("".join(parts)) == call["input"] and start["content_block"]["name"] == "get_weather"
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    assert starts == list(range(len(starts))) == [e["index"] for e in events if e["type"] == "content_block_stop"]
    answer = post(server, "/v1/messages", {**body, "tool_choice": {"type": "none"}, "max_tokens": 8, "messages": [
        *body["messages"], {"role": "assistant", "content": whole["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "Sunny."}]}]})
    assert answer.status_code == 200 and answer.json()["content"][0]["type"] == "text"


def test_images_are_a_400_in_llama_server_s_words(server):
    """Text only: a 400 naming the block (issue 55: it was llama-server's 500, a server error for the request's fault)."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    r = post(server, "/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400 and "image input is not supported" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error" and "text only" in r.json()["error"]["message"]
    r = post(server, "/v1/messages", {"max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [image]}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].content[0]"


def test_an_empty_conversation_and_unknown_fields(server):
    r = post(server, "/v1/messages", {"max_tokens": 4, "messages": []})
    assert r.status_code == 200 and r.json()["type"] == "message"  # as llama-server: the template's empty chat
    r = post(server, "/v1/messages", {"max_tokens": 4, "messages": [], "frequency_penalties": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frequency_penalties"
    r = post(server, "/v1/messages", {"max_tokens": "4", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# -- Vertex AI ------------------------------------------------------------------------------------------------------

def test_vertex_ai_s_settings_and_aliases():
    assert vertex_params({}) is None and vertex_params({"AIP_MODE": "TRAINING"}) is None
    assert vertex_params({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "9000", "AIP_PREDICT_ROUTE": "run",
                          "AIP_HEALTH_ROUTE": "/ok"}) == VertexParams("/run", "/ok", 9000)
    assert request_format("/v1/chat/completions") == "chatCompletions" and request_format("/apply-template") == \
        "applyTemplate" and request_format("/v1/messages/count_tokens") == "messagesCountTokens"
    assert aliases(["/v1/chat/completions", "/chat/completions"]) == {"chatCompletions": "/v1/chat/completions"}


def test_vertex_ai_s_port_wins_over_the_flag(monkeypatch):
    import argparse

    from specstack.commands.serve import vertex_from_env
    from specstack.errors import InvalidParameterError

    args = argparse.Namespace(port=8080)
    monkeypatch.delenv("AIP_MODE", raising=False)
    assert vertex_from_env(args) is None and args.port == 8080
    monkeypatch.setenv("AIP_MODE", "PREDICTION")
    monkeypatch.setenv("AIP_HTTP_PORT", "9123")
    assert vertex_from_env(args) == VertexParams(port=9123) and args.port == 9123
    monkeypatch.setenv("AIP_HTTP_PORT", "http")
    with pytest.raises(InvalidParameterError, match="AIP_HTTP_PORT"):
        vertex_from_env(args)


def test_vertex_ai_predictions_run_each_instance_on_its_route(server):
    chat = {"max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Say hello"}]}
    r = post(server, "/predict", {"instances": [
        {"@requestFormat": "chatCompletions", **chat, "stream": True},
        {"@requestFormat": "/v1/messages", **chat},
        {"@requestFormat": "tokenize", "content": "hi"},
        {"@requestFormat": "nothing"}, 3]})
    assert r.status_code == 200
    oai, anth, tok, unknown, bad = r.json()["predictions"]
    direct = post(server, "/v1/chat/completions", chat).json()
    assert oai["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"] != ""
    assert anth["type"] == "message" and tok["tokens"]
    assert "no handler registered for @requestFormat: nothing" in unknown["error"]["message"]
    assert "must be a JSON object" in bad["error"]["message"]
    assert post(server, "/predict", {"instances": {}}).status_code == 400
    assert httpx.get(server.url + "/vertex-health", timeout=30).json() == httpx.get(server.url + "/health").json()


# -- the Responses stream's telemetry ---------------------------------------------------------------------------

def test_a_responses_stream_s_llama_server_telemetry(server):
    events = sse(server, {"model": "pycoder-6m", "input": PROMPT, "max_output_tokens": 8, "temperature": 0,
                          "timings_per_token": True, "return_progress": True}, path="/v1/responses")
    (progress,) = [e for e in events if "prompt_progress" in e]
    assert progress["type"] == "response.in_progress" and progress["prompt_progress"]["total"] > 0
    assert progress["prompt_progress"]["processed"] >= progress["prompt_progress"]["cache"]
    timed = [e for e in events if e["type"] == "response.output_text.delta" and "timings" in e]
    assert timed and all({"prompt_per_second", "predicted_per_second"} <= set(e["timings"]) for e in timed)
    assert events[-1]["type"] == "response.completed" and events[-1]["timings"]["predicted_n"] == 8
    plain_events = sse(server, {"model": "pycoder-6m", "input": PROMPT, "max_output_tokens": 8}, path="/v1/responses")
    assert not [e for e in plain_events if "prompt_progress" in e or ("timings" in e and e["type"] != "response.completed")]
