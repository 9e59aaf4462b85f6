"""Reasoning as llama-server parses it: the ``<think>...</think>`` block a thinking model (DeepSeek-R1, Qwen3, QwQ)
writes before its answer, taken out of the content into ``reasoning_content``.

llama-server's ``--reasoning-format`` (and a request's ``reasoning_format``, which wins):

- ``none``: the thinking stays in ``content`` as written (a prompt that opened the block gives content its
  opening tag, as llama-server's parser reads the generation prompt's ``<think>`` with the output);
- ``auto`` (llama-server's default) and ``deepseek``: the thinking goes to ``reasoning_content`` (streams send
  it as ``delta.reasoning_content``), the answer after ``</think>`` to ``content``;
- ``deepseek-legacy``: both: ``reasoning_content``, and ``content`` keeping the ``<think>`` block; a stream keeps
  it inline in the content deltas only (llama-server's ``reasoning_in_content``).

A template parses reasoning only where it shows a model that thinks (its text holds a known tag pair, as
llama.cpp's template analysis finds one; ``template_tags``); other models' output is left whole.  A template
whose generation prompt ends with the opening tag (DeepSeek-R1's ``<｜Assistant｜><think>\\n``) starts the output
inside the block, "thinking forced open" (``forced_opening``): everything up to ``</think>`` is thinking.  A
block never closed (the answer cut by max_tokens) is all thinking, as its stream has sent it.  Tool calls are
read from the content only: a call written while thinking is not a call.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import hold

FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
# The tag pairs of thinking models, the more specific first: Seed-OSS, Magistral, Kimi, then the common one
TAGS = (("<seed:think>", "</seed:think>"), ("[THINK]", "[/THINK]"), ("◁think▷", "◁/think▷"), ("<think>", "</think>"))


def template_tags(template: str | None) -> tuple[str, str] | None:
    """The thinking tags a chat template's model writes (None: the template shows no reasoning)."""
    src = template or ""
    return next(((start, end) for start, end in TAGS if start in src and end in src), None)


def forced_opening(prompt: str, start: str) -> str:
    """The opening of a think block a rendered prompt ends with ("" where it ends otherwise): its generation
    prompt starts the model inside the block (``<think>\\n``; a closed ``<think>\\n\\n</think>`` does not)."""
    stripped = prompt.rstrip()
    return prompt[len(stripped) - len(start):] if stripped.endswith(start) else ""


@dataclass(frozen=True)
class Split:
    reasoning: str  # the thinking, stripped ("" where there is none)
    head: str  # the think block as written (with the prompt's opening and its trailing space): legacy's content
    content: str  # the text after the block, which tool calls are read from


@dataclass(frozen=True)
class Reasoning:
    """How one chat request's output is split into thinking and content."""

    start: str
    end: str
    format: str = "auto"
    opening: str = ""  # the prompt's opening of a block the output starts inside ("": not forced open)
    stream: bool = False

    @property
    def extract(self) -> bool:
        """Whether ``reasoning_content`` is filled (every format but ``none``)."""
        return self.format != "none"

    @property
    def inline(self) -> bool:
        """Whether the content keeps the think block (``deepseek-legacy``)."""
        return self.format == "deepseek-legacy"

    @property
    def deltas(self) -> bool:
        """Whether a stream sends ``reasoning_content`` deltas (legacy streams keep the thinking inline)."""
        return self.extract and not (self.inline and self.stream)

    def split(self, text: str, partial: bool = False) -> Split:
        """The output so far (``partial``: more may come, so a tail that may grow into a tag waits)."""
        full = self.opening + text
        if not self.extract:
            return Split("", "", full)
        body = full.lstrip()
        if not body.startswith(self.start):
            if partial and self.start.startswith(body):  # may still open a block
                return Split("", "", "")
            return Split("", "", text)
        inner_at = len(full) - len(body) + len(self.start)
        close = full.find(self.end, inner_at)
        if close < 0:  # still thinking (or cut short: all of it is thinking)
            inner = hold(full[inner_at:], partial, (self.end,))
            return Split(inner.strip(), full[:inner_at] + inner, "")
        after = close + len(self.end)
        rest = full[after:]
        content = rest.lstrip()
        return Split(full[inner_at:close].strip(), full[:len(full) - len(content)], content)
