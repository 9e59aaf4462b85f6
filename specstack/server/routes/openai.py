"""OpenAI's generating routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed or whole, and
the chat prompt's token count (``POST /v1/chat/completions/input_tokens``).

A request's ``speculative`` object overrides its role's defaults (``drafter``, ``k_policy``, ``k``, ``k_max``
and drafter options); every response reports what speculation did."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from .. import session
from ..backends import RoleBackend, served
from ..chat import chat_tokens
from ..jobs import chat_prompt, grammar_for, input_tokens, outputs_for, prompt_ids, reasoning_for, tools_for, verbose
from ..native import Native
from ..telemetry import final_timings
from ..responses import LogprobsOut, final_body, total_usage
from ..schema import ChatRequest, CompletionRequest, unsupported
from ..streams import OpenAIChunks, openai_stream
from ..tools import Reasoning, ToolPlan

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    unsupported(body)
    w = served(request).backend(body.model)
    return await answer(request, w, body, prompt_ids(body.prompt, w.target), chat=False, grammar=grammar_for(body))


@router.post("/v1/chat/completions")
@router.post("/chat/completions")  # llama-server's too
async def chat(body: ChatRequest, request: Request) -> Response:
    unsupported(body)
    w = served(request).backend(body.model)
    tools = tools_for(body, w)
    prompt = chat_prompt(body, w, tools)
    return await answer(request, w, body, [chat_tokens(prompt, w.target)], chat=True,
                        grammar=grammar_for(body, tools), tools=tools, reasoning=reasoning_for(body, w, prompt))


@router.post("/v1/chat/completions/input_tokens")
@router.post("/chat/completions/input_tokens")  # llama-server's both
async def chat_input_tokens(body: ChatRequest, request: Request) -> JSONResponse:
    """How many tokens a chat request's prompt is, rendered as /v1/chat/completions renders it (template, tools,
    continuation), nothing generated: llama-server's count, for a client that fits a chat to the context."""
    unsupported(body)
    return JSONResponse({**input_tokens(body, served(request).backend(body.model)), "object": "response.input_tokens"})


async def answer(request: Request, w: RoleBackend, body: Any, prompts: list[list[int]], chat: bool,
                 grammar: str | None = None, tools: ToolPlan | None = None,
                 reasoning: Reasoning | None = None) -> Response:
    """The request run on its role: a stream of chunks, or the whole response once every choice is done."""
    state = served(request)
    run = await session.start(request, w, body, prompts, state.limits, chat, grammar,
                              tools.triggers if tools is not None else ())
    # chat with tools or a thinking model: each choice read as a message (reasoning split off, then calls)
    outputs = outputs_for(w, run.jobs, tools, state.preserved, reasoning)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    per_prompt = len(run.jobs) // len(prompts)
    echoes = [w.target.detokenize(job.prompt_ids) if getattr(body, "echo", False) else "" for job in run.jobs]
    native = Native(state.limits, w, run.jobs, per_prompt) if verbose(body, state) else None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        shape = OpenAIChunks(run, rid, chat, include_usage, echoes, per_prompt, outputs, native)
        return EventSourceResponse(openai_stream(shape), ping=15)
    texts = list(echoes)
    logprobs = [LogprobsOut(w.target, chat, len(echo)) for echo in echoes]

    def take(event: dict[str, Any]) -> None:
        if native is not None:
            native.add(event)
        if event["type"] == "delta":
            i = event["index"]
            texts[i] += event["text"]
            logprobs[i].add(event)
            if outputs is not None:
                outputs[i].add(event, deltas=False)

    finals = await run.collect(take)
    if finals is None:
        return Response(status_code=499)
    request.state.usage = total_usage(finals, per_prompt)  # for the access log
    for output in outputs or ():
        output.finish()
    wanted = run.jobs[0].config.logprobs is not None
    answer = final_body(rid, w.role.name, texts, finals, chat, [lp.body() for lp in logprobs] if wanted else None,
                        per_prompt, outputs)
    answer["timings"] = final_timings(finals[0])  # llama-server's, beside OpenAI's usage
    if native is not None:
        answer["__verbose"] = native.result(0, finals[0], streamed=False)
    return JSONResponse(answer)
