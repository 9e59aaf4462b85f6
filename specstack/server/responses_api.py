"""OpenAI's Responses API (``POST /v1/responses``) as llama-server offers it: the text and function-tool subset,
translated onto a chat request (``chat_body``, after llama-server's ``server_chat_convert_responses_to_chatcmpl``)
and its answer shaped back (``ResponseShape``: the response object, or the stream's typed events).

Taken: ``input`` (a string, or a list of messages and items: input and output messages, ``function_call``,
``function_call_output``, ``reasoning``), ``instructions`` (a system message first), ``max_output_tokens``,
``temperature``, ``top_p``, function ``tools`` and ``tool_choice``, ``parallel_tool_calls``, ``reasoning.effort``,
``text.format`` (text, json_object, json_schema: structured output), ``stream``, and, as llama-server passes
them on, every chat field (``top_k``, ``seed``, ``speculative``, ...).  Refused with a 400 naming the field:
what needs a store of responses (``previous_response_id``, ``conversation``, ``store: true``, ``background``),
built-in tools (web search, file search, ...), non-text input, ``include``, and ``truncation: auto``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import ValidationError

from .events import Done
from .responses import ApiError, summary
from .schema import ChatRequest, field_path
from .tools import ChoiceOutput

# Responses fields turned into chat fields here; every other field goes to the chat request as it is
OWN = ("input", "instructions", "max_output_tokens", "tools", "tool_choice", "reasoning", "text", "store",
       "previous_response_id", "conversation", "background", "include", "truncation", "max_tool_calls", "prompt",
       "top_logprobs", "stream_options")
# A chat field's error named as the Responses field it came from
RENAMED = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort"}


def _refuse(field: str, why: str) -> ApiError:
    return ApiError(400, f"{field}: {why}", param=field)


def _text_parts(content: Any, where: str, kinds: tuple[str, ...]) -> list[dict[str, str]]:
    """A message's content (a string, or parts of ``kinds``) as chat text parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _refuse(f"{where}.content", "must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise _refuse(f"{where}.content[{j}]", f"{kind} is not supported: this server takes and gives text only")
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise _refuse(f"{where}.content[{j}]", f"must be one of {', '.join(kinds)} with its text")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _messages(items: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: an assistant's text, calls and reasoning in a row make one message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _refuse("input", "must be a string or a list of messages and items")
    out: list[dict[str, Any]] = []

    def assistant() -> dict[str, Any]:
        if not out or out[-1]["role"] != "assistant" or "tool_call_id" in out[-1]:
            out.append({"role": "assistant"})
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _refuse(where, "must be a message or an item object")
        kind, role = item.get("type", "message"), item.get("role")
        if kind == "message" and role in ("user", "system", "developer"):
            out.append({"role": role, "content": _text_parts(item.get("content"), where, ("input_text",))})
        elif kind == "message" and role == "assistant":
            msg = assistant()
            msg["content"] = msg.get("content") or []
            msg["content"] += _text_parts(item.get("content"), where, ("output_text", "input_text"))
        elif kind == "function_call":
            fields = [item.get(k) for k in ("call_id", "name", "arguments")]
            if not all(isinstance(v, str) for v in fields):
                raise _refuse(where, "a function_call needs call_id, name and arguments (strings)")
            call_id, name, arguments = fields
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise _refuse(f"{where}.call_id", "a function_call_output needs the call_id of its call")
            content = output if isinstance(output, str) else \
                "".join(p["text"] for p in _text_parts(output, where, ("input_text",)))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        elif kind == "reasoning":
            texts = [p.get("text") for p in item.get("content") or () if isinstance(p, dict)]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise _refuse(f"{where}.content", "a reasoning item needs its content's text")
            msg = assistant()
            msg["reasoning_content"] = msg.get("reasoning_content", "") + "".join(texts)
        else:
            raise _refuse(where, f"an item of type {kind!r}{f' with role {role!r}' if role else ''} is not supported "
                          "(messages, function_call, function_call_output and reasoning are)")
    for msg in out:  # an assistant turn with calls or reasoning only: no text
        if msg["role"] == "assistant" and not msg.get("content"):
            msg["content"] = "" if not msg.get("tool_calls") else None
            if msg["content"] is None:
                del msg["content"]
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _refuse("tools", "must be a list of function tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _refuse(f"tools[{i}].type", f"only function tools exist here ({kind!r} is a built-in tool this "
                          "server does not have)")
        fn = {k: v for k, v in tool.items() if k != "type"}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str) or choice is None:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _refuse("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"name\": NAME}")


def _format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's response_format."""
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise _refuse("text", "must be {\"format\": {...}}")
    if text.get("verbosity") not in (None, "medium"):
        raise _refuse("text.verbosity", "there is no verbosity control")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _refuse("text.format", "its type must be text, json_object or json_schema")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def chat_body(body: Any) -> dict[str, Any]:
    """A Responses request as the chat request that runs it; a field that cannot be honoured is a 400 naming it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if "input" not in body:
        raise _refuse("input", "is required")
    for field, neutral, why in (
            ("previous_response_id", (None, ""), "responses are not stored here; send the whole conversation as input"),
            ("conversation", (None,), "conversations are not stored here; send the whole conversation as input"),
            ("store", (None, False), "responses are not stored here; leave store out or send false"),
            ("background", (None, False), "responses run in the foreground only"),
            ("include", (None, []), "no extra output data (encrypted reasoning, logprobs, sources) is available"),
            ("truncation", (None, "disabled"), "input is never truncated: a prompt longer than the context is a 400"),
            ("max_tool_calls", (None,), "the number of tool calls is not limited here"),
            ("prompt", (None,), "stored prompt templates are not available; send instructions and input"),
            ("top_logprobs", (None, 0), "log probabilities are not returned by /v1/responses"),
            ("stream_options", (None, {}, {"include_obfuscation": False}), "stream events carry no obfuscation")):
        if body.get(field) not in neutral:
            raise _refuse(field, why)
    if "messages" in body:
        raise _refuse("messages", "/v1/responses takes input (send messages to /v1/chat/completions)")
    chat = {k: v for k, v in body.items() if k not in OWN}
    messages = _messages(body["input"])
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise _refuse("instructions", "must be a string")
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        tools = _tools(body["tools"])
        if tools:
            chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
            raise _refuse("reasoning", "must be {\"effort\": ...}")
        if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
            raise _refuse("reasoning.summary", "reasoning is returned whole (a reasoning item), never summarized")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    if body.get("text") is not None:
        fmt = _format(body["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    if chat.get("n", 1) != 1 or chat.get("n_cmpl", 1) != 1:
        raise _refuse("n", "a response has one output")
    return chat


def chat_request(body: Any) -> Any:
    """``chat_body`` validated as a chat request; a schema error names the Responses field where it came from."""
    chat = chat_body(body)
    try:
        return ChatRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = tuple(first.get("loc", ()))
        param = field_path(loc) or "body"
        top = param.split(".")[0].split("[")[0]
        if top in RENAMED:
            param = RENAMED[top] if top != "messages" else "input"
        if first.get("type") == "extra_forbidden":
            raise ApiError(400, f"Unrecognized request argument supplied: {param}", param=param) from None
        raise ApiError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param) from None


def _usage(final: Done) -> dict[str, Any]:
    cached = final.stats.get("reused_prompt_tokens") or 0
    return {"input_tokens": final.prompt_tokens, "output_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "input_tokens_details": {"cached_tokens": cached}, "output_tokens_details": {"reasoning_tokens": 0}}


class ResponseShape:
    """One response's answer from its choice's output: the whole object, or the stream's events (each a dict with
    its SSE ``event`` name and its ``data``, whose ``type`` is that name, numbered by ``sequence_number``)."""

    def __init__(self, model: str, body: dict[str, Any], output: ChoiceOutput) -> None:
        self.id, self.model, self.body, self.output = "resp_" + uuid.uuid4().hex, model, body, output
        self.created = int(time.time())
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # the output items as they open (reasoning, message, calls)
        self.reasoning_item: dict[str, Any] | None = None
        self.message_item: dict[str, Any] | None = None
        self.call_items: list[dict[str, Any]] = []

    # -- the response object ---------------------------------------------------------------------------------

    def response(self, status: str, final: Done | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": [self._done(item) for item in self.items] if final is not None else [],
            "instructions": self.body.get("instructions"), "max_output_tokens": self.body.get("max_output_tokens"),
            "temperature": self.body.get("temperature"), "top_p": self.body.get("top_p"),
            "tools": self.body.get("tools") or [], "tool_choice": self.body.get("tool_choice") or "auto",
            "parallel_tool_calls": bool(self.body.get("parallel_tool_calls")), "previous_response_id": None,
            "error": None, "incomplete_details": None, "usage": None}
        if final is not None:
            if final.finish_reason == "length":
                out["status"] = "incomplete"
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            else:
                out["completed_at"] = int(time.time())
            out["usage"] = _usage(final)
            out["speculative"] = summary(final.stats)
        return out

    def whole(self, final: Done) -> dict[str, Any]:
        """The response once the choice is done (its output already ``finish``ed)."""
        message = self.output.message()
        if message.get("reasoning_content"):
            self._open_reasoning()
            self.reasoning_item["content"][0]["text"] = message["reasoning_content"]
        if message.get("content"):
            self._open_message()
            self.message_item["content"][0]["text"] = message["content"]
        for call in message.get("tool_calls") or ():
            self._open_call(call["id"], call["function"]["name"])["arguments"] = call["function"]["arguments"]
        return self.response("completed", final)

    # -- the stream ------------------------------------------------------------------------------------------

    def event(self, kind: str, **data: Any) -> dict[str, Any]:
        self.seq += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.seq - 1, **data})}

    @staticmethod
    def extended(event: dict[str, Any], **fields: Any) -> dict[str, Any]:
        """``event`` with llama-server's telemetry beside its data's own keys (``timings``, ``prompt_progress``)."""
        return {**event, "data": json.dumps({**json.loads(event["data"]), **fields})}

    def opening(self) -> list[dict[str, Any]]:
        return [self.event(kind, response=self.response("in_progress"))
                for kind in ("response.created", "response.in_progress")]

    def deltas(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events for a choice output's chat deltas (``ChoiceOutput.add`` / ``finish``)."""
        out = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                if self.reasoning_item is None:
                    out.append(self.event("response.output_item.added", output_index=len(self.items),
                                          item=self._in_progress(self._open_reasoning())))
                item = self.reasoning_item
                item["content"][0]["text"] += delta["reasoning_content"]
                out.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                                      output_index=self.items.index(item), content_index=0,
                                      delta=delta["reasoning_content"]))
            if delta.get("content"):
                if self.message_item is None:
                    item = self._open_message()
                    out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                          item=self._in_progress(item)))
                    out.append(self.event("response.content_part.added", item_id=item["id"],
                                          output_index=len(self.items) - 1, content_index=0,
                                          part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
                item = self.message_item
                item["content"][0]["text"] += delta["content"]
                out.append(self.event("response.output_text.delta", item_id=item["id"],
                                      output_index=self.items.index(item), content_index=0, delta=delta["content"],
                                      logprobs=[]))
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                if call.get("id"):
                    item = self._open_call(call["id"], fn.get("name", ""))
                    out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                          item=self._in_progress(item)))
                item = self.call_items[call["index"]]
                if fn.get("arguments"):
                    item["arguments"] += fn["arguments"]
                    out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.items.index(item), delta=fn["arguments"]))
        return out

    def closing(self, final: Done) -> list[dict[str, Any]]:
        """Each item's done events, then ``response.completed`` with the whole response."""
        out = []
        for index, item in enumerate(self.items):
            done = self._done(item)
            if item["type"] == "reasoning":
                out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=item["content"][0]["text"]))
            elif item["type"] == "message":
                part = done["content"][0]
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
                out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=index, item=done))
        return out + [self.event("response.completed", response=self.response("completed", final))]

    # -- the items ---------------------------------------------------------------------------------------------

    def _open_reasoning(self) -> dict[str, Any]:
        self.reasoning_item = {"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [],
                               "content": [{"type": "reasoning_text", "text": ""}], "encrypted_content": None}
        self.items.append(self.reasoning_item)
        return self.reasoning_item

    def _open_message(self) -> dict[str, Any]:
        self.message_item = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
                             "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(self.message_item)
        return self.message_item

    def _open_call(self, call_id: str, name: str) -> dict[str, Any]:
        item = {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "call_id": call_id,
                "name": name, "arguments": ""}
        self.items.append(item)
        self.call_items.append(item)
        return item

    @staticmethod
    def _in_progress(item: dict[str, Any]) -> dict[str, Any]:
        shown = json.loads(json.dumps(item))
        if item["type"] == "message":
            shown["content"] = []
        elif item["type"] == "reasoning":
            shown["content"] = []
        else:
            shown["arguments"] = ""
        return {**shown, "status": "in_progress"}

    @staticmethod
    def _done(item: dict[str, Any]) -> dict[str, Any]:
        return {**json.loads(json.dumps(item)), "status": "completed"}
