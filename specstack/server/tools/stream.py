"""A choice's output as it streams: the deltas of a message re-read after each piece, and the text the
parser reads (control-token markers written out)."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..events import Delta
from .plan import ToolPlan
from .reasoning import Reasoning
from .types import Parsed, ToolCall

@dataclass
class ToolStream:
    """One choice's message as it streams: ``update`` with the whole text so far gives the OpenAI deltas.

    The thinking (``reasoning``: a model that thinks) is split off first, and the calls (``plan``: a request
    with tools) are read from the content after it; without either the text is the content."""

    plan: ToolPlan | None
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    new_id: Callable[[], str] | None = None
    reasoning: Reasoning | None = None
    thinking: str = ""  # the reasoning_content so far

    def update(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        head = ""
        if self.reasoning is not None:
            split = self.reasoning.split(text, partial=not final)
            text, head = split.content, split.head if self.reasoning.inline else ""
            if split.reasoning != self.thinking and split.reasoning.startswith(self.thinking):
                if self.reasoning.deltas:
                    deltas.append({"reasoning_content": split.reasoning[len(self.thinking):]})
                self.thinking = split.reasoning
        parsed = self.plan.parse(text, partial=not final) if self.plan is not None else Parsed(text)
        content = head + parsed.content
        content = content if final else content.rstrip()  # whitespace waits: a call may strip it
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
                self.ids.append((self.new_id or self.plan.format.new_id)())  # type: ignore[union-attr]
                self.calls.append(call)
                deltas.append({"tool_calls": [{"index": i, "id": self.ids[i], "type": "function",
                                               "function": {"name": call.name, "arguments": call.arguments}}]})
        return deltas

    def message(self) -> dict[str, Any]:
        """The finished message in OpenAI's shape (``content`` None when there are calls and no text)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content if (self.content or not self.calls) else None}
        if self.thinking and self.reasoning is not None and self.reasoning.extract:
            out["reasoning_content"] = self.thinking
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
    data = b"".join(preserved[t].encode() if t in preserved else vocab.token_bytes(t) for t in ids)
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=final)


class ChoiceOutput:
    """One chat choice's output read as a message, for the routes: the events' text (control-token markers
    written out from the generation's ids where the vocabulary has them as tokens), the deltas a stream
    sends, and the final message and finish reason.  ``plan``: the request's tools (None: none);
    ``reasoning``: how its thinking is split off (None: the model's text is not parsed for it)."""

    def __init__(self, plan: ToolPlan | None, vocab: Any, job: Any, preserved: dict[int, str],
                 reasoning: Reasoning | None = None) -> None:
        self.plan, self.vocab, self.job, self.preserved = plan, vocab, job, preserved
        self.stream = ToolStream(plan, reasoning=reasoning)
        self.text = ""
        self.n_tokens = 0

    def add(self, event: Delta, deltas: bool = True) -> list[dict[str, Any]]:
        """Take a delta event; with ``deltas``, the stream's deltas for it (a response parses once, at the end)."""
        self.text += event.text
        self.n_tokens += len(event.tokens)
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
