"""GLM 4.5/4.6: ``<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...</tool_call>``."""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Sequence

from ..base import ToolFormat, hold, register
from ..rules import Rules, literal
from ..scan import Invalid, skip_ws
from ..types import NAME, Parsed, Tool, ToolCall


@register
class Glm45(ToolFormat):
    name = "glm45"
    detect_order = 30
    markers = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    triggers = ("<tool_call>",)  # every call's grammar starts with it
    _call = re.compile(r"<tool_call>\s*([^\n<]+?)\s*(?:\n|(?=<arg_key>)|(?=</tool_call>))(.*?)</tool_call>", re.S)
    _arg = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        start = text.find("<tool_call>")
        if start < 0:
            return Parsed(hold(text, partial, self.markers))
        content = text[:start]
        calls: list[ToolCall] = []
        i = start
        by_name = {t.name: t for t in tools}
        while True:
            i = skip_ws(text, i)
            m = self._call.match(text, i)
            if m is None:
                rest = text[i:]
                if not rest:
                    break
                if partial and (rest.startswith("<tool_call>") or "<tool_call>".startswith(rest)):
                    head = re.match(r"<tool_call>\s*([^\n<]+?)\s*(?:\n|<)", rest)
                    if head and NAME.fullmatch(head.group(1)):
                        calls.append(ToolCall(head.group(1), "", done=False))
                    break
                if calls:
                    content += rest
                    break
                if partial:
                    raise Invalid
                return Parsed(text)
            name = m.group(1).strip()
            if not NAME.fullmatch(name):
                raise Invalid
            args = {k.strip(): self._value(v, by_name.get(name), k.strip()) for k, v in self._arg.findall(m.group(2))}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
            i = m.end()
        return Parsed(content.rstrip() if calls else content, tuple(calls))

    @staticmethod
    def _value(raw: str, tool: Tool | None, key: str) -> Any:
        schema = (tool.parameters.get("properties") or {}).get(key, {}) if tool else {}
        if isinstance(schema, dict) and schema.get("type") == "string":
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            try:
                return ast.literal_eval(raw)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return raw

    def _call_rule(self, g: Rules, tool: Tool, i: int) -> str:
        props = tool.parameters.get("properties") or {}
        required = set(tool.parameters.get("required") or [])
        parts = []
        for n, (key, schema) in enumerate(props.items()):
            if isinstance(schema, dict) and schema.get("type") == "string" and not ({"enum", "const", "pattern"} & set(schema)):
                value = g.add(f"t{i}-v{n}", "[^<]*")
            else:
                value = g.schema(f"t{i}-v{n}", schema if isinstance(schema, dict) else {})
            pair = f'"<arg_key>{literal(key)}</arg_key>\\n<arg_value>" {value} "</arg_value>\\n"'
            parts.append(pair if key in required else f"( {pair} )?")
        return f'"<tool_call>{tool.name}\\n" {" ".join(parts)} "</tool_call>"'

    def example(self, parallel: bool = False) -> str:
        return "<tool_call>tool_name\n<arg_key>arg1</arg_key>\n<arg_value>some_value</arg_value>\n</tool_call>"

    @classmethod
    def detects(cls, template: str) -> bool:
        return "<tool_call>" in template and "<arg_key>" in template
