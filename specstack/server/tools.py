"""Tool calls: the request's tools checked, the model's output parsed back into OpenAI ``tool_calls``, and the
grammars that force a call (``tool_choice: required`` or a named function).

Each model family writes its calls its own way, and the format is read from its chat template as llama.cpp's
``common/chat.cpp`` does (first match wins; ``detect_format``), or named (``get_format``: a role or flag can
set it):

==================  ==========================================================================================
``hermes``          Qwen 2.5/3, Hermes 2/3: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one
                    block a call (vLLM ``hermes``, llama.cpp ``hermes_2_pro``)
``llama3``          Llama 3.1-3.3: ``{"name": "f", "parameters": {...}}`` at the start of the answer, after an
                    optional ``<|python_tag|>``; several joined by ``;`` (vLLM ``llama3_json``)
``mistral``         Mistral: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}]`` (Nemo, Small 3.1); the parser
                    reads the v11 form too
``mistral_v11``     Mistral's v11 tokenizers: ``[TOOL_CALLS]f[ARGS]{...}`` (Small 3.2 with ``[CALL_ID]``,
                    Magistral, Devstral)
``deepseek``        DeepSeek V3/R1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f`` then the
                    arguments in a json fence; V3.1's ``<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}`` is read too
``deepseek_v3_1``   DeepSeek V3.1 (the same parser; its grammar writes V3.1's form)
``glm45``           GLM 4.5/4.6: ``<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...</tool_call>``
                    (values are raw text for string parameters, JSON otherwise; vLLM ``glm4_moe``)
``gemma``           Gemma's prompt convention: a ``tool_code`` fence holding Python calls, ``f(a=1)``, or a
                    bare list ``[f(a=1), g(b="x")]`` (vLLM ``pythonic``)
``generic``         any other template (Gemma 3, whose GGUF has none): JSON, ``{"tool_call": {"name": "f",
                    "arguments": {...}}}``, ``{"tool_calls": [...]}`` or ``{"response": "..."}`` (llama.cpp's
                    Generic); the grammar enforces it for ``auto`` too, as llama.cpp does
==================  ==========================================================================================

Parsing is a pure function of the whole text so far (``ToolFormat.parse``); streaming re-parses the
accumulated text after each piece and sends the difference (``ToolStream``), as llama.cpp does: content only
grows, a call is sent with its id and name once its name is complete, and its arguments grow as the model
writes them (the arguments' JSON text as the model wrote it, so each delta extends the last; formats whose
arguments are not JSON text send them whole when the call is complete).  Text that may still become a call
marker (``<tool_`` at the end) is held back until it is known.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..errors import InvalidParameterError

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names (dots too, as llama.cpp accepts)
CHOICES = ("none", "auto", "required")


class ToolRequestError(InvalidParameterError):
    """A request's tools or tool_choice that cannot be honoured; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# -- the request ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    description: str | None = None


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
class ToolCall:
    """One call the model made: ``arguments`` is the JSON text of an object (OpenAI's shape)."""

    name: str
    arguments: str
    done: bool = True  # False: a streamed parse caught it midway (arguments may still grow)


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: tuple[ToolCall, ...] = ()


# -- JSON, read as it arrives -------------------------------------------------------------------------------

_WS = " \t\n\r"


class _Incomplete(Exception):
    """The text ends inside the value."""


class _Invalid(Exception):
    """The text is not what the format writes here."""


def _ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


def _value_end(s: str, i: int) -> int:
    """Where the JSON value starting at ``s[i]`` ends (``_Incomplete`` if the text ends first)."""
    if i >= len(s):
        raise _Incomplete
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        closers = []
        j = i
        while j < len(s):
            c = s[j]
            if c == '"':
                j = _string_end(s, j)
                continue
            if c in "{[":
                closers.append("}" if c == "{" else "]")
            elif c in "}]":
                if not closers or closers.pop() != c:
                    raise _Invalid
                if not closers:
                    return j + 1
            j += 1
        raise _Incomplete
    for word in ("true", "false", "null"):
        if s.startswith(word, i):
            return i + len(word)
        if word.startswith(s[i:]):
            raise _Incomplete
    m = _NUMBER.match(s, i)
    if not m:
        if s[i] == "-" and i + 1 == len(s):
            raise _Incomplete
        raise _Invalid
    if m.end() == len(s) or (s[m.end()] in ".eE-+" and m.end() + 1 == len(s)):
        raise _Incomplete  # 12 may become 123
    return m.end()


