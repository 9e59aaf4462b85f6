"""OpenAI's Responses API: ``POST /v1/responses`` (and llama-server's ``/responses``), the text and function-tool
subset, run as the chat request it translates to (``responses_api``): the same template, tools, reasoning split,
limits and speculation as ``/v1/chat/completions``, answered as a response object or its stream of events."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from .. import plan, session
from ..events import Delta, Failed, Progress
from ..responses import total_usage
from ..responses_api import ResponseShape, chat_request
from ..telemetry import final_timings, live_timings, prompt_progress

router = APIRouter()


@router.post("/v1/responses/input_tokens")
@router.post("/responses/input_tokens")  # llama-server's both
async def responses_input_tokens(request: Request, body: Any = Body(...)) -> JSONResponse:
    """The prompt's tokens as ``/v1/responses`` would run it (its instructions, input items and tools)."""
    return JSONResponse({**plan.chat_input_tokens(request, chat_request(body)), "object": "response.input_tokens"})


@router.post("/v1/responses")
@router.post("/responses")
async def responses(request: Request, body: Any = Body(...)) -> Response:
    p = await plan.chat(request, chat_request(body), always_message=True)
    run = await session.start(request, p)
    chat, (output,) = p.body, run.outputs
    shape = ResponseShape(p.backend.role.name, body, output)
    if chat.stream:
        return EventSourceResponse(_events(run, shape, bool(chat.timings_per_token), bool(chat.return_progress)),
                                   ping=15)
    finals = await run.collect_into(output)
    if finals is None:
        return Response(status_code=499)
    request.state.usage = total_usage(finals)  # for the access log
    return JSONResponse(shape.whole(finals[0]))


async def _events(run: session.Session, shape: ResponseShape, per_token: bool = False,
                  progress: bool = False) -> AsyncIterator[dict[str, Any]]:
    """The response's events as they come; an error ends the stream with a ``error`` event.  llama-server's
    telemetry: ``progress`` (return_progress) sends the prompt's processing as a ``response.in_progress`` event with
    ``prompt_progress``, ``per_token`` (timings_per_token) puts the ``timings`` so far on each delta's last event;
    ``response.completed`` always carries the final ``timings``."""
    job = run.jobs[0]
    try:
        for event in shape.opening():
            yield event
        if progress:
            yield shape.extended(shape.event("response.in_progress", response=shape.response("in_progress")),
                                 prompt_progress=prompt_progress(job))
        async with aclosing(run.events()) as events:
            async for event in events:
                if isinstance(event, Failed):
                    yield shape.event("error", code=str(event.status), message=event.message, param=event.param)
                    return
                if isinstance(event, Progress):  # a chat field's prompt progress: the Responses API has no event
                    continue
                if isinstance(event, Delta):
                    pieces = shape.deltas(shape.output.add(event))
                    now = live_timings(job, shape.output.n_tokens) if per_token and pieces else None
                    if now is not None:
                        pieces[-1] = shape.extended(pieces[-1], timings=now)
                    for piece in pieces:
                        yield piece
                else:
                    for piece in shape.deltas(shape.output.finish()):
                        yield piece
                    run.request.state.usage = total_usage([event])
                    pieces = shape.closing(event)
                    pieces[-1] = shape.extended(pieces[-1], timings=final_timings(event))
                    for piece in pieces:
                        yield piece
    finally:
        if not run.complete:
            run.cancel_unfinished()  # the client went away mid-stream
