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

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from ..errors import InvalidParameterError
from ..machine.gguf_meta import read_gguf
from ..target import apply_builtin_chat_template, builtin_chat_templates

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


def render(messages: Sequence[dict[str, Any]], template: ChatTemplate, bos: str = "", eos: str = "") -> str:
    """The prompt for ``messages``, ending where the assistant's answer starts."""
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise InvalidParameterError(f"messages[{i}].role must be one of {', '.join(ROLES)} (got {m.get('role')!r})")
    if template.kind == "plain":
        parts = [f"### {m['role'].capitalize()}:\n{_text(m)}\n\n" for m in messages]
        return "".join(parts) + "### Assistant:\n"
    if template.kind == "builtin":
        try:
            return apply_builtin_chat_template(template.text, [(m["role"], _text(m)) for m in messages])
        except ValueError as exc:
            raise InvalidParameterError(str(exc)) from None
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise InvalidParameterError(f"the model's chat template refused the messages: {message}")

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template.text).render(messages=[{**m, "content": _text(m)} for m in messages],
                                                add_generation_prompt=True, bos_token=bos, eos_token=eos)
    except InvalidParameterError:
        raise
    except Exception as exc:
        raise InvalidParameterError(f"the model's chat template failed on these messages: {exc}") from None


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