def _string_end(s: str, i: int) -> int:
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    raise _Incomplete


def _partial_string(raw: str) -> str:
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
class _Member:
    key: str
    start: int  # the value's first character
    end: int | None  # None: the value is still being written


def _object(s: str, i: int) -> tuple[list[_Member], int | None]:
    """The members of the JSON object at ``s[i]`` (``{``) so far, and where it ends (None: not yet)."""
    if i >= len(s):
        raise _Incomplete
    if s[i] != "{":
        raise _Invalid
    members: list[_Member] = []
    j = _ws(s, i + 1)
    if j < len(s) and s[j] == "}":
        return members, j + 1
    while True:
        if j >= len(s):
            return members, None
        if s[j] != '"':
            raise _Invalid
        try:
            k = _string_end(s, j)
        except _Incomplete:
            return members, None
        key = json.loads(s[j:k])
        j = _ws(s, k)
        if j >= len(s):
            return members, None
        if s[j] != ":":
            raise _Invalid
        j = _ws(s, j + 1)
        if j >= len(s):
            return members, None
        try:
            end = _value_end(s, j)
        except _Incomplete:
            members.append(_Member(key, j, None))
            return members, None
        members.append(_Member(key, j, end))
        j = _ws(s, end)
        if j >= len(s):
            return members, None
        if s[j] == "}":
            return members, j + 1
        if s[j] != ",":
            raise _Invalid
        j = _ws(s, j + 1)


def _json(s: str, m: _Member) -> Any:
    try:
        return json.loads(s[m.start:m.end])
    except ValueError:
        raise _Invalid from None


def _arguments(s: str, m: _Member | None, partial_ok: bool) -> tuple[str | None, bool]:
    """A call's arguments as JSON text (what the model wrote) and whether they are complete.

    An object is taken as written; a string holding JSON (some models write that) once it is whole."""
    if m is None:
        return None, False
    if m.end is None:
        if s[m.start] == "{" and partial_ok:
            return s[m.start:], False
        return None, False
    value = _json(s, m)
    if isinstance(value, dict):
        return s[m.start:m.end], True
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            raise _Invalid from None
        if isinstance(inner, dict):
            return value, True
    raise _Invalid


def _call_object(s: str, i: int, name_keys: tuple[str, ...] = ("name",),
                 arg_keys: tuple[str, ...] = ("arguments", "parameters"),
                 allowed: tuple[str, ...] = ("id", "type")) -> tuple[ToolCall | None, int | None]:
    """``{"name": ..., "arguments": {...}}`` at ``s[i]``: the call so far (None before its name is whole) and
    where the object ends (None: not yet)."""
    members, end = _object(s, i)
    name = None
    args_member = None
    for n, m in enumerate(members):
        if m.key in name_keys:
            if m.end is not None:
                name = _json(s, m)
                if not isinstance(name, str):
                    raise _Invalid
        elif m.key in arg_keys:
            args_member = m
        elif m.key not in allowed:
            raise _Invalid
    if end is not None and (name is None or args_member is None):
        raise _Invalid
    if name is None:
        return None, end
    last = members[-1] if members else None
    arguments, complete = _arguments(s, args_member, partial_ok=args_member is last)
    if end is not None and not complete:
        raise _Invalid
    return ToolCall(name, arguments if arguments is not None else "", done=end is not None), end


def _hold(content: str, partial: bool, markers: Sequence[str]) -> str:
    """``content`` less a tail that may still grow into one of ``markers`` (while the text is partial)."""
    if not partial or not content:
        return content
    for n in range(min(len(content), max(map(len, markers))), 0, -1):
        tail = content[-n:]
        if any(m.startswith(tail) for m in markers):
            return content[:-n]
    return content


# -- formats ---------------------------------------------------------------------------------------------


