"""The one session layer: a request's plan (``plan.RequestPlan``) run as jobs on its role's backend, read event
by event, cancelled, collected.  Every generating route (OpenAI's, llama-server's, the Responses and Anthropic
APIs) runs its plan through ``start`` and then either ``Session.collect`` (a whole response) or
``Session.events`` (a stream), so the event loop, the disconnect checks and the cancellation are written once.

An event is one of ``events``' records (``Delta``, ``Progress``, ``Done``, ``Failed``), each tagged with its
choice's ``index``.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Any, AsyncIterator, Callable

from fastapi import Request

from .backends import RoleBackend
from .events import Delta, Done, Event, Failed
from .plan import RequestPlan
from .prometheus import note_answer
from .responses import ApiError
from .tools import ChoiceOutput
from .worker import Job, QueueFull

# The request's session (``RequestPlan.session``), set around ``submit``: a scale-out backend routes by it
# (``scaleout.remote``); the single-process worker has one engine and ignores it.
SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("specstack_session", default=None)
DISCONNECT_POLL_S = 0.25  # how often a waiting request looks for its client having gone


class Session:
    """One request's jobs on its plan's backend, from their first event on; ``finished`` holds each choice's last
    event (done or error) by index; ``outputs``: each choice's output read as a message, where the plan reads
    them so (None: plain text)."""

    def __init__(self, request: Request, plan: RequestPlan, jobs: list[Job], first: Event) -> None:
        self.request, self.plan, self.backend, self.jobs, self.first = request, plan, plan.backend, jobs, first
        self.finished: dict[int, Event] = {}
        self.outputs = None if plan.markers is None else [
            ChoiceOutput(plan.tools, plan.backend.target, job, plan.markers, plan.reasoning) for job in jobs]

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
            if isinstance(event, Failed):
                self.cancel()
                raise ApiError.from_event(event)
            take(event)
            if isinstance(event, Done):
                self.finished[event.index] = event
                if self.complete:
                    return self.finals()
            event = await self.next_event()
        return None

    async def collect_into(self, output: Any) -> list[Event] | None:
        """``collect`` for a one-choice answer that is shaped from its parsed output (a message, a response):
        each delta read into ``output`` (its text, reasoning and tool calls), which is finished at the end."""

        def take(event: Event) -> None:
            if isinstance(event, Delta):
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
                if isinstance(event, (Done, Failed)):
                    self.finished[event.index] = event
                if isinstance(event, Failed):
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


async def start(request: Request, plan: RequestPlan) -> Session:
    """A plan's jobs (one per choice of each prompt) submitted and their first event read: ``ApiError`` for a
    refusal (429 when the queue is full), 499 for a client gone before it."""
    w = plan.backend
    jobs = _jobs(plan)
    token = SESSION.set(plan.session)
    try:
        w.submit(*jobs)
    except QueueFull as exc:
        raise ApiError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(plan.limits.retry_after_s)}) from None
    finally:
        SESSION.reset(token)
    first = await next_event(request, w, jobs)
    if first is None:
        raise ApiError(499, "the client closed the connection")  # the jobs were cancelled
    if isinstance(first, Failed):
        for job in jobs:
            w.cancel(job)
        raise ApiError.from_event(first)
    return Session(request, plan, jobs, first)


def _jobs(plan: RequestPlan) -> list[Job]:
    """``n`` jobs per prompt, all sharing one events queue, their events tagged with the choice's index (prompt
    p's choice i is ``p * n + i``), each with the request's deadline (``--timeout``)."""
    events: asyncio.Queue = asyncio.Queue()
    timeout = plan.limits.timeout_s
    deadline = time.perf_counter() + timeout if timeout > 0 else None
    loop, n = asyncio.get_running_loop(), plan.per_prompt
    return [Job(ids, config, plan.speculative, loop, events, deadline, index=p * n + i, progress=plan.progress)
            for p, ids in enumerate(plan.prompts) for i, config in enumerate(plan.configs)]


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
        if isinstance(event, Failed) and event.metered:
            note_answer(metered=True)  # the worker counted this failure: its answer is not counted again
        return event
