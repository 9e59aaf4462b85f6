"""Chat messages to a prompt: a chosen template, the GGUF's own, or chatml, llama-server's fallback.

Where the template comes from, first match wins (as llama-server's ``--chat-template``):

1. ``--chat-template`` / the role's ``chat_template``: a file (Jinja), or a name of llama.cpp's built-in
   templates (``gemma``, ``chatml``, ``llama3``, ...; ``target.builtin_chat_templates()``), which
   llama.cpp itself formats (``llama_chat_apply_template``);
2. the GGUF's ``tokenizer.chat_template`` (Jinja), else its ``tokenizer.chat_template.tool_use``;
3. none: chatml, the Jinja template llama.cpp's ``common_chat_templates_init`` falls back to (``CHATML``), with a
   warning at load that names the flag, since the model may never have seen it (Gemma 3 270M and the bundled
   models have no template in the file).  This was a plain ``### User:`` format of specstack's own, which no
   client written for llama-server expected.

Jinja templates are rendered in a sandbox as llama.cpp and transformers do, with ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token`` and a request's ``tools``; what a template cannot
show of tools, calls and tool results is written into the messages (``template_caps``).
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, Sequence

from ..errors import InvalidParameterError
from ..modelfile.meta import read_gguf
from ..llama import apply_builtin_chat_template, builtin_chat_templates
from .sandbox import compile_template

ROLES = ("system", "user", "assistant", "tool")
# llama.cpp's CHATML_TEMPLATE_SRC (common/chat.cpp), character for character: the template of a GGUF without one
CHATML = ("{%- for message in messages -%}\n"
          "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
          "{%- endfor -%}\n"
          "{%- if add_generation_prompt -%}\n"
          "  {{- '<|im_start|>assistant\n' -}}\n"
          "{%- endif -%}")


@dataclass(frozen=True)
class ChatTemplate:
    """How a role turns messages into a prompt: ``kind`` jinja (``text`` is the template) or builtin (``text`` is
    llama.cpp's name for it); ``origin`` says where it came from, for /v1/models and the load line; ``fallback``:
    chosen because the GGUF has none (chatml)."""

    kind: Literal["jinja", "builtin"]
    text: str
    origin: str
    fallback: bool = False

    @property
    def warning(self) -> str | None:
        if not self.fallback:
            return None
        return ("has no chat template (tokenizer.chat_template): chat requests get chatml (<|im_start|>), "
                "llama-server's fallback, which the model may never have seen; pass --chat-template NAME (gemma, "
                "chatml, llama3, ...; see `specstack serve --help`) or --chat-template FILE.jinja, or the role key "
                "chat_template")


def load_template(model: Path, choice: str | None = None) -> ChatTemplate:
    """The template for a role: ``choice`` (a file or a built-in name) if given, else the GGUF's (its tool_use
    variant where it has only that), else chatml, as llama.cpp's ``common_chat_templates_init`` chooses."""
    if choice:
        path = Path(choice).expanduser()
        if path.is_file():
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidParameterError(f"cannot read chat template file {path}: {exc}") from None
            return compiled(ChatTemplate("jinja", text, f"file {path}"))
        names = builtin_chat_templates()
        if choice not in names:
            raise InvalidParameterError(f"chat template {choice!r} is neither a file nor one of llama.cpp's built-in "
                                        f"templates: {', '.join(names)}")
        return ChatTemplate("builtin", choice, f"llama.cpp built-in {choice!r}")
    meta = read_gguf(model, tensors=False)
    for key in ("tokenizer.chat_template", "tokenizer.chat_template.tool_use"):
        template = meta.get(key)
        if isinstance(template, str) and template.strip():
            return compiled(ChatTemplate("jinja", template, f"the GGUF's {key}"))
    return ChatTemplate("jinja", CHATML, "none in the GGUF: chatml (llama-server's fallback)", fallback=True)


