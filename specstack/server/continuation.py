"""A chat's last message continued instead of answered: llama-server's assistant prefill and vLLM's
``continue_final_message``, with the request's ``add_generation_prompt``.

llama-server (``server-common.cpp``, ``common/chat-auto-parser-generator.cpp``) reads them so:

- ``add_generation_prompt`` (default true) opens the assistant's turn after the messages; false leaves it
  unopened (the prompt ends with the last message's turn);
- ``continue_final_message``: true (``auto``), ``"content"`` or ``"reasoning_content"`` continues the last
  message: the messages before it are rendered without a generation prompt, then the assistant's generation
  prompt, then the message's text as it stands, so the model writes on from its last word.  ``auto`` continues
  the reasoning where the message has reasoning and no content, else the content;
- a chat that ends with an assistant message is continued (``auto``) without being asked (llama-server's
  ``--prefill-assistant``, on by default), unless two assistant messages end it (refused: which one?);
- continuing and opening a new turn at once is refused, as is continuing an assistant message's tool calls.

Where the template shows thinking (``tools.template_tags``), the generation prompt is cut before its opening
tag and the tag written again with the message's reasoning, and its closing tag before content: a thinking
model continues its answer after a closed block, or its thinking inside an open one.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import InvalidParameterError
from .chat import ChatTemplate, RenderedChat, content_text, render
from .tools.reasoning import template_tags

MODES = ("auto", "content", "reasoning_content")


def continuation(messages: Sequence[dict[str, Any]], add_generation_prompt: bool | None,
                 continue_final_message: bool | str | None, prefill: bool = True) -> tuple[bool, str | None]:
    """Whether the assistant's turn is opened, and how the last message is continued (None: it is not), as
    llama-server decides; ``InvalidParameterError`` for the combinations it refuses, naming the field."""
    opened = True if add_generation_prompt is None else add_generation_prompt
    mode = _mode(continue_final_message)
    last = messages[-1] if messages else {}
    if mode is None and prefill and last.get("role") == "assistant":
        if len(messages) >= 2 and messages[-2].get("role") == "assistant":
            raise InvalidParameterError("messages: a chat cannot end with two or more assistant messages (the last "
                                        "one is continued as the answer's start); merge them or add a user turn")
        mode, opened = "auto", False
    if mode is not None and opened:
        raise InvalidParameterError("add_generation_prompt and continue_final_message cannot both be true: a "
                                    "continued message is not followed by a new turn; send add_generation_prompt: "
                                    "false")
    if mode is not None and last.get("role") == "assistant" and last.get("tool_calls"):
        raise InvalidParameterError("continue_final_message: the last message makes tool calls, which cannot be "
                                    "continued; end the chat with a tool result or a user message")
    return opened, mode


def _mode(value: bool | str | None) -> str | None:
    """llama.cpp's ``common_chat_continuation_parse``: true is ``auto``; false, None: not continued."""
    if value is True:
        return "auto"
    if isinstance(value, str):
        if value not in MODES[1:]:
            raise InvalidParameterError(f"continue_final_message must be true, false, \"content\" or "
                                        f"\"reasoning_content\" (got {value!r})")
        return value
    return None


def render_continued(messages: Sequence[dict[str, Any]], template: ChatTemplate, mode: str,
                     **kwargs: Any) -> RenderedChat:
    """The prompt that continues the last of ``messages`` (``render``'s keywords pass through): the others
    without a generation prompt, then the generation prompt (what opening the turn adds to them), then the
    message's reasoning or content, which stay the request's text, never markup."""
    *before, last = messages
    closed = render(before, template, generation_prompt=False, **kwargs)
    opened = render(before, template, generation_prompt=True, **kwargs)
    generation = _added(closed.text, opened.text)
    content, reasoning = content_text(last.get("content"), "\n\n"), last.get("reasoning_content") or ""
    if mode == "auto":
        mode = "reasoning_content" if reasoning and not content else "content"
    pieces = list(closed.pieces)
    tags = template_tags(template.text) if template.kind == "jinja" else None
    if tags is not None:
        start, end = tags
        at = generation.find(start)
        pieces += [(generation[:at] if at >= 0 else generation, True), (start, True), (reasoning, False)]
        if mode == "content":
            pieces.append((end, True))
    else:
        pieces.append((generation, True))
    if mode == "content":
        pieces.append((content, False))
    return RenderedChat(tuple((text, trusted) for text, trusted in pieces if text))


def _added(closed: str, opened: str) -> str:
    """What ``opened`` has past the longest prefix it shares with ``closed`` (llama.cpp's generation prompt)."""
    n = 0
    for a, b in zip(closed, opened):
        if a != b:
            break
        n += 1
    return opened[n:]