class ToolFormat:
    """How one model family writes tool calls: parsing, and the grammar that forces a call."""

    name = ""
    markers: tuple[str, ...] = ()  # texts that may be control tokens: the output keeps them for the parser
    system_note = ""  # added to the system message when tools are on (the generic format's instruction)
    id_alphabet = string.ascii_letters + string.digits
    id_length = 24
    id_prefix = "call_"

    def parse(self, text: str, partial: bool = False, tools: Sequence[Tool] = ()) -> Parsed:
        """The message in ``text``: its content and calls.  Final (``partial`` False) text that is not a
        well-formed call is content, as llama.cpp falls back to; so is a call cut short (``max_tokens``): the
        text as generated, as vLLM answers, never an unfinished call nor a message with the call's text left
        out (Gemma's ``{"tool_call": {`` cut at 5 tokens came back as empty content)."""
        try:
            parsed = self._parse(text, partial, tools)
        except (_Invalid, _Incomplete):
            if partial:
                return Parsed(_hold(text, True, self.markers) if self.markers else "")
        else:
            if partial or not self._cut(parsed, text):
                return parsed
        try:  # cut short (max_tokens): what the partial reading has, if it is text only (a response, no call)
            cut = self._parse(text, True, tools)
        except (_Invalid, _Incomplete):
            return Parsed(text)
        return cut if cut.content and not cut.calls and not self._cut(cut, text) else Parsed(text)

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        raise NotImplementedError

    def _cut(self, parsed: Parsed, text: str) -> bool:
        """Whether a final reading of ``text`` shows a call cut short: a call not finished, or no call at all
        though a marker that opens one is in the text and the content leaves it out."""
        if parsed.calls:
            return not all(call.done for call in parsed.calls)
        return parsed.content != text and any(marker in text for marker in self.markers)

    def new_id(self) -> str:
        return self.id_prefix + "".join(secrets.choice(self.id_alphabet) for _ in range(self.id_length))

    def grammar(self, tools: Sequence[Tool], parallel: bool = False) -> str:
        """GBNF that admits exactly a call (several with ``parallel``) of one of ``tools``, in this format."""
        g = _Rules()
        calls = [self._call_rule(g, t, i) for i, t in enumerate(tools)]
        g.add("call", " | ".join(calls))
        self._root(g, parallel)
        return g.text()

    def auto_grammar(self, tools: Sequence[Tool], parallel: bool, response: dict | None) -> str | None:
        """The grammar for ``tool_choice: auto`` (None: the output is free and parsed)."""
        return None

    def example(self, parallel: bool = False) -> str:
        """A call in this format, for the tools' system message of a template that does not describe tools."""
        return ""

    def _call_rule(self, g: "_Rules", tool: Tool, i: int) -> str:
        raise NotImplementedError

    def _root(self, g: "_Rules", parallel: bool) -> None:
        g.add("root", "call ( call )*" if parallel else "call")


def _object_schema(props: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required)}


def _call_schema(tool: Tool, args_key: str = "arguments", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    props = {"name": {"const": tool.name}, args_key: tool.parameters, **(extra or {})}
    return _object_schema(props, list(props))


class Hermes(ToolFormat):
    name = "hermes"
    markers = ("<tool_call>", "</tool_call>")
    _open = "<tool_call>"
    _close = "</tool_call>"

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        start = text.find(self._open)
        if start < 0:
            return Parsed(_hold(text, partial, self.markers))
        content = text[:start]
        calls: list[ToolCall] = []
        i = start
        while True:
            i = _ws(text, i)
            if not text.startswith(self._open, i):
                if partial and self._open.startswith(text[i:]):
                    break
                content += text[i:]
                break
            i = _ws(text, i + len(self._open))
            try:
                call, end = _call_object(text, i)
            except _Incomplete:
                break
            except _Invalid:
                if partial:
                    raise
                return Parsed(text)
            if call is not None:
                calls.append(call)
            if end is None:
                if not partial:
                    return Parsed(text)
                break
            j = _ws(text, end)
            if text.startswith(self._close, j):
                i = j + len(self._close)
            elif partial and self._close.startswith(text[j:]):
                calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments, done=False)
                break
            else:
                if partial:
                    raise _Invalid
                return Parsed(text)
        return Parsed(content.rstrip() if calls else content, tuple(calls))

    def _call_rule(self, g: "_Rules", tool: Tool, i: int) -> str:
        body = g.schema(f"t{i}", _call_schema(tool))
        return f'"{_lit(self._open)}\\n" {body} "\\n{_lit(self._close)}"'

    def _root(self, g: "_Rules", parallel: bool) -> None:
        g.add("root", 'call ( "\\n" call )*' if parallel else "call")

    def example(self, parallel: bool = False) -> str:
        return '<tool_call>\n{"name": "tool_name", "arguments": {"arg1": "some_value"}}\n</tool_call>'