def compiled(template: ChatTemplate) -> ChatTemplate:
    """``template`` once its Jinja compiles in the sandbox, else ``InvalidParameterError`` naming where it came
    from, the line and the parser's reason.

    Compiled at load (``serve`` checks every role's template before it binds the port), as llama-server
    parses its template at start-up and refuses to run without one that parses: compiled only per request,
    a syntax error let the server print ``ready`` and answer every chat with a 400 blaming the messages."""
    from jinja2 import TemplateSyntaxError

    try:
        compile_template(template.text)
    except TemplateSyntaxError as exc:
        where = f" at line {exc.lineno}" if exc.lineno else ""
        reason = f"Jinja syntax error{where}: {exc.message}"
    except Exception as exc:  # anything else the compiler raises (a template nested past Python's recursion limit)
        reason = f"{type(exc).__name__}: {exc}"
    else:
        return template
    raise InvalidParameterError(f"chat template ({template.origin}) does not compile: {reason}; fix it, or pass "
                                "another with --chat-template NAME or FILE (the role key chat_template)")


@dataclass(frozen=True)
class RenderedChat:
    """A chat prompt as the template's own markup and the messages' text, kept apart.

    ``pieces`` alternate in order: ``(text, True)`` was written by the template and may spell control tokens
    (``<start_of_turn>``); ``(text, False)`` came from a message and is always plain text, however it is
    spelled, so a user cannot close their turn and write the model's (as llama-server and vLLM keep it).
    """

    pieces: tuple[tuple[str, bool], ...]

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.pieces)


class ChatVocabulary(Protocol):
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...
    def split_special(self, text: str) -> list[str | int]: ...


def chat_tokens(chat: RenderedChat, vocab: ChatVocabulary) -> list[int]:
    """Token ids of ``chat``: control tokens only where the template wrote them; every stretch of text between
    two of them is tokenized whole, so an ordinary chat gets the ids that tokenizing the rendered prompt with
    special parsing would give (llama.cpp tokenizes each text fragment between specials on its own too)."""
    fragments: list[str | int] = []
    for text, trusted in chat.pieces:
        for part in (vocab.split_special(text) if trusted else [text]):
            if isinstance(part, str) and fragments and isinstance(fragments[-1], str):
                fragments[-1] += part
            elif part != "":
                fragments.append(part)
    ids = vocab.tokenize("", add_special=True)  # BOS where the model asks for it
    for part in fragments:
        ids.extend([part] if isinstance(part, int) else vocab.tokenize(part, add_special=False))
    return ids


def render(messages: Sequence[dict[str, Any]], template: ChatTemplate, bos: str = "", eos: str = "", *,
           tools: Sequence[dict[str, Any]] | None = None, tool_example: str = "", system_note: str = "",
           extra: dict[str, Any] | None = None, generation_prompt: bool = True) -> RenderedChat:
    """The prompt for ``messages``, ending where the assistant's answer starts, with what the template wrote
    told apart from what the messages said.

    ``tools`` (OpenAI's function tools) go to the template as ``tools``, as ``llama-server --jinja`` and
    transformers pass them; assistant ``tool_calls`` and ``tool`` messages go to it as they are.  What the
    template cannot show is written into the messages as llama.cpp's templates (minja) do
    (``template_caps``): the tools as a system message (with ``tool_example``, a call in the format the
    output is read in), calls as JSON content, tool results as a user message of JSON, a system message
    into the first user message.  ``system_note`` is added to the system message (the generic tool format's
    instruction, as llama.cpp adds it); ``extra`` adds template variables (``chat_template_kwargs``).
    ``generation_prompt`` False leaves the assistant's turn unopened (a request's ``add_generation_prompt``).

    The template is rendered twice: with each message's text as it is, and with each replaced by a unique
    marker. The markers show where the messages' text went; the first rendering shows what the template did
    to it (llama.cpp's built-in templates trim it).  The tools' text is the request's too, and is marked the
    same way, except words such as ``string`` or a parameter's name (``SAFE``), which templates compare.
    """
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise InvalidParameterError(f"messages[{i}].role must be one of {', '.join(ROLES)} (got {m.get('role')!r})")
    messages = [{**m, "content": _text(m)} for m in messages]
    if system_note:
        messages = add_system(messages, system_note)
    tools = list(tools or ())
    messages = _polyfilled(messages, template_caps(template), tools, tool_example)
    # every string a message brings, nested ones too (content, name, tool_calls' arguments, ...), is the user's
    # text; the role is checked
    marks = _Marks()
    marked_messages = [{k: (v if k == "role" else marks.message(v, k)) for k, v in m.items()} for m in messages]
    marked_tools = [marks.tool(t) for t in tools]
    full = _apply(template, messages, bos, eos, tools, extra, generation_prompt)
    marked = _apply(template, marked_messages, bos, eos, marked_tools, extra, generation_prompt)
    return _split(full, marked, marks.markers(), marks.texts)


