"""Chat messages to a prompt: the GGUF's own chat template, or a documented plain format.

Templates are Jinja (``tokenizer.chat_template``), rendered in a sandbox as
llama.cpp and transformers do, with ``messages``, ``add_generation_prompt``,
``bos_token`` and ``eos_token``.  A model without a template (the bundled
code models) gets the plain format::

    ### System:
    You are terse.

    ### User:
    Write a stack class.

    ### Assistant:
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..errors import InvalidParameterError
from ..machine.gguf_meta import read_gguf

ROLES = ("system", "user", "assistant", "tool")


def load_template(model: Path) -> str | None:
    """The GGUF's chat template, if it has one."""
    template = read_gguf(model, tensors=False).get("tokenizer.chat_template")
    return template if isinstance(template, str) and template.strip() else None


def render(messages: Sequence[dict[str, Any]], template: str | None, bos: str = "", eos: str = "") -> str:
    """The prompt for ``messages``, ending where the assistant's answer starts."""
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise InvalidParameterError(f"messages[{i}].role must be one of {', '.join(ROLES)} (got {m.get('role')!r})")
    if template is None:
        parts = [f"### {m['role'].capitalize()}:\n{_text(m)}\n\n" for m in messages]
        return "".join(parts) + "### Assistant:\n"
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise InvalidParameterError(f"the model's chat template refused the messages: {message}")

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=[{**m, "content": _text(m)} for m in messages],
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
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise InvalidParameterError("message content must be a string or a list of content parts")
