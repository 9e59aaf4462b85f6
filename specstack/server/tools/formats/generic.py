"""llama.cpp's Generic: the whole answer is JSON, a call or a response (any template not detected otherwise)."""

from __future__ import annotations

import json
from typing import Any, Sequence

from ..base import ToolFormat, register
from ..rules import Rules, call_schema, object_schema
from ..scan import Invalid, call_object, member_value, partial_string, read_object, skip_ws
from ..types import Parsed, Tool, ToolCall


@register
class Generic(ToolFormat):
    """llama.cpp's Generic: the whole answer is JSON, a call or a response."""

    name = "generic"
    detect_order = 1000
    system_note = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
                   "reply to the user's request")

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        i = skip_ws(text, 0)
        if i >= len(text):
            return Parsed("" if partial else text)
        if text[i] != "{":
            return Parsed(text)
        members, end = read_object(text, i)
        if not members:
            if not partial:  # ``{}``, or an object cut before its first key: not a message
                raise Invalid
            return Parsed("")
        m = members[0]
        if m.key == "response":
            if m.end is None:
                if text[m.start] == '"':
                    return Parsed(partial_string(text[m.start:]))
                return Parsed("")
            value = member_value(text, m)
            if end is None and not partial:
                raise Invalid
            return Parsed(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=2))
        if m.key == "tool_call":
            if text[m.start] != "{":
                raise Invalid
            call, cend = call_object(text, m.start)
            if not partial and (cend is None or end is None):
                raise Invalid
            return Parsed("", (call,) if call is not None else ())
        if m.key == "tool_calls":
            j = m.start
            if text[j] != "[":
                raise Invalid
            calls: list[ToolCall] = []
            j = skip_ws(text, j + 1)
            while j < len(text) and text[j] != "]":
                call, cend = call_object(text, j)
                if call is not None:
                    calls.append(call)
                if cend is None:
                    break
                j = skip_ws(text, cend)
                if j < len(text) and text[j] == ",":
                    j = skip_ws(text, j + 1)
            if not partial and end is None:
                raise Invalid
            return Parsed("", tuple(calls))
        raise Invalid

    def _schema(self, tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
        items = []
        for t in tools:
            s = call_schema(t, extra={"id": {"type": "string", "minLength": 4}} if parallel else None)
            items.append(s)
        one = items[0] if len(items) == 1 else {"anyOf": items}
        if parallel:
            return object_schema({"tool_calls": {"type": "array", "items": one, "minItems": 1}}, ["tool_calls"])
        return object_schema({"tool_call": one}, ["tool_call"])

    def grammar(self, tools: Sequence[Tool], parallel: bool = False) -> str:
        g = Rules()
        g.add("root", g.schema("call", self._schema(tools, parallel)))
        return g.text()

    def auto_grammar(self, tools: Sequence[Tool], parallel: bool, response: dict | None) -> str | None:
        answer = object_schema({"response": response if response is not None else {"type": "string"}}, ["response"])
        g = Rules()
        g.add("root", g.schema("msg", {"anyOf": [self._schema(tools, parallel), answer]}))
        return g.text()

    def example(self, parallel: bool = False) -> str:
        if parallel:
            return json.dumps({"tool_calls": [{"name": "tool_name", "arguments": {"arg1": "some_value"},
                                               "id": "call_1___"}]}, indent=2)
        return json.dumps({"tool_call": {"name": "tool_name", "arguments": {"arg1": "some_value"}}}, indent=2)

    @classmethod
    def detects(cls, template: str) -> bool:
        return True  # any other template
