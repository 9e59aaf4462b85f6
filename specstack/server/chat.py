"""Chat messages to a prompt: a chosen template, the GGUF's own, or a documented plain format.

Where the template comes from, first match wins (as llama-server's ``--chat-template``):

1. ``--chat-template`` / the role's ``chat_template``: a file (Jinja), or a name of llama.cpp's built-in
   templates (``gemma``, ``chatml``, ``llama3``, ...; ``target.builtin_chat_templates()``), which
   llama.cpp itself formats (``llama_chat_apply_template``);
2. the GGUF's ``tokenizer.chat_template`` (Jinja);
3. none: the plain format below, with a warning at load that names the flag, since it is a format the
   model most likely never saw (Gemma 3 echoed the question over and over in it).

Jinja templates are rendered in a sandbox as llama.cpp and transformers do, with ``messages``,
``add_generation_prompt``, ``bos_token`` and ``eos_token``.  The plain format::

    ### System:
    You are terse.

    ### User:
    Write a stack class.

    ### Assistant:
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, Sequence

from ..errors import InvalidParameterError
from ..modelfile.meta import read_gguf
from ..llama import apply_builtin_chat_template, builtin_chat_templates

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatTemplate:
    """How a role turns messages into a prompt: ``kind`` jinja (``text`` is the template), builtin (``text``
    is llama.cpp's name for it) or plain; ``origin`` says where it came from, for /v1/models and the load line."""

    kind: Literal["jinja", "builtin", "plain"]
    text: str
    origin: str

    @property
    def warning(self) -> str | None:
        if self.kind != "plain":
            return None
        return ("has no chat template (tokenizer.chat_template): chat requests get a plain '### User:' format "
                "the model has most likely never seen; pass --chat-template NAME (gemma, chatml, llama3, ...; "
                "see `specstack serve --help`) or --chat-template FILE.jinja, or the role key chat_template")


def load_template(model: Path, choice: str | None = None) -> ChatTemplate:
    """The template for a role: ``choice`` (a file or a built-in name) if given, else the GGUF's, else plain."""
    if choice:
        path = Path(choice).expanduser()
        if path.is_file():
            try:
                return ChatTemplate("jinja", path.read_text(encoding="utf-8"), f"file {path}")
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidParameterError(f"cannot read chat template file {path}: {exc}") from None
        names = builtin_chat_templates()
        if choice not in names:
            raise InvalidParameterError(f"chat template {choice!r} is neither a file nor one of llama.cpp's built-in "
                                        f"templates: {', '.join(names)}")
        return ChatTemplate("builtin", choice, f"llama.cpp built-in {choice!r}")
    template = read_gguf(model, tensors=False).get("tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        return ChatTemplate("jinja", template, "the GGUF's tokenizer.chat_template")
    return ChatTemplate("plain", "", "none (plain ### format)")


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


def render(messages: Sequence[dict[str, Any]], template: ChatTemplate, bos: str = "", eos: str = "") -> RenderedChat:
    """The prompt for ``messages``, ending where the assistant's answer starts, with what the template wrote
    told apart from what the messages said.

    The template is rendered twice: with each message's text as it is, and with each replaced by a unique
    marker. The markers show where the messages' text went; the first rendering shows what the template did
    to it (llama.cpp's built-in templates trim it).
    """
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise InvalidParameterError(f"messages[{i}].role must be one of {', '.join(ROLES)} (got {m.get('role')!r})")
    messages = [{**m, "content": _text(m)} for m in messages]
    if template.kind == "plain":
        pieces: list[tuple[str, bool]] = []
        for m in messages:
            pieces += [(f"### {m['role'].capitalize()}:\n", True), (m["content"], False), ("\n\n", True)]
        return RenderedChat(tuple(pieces) + (("### Assistant:\n", True),))
    # every string a message brings, nested ones too (content, name, tool_calls' arguments, ...), is the user's
    # text; the role is checked
    nonce = secrets.token_hex(8)
    texts: list[str] = []
    marked_messages = [{k: (v if k == "role" else _marked(v, texts, nonce)) for k, v in m.items()} for m in messages]
    markers = [f"specstack{nonce}m{n}e" for n in range(len(texts))]
    full = _apply(template, messages, bos, eos)
    marked = _apply(template, marked_messages, bos, eos)
    return _split(full, marked, markers, texts)


def _marked(value: Any, texts: list[str], nonce: str) -> Any:
    """``value`` with each string in it replaced by the next marker (letters and digits: trim leaves them be),
    the strings kept in ``texts``."""
    if isinstance(value, str):
        texts.append(value)
        return f"specstack{nonce}m{len(texts) - 1}e"
    if isinstance(value, dict):
        return {k: _marked(v, texts, nonce) for k, v in value.items()}
    if isinstance(value, list):
        return [_marked(v, texts, nonce) for v in value]
    return value


def _apply(template: ChatTemplate, messages: Sequence[dict[str, Any]], bos: str, eos: str) -> str:
    if template.kind == "builtin":
        try:
            return apply_builtin_chat_template(template.text, [(m["role"], m["content"]) for m in messages])
        except ValueError as exc:
            raise InvalidParameterError(str(exc)) from None
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise InvalidParameterError(f"the model's chat template refused the messages: {message}")

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template.text).render(messages=list(messages),
                                                add_generation_prompt=True, bos_token=bos, eos_token=eos)
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
        for candidate in (text, text.strip()):
            if full.startswith(candidate + after, pos):
                out.append((candidate, False))
                pos += len(candidate)
                break
        else:
            return None
    return out if pos == len(full) else None


def _text(message: dict[str, Any]) -> str:
    """Message content as text; OpenAI content parts of type "text" are joined."""
    content = message.get("content")
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
        return "".join(p.get("text", "") for p in content)
    raise InvalidParameterError("message content must be a string or a list of content parts")