class Llama3(ToolFormat):
    name = "llama3"
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
                call, end = _call_object(text, i, arg_keys=("parameters", "arguments"))
            except _Incomplete:
                return Parsed("", tuple(calls))
            except _Invalid:
                if calls and not partial:
                    return Parsed(text)
                raise
            if call is not None:
                calls.append(call)
            if end is None:
                if not partial:
                    raise _Invalid
                return Parsed("", tuple(calls))
            j = _ws(text, end)
            if j < len(text) and text[j] == ";":
                i = _ws(text, j + 1)
                if i >= len(text):
                    if partial:
                        return Parsed("", tuple(calls))
                    return Parsed("", tuple(calls))
                continue
            if j >= len(text):
                return Parsed("", tuple(calls))
            if partial:
                raise _Invalid
            return Parsed(text)  # a call followed by prose: llama.cpp reads only a call that is the answer

    @staticmethod
    def _builtin(text: str) -> Parsed | None:
        """``<|python_tag|>brave_search.call(query="...")``: Llama's built-in tools, arguments as keywords."""
        m = re.match(r"\s*<\|python_tag\|>\s*(\w+)\.call\((.*)\)\s*$", text, re.S)
        if not m:
            return None
        args = _python_kwargs(f"f({m.group(2)})")
        return None if args is None else Parsed("", (ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)),))

    def _call_rule(self, g: "_Rules", tool: Tool, i: int) -> str:
        return g.schema(f"t{i}", _call_schema(tool, "parameters"))

    def _root(self, g: "_Rules", parallel: bool) -> None:
        g.add("root", 'call ( "; " call )*' if parallel else "call")

    def example(self, parallel: bool = False) -> str:
        return '{"name": "tool_name", "parameters": {"arg1": "some_value"}}'


