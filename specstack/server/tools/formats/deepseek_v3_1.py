"""DeepSeek V3.1: ``NAME<｜tool▁sep｜>{...}`` (DeepSeek's parser; its grammar writes V3.1's form)."""

from __future__ import annotations

from ..base import register
from ..rules import Rules
from ..types import Tool
from .deepseek import DS_BEGIN, DS_CALL, DS_CALL_END, DS_END, DS_SEP, DeepSeek


@register
class DeepSeekV31(DeepSeek):
    name = "deepseek_v3_1"
    detect_order = 10

    def _call_rule(self, g: Rules, tool: Tool, i: int) -> str:
        return f'"{DS_CALL}{tool.name}{DS_SEP}" {g.schema(f"t{i}", tool.parameters)} "{DS_CALL_END}"'

    def example(self, parallel: bool = False) -> str:
        return f'{DS_BEGIN[0]}{DS_CALL}tool_name{DS_SEP}{{"arg1": "some_value"}}{DS_CALL_END}{DS_END}'

    @classmethod
    def detects(cls, template: str) -> bool:
        return "message['prefix'] is defined and message['prefix'] and thinking" in template
