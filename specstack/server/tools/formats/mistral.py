"""Mistral (Nemo, Small 3.1): ``[TOOL_CALLS][{"name": "f", "arguments": {...}}]``; the v11 form is read too."""

from __future__ import annotations

import json
from typing import Any, Sequence

from ..base import ToolFormat, hold, register
from ..rules import Rules, call_schema
from ..scan import Incomplete, Invalid, call_object, skip_ws, value_end
from ..types import NAME, Parsed, Tool, ToolCall


@register
class Mistral(ToolFormat):
    name = "mistral"
    detect_order = 70
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    triggers = ("[TOOL_CALLS]",)  # every call's grammar starts with it
    id_prefix = ""
    id_length = 9  # Nemo's template refuses any other id

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return Parsed(hold(text, partial, self.markers))
        content = text[:start]
        i = skip_ws(text, start + len("[TOOL_CALLS]"))
        if i >= len(text):
            return Parsed(content)
        calls: list[ToolCall] = []
        if text[i] == "[":  # v3-v7: a JSON array of calls
            i = skip_ws(text, i + 1)
            while i < len(text):
                if text[i] == "]":
                    i += 1
                    break
                call, end = call_object(text, i)
                if call is not None:
                    calls.append(call)
                if end is None:
                    if not partial:
                        raise Invalid
                    break
                i = skip_ws(text, end)
                if i < len(text) and text[i] == ",":
                    i = skip_ws(text, i + 1)
            else:
                if not partial:
                    raise Invalid
            return Parsed(content.rstrip() if calls else content, tuple(calls))
        # v11: NAME[ARGS]{...}, repeated with [TOOL_CALLS] between calls
        while True:
            k = text.find("[ARGS]", i)
            if k < 0:
                if partial:
                    return Parsed(content, tuple(calls))
                raise Invalid
            name = text[i:k].split("[CALL_ID]")[0].strip()  # Small 3.2 writes NAME[CALL_ID]ID[ARGS]
            if not NAME.fullmatch(name):
                raise Invalid
            j = skip_ws(text, k + len("[ARGS]"))
            try:
                end = value_end(text, j)
            except Incomplete:
                if j < len(text) and text[j] == "{":
                    calls.append(ToolCall(name, text[j:], done=False))
                else:
                    calls.append(ToolCall(name, "", done=False))
                return Parsed(content, tuple(calls))
            if not isinstance(json.loads(text[j:end]), dict):
                raise Invalid
            calls.append(ToolCall(name, text[j:end]))
            i = skip_ws(text, end)
            if text.startswith("[TOOL_CALLS]", i):
                i = skip_ws(text, i + len("[TOOL_CALLS]"))
                continue
            if i < len(text) and not partial:
                raise Invalid
            return Parsed(content.rstrip(), tuple(calls))

    def grammar(self, tools: Sequence[Tool], parallel: bool = False) -> str:
        # with the 9-character id Nemo's template asks of each call (the response's ids are this server's own)
        calls = [call_schema(t, extra={"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}}) for t in tools]
        item = {"anyOf": calls} if len(calls) > 1 else calls[0]
        schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        g = Rules()
        g.add("root", f'"[TOOL_CALLS]" {g.schema("calls", schema)}')
        return g.text()

    def example(self, parallel: bool = False) -> str:
        return '[TOOL_CALLS][{"name": "tool_name", "arguments": {"arg1": "some_value"}}]'

    @classmethod
    def detects(cls, template: str) -> bool:
        return "[TOOL_CALLS]" in template