class Mistral(ToolFormat):
    name = "mistral"
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    id_prefix = ""
    id_length = 9  # Nemo's template refuses any other id

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return Parsed(_hold(text, partial, self.markers))
        content = text[:start]
        i = _ws(text, start + len("[TOOL_CALLS]"))
        if i >= len(text):
            return Parsed(content)
        calls: list[ToolCall] = []
        if text[i] == "[":  # v3-v7: a JSON array of calls
            i = _ws(text, i + 1)
            while i < len(text):
                if text[i] == "]":
                    i += 1
                    break
                call, end = _call_object(text, i)
                if call is not None:
                    calls.append(call)
                if end is None:
                    if not partial:
                        raise _Invalid
                    break
                i = _ws(text, end)
                if i < len(text) and text[i] == ",":
                    i = _ws(text, i + 1)
            else:
                if not partial:
                    raise _Invalid
            return Parsed(content.rstrip() if calls else content, tuple(calls))
        # v11: NAME[ARGS]{...}, repeated with [TOOL_CALLS] between calls
        while True:
            k = text.find("[ARGS]", i)
            if k < 0:
                if partial:
                    return Parsed(content, tuple(calls))
                raise _Invalid
            name = text[i:k].split("[CALL_ID]")[0].strip()  # Small 3.2 writes NAME[CALL_ID]ID[ARGS]
            if not NAME.fullmatch(name):
                raise _Invalid
            j = _ws(text, k + len("[ARGS]"))
            try:
                end = _value_end(text, j)
            except _Incomplete:
                if j < len(text) and text[j] == "{":
                    calls.append(ToolCall(name, text[j:], done=False))
                else:
                    calls.append(ToolCall(name, "", done=False))
                return Parsed(content, tuple(calls))
            if not isinstance(json.loads(text[j:end]), dict):
                raise _Invalid
            calls.append(ToolCall(name, text[j:end]))
            i = _ws(text, end)
            if text.startswith("[TOOL_CALLS]", i):
                i = _ws(text, i + len("[TOOL_CALLS]"))
                continue
            if i < len(text) and not partial:
                raise _Invalid
            return Parsed(content.rstrip(), tuple(calls))

    def grammar(self, tools: Sequence[Tool], parallel: bool = False) -> str:
        # with the 9-character id Nemo's template asks of each call (the response's ids are this server's own)
        calls = [_call_schema(t, extra={"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}}) for t in tools]
        item = {"anyOf": calls} if len(calls) > 1 else calls[0]
        schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        g = _Rules()
        g.add("root", f'"[TOOL_CALLS]" {g.schema("calls", schema)}')
        return g.text()

    def example(self, parallel: bool = False) -> str:
        return '[TOOL_CALLS][{"name": "tool_name", "arguments": {"arg1": "some_value"}}]'


class MistralV11(Mistral):
    """Mistral's v11 tokenizers (Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]NAME[ARGS]{...}`` a call."""

    name = "mistral_v11"

    def _call_rule(self, g: "_Rules", tool: Tool, i: int) -> str:
        # Small 3.2's template writes a [CALL_ID] before [ARGS]: the model may too
        return f'"[TOOL_CALLS]{tool.name}" ( "[CALL_ID]" [a-zA-Z0-9]{{9}} )? "[ARGS]" {g.schema(f"t{i}", tool.parameters)}'

    def grammar(self, tools: Sequence[Tool], parallel: bool = False) -> str:
        return ToolFormat.grammar(self, tools, parallel)

    def example(self, parallel: bool = False) -> str:
        return '[TOOL_CALLS]tool_name[ARGS]{"arg1": "some_value"}'


_DS_BEGIN = ("<｜tool▁calls▁begin｜>", "<｜tool_calls_begin｜>", "<｜tool calls begin｜>", "<｜tool\\_calls\\_begin｜>",
             "<｜tool▁calls｜>")
_DS_CALL, _DS_SEP, _DS_CALL_END, _DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"


class DeepSeek(ToolFormat):
    """DeepSeek V3/R1 (``function<｜tool▁sep｜>NAME`` and a json fence) and V3.1 (``NAME<｜tool▁sep｜>{...}``)."""

    name = "deepseek"
    markers = _DS_BEGIN + (_DS_CALL, _DS_SEP, _DS_CALL_END, _DS_END)

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        hits = [(text.find(b), b) for b in _DS_BEGIN if text.find(b) >= 0]
        if not hits:
            return Parsed(_hold(text, partial, self.markers))
        start, begin = min(hits)
        content = text[:start]
        i = start + len(begin)
        calls: list[ToolCall] = []
        while True:
            i = _ws(text, i)
            if text.startswith(_DS_END, i):
                i += len(_DS_END)
                break
            if i >= len(text) or (partial and any(m.startswith(text[i:]) for m in (_DS_CALL, _DS_END))):
                if not partial:
                    break  # no end marker: as llama.cpp, the calls stand
                return Parsed(content, tuple(calls))
            if text.startswith(_DS_CALL, i):
                i += len(_DS_CALL)
            k = text.find(_DS_SEP, i)
            if k < 0:
                if partial:
                    return Parsed(content, tuple(calls))
                raise _Invalid
            kind = text[i:k]
            fenced = kind.strip() == "function"
            j = k + len(_DS_SEP)
            if fenced:
                nl = text.find("\n", j)
                if nl < 0:
                    if partial:
                        return Parsed(content, tuple(calls))
                    raise _Invalid
                name = text[j:nl].strip()
                j = nl + 1
                fence = "```json\n"
                if not text.startswith(fence, j):
                    if partial and fence.startswith(text[j:]):
                        calls.append(ToolCall(name, "", done=False))
                        return Parsed(content, tuple(calls))
                    raise _Invalid
                j += len(fence)
            else:
                name = kind.strip()
            if not NAME.fullmatch(name):
                raise _Invalid
            j = _ws(text, j)
            try:
                end = _value_end(text, j)
            except _Incomplete:
                args = text[j:] if j < len(text) and text[j] == "{" else ""
                calls.append(ToolCall(name, args, done=False))
                return Parsed(content, tuple(calls))
            if not isinstance(json.loads(text[j:end]), dict):
                raise _Invalid
            calls.append(ToolCall(name, text[j:end]))
            i = _ws(text, end)
            if fenced:
                if text.startswith("```", i):
                    i = _ws(text, i + 3)
                elif partial and "```".startswith(text[i:]):
                    return Parsed(content, tuple(calls))
                else:
                    raise _Invalid
            if text.startswith(_DS_CALL_END, i):
                i += len(_DS_CALL_END)
            elif partial and _DS_CALL_END.startswith(text[i:]):
                return Parsed(content, tuple(calls))
            else:
                raise _Invalid
        return Parsed((content + text[i:]).rstrip(), tuple(calls))

    def _call_rule(self, g: "_Rules", tool: Tool, i: int) -> str:
        args = g.schema(f"t{i}", tool.parameters)
        return f'"{_DS_CALL}function{_DS_SEP}{tool.name}\\n```json\\n" {args} "\\n```{_DS_CALL_END}"'

    def _root(self, g: "_Rules", parallel: bool) -> None:
        g.add("root", f'"{_DS_BEGIN[0]}" call {"( call )* " if parallel else ""}"{_DS_END}"')

    def example(self, parallel: bool = False) -> str:
        return (f'{_DS_BEGIN[0]}{_DS_CALL}function{_DS_SEP}tool_name\n```json\n{{"arg1": "some_value"}}\n```'
                f'{_DS_CALL_END}{_DS_END}')


class DeepSeekV31(DeepSeek):
    name = "deepseek_v3_1"

    def _call_rule(self, g: "_Rules", tool: Tool, i: int) -> str:
        return f'"{_DS_CALL}{tool.name}{_DS_SEP}" {g.schema(f"t{i}", tool.parameters)} "{_DS_CALL_END}"'

    def example(self, parallel: bool = False) -> str:
        return f'{_DS_BEGIN[0]}{_DS_CALL}tool_name{_DS_SEP}{{"arg1": "some_value"}}{_DS_CALL_END}{_DS_END}'


class Glm45(ToolFormat):
    name = "glm45"
    markers = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    _call = re.compile(r"<tool_call>\s*([^\n<]+?)\s*(?:\n|(?=<arg_key>)|(?=</tool_call>))(.*?)</tool_call>", re.S)
    _arg = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        start = text.find("<tool_call>")
        if start < 0:
            return Parsed(_hold(text, partial, self.markers))
        content = text[:start]
        calls: list[ToolCall] = []
        i = start
        by_name = {t.name: t for t in tools}
        while True:
            i = _ws(text, i)
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
                    raise _Invalid
                return Parsed(text)
            name = m.group(1).strip()
            if not NAME.fullmatch(name):
                raise _Invalid
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

    def _call_rule(self, g: "_Rules", tool: Tool, i: int) -> str:
        props = tool.parameters.get("properties") or {}
        required = set(tool.parameters.get("required") or [])
        parts = []
        for n, (key, schema) in enumerate(props.items()):
            if isinstance(schema, dict) and schema.get("type") == "string" and not ({"enum", "const", "pattern"} & set(schema)):
                value = g.add(f"t{i}-v{n}", "[^<]*")
            else:
                value = g.schema(f"t{i}-v{n}", schema if isinstance(schema, dict) else {})
            pair = f'"<arg_key>{_lit(key)}</arg_key>\\n<arg_value>" {value} "</arg_value>\\n"'
            parts.append(pair if key in required else f"( {pair} )?")
        return f'"<tool_call>{tool.name}\\n" {" ".join(parts)} "</tool_call>"'

    def example(self, parallel: bool = False) -> str:
        return "<tool_call>tool_name\n<arg_key>arg1</arg_key>\n<arg_value>some_value</arg_value>\n</tool_call>"


class Pythonic(ToolFormat):
    """Gemma's convention (```` ```tool_code ```` fences of Python calls) and vLLM's ``pythonic`` list."""

    name = "gemma"
    markers = ("```tool_code",)
    _fence = re.compile(r"```tool_code[ \t]*\n(.*?)\n?```", re.S)

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        stripped = text.strip()
        if stripped.startswith("[") and "```tool_code" not in text:
            if partial:
                return Parsed("")
            calls = _python_calls(stripped)
            return Parsed("", tuple(calls)) if calls else Parsed(text)
        start = text.find("```tool_code")
        if start < 0:
            return Parsed(_hold(text, partial, self.markers))
        calls: list[ToolCall] = []
        content, pos = "", 0
        for m in self._fence.finditer(text):
            found = _python_calls(m.group(1).strip())
            if not found:
                raise _Invalid
            content += text[pos:m.start()]
            calls += found
            pos = m.end()
        rest = text[pos:]
        if partial and "```tool_code" in rest:
            rest = rest[:rest.find("```tool_code")]
        content += rest
        return Parsed(content.rstrip() if calls else content, tuple(calls))

    def _call_rule(self, g: "_Rules", tool: Tool, i: int) -> str:
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


def _python_kwargs(code: str) -> dict[str, Any] | None:
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


def _python_calls(code: str) -> list[ToolCall]:
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
        args = _python_kwargs(ast.unparse(n))
        if args is None or not NAME.fullmatch(name):
            return []
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls


class Generic(ToolFormat):
    """llama.cpp's Generic: the whole answer is JSON, a call or a response."""

    name = "generic"
    system_note = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
                   "reply to the user's request")

    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        i = _ws(text, 0)
        if i >= len(text):
            return Parsed("" if partial else text)
        if text[i] != "{":
            return Parsed(text)
        members, end = _object(text, i)
        if not members:
            if not partial:  # ``{}``, or an object cut before its first key: not a message
                raise _Invalid
            return Parsed("")
        m = members[0]
        if m.key == "response":
            if m.end is None:
                if text[m.start] == '"':
                    return Parsed(_partial_string(text[m.start:]))
                return Parsed("")
            value = _json(text, m)
            if end is None and not partial:
                raise _Invalid
            return Parsed(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=2))
        if m.key == "tool_call":
            if text[m.start] != "{":
                raise _Invalid
            call, cend = _call_object(text, m.start)
            if not partial and (cend is None or end is None):
                raise _Invalid
            return Parsed("", (call,) if call is not None else ())
        if m.key == "tool_calls":
            j = m.start
            if text[j] != "[":
                raise _Invalid
            calls: list[ToolCall] = []
            j = _ws(text, j + 1)
            while j < len(text) and text[j] != "]":
                call, cend = _call_object(text, j)
                if call is not None:
                    calls.append(call)
                if cend is None:
                    break
                j = _ws(text, cend)
                if j < len(text) and text[j] == ",":
                    j = _ws(text, j + 1)
            if not partial and end is None:
                raise _Invalid
            return Parsed("", tuple(calls))
        raise _Invalid

    def _schema(self, tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
        items = []
        for t in tools:
            s = _call_schema(t, extra={"id": {"type": "string", "minLength": 4}} if parallel else None)
            items.append(s)
        one = items[0] if len(items) == 1 else {"anyOf": items}
        if parallel:
            return _object_schema({"tool_calls": {"type": "array", "items": one, "minItems": 1}}, ["tool_calls"])
        return _object_schema({"tool_call": one}, ["tool_call"])

    def grammar(self, tools: Sequence[Tool], parallel: bool = False) -> str:
        g = _Rules()
        g.add("root", g.schema("call", self._schema(tools, parallel)))
        return g.text()

    def auto_grammar(self, tools: Sequence[Tool], parallel: bool, response: dict | None) -> str | None:
        answer = _object_schema({"response": response if response is not None else {"type": "string"}}, ["response"])
        g = _Rules()
        g.add("root", g.schema("msg", {"anyOf": [self._schema(tools, parallel), answer]}))
        return g.text()

    def example(self, parallel: bool = False) -> str:
        if parallel:
            return json.dumps({"tool_calls": [{"name": "tool_name", "arguments": {"arg1": "some_value"},
                                               "id": "call_1___"}]}, indent=2)
        return json.dumps({"tool_call": {"name": "tool_name", "arguments": {"arg1": "some_value"}}}, indent=2)


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3(), Mistral(), MistralV11(), DeepSeek(), DeepSeekV31(),
                                                      Glm45(), Pythonic(), Generic())}


