"""Mistral's v11 tokenizers (Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]NAME[ARGS]{...}``."""

from __future__ import annotations

from typing import Sequence

from ..base import ToolFormat, register
from ..rules import Rules
from ..types import Tool
from .mistral import Mistral


@register
class MistralV11(Mistral):
    """Mistral's v11 tokenizers (Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]NAME[ARGS]{...}`` a call."""

    name = "mistral_v11"
    detect_order = 60

    def _call_rule(self, g: Rules, tool: Tool, i: int) -> str:
        # Small 3.2's template writes a [CALL_ID] before [ARGS]: the model may too
        return f'"[TOOL_CALLS]{tool.name}" ( "[CALL_ID]" [a-zA-Z0-9]{{9}} )? "[ARGS]" {g.schema(f"t{i}", tool.parameters)}'

    def grammar(self, tools: Sequence[Tool], parallel: bool = False) -> str:
        return ToolFormat.grammar(self, tools, parallel)

    def example(self, parallel: bool = False) -> str:
        return '[TOOL_CALLS]tool_name[ARGS]{"arg1": "some_value"}'

    @classmethod
    def detects(cls, template: str) -> bool:
        return "[TOOL_CALLS]" in template and "[ARGS]" in template
