"""Python call syntax read as tool calls (Gemma's ``tool_code``, vLLM's ``pythonic``, Llama's built-in
tools): keyword arguments whose values are literals, never evaluated."""

from __future__ import annotations

import ast
import json
from typing import Any

from .types import NAME, ToolCall

def python_kwargs(code: str) -> dict[str, Any] | None:
    try:
        node = ast.parse(code, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    out = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        value = _python_value(kw.value)
        if value is _BAD:
            return None
        out[kw.arg] = value
    return out


_BAD = object()
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _python_value(node: ast.AST) -> Any:
    if isinstance(node, ast.Name):
        return _NAMES.get(node.id, _BAD)
    if isinstance(node, ast.List):
        items = [_python_value(e) for e in node.elts]
        return _BAD if any(v is _BAD for v in items) else items
    if isinstance(node, ast.Dict):
        keys = [_python_value(k) if k is not None else _BAD for k in node.keys]
        vals = [_python_value(v) for v in node.values]
        if any(v is _BAD for v in keys + vals) or not all(isinstance(k, str) for k in keys):
            return _BAD
        return dict(zip(keys, vals))
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return _BAD


def python_calls(code: str) -> list[ToolCall]:
    try:
        node = ast.parse(code, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    nodes = node.elts if isinstance(node, ast.List) else [node]
    calls = []
    for n in nodes:
        if not isinstance(n, ast.Call):
            return []
        name = ast.unparse(n.func)
        args = python_kwargs(ast.unparse(n))
        if args is None or not NAME.fullmatch(name):
            return []
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls
