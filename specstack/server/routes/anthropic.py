"""Anthropic's Messages API: ``POST /v1/messages`` (whole or streamed) and ``POST /v1/messages/count_tokens``, run
as the chat request each translates to (``anthropic_api``): the same template, tools, reasoning split, limits and
speculation as ``/v1/chat/completions``, answered as a message or its stream of events (``anthropic_shape``)."""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from .. import plan, session
from ..anthropic_api import chat_request, check_budget
from ..anthropic_shape import MessageShape
from ..backends import Limits, RoleBackend
from ..events import Delta, Failed
from ..responses import total_usage
from ..schema import requested_tokens
from ..tools import template_tags

router = APIRouter()


@router.post("/v1/messages")
async def messages(request: Request, body: Any = Body(...)) -> Response:
    chat, budget = chat_request(body)

    def thinking_budget(w: RoleBackend, limits: Limits) -> None:
        template = w.template
        thinks = template_tags(template.text if template is not None and template.kind == "jinja" else None) is not None
        check_budget(budget, requested_tokens(chat, limits.default_max_tokens)[0], thinks)

    p = await plan.chat(request, chat, always_message=True, check=thinking_budget)
    run = await session.start(request, p)
    (output,) = run.outputs
    stop = [s for s in ([chat.stop] if isinstance(chat.stop, str) else chat.stop or ()) if isinstance(s, str)]
    shape = MessageShape(p.backend.role.name, output, stop)
    if chat.stream:
        return EventSourceResponse(_events(run, shape), ping=15)
    finals = await run.collect_into(output)
    if finals is None:
        return Response(status_code=499)
    request.state.usage = total_usage(finals)  # for the access log
    return JSONResponse(shape.whole(finals[0]))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, body: Any = Body(...)) -> JSONResponse:
    """The prompt's tokens as ``/v1/messages`` would run it (its template, system prompt and tools)."""
    return JSONResponse(plan.chat_input_tokens(request, chat_request(body)[0]))


async def _events(run: session.Session, shape: MessageShape) -> AsyncIterator[dict[str, Any]]:
    """The message's events as they come; an error ends the stream with Anthropic's ``error`` event."""
    try:
        gen = getattr(run.jobs[0], "gen", None)
        cached = getattr(getattr(gen, "stats", None), "n_reused", 0) or 0
        for event in shape.opening(len(run.jobs[0].prompt_ids), cached):
            yield event
        async with aclosing(run.events()) as events:
            async for event in events:
                if isinstance(event, Failed):
                    yield {"event": "error", "data": _error(event)}
                    return
                if isinstance(event, Delta):
                    for piece in shape.deltas(shape.output.add(event)):
                        yield piece
                else:
                    for piece in shape.deltas(shape.output.finish()):
                        yield piece
                    run.request.state.usage = total_usage([event])
                    for piece in shape.closing(event):
                        yield piece
    finally:
        if not run.complete:
            run.cancel_unfinished()  # the client went away mid-stream


def _error(event: Failed) -> str:
    return json.dumps({"type": "error", "error": {"type": event.kind, "message": event.message,
                                                  "param": event.param, "code": event.status}})
