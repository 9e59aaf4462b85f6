"""The abstract tool-call format and the registry of formats (one module each under ``formats/``).

A format parses a model's whole output so far into content and calls, and builds the grammar that forces a
call; ``detects`` says whether a chat template's model writes it.  Formats register themselves by name
(``@register``); ``detect_format`` asks them in ``detect_order`` (llama.cpp's order: first match wins).
"""

from __future__ import annotations

import functools
import secrets
import string
from abc import ABC, abstractmethod
from typing import Sequence

from ...errors import InvalidParameterError
from .rules import Rules
from .scan import Incomplete, Invalid
from .types import Parsed, Tool

def hold(content: str, partial: bool, markers: Sequence[str]) -> str:
    """``content`` less a tail that may still grow into one of ``markers`` (while the text is partial)."""
    if not partial or not content:
        return content
    for n in range(min(len(content), max(map(len, markers))), 0, -1):
        tail = content[-n:]
        if any(m.startswith(tail) for m in markers):
            return content[:-n]
    return content


class ToolFormat(ABC):
    """How one model family writes tool calls: parsing, and the grammar that forces a call."""

    name = ""
    detect_order = 100  # where ``detect_format`` asks this format (lower first): a template that two formats'
    # tests match is the more specific one's (GLM's ``<tool_call>`` with ``<arg_key>`` before Hermes')
    markers: tuple[str, ...] = ()  # texts that may be control tokens: the output keeps them for the parser
    # The words that open a call, from which ``grammar`` matches: under ``tool_choice: auto`` the output is free
    # until one of them, then the call's grammar (a lazy grammar, llama.cpp's ``grammar_lazy``).  () where a
    # call has no opening word (Llama 3's bare JSON): ``auto`` is then free text, read by the parser.
    triggers: tuple[str, ...] = ()
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
        except (Invalid, Incomplete):
            if partial:
                return Parsed(hold(text, True, self.markers) if self.markers else "")
        else:
            if partial or not self._cut(parsed, text):
                return parsed
        try:  # cut short (max_tokens): what the partial reading has, if it is text only (a response, no call)
            cut = self._parse(text, True, tools)
        except (Invalid, Incomplete):
            return Parsed(text)
        return cut if cut.content and not cut.calls and not self._cut(cut, text) else Parsed(text)

    @classmethod
    def detects(cls, template: str) -> bool:
        """Whether a chat template's text shows that its model writes this format."""
        return False

    @abstractmethod
    def _parse(self, text: str, partial: bool, tools: Sequence[Tool]) -> Parsed:
        """``text`` read as content and calls; raises ``Invalid`` (or ``Incomplete``) where it is not this format."""

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
        g = Rules()
        calls = [self._call_rule(g, t, i) for i, t in enumerate(tools)]
        g.add("call", " | ".join(calls))
        self._root(g, parallel)
        return g.text()

    def auto_grammar(self, tools: Sequence[Tool], parallel: bool, response: dict | None) -> str | None:
        """The grammar for ``tool_choice: auto`` from the first token (None: the output is free until a trigger,
        then ``grammar``; free and parsed where the format has no ``triggers``)."""
        return self.grammar(tools, parallel) if self.triggers else None

    def example(self, parallel: bool = False) -> str:
        """A call in this format, for the tools' system message of a template that does not describe tools."""
        return ""

    def _call_rule(self, g: Rules, tool: Tool, i: int) -> str:
        raise NotImplementedError

    def _root(self, g: Rules, parallel: bool) -> None:
        g.add("root", "call ( call )*" if parallel else "call")


FORMATS: dict[str, ToolFormat] = {}  # by name, in the order registered (``formats/__init__``)


def register(cls: type[ToolFormat]) -> type[ToolFormat]:
    """Class decorator: the format is known by its ``name`` (a role's ``tool_call_format``) and detected from
    templates in its ``detect_order``."""
    FORMATS[cls.name] = cls()
    return cls


def get_format(name: str) -> ToolFormat:
    """A format by name (a role's or the command line's choice)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise InvalidParameterError(f"unknown tool-call format {name!r}; choose one of {', '.join(FORMATS)}") from None


@functools.lru_cache(maxsize=64)
def detect_format(template: str | None) -> str:
    """The format a chat template's model writes, from the template's text (llama.cpp's order); remembered per
    template, since a role's template is read for it on every chat request with tools."""
    src = template or ""
    return next(f.name for f in sorted(FORMATS.values(), key=lambda f: f.detect_order) if f.detects(src))
