"""GBNF put together from fixed text and JSON schemas: the grammars that force a tool call."""

from __future__ import annotations

from typing import Any, Sequence

from ...errors import InvalidParameterError
from .types import Tool

def literal(text: str) -> str:
    """``text`` for inside a GBNF string literal."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


class Rules:
    """A GBNF grammar put together from fixed text and JSON schemas (llama.cpp's converter, each schema's rules
    under its own prefix)."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}

    def add(self, name: str, body: str) -> str:
        self.rules[name] = body
        return name

    def schema(self, prefix: str, schema: dict[str, Any]) -> str:
        from ...json_schema import embedded
        from ...llama.schema_gbnf import schema_to_gbnf

        for name, body in _rules(schema_to_gbnf(embedded(schema))).items():  # a tool's own $defs, where it stands
            self.rules[f"{prefix}-{name}"] = _renamed(body, prefix)
        return f"{prefix}-root"

    def text(self) -> str:
        return "\n".join(f"{name} ::= {body}" for name, body in self.rules.items()) + "\n"


def _rules(gbnf: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in gbnf.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, body = line.partition(" ::= ")
        if not sep:
            raise InvalidParameterError(f"unexpected grammar line from the JSON schema converter: {line!r}")
        out[name.strip()] = body
    return out


def _renamed(body: str, prefix: str) -> str:
    """A rule body with each rule it names prefixed (literals, character classes and repetitions left alone)."""
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < len(body) and body[j] != close:
                j += 2 if body[j] == "\\" else 1
            out.append(body[i:j + 1])
            i = j + 1
        elif c == "{":
            j = body.index("}", i)
            out.append(body[i:j + 1])
            i = j + 1
        elif c.isalnum() or c in "-_":
            j = i
            while j < len(body) and (body[j].isalnum() or body[j] in "-_"):
                j += 1
            out.append(f"{prefix}-{body[i:j]}")
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def object_schema(props: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required)}


def call_schema(tool: Tool, args_key: str = "arguments", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    props = {"name": {"const": tool.name}, args_key: tool.parameters, **(extra or {})}
    return object_schema(props, list(props))
