"""Anthropic's answers from a chat choice's output (``tools.ChoiceOutput``): the whole ``message`` object, or the
stream's typed events (``message_start``, ``content_block_start``/``_delta``/``_stop``, ``message_delta``,
``message_stop``), as llama-server's ``to_json_anthropic`` and ``to_json_anthropic_stream`` write them.

Blocks come in the order the model writes them: thinking (with an empty ``signature``: a local model signs
nothing), text, then one ``tool_use`` per call; a stream numbers them from 0 and closes each before the next
opens, as Anthropic's own stream does.  ``stop_reason`` is ``end_turn``, ``max_tokens``, ``tool_use``, or
``stop_sequence`` with the client's ``stop_sequence`` that ended the text.  Usage counts the prompt's reused
tokens apart (``cache_read_input_tokens``); speculation's summary rides along under ``speculative``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .events import Done
from .responses import summary
from .tools import ChoiceOutput


def _event(kind: str, **data: Any) -> dict[str, Any]:
    return {"event": kind, "data": json.dumps({"type": kind, **data})}


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's ``input`` is ({} where the text is no JSON object)."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageShape:
    """One Anthropic answer from its choice's output; ``stop`` is the request's stop sequences (which one ended
    the text is read from the generation's whole output)."""

    def __init__(self, model: str, output: ChoiceOutput, stop: list[str]) -> None:
        self.id, self.model, self.output, self.stop = "msg_" + uuid.uuid4().hex[:24], model, output, stop
        self.index = -1  # the open block's index in a stream (-1: none yet)
        self.open: str | None = None  # the open block's kind: thinking, text, or call<i> (a tool_use)

    # -- the message object --------------------------------------------------------------------------------

    @staticmethod
    def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
        """Anthropic's usage: the prompt's reused tokens apart from those it processed (nothing is written to a
        cache on request: the prefix cache is automatic)."""
        return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": output_tokens}

    def stop_reason(self, final: Done) -> tuple[str, str | None]:
        """Why the answer ended, in Anthropic's words, and the stop sequence that ended it (None: none did)."""
        if self.output.message().get("tool_calls") and final.finish_reason in ("stop", "tool_calls"):
            return "tool_use", None
        if final.finish_reason != "stop":
            return "max_tokens", None
        word = self._stop_word()
        return ("stop_sequence", word) if word else ("end_turn", None)

    def _stop_word(self) -> str | None:
        gen = getattr(self.output.job, "gen", None)
        if gen is None or getattr(gen.stats, "stop_reason", "") != "stop" or not self.stop:
            return None
        whole = self.output.vocab.detokenize(gen.output_ids)
        at = len(self.output.text)
        return next((s for s in self.stop if whole.startswith(s, at)), None)

    def blocks(self) -> list[dict[str, Any]]:
        """The finished message's content blocks (an empty text block where there is nothing else)."""
        message = self.output.message()
        out: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            out.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            out.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            out.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _arguments(call["function"]["arguments"])})
        return out or [{"type": "text", "text": ""}]

    def whole(self, final: Done) -> dict[str, Any]:
        """The message once its choice is done (its output already ``finish``ed)."""
        reason, word = self.stop_reason(final)
        return {"id": self.id, "type": "message", "role": "assistant", "content": self.blocks(), "model": self.model,
                "stop_reason": reason, "stop_sequence": word,
                "usage": self.usage(final.prompt_tokens, final.stats.get("reused_prompt_tokens") or 0,
                                    final.completion_tokens), "speculative": summary(final.stats)}

    # -- the stream ----------------------------------------------------------------------------------------

    def opening(self, prompt_tokens: int, cached: int) -> list[dict[str, Any]]:
        return [_event("message_start", message={
            "id": self.id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None, "usage": self.usage(prompt_tokens, cached, 0)})]

    def deltas(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events for a choice output's chat deltas (``ChoiceOutput.add`` / ``finish``)."""
        out: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                out += self._block("thinking", {"type": "thinking", "thinking": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                out += self._block("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                if call.get("id"):
                    out += self._block(f"call{call['index']}", {"type": "tool_use", "id": call["id"],
                                                                "name": fn.get("name", ""), "input": {}})
                if fn.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def closing(self, final: Done) -> list[dict[str, Any]]:
        """The last block closed (an empty text block first where none opened), ``message_delta`` and
        ``message_stop``."""
        out = [] if self.open is not None else self._block("text", {"type": "text", "text": ""})
        out += self._close()
        reason, word = self.stop_reason(final)
        out.append(_event("message_delta", delta={"stop_reason": reason, "stop_sequence": word},
                          usage={"output_tokens": final.completion_tokens}, speculative=summary(final.stats)))
        return out + [_event("message_stop")]

    def _block(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        """Open a block of ``kind`` unless it is the open one (the open one closed first)."""
        if self.open == kind:
            return []
        out = self._close()
        self.index += 1
        self.open = kind
        return out + [_event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # Anthropic's stream signs a thinking block before it closes
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        out.append(_event("content_block_stop", index=self.index))
        self.open = None
        return out

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return _event("content_block_delta", index=self.index, delta=delta)
