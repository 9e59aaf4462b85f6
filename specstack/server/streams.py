"""Server-sent event bodies from a ``Session``'s events: OpenAI's chunks (``chat.completion.chunk`` or
``text_completion``, a finish chunk per choice, usage and ``[DONE]``) and llama-server's native chunks."""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from typing import Any, AsyncIterator

from .native import Native
from .telemetry import final_timings
from .responses import LogprobsOut, chunk, summary, system_fingerprint, total_usage
from .events import Delta, Done, Failed, Progress
from .session import Session
from .tools import ChoiceOutput


class OpenAIChunks:
    """One OpenAI stream's shape: its id, object, model and options, and each choice's text offset."""

    def __init__(self, session: Session, rid: str, chat: bool, include_usage: bool, echoes: list[str] | None = None,
                 per_prompt: int = 1, outputs: list[ChoiceOutput] | None = None, native: Native | None = None) -> None:
        self.session, self.rid, self.chat, self.include_usage = session, rid, chat, include_usage
        self.native = native  # fed every event where the request is verbose: each choice's ``__verbose``
        self.echoes = echoes or [""] * len(session.jobs)
        self.offsets = [len(echo) for echo in self.echoes]  # text_offset of each choice's next token
        self.per_prompt, self.outputs = per_prompt, outputs
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.model = session.backend.role.name

    def piece(self, i: int, choice: dict[str, Any], extra: dict[str, Any] | None = None,
              top: dict[str, Any] | None = None) -> str:
        return chunk(self.rid, self.obj, self.created, self.model, {**choice, "index": i}, self.include_usage, extra,
                     top)

    def opening(self) -> list[str]:
        """Each choice's first chunks: chat's assistant role (with ``content`` null, as llama-server and OpenAI
        send it), completions' echo (even when no token follows)."""
        out = []
        for i, echo in enumerate(self.echoes):
            if self.chat:
                out.append(self.piece(i, {"delta": {"role": "assistant", "content": None}, "finish_reason": None}))
            if echo:
                out.append(self.piece(i, {"text": echo, "logprobs": None, "finish_reason": None}))
        return out

    def delta(self, event: Delta) -> list[str]:
        """A delta's chunks: its text (or, with tools, what the re-read message gained), logprobs and tokens."""
        i = event.index
        if self.native is not None:
            self.native.add(event)
        lp = None
        if event.logprobs is not None:
            out = LogprobsOut(self.session.backend.target, self.chat, self.offsets[i])
            out.add(event)
            lp = out.body()
        self.offsets[i] += len(event.text)
        if self.outputs is not None:
            return [self.piece(i, {"delta": delta, "logprobs": lp if n == 0 else None, "finish_reason": None},
                               {"tokens": event.tokens} if n == 0 else None)
                    for n, delta in enumerate(self.outputs[i].add(event))]
        choice = ({"delta": {"content": event.text}, "logprobs": lp} if self.chat
                  else {"text": event.text, "logprobs": lp})
        return [self.piece(i, {**choice, "finish_reason": None}, {"tokens": event.tokens})]

    def progress(self, event: Progress) -> list[str]:
        """A prompt progress chunk, as llama-server sends one: the assistant's empty opening delta with
        ``prompt_progress`` (``total``, ``cache``, ``processed``, ``time_ms``) beside it."""
        choice = {"delta": {"role": "assistant", "content": None}} if self.chat else {"text": "", "logprobs": None}
        return [self.piece(event.index, {**choice, "finish_reason": None}, top={"prompt_progress": event.fields()})]

    def done(self, event: Done) -> list[str]:
        """A choice's finish chunk (with tools: the message's last deltas first), speculation's summary in it; as
        llama-server, its ``timings`` where no usage chunk follows, and a verbose request's ``__verbose`` in the
        first of these chunks."""
        i, reason = event.index, event.finish_reason
        verbose = {}
        if self.native is not None:
            self.native.add(event)
            verbose = {"__verbose": self.native.result(i, event, streamed=True)}
        choices = []
        if self.outputs is not None:
            choices = [{"delta": delta, "logprobs": None, "finish_reason": None} for delta in self.outputs[i].finish()]
            reason = self.outputs[i].finish_reason(reason)
        choices.append({**({"delta": {}} if self.chat else {"text": "", "logprobs": None}), "finish_reason": reason})
        last = len(choices) - 1
        return [self.piece(i, c, {"speculative": summary(event.stats)} if n == last else None,
                           {**(verbose if n == 0 else {}),
                            **({"timings": final_timings(event)} if n == last and not self.include_usage else {})})
                for n, c in enumerate(choices)]

    def closing(self) -> list[str]:
        """After the last choice: the usage chunk (each prompt counted once), if asked for, and ``[DONE]``."""
        usage = total_usage(self.session.finals(), self.per_prompt)
        self.session.request.state.usage = usage  # for the access log
        tail = [json.dumps({"id": self.rid, "object": self.obj, "created": self.created, "model": self.model,
                            "system_fingerprint": system_fingerprint(), "choices": [], "usage": usage, "timings": final_timings(self.session.finals()[0])})
                ] if self.include_usage else []
        return tail + ["[DONE]"]


async def openai_stream(shape: OpenAIChunks) -> AsyncIterator[str]:
    """The choices' chunks as they come, each with its ``index``; every choice ends with its finish chunk, the
    usage chunk and ``[DONE]`` follow the last; an error ends the stream with OpenAI's error object."""
    try:
        for piece in shape.opening():
            yield piece
        async with aclosing(shape.session.events()) as events:
            async for event in events:
                if isinstance(event, Failed):
                    yield json.dumps({"error": {"message": event.message, "type": event.kind,
                                                "param": event.param, "code": event.status}})
                    return
                shaped = (shape.delta if isinstance(event, Delta) else shape.progress if isinstance(event, Progress)
                          else shape.done)
                for piece in shaped(event):
                    yield piece
        for piece in shape.closing():
            yield piece
    finally:
        if not shape.session.complete:
            shape.session.cancel_unfinished()  # the client went away mid-stream


async def native_stream(session: Session, native: Native, per_token: bool = False) -> AsyncIterator[str]:
    """SSE chunks as llama-server sends them: one per delta (``stop: false``), then each choice's final result
    (``stop: true``); no ``[DONE]``, as the native route has none.  A ``return_progress`` request's prompt progress
    comes first, each chunk with its ``timings`` where ``per_token`` (``timings_per_token``) asks for them."""
    async with aclosing(session.events()) as events:
        async for event in events:
            i = event.index
            if isinstance(event, Failed):
                yield json.dumps({"error": {"code": event.status, "message": event.message,
                                            "type": event.kind, "param": event.param}})
                return
            if isinstance(event, Progress):  # return_progress: before the first token, as llama-server's partials
                yield json.dumps(native.progress(i, event, per_token))
                continue
            part = native.add(event)
            if isinstance(event, Delta):
                yield json.dumps({"index": i, **part, "stop": False, "id_slot": native.slot[i],
                                  "tokens_predicted": len(native.ids[i]),
                                  "tokens_evaluated": len(session.jobs[i].prompt_ids)})
            else:
                yield json.dumps(native.result(i, event, streamed=True))
    if session.complete:
        session.request.state.usage = native.usage(session.finals())
