"""Structured output: what a request asks its output to look like, as the one GBNF grammar the engine enforces.

OpenAI's ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"schema":
...}}``), llama-server's ``json_schema`` and ``grammar`` (GBNF) fields, and a chat request's tools
(``tool_choice: required`` or a named function: a grammar forcing the call; ``auto`` with the generic
format: a call or a response, as llama.cpp) become ``Constraints.grammar``, which the grammar engine
(llguidance, ``llama.guidance``) applies at every draft position (``specstack.constraints``).  JSON schemas go through llama.cpp's
converter (``llama.schema_gbnf.schema_to_gbnf``).  As llama-server: ``json_object`` without a schema is any JSON
object; a grammar and a schema together, or a grammar with tools, are refused.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import InvalidParameterError
from ..gbnf import check_gbnf
from .tools import ToolPlan

RESPONSE_TYPES = ("text", "json_object", "json_schema")


class StructuredError(InvalidParameterError):
    """A request's structured-output fields that cannot be honoured; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def response_schema(response_format: dict[str, Any] | None, json_schema: dict[str, Any] | None = None) -> dict | None:
    """The JSON schema the answer must follow (``{}``: any JSON object), or None for free text."""
    schema = None
    if response_format is not None:
        kind = response_format.get("type")
        if kind not in RESPONSE_TYPES:
            raise StructuredError(f"response_format.type must be one of {', '.join(RESPONSE_TYPES)} "
                                  f"(got {json.dumps(kind)})", "response_format.type")
        if kind == "json_object":
            extra = set(response_format) - {"type", "schema"}
            if extra:
                raise StructuredError(f"response_format has unknown field {sorted(extra)[0]!r}", "response_format")
            schema = response_format.get("schema", {"type": "object"})
            if schema == {}:
                schema = {"type": "object"}
        elif kind == "json_schema":
            wrapper = response_format.get("json_schema")
            if not isinstance(wrapper, dict):
                raise StructuredError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                                      "response_format.json_schema")
            extra = set(wrapper) - {"name", "description", "schema", "strict"}
            if extra:
                raise StructuredError(f"response_format.json_schema has unknown field {sorted(extra)[0]!r}",
                                      "response_format.json_schema")
            _check_wrapper(wrapper)
            schema = wrapper.get("schema", {})
        if kind != "text" and not isinstance(schema, (dict, bool)):
            raise StructuredError("the response_format's schema must be a JSON schema object", "response_format")
    if json_schema is not None:
        if schema is not None and json_schema != schema:
            raise StructuredError("response_format and json_schema give two schemas; send one of them", "json_schema")
        schema = json_schema
    return schema


SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's json_schema.name


def _check_wrapper(wrapper: dict[str, Any]) -> None:
    """``response_format.json_schema``'s ``name`` and ``strict`` of OpenAI's types: a value it refuses would
    otherwise pass unread (the name is optional, as llama-server takes it; the grammar is strict either way)."""
    name = wrapper.get("name")
    if name is not None and not (isinstance(name, str) and SCHEMA_NAME.fullmatch(name)):
        raise StructuredError("response_format.json_schema.name must be 1-64 letters, digits, '_' or '-' "
                              f"(got {json.dumps(name)})", "response_format.json_schema.name")
    strict = wrapper.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredError(f"response_format.json_schema.strict must be true or false (got {json.dumps(strict)})",
                              "response_format.json_schema.strict")


def request_grammar(*, response_format: dict[str, Any] | None = None, json_schema: dict[str, Any] | None = None,
                    grammar: str | None = None, tools: ToolPlan | None = None) -> str | None:
    """The GBNF grammar a request's output must follow, or None when it is free.

    ``tools`` is the chat request's tool plan (``tools.plan``); a forced call's grammar comes from its
    format, and a schema with tools is the generic format's ``response`` (llama.cpp's rule)."""
    from ..llama.schema_gbnf import schema_to_gbnf

    schema = response_schema(response_format, json_schema)
    grammar = grammar or None
    if grammar is not None and schema is not None:
        raise StructuredError("grammar and a JSON schema (response_format or json_schema) cannot be combined; "
                              "send one of them", "grammar")
    if tools is not None and tools.active:
        if grammar is not None:
            raise StructuredError("grammar cannot be combined with tools (their calls have a grammar of their own); "
                                  "leave out grammar or set tool_choice to none", "grammar")
        if tools.choice == "auto" and schema is not None and tools.format.name != "generic":
            raise StructuredError("a JSON schema with tool_choice auto needs the generic tool-call format (llama.cpp "
                                  f"uses it there); this model's format is {tools.format.name!r}", "response_format")
        try:
            return tools.grammar(response=None if schema is None else _object(schema))
        except InvalidParameterError as exc:
            raise StructuredError(f"a tool's parameters cannot be enforced: {exc}", "tools") from None
    if grammar is not None:
        try:
            check_gbnf(grammar)  # untrusted: the limits llama.cpp's parser needs, before it sees the text
        except InvalidParameterError as exc:
            raise StructuredError(f"grammar: {exc}", "grammar") from None
        return grammar
    if schema is None:
        return None
    try:
        return schema_to_gbnf(schema)
    except InvalidParameterError as exc:
        raise StructuredError(str(exc), "json_schema" if json_schema is not None else "response_format") from None


def grammar_field(body: Any) -> str:
    """The request field a body's grammar came from, for a refusal found while building it."""
    for name in ("grammar", "json_schema", "response_format"):
        if getattr(body, name, None):
            return name
    return "tools" if getattr(body, "tools", None) else "grammar"


def _object(schema: dict | bool) -> dict:
    return {} if schema is True else schema  # type: ignore[return-value]
