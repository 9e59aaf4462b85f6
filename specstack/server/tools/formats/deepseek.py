"""DeepSeek V3/R1: ``<｜tool▁calls▁begin｜>`` calls with a json fence (V3.1's form is read too)."""

from __future__ import annotations

import json
from typing import Sequence

from ..base import ToolFormat, hold, register
from ..rules import Rules
from ..scan import Incomplete, Invalid, skip_ws, value_end
from ..types import NAME, Parsed, Tool, ToolCall


DS_BEGIN = ("<｜tool▁calls▁begin｜>", "<｜tool_calls_begin｜>", "<｜tool calls begin｜>", "<｜tool\\_calls\\_begin｜>",
             "<｜tool▁calls｜>")
DS_CALL, DS_SEP, DS_CALL_END, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"



@register
class DeepSeek(ToolFormat):
    """DeepSeek V3/R1 (``function<｜tool▁sep｜>NAME`` and a json fence) and V3.1 (``NAME<｜tool▁sep｜>{...}``)."""

    name = "deepseek"
    detect_order = 20
    markers = DS_BEGIN + (DS_CALL, DS_SEP, DS_CALL_END, DS_END)
    triggers = DS_BEGIN[:1]  # every call's grammar starts with it

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        hits = [(text.find(b), b) for b in DS_BEGIN if text.find(b) >= 0]
        if not hits:
            return Parsed(hold(text, partial, self.markers))
        start, begin = min(hits)
        content = text[:start]
        i = start + len(begin)
        calls: list[ToolCall] = []
        while True:
            i = skip_ws(text, i)
            if text.startswith(DS_END, i):
                i += len(DS_END)
                break
            if i >= len(text) or (partial and any(m.startswith(text[i:]) for m in (DS_CALL, DS_END))):
                if not partial:
                    break  # no end marker: as llama.cpp, the calls stand
                return Parsed(content, tuple(calls))
            if text.startswith(DS_CALL, i):
                i += len(DS_CALL)
            k = text.find(DS_SEP, i)
            if k < 0:
                if partial:
                    return Parsed(content, tuple(calls))
                raise Invalid
            kind = text[i:k]
            fenced = kind.strip() == "function"
            j = k + len(DS_SEP)
            if fenced:
                nl = text.find("\n", j)
                if nl < 0:
                    if partial:
                        return Parsed(content, tuple(calls))
                    raise Invalid
                name = text[j:nl].strip()
                j = nl + 1
                fence = "```json\n"
                if not text.startswith(fence, j):
                    if partial and fence.startswith(text[j:]):
                        calls.append(ToolCall(name, "", done=False))
                        return Parsed(content, tuple(calls))
                    raise Invalid
                j += len(fence)
            else:
                name = kind.strip()
            if not NAME.fullmatch(name):
                raise Invalid
            j = skip_ws(text, j)
            try:
                end = value_end(text, j)
            except Incomplete:
                args = text[j:] if j < len(text) and text[j] == "{" else ""
                calls.append(ToolCall(name, args, done=False))
                return Parsed(content, tuple(calls))
            if not isinstance(json.loads(text[j:end]), dict):
                raise Invalid
            calls.append(ToolCall(name, text[j:end]))
            i = skip_ws(text, end)
            if fenced:
                if text.startswith("```", i):
                    i = skip_ws(text, i + 3)
                elif partial and "```".startswith(text[i:]):
                    return Parsed(content, tuple(calls))
                else:
                    raise Invalid
            if text.startswith(DS_CALL_END, i):
                i += len(DS_CALL_END)
            elif partial and DS_CALL_END.startswith(text[i:]):
                return Parsed(content, tuple(calls))
            else:
                raise Invalid
        return Parsed((content + text[i:]).rstrip(), tuple(calls))

    def _call_rule(self, g: Rules, tool: Tool, i: int) -> str:
        args = g.schema(f"t{i}", tool.parameters)
        return f'"{DS_CALL}function{DS_SEP}{tool.name}\\n```json\\n" {args} "\\n```{DS_CALL_END}"'

    def _root(self, g: Rules, parallel: bool) -> None:
        g.add("root", f'"{DS_BEGIN[0]}" call {"( call )* " if parallel else ""}"{DS_END}"')

    def example(self, parallel: bool = False) -> str:
        return (f'{DS_BEGIN[0]}{DS_CALL}function{DS_SEP}tool_name\n```json\n{{"arg1": "some_value"}}\n```'
                f'{DS_CALL_END}{DS_END}')

    @classmethod
    def detects(cls, template: str) -> bool:
        return "<｜tool▁calls▁begin｜>" in template
