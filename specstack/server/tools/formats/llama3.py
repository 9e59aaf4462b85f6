"""Llama 3.1-3.3: ``{"name": "f", "parameters": {...}}`` as the answer, after an optional ``<|python_tag|>``."""

from __future__ import annotations

import json
import re
from typing import Sequence

from ..base import ToolFormat, register
from ..pycalls import python_kwargs
from ..rules import Rules, call_schema
from ..scan import Incomplete, Invalid, call_object, skip_ws
from ..types import Parsed, Tool, ToolCall


@register
class Llama3(ToolFormat):
    name = "llama3"
    detect_order = 50
    markers = ("<|python_tag|>",)
    _start = re.compile(r'\s*(?:<\|python_tag\|>\s*)?(?=\{)')

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        m = self._start.match(text)
        if not m:
            stripped = text.lstrip()
            if partial and ("<|python_tag|>".startswith(stripped) or stripped.startswith("<|python_tag|>")):
                return Parsed("")
            builtin = self._builtin(text)
            if builtin is not None:
                return builtin
            return Parsed(text)
        calls: list[ToolCall] = []
        i = m.end()
        while True:
            try:
                call, end = call_object(text, i, arg_keys=("parameters", "arguments"))
            except Incomplete:
                return Parsed("", tuple(calls))
            except Invalid:
                if calls and not partial:
                    return Parsed(text)
                raise
            if call is not None:
                calls.append(call)
            if end is None:
                if not partial:
                    raise Invalid
                return Parsed("", tuple(calls))
            j = skip_ws(text, end)
            if j < len(text) and text[j] == ";":
                i = skip_ws(text, j + 1)
                if i >= len(text):
                    if partial:
                        return Parsed("", tuple(calls))
                    return Parsed("", tuple(calls))
                continue
            if j >= len(text):
                return Parsed("", tuple(calls))
            if partial:
                raise Invalid
            return Parsed(text)  # a call followed by prose: llama.cpp reads only a call that is the answer

    @staticmethod
    def _builtin(text: str) -> Parsed | None:
        """``<|python_tag|>brave_search.call(query="...")``: Llama's built-in tools, arguments as keywords."""
        m = re.match(r"\s*<\|python_tag\|>\s*(\w+)\.call\((.*)\)\s*$", text, re.S)
        if not m:
            return None
        args = python_kwargs(f"f({m.group(2)})")
        return None if args is None else Parsed("", (ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)),))

    def _call_rule(self, g: Rules, tool: Tool, i: int) -> str:
        return g.schema(f"t{i}", call_schema(tool, "parameters"))

    def _root(self, g: Rules, parallel: bool) -> None:
        g.add("root", 'call ( "; " call )*' if parallel else "call")

    def example(self, parallel: bool = False) -> str:
        return '{"name": "tool_name", "parameters": {"arg1": "some_value"}}'

    @classmethod
    def detects(cls, template: str) -> bool:
        return "<|start_header_id|>ipython<|end_header_id|>" in template