def get_format(name: str) -> ToolFormat:
    """A format by name (a role's or the command line's choice)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise InvalidParameterError(f"unknown tool-call format {name!r}; choose one of {', '.join(FORMATS)}") from None


def detect_format(template: str | None) -> str:
    """The format a chat template's model writes, from the template's text (llama.cpp's order)."""
    src = template or ""
    if "message['prefix'] is defined and message['prefix'] and thinking" in src:
        return "deepseek_v3_1"
    if "<｜tool▁calls▁begin｜>" in src:
        return "deepseek"
    if "<tool_call>" in src:
        return "glm45" if "<arg_key>" in src else "hermes"
    if "<|start_header_id|>ipython<|end_header_id|>" in src:
        return "llama3"
    if "[TOOL_CALLS]" in src:
        return "mistral_v11" if "[ARGS]" in src else "mistral"
    if "```tool_code" in src:
        return "gemma"
    return "generic"


# -- the plan for one request ----------------------------------------------------------------------------


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

    def grammar(self, response: dict | None = None) -> str | None:
        """The grammar the output follows (None: free output): a forced call for required or a named function."""
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


@dataclass
class ToolStream:
    """One choice's message as it streams: ``update`` with the whole text so far gives the OpenAI deltas."""

    plan: ToolPlan
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    new_id: Callable[[], str] | None = None

    def update(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        parsed = self.plan.parse(text, partial=not final)
        deltas: list[dict[str, Any]] = []
        content = parsed.content if final else parsed.content.rstrip()  # whitespace waits: a call may strip it
        if content != self.content and content.startswith(self.content):
            deltas.append({"content": content[len(self.content):]})
            self.content = content
        for i, call in enumerate(parsed.calls):
            if i < len(self.calls):
                old = self.calls[i]
                if call.name != old.name or not call.arguments.startswith(old.arguments):
                    continue  # what was sent stands; a final parse that reads it otherwise cannot unsend it
                if call.arguments != old.arguments:
                    deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments[len(old.arguments):]}}]})
                self.calls[i] = call
            elif i == len(self.calls):
                self.ids.append((self.new_id or self.plan.format.new_id)())
                self.calls.append(call)
                deltas.append({"tool_calls": [{"index": i, "id": self.ids[i], "type": "function",
                                               "function": {"name": call.name, "arguments": call.arguments}}]})
        return deltas

    def message(self) -> dict[str, Any]:
        """The finished message in OpenAI's shape (``content`` None when there are calls and no text)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content if (self.content or not self.calls) else None}
        if self.calls:
            out["tool_calls"] = [{"id": self.ids[i], "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for i, c in enumerate(self.calls)]
        return out


# -- the text the parser reads -------------------------------------------------------------------------------


def preserved_tokens(vocab: Any, markers: Sequence[str]) -> dict[int, str]:
    """Of a format's ``markers``, those this vocabulary has as one control token, by id.

    Output text leaves control tokens out (``[TOOL_CALLS]`` decodes to nothing), so the parser reads the
    output with these written as their text, as llama-server keeps a format's ``preserved_tokens``."""
    out: dict[int, str] = {}
    for marker in markers:
        try:
            ids = vocab.tokenize(marker, add_special=False, parse_special=True)
        except Exception:
            continue
        if len(ids) == 1 and vocab.token_bytes(ids[0]) != marker.encode():
            out[ids[0]] = marker
    return out


