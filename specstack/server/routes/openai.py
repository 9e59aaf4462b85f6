"""OpenAI's generating routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed or whole, and
the chat prompt's token count (``POST /v1/chat/completions/input_tokens``).

A request's ``speculative`` object overrides its role's defaults (``drafter``, ``k_policy``, ``k``, ``k_max``
and drafter options); every response reports what speculation did."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from .. import plan, session
from ..events import Delta, Event
from ..native import Native
from ..telemetry import final_timings
from ..responses import LogprobsOut, final_body, total_usage
from ..schema import ChatRequest, CompletionRequest
from ..streams import OpenAIChunks, openai_stream

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await answer(request, await plan.completion(request, body))


@router.post("/v1/chat/completions")
@router.post("/chat/completions")  # llama-server's too
async def chat(body: ChatRequest, request: Request) -> Response:
    return await answer(request, await plan.chat(request, body))


@router.post("/v1/chat/completions/input_tokens")
@router.post("/chat/completions/input_tokens")  # llama-server's both
async def chat_input_tokens(body: ChatRequest, request: Request) -> JSONResponse:
    """How many tokens a chat request's prompt is, rendered as /v1/chat/completions renders it (template, tools,
    continuation), nothing generated: llama-server's count, for a client that fits a chat to the context."""
    return JSONResponse({**plan.chat_input_tokens(request, body), "object": "response.input_tokens"})


async def answer(request: Request, p: plan.RequestPlan) -> Response:
    """The plan run on its role: a stream of chunks, or the whole response once every choice is done (with tools
    or a thinking model, each choice read as a message: reasoning split off, then calls)."""
    run = await session.start(request, p)
    w, body, outputs = p.backend, p.body, run.outputs
    rid = ("chatcmpl-" if p.chat else "cmpl-") + uuid.uuid4().hex[:24]
    echoes = [w.target.detokenize(job.prompt_ids) if getattr(body, "echo", False) else "" for job in run.jobs]
    native = Native(p.limits, w, run.jobs, p.per_prompt) if p.verbose else None
    if p.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        shape = OpenAIChunks(run, rid, p.chat, include_usage, echoes, p.per_prompt, outputs, native)
        return EventSourceResponse(openai_stream(shape), ping=15)
    texts = list(echoes)
    logprobs = [LogprobsOut(w.target, p.chat, len(echo)) for echo in echoes]

    def take(event: Event) -> None:
        if native is not None:
            native.add(event)
        if isinstance(event, Delta):
            i = event.index
            texts[i] += event.text
            logprobs[i].add(event)
            if outputs is not None:
                outputs[i].add(event, deltas=False)

    finals = await run.collect(take)
    if finals is None:
        return Response(status_code=499)
    request.state.usage = total_usage(finals, p.per_prompt)  # for the access log
    for output in outputs or ():
        output.finish()
    wanted = p.configs[0].logprobs is not None
    answer = final_body(rid, w.role.name, texts, finals, p.chat, [lp.body() for lp in logprobs] if wanted else None,
                        p.per_prompt, outputs)
    answer["timings"] = final_timings(finals[0])  # llama-server's, beside OpenAI's usage
    if native is not None:
        answer["__verbose"] = native.result(0, finals[0], streamed=False)
    return JSONResponse(answer)
