"""The plan for one request: its ``tools`` and ``tool_choice`` checked (every key known and of its type),
the format its model writes calls in, and the grammar that forces a call."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from .base import ToolFormat
from .formats import detect_format, get_format
from .types import NAME, Parsed, Tool, ToolRequestError

CHOICES = ("none", "auto", "required")


def check_tools(tools: Any) -> list[Tool]:
    """The request's ``tools`` (OpenAI's ``{"type": "function", "function": {name, description, parameters}}``)."""
    if not isinstance(tools, list):
        raise ToolRequestError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        checked = _tool(tool, f"tools[{i}]")
        if any(t.name == checked.name for t in out):
            raise ToolRequestError(f"tools[{i}]: two tools are named {checked.name!r}", f"tools[{i}].function.name")
        out.append(checked)
    return out


TOOL_KEYS = ("type", "function")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def _tool(tool: Any, where: str) -> Tool:
    """One entry of ``tools``, every key known and of its type: a key the server does not know, or a value of the
    wrong type, would otherwise go to the template unread (OpenAI answers both with a 400)."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolRequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                               "\"parameters\": {...}}}} (only function tools exist here)", where)
    fn = tool["function"]
    for keys, value, at in ((TOOL_KEYS, tool, where), (FUNCTION_KEYS, fn, f"{where}.function")):
        extra = set(value) - set(keys)
        if extra:
            raise ToolRequestError(f"{at} has unknown field {sorted(extra)[0]!r}", where)
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolRequestError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.' "
                               f"(got {name!r})", f"{where}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ToolRequestError(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolRequestError(f"{where}.function.description must be a string", f"{where}.function.description")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):  # the grammar enforces the schema either way
        raise ToolRequestError(f"{where}.function.strict must be true or false (got {json.dumps(strict)})",
                               f"{where}.function.strict")
    return Tool(name, params, description)


def check_tool_choice(choice: Any, tools: Sequence[Tool]) -> str:
    """``none``, ``auto``, ``required`` or the name of the function the request forces."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolRequestError(f"tool_choice must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", "
                                   f"\"function\": {{\"name\": ...}}}} (got {choice!r})", "tool_choice")
        if choice == "required" and not tools:
            raise ToolRequestError("tool_choice 'required' needs tools", "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise ToolRequestError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                               "{\"name\": NAME}}", "tool_choice")
    if not any(t.name == name for t in tools):
        raise ToolRequestError(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
    return name



@dataclass(frozen=True)
class ToolPlan:
    """What a chat request does with tools: which, how the model must answer, how its output is read."""

    tools: tuple[Tool, ...]
    choice: str  # none, auto, required, or a function's name
    parallel: bool
    format: ToolFormat
    raw: tuple[dict[str, Any], ...] = ()  # the tools as the request sent them (for the template)

    @property
    def active(self) -> bool:
        """Tools are rendered and the output parsed."""
        return bool(self.tools) and self.choice != "none"

    @property
    def triggers(self) -> tuple[str, ...]:
        """Under ``auto``, the words after which ``grammar`` applies (a lazy grammar: free text before them);
        () where the grammar applies from the first token, or there is none."""
        return self.format.triggers if self.active and self.choice == "auto" else ()

    def grammar(self, response: dict | None = None) -> str | None:
        """The grammar the output follows (None: free output): a forced call for required or a named function;
        under ``auto`` the format's (a call or a response from the start, or a call after ``triggers``)."""
        if not self.active:
            return None
        if self.choice == "auto":
            return self.format.auto_grammar(self.tools, self.parallel, response)
        tools = self.tools if self.choice == "required" else tuple(t for t in self.tools if t.name == self.choice)
        return self.format.grammar(tools, self.parallel)

    def parse(self, text: str, partial: bool = False) -> Parsed:
        return self.format.parse(text, partial, self.tools)


def plan(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, template_text: str | None,
         format_name: str | None = None) -> ToolPlan:
    """A request's tool plan; ``format_name`` overrides the format read from the template."""
    checked = check_tools(tools) if tools is not None else []
    choice = check_tool_choice(tool_choice, checked)
    fmt = get_format(format_name) if format_name else get_format(detect_format(template_text))
    # llama-server's default: one call a turn unless the request asks for more
    return ToolPlan(tuple(checked), choice, bool(parallel_tool_calls), fmt, tuple(tools or ()))


# -- streaming ---------------------------------------------------------------------------------------------