def output_text(ids: Sequence[int], vocab: Any, preserved: dict[int, str], final: bool = False) -> str:
    """The text of output tokens ``ids`` with the ``preserved`` control tokens written out (an unfinished
    UTF-8 character at the end waits, unless ``final``)."""
    import codecs

    data = b"".join(preserved[t].encode() if t in preserved else vocab.token_bytes(t) for t in ids)
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=final)


class ChoiceOutput:
    """One chat choice's output read as a message, for the routes: the events' text (control-token markers
    written out from the generation's ids where the vocabulary has them as tokens), the deltas a stream
    sends, and the final message and finish reason."""

    def __init__(self, plan: ToolPlan, vocab: Any, job: Any, preserved: dict[int, str]) -> None:
        self.plan, self.vocab, self.job, self.preserved = plan, vocab, job, preserved
        self.stream = ToolStream(plan)
        self.text = ""
        self.n_tokens = 0

    def add(self, event: dict[str, Any], deltas: bool = True) -> list[dict[str, Any]]:
        """Take a delta event; with ``deltas``, the stream's deltas for it (a response parses once, at the end)."""
        self.text += event["text"]
        self.n_tokens += len(event.get("tokens") or ())
        return self.stream.update(self._text(False)) if deltas else []

    def finish(self) -> list[dict[str, Any]]:
        return self.stream.update(self._text(True), final=True)

    def message(self) -> dict[str, Any]:
        return self.stream.message()

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` when the answer is calls, as llama-server (a length cut stays ``length``)."""
        return "tool_calls" if self.stream.calls and reason == "stop" else reason

    def _text(self, final: bool) -> str:
        gen = getattr(self.job, "gen", None)
        if self.preserved and gen is not None:
            ids = gen.output_ids[:self.n_tokens]  # the reported tokens (the list only grows)
            if any(t in self.preserved for t in ids):
                return output_text(ids, self.vocab, self.preserved, final)
        return self.text


# -- GBNF composition --------------------------------------------------------------------------------------


def _lit(text: str) -> str:
    """``text`` for inside a GBNF string literal."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


class _Rules:
    """A GBNF grammar put together from fixed text and JSON schemas (llama.cpp's converter, each schema's rules
    under its own prefix)."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}

    def add(self, name: str, body: str) -> str:
        self.rules[name] = body
        return name

    def schema(self, prefix: str, schema: dict[str, Any]) -> str:
        from ..json_schema import embedded
        from ..llama.grammar import schema_to_gbnf

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
