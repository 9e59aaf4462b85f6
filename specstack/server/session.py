"""The one session layer: a request's jobs started on its role's backend, read event by event, cancelled,
collected.  Every generating route (OpenAI's completions and chat, llama-server's /completion) runs through
``start`` and then either ``Session.collect`` (a whole response) or ``Session.events`` (a stream), so the
event loop, the disconnect checks and the cancellation are written once.

An event is the worker's dict: ``delta`` (text, tokens, logprobs), ``done`` (finish reason, stats, usage) or
``error`` (status, message, kind, param), each tagged with its choice's ``index``.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Any, AsyncIterator, Callable

from fastapi import Request

from .backends import Limits, RoleBackend
from .jobs import make_jobs, prepare_grammar, session_key
from .prometheus import note_answer
from .responses import ApiError
from .structured import grammar_field
from .worker import Job, QueueFull

# The request's session (``jobs.session_key``), set around ``submit``: a scale-out backend routes by it
# (``scaleout.remote``); the single-process worker has one engine and ignores it.
SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("specstack_session", default=None)
DISCONNECT_POLL_S = 0.25  # how often a waiting request looks for its client having gone

Event = dict[str, Any]


class Session:
    """One request's jobs on one backend, from their first event on; ``finished`` holds each choice's last
    event (done or error) by index."""

    def __init__(self, request: Request, backend: RoleBackend, jobs: list[Job], first: Event) -> None:
        self.request, self.backend, self.jobs, self.first = request, backend, jobs, first
        self.finished: dict[int, Event] = {}

    async def next_event(self) -> Event | None:
        """The next event of any of the jobs; None (and the jobs cancelled) when the client disconnects.

        The client is checked every ``DISCONNECT_POLL_S`` whether or not events keep coming: a plain
        response's tokens arrive faster than that, and checking only when none came never noticed
        a client that had left (the generation ran on for minutes, holding its slot)."""
        return await next_event(self.request, self.backend, self.jobs)

    def cancel(self) -> None:
        """Cancel every job (a job already finished is left as it is by its worker)."""
        for job in self.jobs:
            self.backend.cancel(job)

    def cancel_unfinished(self) -> None:
        """Cancel the jobs that have not finished (a stream left early, or one choice failed)."""
        for job in self.jobs:
            if job.index not in self.finished:
                self.backend.cancel(job)

    @property
    def complete(self) -> bool:
        return len(self.finished) == len(self.jobs)

    def finals(self) -> list[Event]:
        """Each choice's last event, in index order (once ``complete``)."""
        return [self.finished[i] for i in range(len(self.jobs))]

    async def collect(self, take: Callable[[Event], None]) -> list[Event] | None:
        """Every event to the end, for a whole response: ``take`` sees each delta and done event as it comes.
        The finals in index order; None when the client went away (the jobs cancelled); an error event cancels
        the jobs and raises its ``ApiError``."""
        event: Event | None = self.first
        while event is not None:
            if event["type"] == "error":
                self.cancel()
                raise ApiError.from_event(event)
            take(event)
            if event["type"] == "done":
                self.finished[event["index"]] = event
                if self.complete:
                    return self.finals()
            event = await self.next_event()
        return None

    async def collect_into(self, output: Any) -> list[Event] | None:
        """``collect`` for a one-choice answer that is shaped from its parsed output (a message, a response):
        each delta read into ``output`` (its text, reasoning and tool calls), which is finished at the end."""

        def take(event: Event) -> None:
            if event["type"] == "delta":
                output.add(event, deltas=False)

        finals = await self.collect(take)
        if finals is not None:
            output.finish()
        return finals

    async def events(self) -> AsyncIterator[Event]:
        """Every event to the end, for a stream: the first error ends it (the other choices cancelled first).
        Leaving early (the client went away mid-stream) cancels what has not finished; close it with
        ``contextlib.aclosing`` so that happens at once."""
        event = self.first
        try:
            while True:
                if event["type"] in ("done", "error"):
                    self.finished[event["index"]] = event
                if event["type"] == "error":
                    self.cancel_unfinished()
                    yield event
                    return
                yield event
                if self.complete:
                    return
                event = await self.jobs[0].events.get()
        finally:
            if not self.complete:
                self.cancel_unfinished()


async def start(request: Request, w: RoleBackend, body: Any, prompts: list[list[int]], limits: Limits, chat: bool,
                grammar: str | None = None, triggers: tuple[str, ...] = ()) -> Session:
    """A request's jobs made (``jobs.make_jobs``), submitted, and their first event read: ``ApiError`` for a
    refusal (429 when the queue is full), 499 for a client gone before it.  ``triggers``: the grammar is lazy,
    free text until one of them (a tool call under ``tool_choice: auto``)."""
    if grammar:
        grammar, triggers = await prepare_grammar(w, grammar, grammar_field(body), triggers)
    # prompt progress, for a stream that asks (llama-server's return_progress): chunks of their own before the first
    # token; a whole answer has nowhere to put them
    progress = bool(body.stream and getattr(body, "return_progress", None))
    jobs = make_jobs(w, body, prompts, limits, "messages" if chat else "prompt", grammar, triggers, progress)
    token = SESSION.set(session_key(request, body))
    try:
        w.submit(*jobs)
    except QueueFull as exc:
        raise ApiError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(limits.retry_after_s)}) from None
    finally:
        SESSION.reset(token)
    first = await next_event(request, w, jobs)
    if first is None:
        raise ApiError(499, "the client closed the connection")  # the jobs were cancelled
    if first["type"] == "error":
        for job in jobs:
            w.cancel(job)
        raise ApiError.from_event(first)
    return Session(request, w, jobs, first)


async def next_event(request: Request, w: RoleBackend, jobs: list[Job]) -> Event | None:
    """The next event of any of ``jobs`` (``Session.next_event``)."""
    head = jobs[0]
    while True:
        now = time.monotonic()
        if now - head.checked_at >= DISCONNECT_POLL_S:
            head.checked_at = now
            if await request.is_disconnected():
                for job in jobs:
                    w.cancel(job)
                return None
        try:
            event = await asyncio.wait_for(head.events.get(), timeout=DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            continue
        if event["type"] == "error" and event.get("metered"):
            note_answer(metered=True)  # the worker counted this failure: its answer is not counted again
        return event
