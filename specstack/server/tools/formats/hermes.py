"""Hermes (Qwen 2.5/3, Hermes 2/3): ``<tool_call>\\n{...}\\n</tool_call>``, one block a call."""

from __future__ import annotations

from typing import Sequence

from ..base import ToolFormat, hold, register
from ..rules import Rules, call_schema, literal
from ..scan import Incomplete, Invalid, call_object, skip_ws
from ..types import Parsed, Tool, ToolCall


@register
class Hermes(ToolFormat):
    name = "hermes"
    detect_order = 40
    markers = ("<tool_call>", "</tool_call>")
    triggers = ("<tool_call>",)  # every call's grammar starts with it
    _open = "<tool_call>"
    _close = "</tool_call>"

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        start = text.find(self._open)
        if start < 0:
            return Parsed(hold(text, partial, self.markers))
        content = text[:start]
        calls: list[ToolCall] = []
        i = start
        while True:
            i = skip_ws(text, i)
            if not text.startswith(self._open, i):
                if partial and self._open.startswith(text[i:]):
                    break
                content += text[i:]
                break
            i = skip_ws(text, i + len(self._open))
            try:
                call, end = call_object(text, i)
            except Incomplete:
                break
            except Invalid:
                if partial:
                    raise
                return Parsed(text)
            if call is not None:
                calls.append(call)
            if end is None:
                if not partial:
                    return Parsed(text)
                break
            j = skip_ws(text, end)
            if text.startswith(self._close, j):
                i = j + len(self._close)
            elif partial and self._close.startswith(text[j:]):
                calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments, done=False)
                break
            else:
                if partial:
                    raise Invalid
                return Parsed(text)
        return Parsed(content.rstrip() if calls else content, tuple(calls))

    def _call_rule(self, g: Rules, tool: Tool, i: int) -> str:
        body = g.schema(f"t{i}", call_schema(tool))
        return f'"{literal(self._open)}\\n" {body} "\\n{literal(self._close)}"'

    def _root(self, g: Rules, parallel: bool) -> None:
        g.add("root", 'call ( "\\n" call )*' if parallel else "call")

    def example(self, parallel: bool = False) -> str:
        return '<tool_call>\n{"name": "tool_name", "arguments": {"arg1": "some_value"}}\n</tool_call>'

    @classmethod
    def detects(cls, template: str) -> bool:
        return "<tool_call>" in template
