"""JSON read as it arrives: where a value ends, an object's members so far, a call object's name and
arguments (``Incomplete``: the text ends inside; ``Invalid``: it is not what a format writes there)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .types import ToolCall

_WS = " \t\n\r"


class Incomplete(Exception):
    """The text ends inside the value."""


class Invalid(Exception):
    """The text is not what the format writes here."""


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


def value_end(s: str, i: int) -> int:
    """Where the JSON value starting at ``s[i]`` ends (``Incomplete`` if the text ends first)."""
    if i >= len(s):
        raise Incomplete
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c in "{[":
        closers = []
        j = i
        while j < len(s):
            c = s[j]
            if c == '"':
                j = string_end(s, j)
                continue
            if c in "{[":
                closers.append("}" if c == "{" else "]")
            elif c in "}]":
                if not closers or closers.pop() != c:
                    raise Invalid
                if not closers:
                    return j + 1
            j += 1
        raise Incomplete
    for word in ("true", "false", "null"):
        if s.startswith(word, i):
            return i + len(word)
        if word.startswith(s[i:]):
            raise Incomplete
    m = _NUMBER.match(s, i)
    if not m:
        if s[i] == "-" and i + 1 == len(s):
            raise Incomplete
        raise Invalid
    if m.end() == len(s) or (s[m.end()] in ".eE-+" and m.end() + 1 == len(s)):
        raise Incomplete  # 12 may become 123
    return m.end()


def string_end(s: str, i: int) -> int:
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    raise Incomplete


def partial_string(raw: str) -> str:
    """The text of an unfinished JSON string (``raw`` starts at its quote): what is certain so far."""
    body = raw[1:]
    cut = len(body)
    k = body.rfind("\\")
    if k >= 0:
        tail = body[k:]
        if tail == "\\" or (tail.startswith("\\u") and len(tail) < 6):
            cut = k
        elif (n := len(tail) - len(tail.lstrip("\\"))) % 2 == 1 and len(tail) == n:
            cut = k
    try:
        text = json.loads('"' + body[:cut] + '"')
    except ValueError:
        return ""
    if text and "\ud800" <= text[-1] <= "\udbff":  # half of a surrogate pair: wait for the other half
        text = text[:-1]
    return text


@dataclass
class Member:
    key: str
    start: int  # the value's first character
    end: int | None  # None: the value is still being written


def read_object(s: str, i: int) -> tuple[list[Member], int | None]:
    """The members of the JSON object at ``s[i]`` (``{``) so far, and where it ends (None: not yet)."""
    if i >= len(s):
        raise Incomplete
    if s[i] != "{":
        raise Invalid
    members: list[Member] = []
    j = skip_ws(s, i + 1)
    if j < len(s) and s[j] == "}":
        return members, j + 1
    while True:
        if j >= len(s):
            return members, None
        if s[j] != '"':
            raise Invalid
        try:
            k = string_end(s, j)
        except Incomplete:
            return members, None
        key = json.loads(s[j:k])
        j = skip_ws(s, k)
        if j >= len(s):
            return members, None
        if s[j] != ":":
            raise Invalid
        j = skip_ws(s, j + 1)
        if j >= len(s):
            return members, None
        try:
            end = value_end(s, j)
        except Incomplete:
            members.append(Member(key, j, None))
            return members, None
        members.append(Member(key, j, end))
        j = skip_ws(s, end)
        if j >= len(s):
            return members, None
        if s[j] == "}":
            return members, j + 1
        if s[j] != ",":
            raise Invalid
        j = skip_ws(s, j + 1)


def member_value(s: str, m: Member) -> Any:
    try:
        return json.loads(s[m.start:m.end])
    except ValueError:
        raise Invalid from None


def call_arguments(s: str, m: Member | None, partial_ok: bool) -> tuple[str | None, bool]:
    """A call's arguments as JSON text (what the model wrote) and whether they are complete.

    An object is taken as written; a string holding JSON (some models write that) once it is whole."""
    if m is None:
        return None, False
    if m.end is None:
        if s[m.start] == "{" and partial_ok:
            return s[m.start:], False
        return None, False
    value = member_value(s, m)
    if isinstance(value, dict):
        return s[m.start:m.end], True
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            raise Invalid from None
        if isinstance(inner, dict):
            return value, True
    raise Invalid


def call_object(s: str, i: int, name_keys: tuple[str, ...] = ("name",),
                 arg_keys: tuple[str, ...] = ("arguments", "parameters"),
                 allowed: tuple[str, ...] = ("id", "type")) -> tuple[ToolCall | None, int | None]:
    """``{"name": ..., "arguments": {...}}`` at ``s[i]``: the call so far (None before its name is whole) and
    where the object ends (None: not yet)."""
    members, end = read_object(s, i)
    name = None
    args_member = None
    for n, m in enumerate(members):
        if m.key in name_keys:
            if m.end is not None:
                name = member_value(s, m)
                if not isinstance(name, str):
                    raise Invalid
        elif m.key in arg_keys:
            args_member = m
        elif m.key not in allowed:
            raise Invalid
    if end is not None and (name is None or args_member is None):
        raise Invalid
    if name is None:
        return None, end
    last = members[-1] if members else None
    arguments, complete = call_arguments(s, args_member, partial_ok=args_member is last)
    if end is not None and not complete:
        raise Invalid
    return ToolCall(name, arguments if arguments is not None else "", done=end is not None), end
