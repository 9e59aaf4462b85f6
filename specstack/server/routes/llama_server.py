"""llama-server's own routes, on the same roles and workers as OpenAI's.

``POST /completion`` (and ``/completions``) in llama.cpp's native shape, streaming included, with its
``timings``; ``POST /infill`` (fill in the middle, ``server.infill``) on the same path; ``POST /tokenize``, ``/detokenize``, ``/apply-template``; ``GET /props`` and the read-only
``GET /slots``; ``/v1/embeddings`` (and ``/embedding``, ``/embeddings``) answer 501, since no role is
loaded for embeddings.  Each route picks its role by the body's (or the query's) ``model``, as llama-server's
router does, else the first role.  A generation goes through ``session.start`` (the role's worker), so every
check, limit, constraint and speculation setting of ``/v1/completions`` holds here too.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from sse_starlette.sse import EventSourceResponse

from .. import plan, session
from ..backends import Limits, RoleBackend, served
from ..infill import InfillRequest, infill_prompt
from ..native import Native, busy_slots, native_text, piece_text, props_body, slot_entries
from ..responses import ApiError, error
from ..schema import ChatRequest, CompletionRequest
from ..streams import native_stream

router = APIRouter()

INFILL_BATCH = 2048  # llama-server's default -b: an infill prompt's prefix and suffix are cut to fit it, and its
# extra files to the context left after it and twice n_predict (none in a context of 2048 or less, as llama-server)
NO_EMBEDDINGS = ("specstack serve has no embedding role: every role loads its model for generation (llama.cpp's "
                 "--embeddings mode is not offered), so it computes no embeddings; serve them with "
                 "`llama-server --embeddings`")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, strict=True)
    content: str = Field(strict=True)
    add_special: bool = Field(False, strict=True)
    parse_special: bool = Field(True, strict=True)
    with_pieces: bool = Field(False, strict=True)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, strict=True)
    tokens: list[StrictInt]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    unsupported_text(body.content, "content")
    target = served(request).backend(body.model).target
    ids = target.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
    if not body.with_pieces:
        return JSONResponse({"tokens": ids})
    return JSONResponse({"tokens": [{"id": t, "piece": piece_text(target, t)} for t in ids]})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    target = served(request).backend(body.model).target
    bad = [t for t in body.tokens if not 0 <= t < target.n_vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{target.n_vocab - 1})", param="tokens")
    return JSONResponse({"content": native_text(target, body.tokens)})


def unsupported_text(value: str, field: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{field} holds a lone UTF-16 surrogate, which is not Unicode text; send valid UTF-8",
                       param=field) from None


@router.post("/apply-template")
async def apply_template(body: ChatRequest, request: Request) -> JSONResponse:
    """The prompt a chat request would get, as text (the same parsing and template as /v1/chat/completions)."""
    return JSONResponse({"prompt": plan.chat_text(request, body)})


@router.get("/props")
async def props(request: Request, model: str | None = None) -> JSONResponse:
    state = served(request)
    return JSONResponse(props_body(state.backend(model), state.limits))


@router.post("/props")
async def set_props() -> JSONResponse:
    return error(403, "changing server properties is not supported: POST /props needs llama-server's --props, which "
                      "specstack serve does not offer; restart with other flags or another roles file",
                 code="not_supported")


@router.get("/slots")
async def slots(request: Request, model: str | None = None, fail_on_no_slot: int = 0) -> Response:
    """One entry per slot of the role: busy or not, and how far its generation is (read-only; llama-server's
    save/restore/erase actions are not offered).  No prompt text is shown."""
    state = served(request)
    if not state.slots:
        return error(501, "This server does not support slots endpoint (started with --no-slots)",
                     "not_supported_error", code="not_supported")
    w = state.backend(model)
    busy = busy_slots(w)
    if fail_on_no_slot and len(busy) >= w.role.parallel:
        return error(503, "no slot available", "unavailable_error", code="unavailable")
    return JSONResponse(slot_entries(w, state.limits, busy))


@router.post("/v1/embeddings")
@router.post("/embedding")
@router.post("/embeddings")
async def embeddings() -> JSONResponse:
    return error(501, NO_EMBEDDINGS, "not_implemented_error", code="not_implemented")


@router.post("/completion")
@router.post("/completions")
async def completion(body: CompletionRequest, request: Request) -> Response:
    """llama-server's native completion: ``content``, ``tokens``, ``stop_type``, ``timings`` and the request's
    ``generation_settings``; a list of prompts (or ``n_cmpl``) answers with a list of such results."""
    return await native_answer(request, await plan.native(request, body))


@router.post("/infill")
async def infill(body: InfillRequest, request: Request) -> Response:
    """llama-server's fill-in-the-middle (``server.infill``): the FIM prompt from ``input_prefix``,
    ``input_suffix`` and ``input_extra``, then ``/completion``'s path, speculation included."""
    return await native_answer(request, await plan.native(request, body, fim_prompt))


def fim_prompt(w: RoleBackend, body: Any, limits: Limits) -> list[list[int]]:
    """/infill's one prompt, its parts cut to llama-server's batch and the context left for ``n_predict``."""
    n_predict = body.n_predict if body.n_predict and body.n_predict > 0 else limits.default_max_tokens
    return [infill_prompt(w.target, body, INFILL_BATCH, n_predict, w.target.capacity)]


async def native_answer(request: Request, p: plan.RequestPlan) -> Response:
    """The plan run on its role and answered in llama-server's native shape, streamed or whole; its ``fields``
    (``response_fields``) cut each final result to the fields named, as llama-server's (the stream's last chunk
    too, which is that result)."""
    run = await session.start(request, p)
    native = Native(p.limits, p.backend, run.jobs, p.per_prompt, p.fields)
    if p.stream:
        return EventSourceResponse(native_stream(run, native, bool(getattr(p.body, "timings_per_token", None))),
                                   ping=15)
    finals = await run.collect(native.add)
    if finals is None:
        return Response(status_code=499)
    request.state.usage = native.usage(finals)
    results = [native.result(i, final, streamed=False) for i, final in enumerate(finals)]
    return JSONResponse(results[0] if len(results) == 1 else results)