# Strings a template may compare or count (JSON schema words, a parameter's or function's name, an OpenAI
# call id or type) are left as they are when they are only letters, digits and ``_-.``: no control token is
# spelled that way, so they cannot write markup; anything else the request brings is marked.
SAFE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class _Marks:
    """Markers for a request's strings: each distinct string gets one (the same string the same marker, so a
    template that looks a parameter's name up in ``required`` finds it)."""

    def __init__(self) -> None:
        self.nonce = secrets.token_hex(8)
        self.texts: list[str] = []
        self._index: dict[str, int] = {}

    def markers(self) -> list[str]:
        return [f"specstack{self.nonce}m{n}e" for n in range(len(self.texts))]

    def mark(self, text: str) -> str:
        """The marker for ``text`` (letters and digits: trim leaves it be); "" stays "" (a template may test
        whether a message has content)."""
        if not text:
            return text
        n = self._index.get(text)
        if n is None:
            n = self._index[text] = len(self.texts)
            self.texts.append(text)
        return f"specstack{self.nonce}m{n}e"

    def _key(self, key: Any) -> Any:
        return key if not isinstance(key, str) or SAFE.fullmatch(key) else self.mark(key)

    def message(self, value: Any, key: str | None = None) -> Any:
        """A message's value: every string marked but a safe call id or type (Mistral's template counts ids)."""
        if isinstance(value, str):
            return value if key in ("id", "tool_call_id", "type") and SAFE.fullmatch(value) else self.mark(value)
        if isinstance(value, dict):
            return {self._key(k): self.message(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [self.message(v) for v in value]
        return value

    def tool(self, value: Any) -> Any:
        """A tool's value: safe words as they are (``"type": "string"``), every other string marked."""
        if isinstance(value, str):
            return value if SAFE.fullmatch(value) else self.mark(value)
        if isinstance(value, dict):
            return {self._key(k): self.tool(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.tool(v) for v in value]
        return value


@dataclass(frozen=True)
class TemplateCaps:
    """What a template shows of a chat, probed as minja (llama.cpp's template engine) probes it."""

    system_role: bool = True
    tools: bool = False  # it describes the request's tools
    tool_calls: bool = False  # it writes an assistant message's tool_calls
    tool_responses: bool = False  # it writes tool messages
    object_arguments: bool = False  # it needs a call's arguments as an object, not JSON text
    parallel_tool_calls: bool = False  # it writes several calls of one message


@functools.lru_cache(maxsize=64)
def template_caps(template: ChatTemplate) -> TemplateCaps:
    """What ``template`` shows (llama.cpp's built-ins: text turns only)."""
    if template.kind != "jinja":
        return TemplateCaps()

    def raw(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        try:
            return _apply(template, messages, "", "", tools)
        except Exception:
            return ""

    user = {"role": "user", "content": "<User Needle>"}
    system_role = "<System Needle>" in raw([{"role": "system", "content": "<System Needle>"}, user])
    probe_tool = {"type": "function", "function": {
        "name": "some_tool", "description": "Some tool.",
        "parameters": {"type": "object", "properties": {"arg": {"type": "string", "description": "Some argument."}},
                       "required": ["arg"]}}}
    tools = "some_tool" in raw([user], [probe_tool])

    def call_message(*calls: dict[str, Any]) -> dict[str, Any]:
        return {"role": "assistant", "content": "", "tool_calls": list(calls)}

    def call(name: str, arguments: Any) -> dict[str, Any]:
        return {"id": "call_1___", "type": "function", "function": {"name": name, "arguments": arguments}}

    needle = {"argument_needle": "print('Hello, World!')"}

    def keyed(out: str) -> bool:  # the argument's name written as a name (GLM, Qwen3-Coder), not inside JSON
        return "<parameter=argument_needle>" in out or "argument_needle</arg_key>" in out

    def shows(out: str) -> bool:
        return keyed(out) or '"argument_needle":' in out or "'argument_needle':" in out

    text_out = raw([user, call_message(call("ipython", json.dumps(needle)))])
    object_out = raw([user, call_message(call("ipython", needle))])
    as_text, as_object = shows(text_out), shows(object_out)
    tool_calls = as_text or as_object
    # an object where the template takes one, or where only an object has its keys written as keys (GLM writes
    # JSON text whole, as one "raw_arguments")
    object_arguments = as_object and (not as_text or (keyed(object_out) and not keyed(text_out)))
    parallel = responses = False
    if tool_calls:
        args = needle if object_arguments else json.dumps(needle)
        out = raw([user, call_message(call("test_tool1", args), call("test_tool2", args))])
        parallel = "test_tool1" in out and "test_tool2" in out
        out = raw([user, call_message(call("test_tool1", args)),
                   {"role": "tool", "name": "test_tool1", "content": "Some response!", "tool_call_id": "call_911_"}])
        responses = "Some response!" in out
    return TemplateCaps(system_role, tools, tool_calls, responses, object_arguments, parallel)


TOOLS_INTRO = "You can call any of the following tools to satisfy the user's requests: "


def _polyfilled(messages: list[dict[str, Any]], caps: TemplateCaps, tools: list[dict[str, Any]],
                example: str) -> list[dict[str, Any]]:
    """``messages`` with what the template cannot show written into them (minja's polyfills)."""
    if tools and not caps.tools:
        note = TOOLS_INTRO + json.dumps(tools, indent=2, ensure_ascii=False)
        if example:
            note += "\n\nExample tool call syntax:\n\n" + example + "\n\n"
        messages = add_system(messages, note)
    out: list[dict[str, Any]] = []
    pending = ""
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = [_object_arguments(c) for c in m["tool_calls"]] if (caps.object_arguments or not caps.tool_calls) \
                else m["tool_calls"]
            m["tool_calls"] = calls
            if not caps.tool_calls:
                listed = []
                for c in calls:
                    fn = c.get("function") if isinstance(c, dict) else None
                    if not isinstance(fn, dict):
                        continue
                    entry = {"name": fn.get("name"), "arguments": fn.get("arguments")}
                    if isinstance(c, dict) and "id" in c:
                        entry["id"] = c["id"]
                    listed.append(entry)
                body: dict[str, Any] = {"tool_calls": listed}
                if m.get("content"):
                    body["content"] = m["content"]
                m["content"] = json.dumps(body, indent=2, ensure_ascii=False)
                del m["tool_calls"]
        if m["role"] == "tool" and not caps.tool_responses:
            response: dict[str, Any] = {}
            if "name" in m:
                response["tool"] = m.pop("name")
            response["content"] = m["content"]
            if "tool_call_id" in m:
                response["tool_call_id"] = m.pop("tool_call_id")
            m = {**m, "role": "user", "content": json.dumps({"tool_response": response}, indent=2, ensure_ascii=False)}
        if not caps.system_role:
            if m["role"] == "system":
                pending = f"{pending}\n{m['content']}" if pending else m["content"]
                continue
            if m["role"] == "user" and pending:
                m["content"] = pending + ("\n" + m["content"] if m["content"] else "")
                pending = ""
            elif pending:
                out.append({"role": "user", "content": pending})
                pending = ""
        out.append(m)
    if pending:
        out.append({"role": "user", "content": pending})
    return out


def add_system(messages: Sequence[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """``messages`` with ``note`` appended to their system message (one is put first if there is none)."""
    messages = list(messages)
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{_text(first)}\n\n{note}"}] + messages[1:]
    return [{"role": "system", "content": note}] + messages


def _object_arguments(call: Any) -> Any:
    """A call with its arguments' JSON text read as an object (templates that iterate them need one)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = call["function"]
    if isinstance(fn.get("arguments"), str):
        try:
            fn = {**fn, "arguments": json.loads(fn["arguments"])}
        except ValueError:
            pass
    return {**call, "function": fn}


def template_context() -> dict[str, Any]:
    """The variables llama-server gives every template before a request's own (``chat_template_kwargs`` win):
    ``enable_thinking`` true (``jobs.template_kwargs`` sets it false where thinking is off), and today's date as
    ``datetime`` ("Nov 27 2026": firefunction-v2 writes it) and ``date_string`` ("27 Nov 2026": Llama 3.x's
    templates write it, else their fixed "26 Jul 2024") (llama.cpp's ``common_chat_extra_context``)."""
    now = datetime.datetime.now()
    return {"enable_thinking": True, "datetime": now.strftime("%b %d %Y"), "date_string": now.strftime("%d %b %Y")}


def _apply(template: ChatTemplate, messages: Sequence[dict[str, Any]], bos: str, eos: str,
           tools: Sequence[dict[str, Any]] | None = None, extra: dict[str, Any] | None = None,
           generation_prompt: bool = True) -> str:
    if template.kind == "builtin":
        try:
            return apply_builtin_chat_template(template.text, [(m["role"], m["content"]) for m in messages],
                                               generation_prompt)
        except ValueError as exc:
            raise InvalidParameterError(str(exc)) from None

    def raise_exception(message: str) -> None:
        raise InvalidParameterError(f"the model's chat template refused the messages: {message}")

    # add_generation_prompt is left undefined rather than false, as llama-server leaves it (templates test both)
    context: dict[str, Any] = {**template_context(), **(extra or {}), "messages": list(messages),
                               "bos_token": bos, "eos_token": eos, "raise_exception": raise_exception}
    if generation_prompt:
        context["add_generation_prompt"] = True
    if tools:
        context["tools"] = list(tools)
    try:
        return compile_template(template.text).render(**context)
    except InvalidParameterError:
        raise
    except Exception as exc:
        raise InvalidParameterError(f"the model's chat template failed on these messages: {exc}") from None


_MARKER = re.compile("specstack[0-9a-f]{16}m([0-9]+)e")


def _split(full: str, marked: str, markers: Sequence[str], texts: Sequence[str]) -> RenderedChat:
    """Pieces of ``full`` told apart by where ``markers`` landed in ``marked``.

    Each message's text goes in as the template put it (as is, or trimmed as llama.cpp's built-ins do) when
    the pieces then spell ``full`` exactly. A template that does anything else to the text (or drops or
    repeats it) gets the messages' text as is, still never as markup.
    """
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for match in _MARKER.finditer(marked):
        if match.group(0) not in markers:  # a message that spells a marker of another nonce: its own text
            continue
        pieces += [(marked[pos:match.start()], True), (texts[int(match.group(1))], False)]
        pos = match.end()
    pieces.append((marked[pos:], True))
    nonce = markers[0][9:25] if markers else None
    if nonce and any(nonce in text for text, trusted in pieces if trusted):
        # the template changed a marker (case, slicing): what it wrote there cannot be told from the markup
        raise InvalidParameterError("the chat template transforms message text in a way that cannot be kept apart "
                                    "from its markup; pass another template with --chat-template")
    fitted = _fit(full, pieces)
    return RenderedChat(tuple((t, trusted) for t, trusted in (fitted or pieces) if t))


def _fit(full: str, pieces: list[tuple[str, bool]]) -> list[tuple[str, bool]] | None:
    """``pieces`` with each message's text as ``full`` holds it (as is, or stripped), or None if none fits."""
    out: list[tuple[str, bool]] = []
    pos = 0
    for i, (text, trusted) in enumerate(pieces):
        if trusted:
            if not full.startswith(text, pos):
                return None
            out.append((text, True))
            pos += len(text)
            continue
        after = pieces[i + 1][0] if i + 1 < len(pieces) else ""
        # as is, trimmed, or escaped inside a JSON string (a template's ``tojson`` of the tools or arguments)
        escaped = (json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1])
        for candidate in dict.fromkeys((text, text.strip()) + escaped):
            if full.startswith(candidate + after, pos):
                out.append((candidate, False))
                pos += len(candidate)
                break
        else:
            return None
    return out if pos == len(full) else None


def _text(message: dict[str, Any]) -> str:
    """Message content as text; OpenAI content parts of type "text" are joined."""
    return content_text(message.get("content"))


def content_text(content: Any, joiner: str = "") -> str:
    """A message's content as text: its string, or its text parts joined by ``joiner`` (a template's messages:
    nothing; a continued message: blank lines, as llama.cpp's ``render_content``); other parts are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        other = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content
                 if not (isinstance(p, dict) and p.get("type") == "text")]
        if other:
            raise InvalidParameterError(f"content parts of type {other[0]!r} are not supported (text-only models); "
                                        "send text parts only")
        return joiner.join(p.get("text", "") for p in content)
    raise InvalidParameterError("message content must be a string or a list of content parts")
