"""llama-server's chat details on `specstack serve`, over real HTTP on the bundled model: templates rendered with
llama-server's variables (today's date, ``enable_thinking``, a string plus an undefined value), the request's
``add_generation_prompt`` and ``continue_final_message`` (and a last assistant message continued unasked),
``__verbose`` and ``timings`` in the answers, the prompt's token count (``/chat/completions/input_tokens``), a
prompt past the context refused as llama-server refuses it, and several choices of one chat.

The templates are llama.cpp's test set (``tests/fixtures/chat_templates``); the model cannot read their markup
(pycoder has no such control tokens), which changes nothing of what is checked: the prompt's text and the
answers' shapes.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import httpx
import pytest

from specstack.server.app import Limits, create_app
from specstack.server.roles import Role
from test_serve import Server

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
LLAMA = str(FIXTURES / "meta-llama-Llama-3.3-70B-Instruct.jinja")
QWQ = str(FIXTURES / "Qwen-QwQ-32B.jinja")
FIRE = str(FIXTURES / "fireworks-ai-llama-3-firefunction-v2.jinja")
BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
ASSISTANT = "<|start_header_id|>assistant<|end_header_id|>\n\n"
CTX = 256  # per slot: a prompt past it is quick to build


@pytest.fixture(scope="module")
def http():
    """Three roles of the bundled model, each with one of llama.cpp's test templates; the server runs verbose
    (``serve --verbose``), so answers carry ``__verbose`` unless a request says otherwise."""
    roles = [Role(name="llama", chat_template=LLAMA, ctx=CTX, parallel=2, exact="on", threads=1),
             Role(name="qwq", chat_template=QWQ, ctx=CTX, parallel=1, threads=1),
             Role(name="fire", chat_template=FIRE, ctx=CTX, parallel=1, threads=1)]
    with Server(create_app(roles, Limits(max_tokens=64), verbose=True)) as s:
        with httpx.Client(base_url=s.url, timeout=300) as client:
            yield client


def prompt(http: httpx.Client, model: str, messages: list[dict], **fields) -> str:
    r = http.post("/apply-template", json={"model": model, "messages": messages, **fields})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


# -- templates rendered as llama-server renders them ---------------------------------------------------------

def test_templates_get_todays_date_and_concatenate_undefined_values(http):
    """Llama 3.3 writes ``date_string`` (its own fixed date without it); firefunction-v2 writes ``datetime`` and
    adds the undefined ``functions`` to a string, which plain Jinja refuses (every chat was a 400)."""
    today = datetime.date.today()
    assert today.strftime("%d %b %Y") in prompt(http, "llama", BOOK)
    assert today.strftime("%b %d %Y") in prompt(http, "fire", BOOK)


def test_thinking_is_enabled_unless_the_request_turns_it_off(http):
    """``enable_thinking`` is true unless said otherwise, as llama-server passes it: QwQ's block stays open."""
    question = [{"role": "user", "content": "What is today?"}]
    assert prompt(http, "qwq", question).endswith("<|im_start|>assistant\n<think>\n")
    off = prompt(http, "qwq", question, chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n</think>")


def test_add_generation_prompt_false_leaves_the_turn_unopened(http):
    assert prompt(http, "llama", BOOK).endswith("What is the best book<|eot_id|>" + ASSISTANT)
    closed = prompt(http, "llama", BOOK, add_generation_prompt=False)
    assert closed.endswith("What is the best book<|eot_id|>") and ASSISTANT not in closed


@pytest.mark.parametrize("content,text", [("Whill", "Whill"),
                                          ([{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}],
                                           "Wh\n\nill")])
def test_a_last_assistant_message_is_continued(http, content, text):
    """llama-server's prefill: the assistant's turn opened, then its message's text, nothing after it."""
    messages = BOOK + [{"role": "assistant", "content": content}]
    assert prompt(http, "llama", messages).endswith("What is the best book<|eot_id|>" + ASSISTANT + text)
    vllm = prompt(http, "llama", messages, add_generation_prompt=False, continue_final_message=True)
    assert vllm == prompt(http, "llama", messages)


@pytest.mark.parametrize("fields,messages,param", [
    ({"add_generation_prompt": True, "continue_final_message": True}, BOOK + [{"role": "assistant", "content": "Hi"}],
     "add_generation_prompt"),
    ({}, BOOK + [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}], "messages"),
    ({"continue_final_message": "everything"}, BOOK, "continue_final_message"),
])
def test_continuations_llama_server_refuses(http, fields, messages, param):
    r = http.post("/v1/chat/completions", json={"model": "llama", "messages": messages, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# -- answers: __verbose, timings, the token count, the context, several choices ------------------------------

def test_verbose_answers_carry_the_prompt_as_the_model_read_it(http):
    messages = BOOK + [{"role": "assistant", "content": "Whill"}]
    r = http.post("/v1/chat/completions", json={"model": "llama", "messages": messages, "max_tokens": 4})
    body = r.json()
    assert r.status_code == 200 and body["__verbose"]["prompt"].endswith(ASSISTANT + "Whill")
    assert body["__verbose"]["tokens_evaluated"] == body["usage"]["prompt_tokens"]
    assert body["timings"]["predicted_n"] == body["usage"]["completion_tokens"]
    quiet = http.post("/v1/chat/completions", json={"model": "llama", "messages": BOOK, "max_tokens": 2,
                                                    "verbose": False}).json()
    assert "__verbose" not in quiet and "timings" in quiet


def test_a_stream_ends_with_timings_and_carries_verbose(http):
    chunks = []
    with http.stream("POST", "/v1/chat/completions", json={
            "model": "llama", "messages": BOOK, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert "timings" not in chunks[0] and chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    last = chunks[-1]
    assert last["choices"] == [] and last["timings"]["predicted_n"] == last["usage"]["completion_tokens"]
    assert any("__verbose" in c for c in chunks)


def test_input_tokens_counts_the_chat_prompt(http):
    answer = http.post("/v1/chat/completions", json={"model": "llama", "messages": BOOK, "max_tokens": 1}).json()
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        r = http.post(path, json={"model": "llama", "messages": BOOK})
        assert r.status_code == 200 and r.json()["input_tokens"] == answer["usage"]["prompt_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_past_the_context_is_refused_as_llama_server_refuses_it(http, stream):
    r = http.post("/v1/chat/completions", json={"model": "llama", "messages": BOOK * 40, "stream": stream})
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "exceed_context_size_error"
    assert error["n_prompt_tokens"] > CTX and error["n_ctx"] == CTX


def test_a_chat_gives_several_choices(http):
    r = http.post("/v1/chat/completions", json={"model": "llama", "messages": BOOK, "max_tokens": 4, "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["message"]["role"] == "assistant" and c["finish_reason"] == "length" for c in choices)


def stream_chunks(http: httpx.Client, body: dict) -> list[dict]:
    chunks = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_return_progress_streams_the_prompts_processing(http):
    """llama-server's prompt progress: the cached prefix first, then more after each step that processed more,
    up to the whole prompt, before the first token; a prompt met again starts from more of it cached."""
    body = {"model": "llama", "messages": [{"role": "user", "content": "This is a test" * 10}], "max_tokens": 3,
            "return_progress": True, "stream_options": {"include_usage": True}}
    cached = []
    for _ in range(2):
        chunks = stream_chunks(http, body)
        progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
        first_text = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content"))
        assert max(i for i, c in enumerate(chunks) if "prompt_progress" in c) < first_text
        total = chunks[-1]["usage"]["prompt_tokens"]
        assert progress[0]["cache"] == progress[0]["processed"] and progress[-1]["processed"] == total
        assert all(p["total"] == total and p["cache"] == progress[0]["cache"] for p in progress)
        assert all(a["processed"] < b["processed"] for a, b in zip(progress, progress[1:]))
        cached.append(progress[0]["cache"])
    assert cached[1] > cached[0]
    plain = stream_chunks(http, {**body, "return_progress": False})
    assert not any("prompt_progress" in c for c in plain)


def test_id_slot_runs_every_choice_in_that_slot(http):
    """llama-server's ``id_slot``: both choices of a request in the named slot, one after the other (the scheduler
    does not lock up), on the chat route and the native one; a slot the role lacks is a 400."""
    for _ in range(2):
        r = http.post("/v1/chat/completions", json={"model": "llama", "messages": BOOK, "max_tokens": 3, "n": 2,
                                                    "id_slot": 0})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2 and r.json()["__verbose"]["id_slot"] == 0
    results = http.post("/completion", json={"model": "llama", "prompt": "def f():", "n_predict": 3, "n_cmpl": 2,
                                             "id_slot": 1}).json()
    assert [res["id_slot"] for res in results] == [1, 1]
    r = http.post("/v1/chat/completions", json={"model": "llama", "messages": BOOK, "max_tokens": 3, "id_slot": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot"


def test_a_responses_stream_with_return_progress_still_completes(http):
    """The Responses API runs as a chat: its stream has no progress event, and skips the chat's."""
    events = []
    with http.stream("POST", "/v1/responses", json={"model": "llama", "input": "What is the best book",
                                                    "max_output_tokens": 3, "stream": True,
                                                    "return_progress": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:])["type"] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "response.completed" and events.count("response.completed") == 1
