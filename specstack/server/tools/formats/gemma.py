"""Gemma's convention: a ``tool_code`` fence of Python calls, or a bare list of them (vLLM ``pythonic``)."""

from __future__ import annotations

import re
from typing import Sequence

from ..base import ToolFormat, hold, register
from ..pycalls import python_calls
from ..rules import Rules
from ..scan import Invalid
from ..types import Parsed, Tool, ToolCall


@register
class Pythonic(ToolFormat):
    """Gemma's convention (```` ```tool_code ```` fences of Python calls) and vLLM's ``pythonic`` list."""

    name = "gemma"
    detect_order = 80
    markers = ("```tool_code",)
    triggers = ("```tool_code",)  # every call's grammar starts with it
    _fence = re.compile(r"```tool_code[ \t]*\n(.*?)\n?```", re.S)

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        stripped = text.strip()
        if stripped.startswith("[") and "```tool_code" not in text:
            if partial:
                return Parsed("")
            calls = python_calls(stripped)
            return Parsed("", tuple(calls)) if calls else Parsed(text)
        start = text.find("```tool_code")
        if start < 0:
            return Parsed(hold(text, partial, self.markers))
        calls: list[ToolCall] = []
        content, pos = "", 0
        for m in self._fence.finditer(text):
            found = python_calls(m.group(1).strip())
            if not found:
                raise Invalid
            content += text[pos:m.start()]
            calls += found
            pos = m.end()
        rest = text[pos:]
        if partial and "```tool_code" in rest:
            rest = rest[:rest.find("```tool_code")]
        content += rest
        return Parsed(content.rstrip() if calls else content, tuple(calls))

    def _call_rule(self, g: Rules, tool: Tool, i: int) -> str:
        props = tool.parameters.get("properties") or {}
        required = [k for k in (tool.parameters.get("required") or []) if k in props]
        args = []
        for n, key in enumerate(required):
            value = g.schema(f"t{i}-v{n}", props[key] if isinstance(props[key], dict) else {})
            args.append(f'"{key}=" {value}')
        if not args:
            return f'"```tool_code\\n{tool.name}()\\n```"'
        inner = ' ", " '.join(args)
        return f'"```tool_code\\n{tool.name}(" {inner} ")\\n```"'

    def example(self, parallel: bool = False) -> str:
        return '```tool_code\ntool_name(arg1="some_value")\n```'

    @classmethod
    def detects(cls, template: str) -> bool:
        return "```tool_code" in template
