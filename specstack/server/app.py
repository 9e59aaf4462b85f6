"""The OpenAI-compatible HTTP API: completions, chat, models, health, metrics and the live page.

Every error body is OpenAI's ``{"error": {message, type, param, code}}``;
invalid input is a 400 that names the field.  A request's ``speculative``
object overrides its role's defaults (``drafter``, ``k_policy``, ``k``,
``k_max`` and drafter options); every response reports what speculation did.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, Optional, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, create_model
from sse_starlette.sse import AppStatus, EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..commands.common import DRAFTER_FLAGS, check_drafter_options, inapplicable
from ..draft_length import MAX_DRAFT, POLICIES
from ..drafters.base import check_name
from ..generation import GenerationConfig
from ..errors import SpecstackError
from ..sampling import MAX_LOGPROBS, SamplingParams
from .chat import chat_tokens, render
from .metrics import ServerMetrics
from .roles import Role
from .worker import Job, QueueFull, RoleWorker

STATIC = Path(__file__).resolve().parent / "static"

# The request's session (``x-session-id`` header, else the body's ``user``), set around ``submit``: a scale-out
# backend routes by it (``scaleout.remote``); the single-process worker has one engine and ignores it.
SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("specstack_session", default=None)


class RoleBackend(Protocol):
    """What the routes need of a role: ``RoleWorker`` (one engine in this process, the default) or
    ``scaleout.remote.RemoteRole`` (a Ray Serve deployment of replicas).  One set of routes serves both."""

    role: Role
    ready: Any  # .is_set()
    load_error: str | None
    target: Any  # tokenize, detokenize, token_bytes, capacity, n_vocab, n_ctx, shapes
    template: Any

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def submit(self, *jobs: Job) -> None: ...
    def cancel(self, job: Job) -> None: ...


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (the security defaults of `specstack serve`)."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 0  # 0: the role's context
    max_tokens: int = 4096
    timeout_s: float = 600.0
    retry_after_s: int = 1
    # Choices per request (``n``).  Each is its own generation with its own slot; with more choices than
    # slots the rest wait in the queue (and take its places), as separate requests would.
    max_n: int = 16


def _speculative_model() -> type[BaseModel]:
    """A request's ``speculative`` object: the k settings plus every per-request drafter flag.

    Built from ``DRAFTER_FLAGS``, so a new drafter flag is a new request key with no second list.
    Option values are checked where the flags' are, by the drafters' config dataclasses
    (``check_drafter_options``, before the job is queued).
    """
    k_field = (Optional[int], Field(None, ge=1, le=MAX_DRAFT, strict=True))
    fields: dict[str, Any] = {"drafter": (Optional[str], None), "k_policy": (Optional[Literal[POLICIES]], None),
                              "k": k_field, "k_max": k_field}
    for flag in DRAFTER_FLAGS:
        if flag.per_request:
            fields[flag.dest] = (Optional[flag.type or bool], None)
    return create_model("Speculative", __config__=ConfigDict(extra="forbid"), **fields)


Speculative = _speculative_model()


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    # strict: JSON true is not 1 (max_tokens: true used to mean one token), nor 2.0 an integer
    max_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float = Field(1.0, ge=0, le=100, strict=True)
    top_p: float = Field(1.0, gt=0, le=1, strict=True)
    top_k: int = Field(0, ge=0, strict=True)
    min_p: float = Field(0.0, ge=0, le=1, strict=True)
    seed: int | None = Field(None, strict=True)
    user: str | None = None  # OpenAI's end-user id: the session key for routing when no x-session-id is sent
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, strict=True, description="choices; at most Limits.max_n")
    speculative: Speculative | None = None
    # Accepted by the OpenAI API but not done here: a request that sets them gets a 400 naming the field
    # (``unsupported``), never a 200 that silently ignores them.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    response_format: Any = None
    logit_bias: Any = None


class CompletionRequest(_Common):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    echo: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)


def unsupported(body: _Common) -> None:
    """400 for a field this server would otherwise ignore: the client must know it was not honoured."""
    if body.tools or body.functions:
        raise ApiError(400, "tools/function calling is not supported by specstack serve; leave out 'tools'",
                       param="tools")
    if body.tool_choice not in (None, "none"):
        raise ApiError(400, "tool_choice is not supported (no tools here); leave it out", param="tool_choice")
    if body.response_format not in (None, {"type": "text"}):
        raise ApiError(400, "response_format other than {\"type\": \"text\"} (JSON mode, schemas) is not supported; "
                       "leave it out", param="response_format")
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported: it would change the target's distribution; leave it out",
                       param="logit_bias")
    if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
        raise ApiError(400, "echo with logprobs is not supported (it needs the prompt tokens' logprobs); ask for "
                       "one or the other", param="echo")
    if isinstance(body, ChatRequest) and body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    bad = _invalid_text(body.model_dump(exclude_none=True))
    if bad is not None:
        raise ApiError(400, f"{bad} holds a lone UTF-16 surrogate (such as \\ud800), which is not Unicode text and "
                       "cannot be tokenized; send valid UTF-8", param=bad)


def _invalid_text(value: Any, where: str = "") -> str | None:
    """The path of the first string that cannot be UTF-8 (JSON's "\\ud800" decodes to a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _invalid_text(item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


def exactness(w: RoleBackend) -> dict[str, Any]:
    """The ``--exact`` mode a role runs in and why (auto decides at load, by measurement)."""
    shapes = w.target.shapes if w.target is not None and w.target.shapes.settled else None
    if shapes is None:
        return {"requested": w.role.exact, "mode": None, "why": "not loaded yet"}
    return {"requested": w.role.exact, "mode": "on" if shapes.exact else "off", "why": shapes.why}


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


DISCONNECT_POLL_S = 0.25  # how often a waiting request looks for its client having gone


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.response = error(status, message, kind, param, code, headers)


class Guard:
    """Body size and API key, checked before any route runs: a plain ASGI middleware.

    Starlette's ``@app.middleware("http")`` wraps ``receive``, so a route's ``request.is_disconnected()``
    never saw a non-streaming client leave, and its generation held a slot for minutes (vLLM moved to a
    plain ASGI middleware for the same reason).  A body without a Content-Length (``Transfer-Encoding:
    chunked``) is read here up to the limit, so it cannot reach the tokenizer by being unannounced.
    """

    def __init__(self, app: Any, max_body_bytes: int, api_key: str | None) -> None:
        self.app, self.max_body_bytes, self.api_key = app, max_body_bytes, api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(length, scope, receive, send)
        if self.api_key and scope["path"].startswith("/v1/") and headers.get("authorization", "") != f"Bearer {self.api_key}":
            return await error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", "authentication_error",
                               code="invalid_api_key")(scope, receive, send)
        if length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            body, more = b"", True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_body_bytes:
                    return await self._too_large(f"more than {self.max_body_bytes}", scope, receive, send)
            receive = _replay(body, receive)
        return await self.app(scope, receive, send)

    async def _too_large(self, size: str, scope: dict, receive: Any, send: Any) -> None:
        await error(413, f"the request body has {size} bytes; the limit is {self.max_body_bytes} "
                         "(start the server with a larger --max-body)", code="body_too_large")(scope, receive, send)


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI ``receive`` that gives the body already read, then passes on (a disconnect is still seen)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def create_app(roles: list[Role], limits: Limits = Limits(), api_key: str | None = None, max_queue: int = 16,
               backends: dict[str, RoleBackend] | None = None,
               render_metrics: Callable[[], Awaitable[bytes]] | None = None,
               role_health: Callable[[], Awaitable[dict[str, tuple[str | None, dict[str, Any]]]]] | None = None,
               ) -> FastAPI:
    """The API over ``roles``: by default one ``RoleWorker`` each in this process; ``backends`` (by role name),
    ``render_metrics`` and ``role_health`` put other engines behind the same routes (``specstack serve --ray``).

    ``role_health`` gives, by role name, why the role cannot take traffic yet (None: it can) and what its
    /health entry adds (replicas up, under --ray)."""
    metrics = ServerMetrics()
    workers: dict[str, RoleBackend] = backends if backends is not None else {
        r.name: RoleWorker(r, metrics, max_queue) for r in roles}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for w in workers.values():
            w.start()
        yield
        for w in workers.values():  # after uvicorn has drained in-flight requests
            await asyncio.to_thread(w.stop)

    # SIGTERM drains: uvicorn stops accepting and waits for open requests (up to --timeout), streams
    # too.  sse-starlette would otherwise end every open stream at once, without its finish chunk or [DONE].
    AppStatus.disable_automatic_graceful_drain()
    app = FastAPI(title="specstack", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.workers = workers
    app.state.metrics = metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return error(400, f"the request body is not valid JSON: {first.get('msg')}", param=None, code="invalid_json")
        return error(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    app.add_middleware(Guard, max_body_bytes=limits.max_body_bytes, api_key=api_key)

    def worker_for(model: str | None) -> RoleBackend:
        if model is None or model not in workers:
            if model is not None and len(workers) > 1:
                raise ApiError(404, f"model {model!r} is not served here; choose one of: {', '.join(workers)}",
                               "not_found_error", "model", "model_not_found")
            w = next(iter(workers.values()))
        else:
            w = workers[model]
        if not w.ready.is_set():
            raise ApiError(503, "the model is still loading; retry shortly", "unavailable_error", headers={"Retry-After": "2"})
        if w.load_error:
            raise ApiError(503, f"role {w.role.name!r} failed to load: {w.load_error}", "unavailable_error")
        return w

    @app.get("/health")
    async def health() -> JSONResponse:
        failed = [f"{w.role.name}: {w.load_error}" for w in workers.values() if w.load_error]
        if failed:
            return error(503, "; ".join(failed), "unavailable_error", code="503")
        if not all(w.ready.is_set() for w in workers.values()):
            return error(503, "Loading model", "unavailable_error", code="503")
        extra = await role_health() if role_health is not None else {}
        down = [f"{name}: {why}" for name, (why, _) in extra.items() if why]
        if down:
            return error(503, "; ".join(down), "unavailable_error", code="503")
        return JSONResponse({"status": "ok", "roles": {
            w.role.name: {"exact": exactness(w), **extra.get(w.role.name, (None, {}))[1]} for w in workers.values()}})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = await render_metrics() if render_metrics is not None else metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": w.role.name, "object": "model", "created": 0, "owned_by": "specstack",
             "speculative": {"drafter": w.role.drafter, "k_policy": w.role.k_policy, "k": w.role.k,
                             "parallel": w.role.parallel, "exact": exactness(w)},
             "chat_template": w.template.origin if w.template else None,
             "n_ctx": w.target.n_ctx if w.target else None}
            for w in workers.values()]})

    @app.get("/")
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        unsupported(body)
        w = worker_for(body.model)
        ids = body.prompt if isinstance(body.prompt, list) else w.target.tokenize(body.prompt)
        return await run(request, w, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        unsupported(body)
        w = worker_for(body.model)
        try:
            prompt = render([m.model_dump() for m in body.messages], w.template)
        except SpecstackError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await run(request, w, body, chat_tokens(prompt, w.target), chat=True)

    async def run(request: Request, w: RoleBackend, body: _Common, ids: list[int], chat: bool) -> Response:
        jobs = make_jobs(w, body, ids)
        token = SESSION.set(request.headers.get("x-session-id") or body.user)
        try:
            w.submit(*jobs)
        except QueueFull as exc:
            raise ApiError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(limits.retry_after_s)}) from None
        finally:
            SESSION.reset(token)
        first = await next_event(request, w, jobs)
        if first is None:
            return Response(status_code=499)  # client gone; the jobs were cancelled
        if first["type"] == "error":
            cancel_all(w, jobs)
            return error_event(first)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        echo = w.target.detokenize(ids) if getattr(body, "echo", False) else ""
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventSourceResponse(stream(request, w, jobs, first, rid, chat, include_usage, echo), ping=15)
        texts = [echo] * len(jobs)
        logprobs = [LogprobsOut(w.target, chat, len(echo)) for _ in jobs]
        finals: dict[int, dict[str, Any]] = {}
        event: dict[str, Any] | None = first
        while True:
            i = event["index"]
            if event["type"] == "error":
                cancel_all(w, jobs)
                return error_event(event)
            if event["type"] == "delta":
                texts[i] += event["text"]
                logprobs[i].add(event)
            else:
                finals[i] = event
                if len(finals) == len(jobs):
                    break
            event = await next_event(request, w, jobs)
            if event is None:
                return Response(status_code=499)
        wanted = jobs[0].config.logprobs is not None
        return JSONResponse(final_body(rid, w.role.name, texts, [finals[i] for i in range(len(jobs))], chat,
                                       [lp.body() for lp in logprobs] if wanted else None))

    def cancel_all(w: RoleBackend, jobs: list[Job]) -> None:
        for job in jobs:
            w.cancel(job)

    def make_jobs(w: RoleBackend, body: _Common, ids: list[int]) -> list[Job]:
        """One job per choice (``n``), checked once: choice i samples with ``seed + i`` (a negative or absent seed:
        each its own random one), and all share one events queue, their events tagged with the choice's index."""
        if body.n > limits.max_n:
            raise ApiError(400, f"n is {body.n}; this server allows at most {limits.max_n} choices per request",
                           param="n")
        target = w.target
        limit = limits.max_prompt_tokens or target.capacity - 1
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(ids) > min(limit, target.capacity - 1):
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context allows {min(limit, target.capacity - 1)} "
                                "(prompt plus at least one new token)", param="prompt", code="context_length_exceeded")
        if any(not 0 <= t < target.n_vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in 0..{target.n_vocab - 1}", param="prompt")
        max_tokens = body.max_tokens or 16
        if max_tokens > limits.max_tokens:
            raise ApiError(400, f"max_tokens is {max_tokens}; this server allows at most {limits.max_tokens}",
                           param="max_tokens")
        spec = body.speculative.model_dump(exclude_none=True) if body.speculative else {}
        if "drafter" in spec:
            check_drafter(spec["drafter"])
        try:
            check_drafter_options(spec)
        except SpecstackError as exc:
            raise ApiError(400, str(exc), param="speculative") from None
        drafter = spec.get("drafter", w.role.drafter)
        unused = inapplicable(drafter, set(spec))
        if unused is not None:
            raise ApiError(400, f"speculative.{unused.dest} applies to drafter {' or '.join(sorted(unused.configs))}, "
                           f"not {drafter!r}; leave it out or choose one of those", param=f"speculative.{unused.dest}")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stops):
            raise ApiError(400, "stop strings must be non-empty", param="stop")
        try:
            sampling = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                      min_p=body.min_p, seed=body.seed)
            config = GenerationConfig(max_tokens=max_tokens, stop=tuple(stops), sampling=sampling,
                                      k=spec.get("k", w.role.k), logprobs=wanted_logprobs(body))
        except SpecstackError as exc:
            raise ApiError(400, str(exc)) from None
        events: asyncio.Queue = asyncio.Queue()
        deadline = time.perf_counter() + limits.timeout_s if limits.timeout_s > 0 else None
        seeded = body.seed is not None and body.seed >= 0
        return [Job(ids, config if i == 0 else dataclasses.replace(
                        config, sampling=dataclasses.replace(sampling, seed=body.seed + i if seeded else body.seed)),
                    spec, asyncio.get_running_loop(), events, deadline, index=i)
                for i in range(body.n)]

    def check_drafter(name: str) -> None:
        try:
            check_name(name, "speculative.drafter")
        except SpecstackError as exc:
            raise ApiError(400, str(exc), param="speculative.drafter") from None

    async def next_event(request: Request, w: RoleBackend, jobs: list[Job]) -> dict[str, Any] | None:
        """The next event of any of a request's jobs; None (and the jobs cancelled) when the client disconnects.

        The client is checked every ``DISCONNECT_POLL_S`` whether or not events keep coming: a plain
        response's tokens arrive faster than that, and checking only when none came never noticed
        a client that had left (the generation ran on for minutes, holding its slot)."""
        head = jobs[0]
        while True:
            now = time.monotonic()
            if now - head.checked_at >= DISCONNECT_POLL_S:
                head.checked_at = now
                if await request.is_disconnected():
                    cancel_all(w, jobs)
                    return None
            try:
                return await asyncio.wait_for(head.events.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    async def stream(request: Request, w: RoleBackend, jobs: list[Job], event: dict[str, Any], rid: str, chat: bool,
                     include_usage: bool, echo: str = "") -> AsyncIterator[str]:
        """The choices' chunks as they come, each with its ``index``; every choice ends with its finish chunk,
        the usage chunk (prompt counted once) and ``[DONE]`` follow the last."""
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        finished: dict[int, dict[str, Any]] = {}
        offsets = [len(echo)] * len(jobs)  # text_offset of each choice's next token

        def piece(i: int, choice: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
            return chunk(rid, obj, created, w.role.name, {**choice, "index": i}, include_usage, extra)

        try:
            for i in range(len(jobs)):
                if chat:
                    yield piece(i, {"delta": {"role": "assistant"}, "finish_reason": None})
                if echo:  # completions' echo: the prompt's text first, even when no token follows
                    yield piece(i, {"text": echo, "logprobs": None, "finish_reason": None})
            while True:
                i = event["index"]
                if event["type"] == "delta":
                    lp = None
                    if event.get("logprobs") is not None:
                        lp = LogprobsOut(w.target, chat, offsets[i])
                        lp.add(event)
                        lp = lp.body()
                    offsets[i] += len(event["text"])
                    choice = ({"delta": {"content": event["text"]}, "logprobs": lp} if chat
                              else {"text": event["text"], "logprobs": lp})
                    yield piece(i, {**choice, "finish_reason": None}, {"tokens": event["tokens"]})
                elif event["type"] == "done":
                    finished[i] = event
                    choice = {"delta": {}} if chat else {"text": "", "logprobs": None}
                    yield piece(i, {**choice, "finish_reason": event["finish_reason"]},
                                {"speculative": summary(event["stats"])})
                    if len(finished) == len(jobs):
                        if include_usage:
                            yield json.dumps({"id": rid, "object": obj, "created": created, "model": w.role.name,
                                              "choices": [], "usage": total_usage(list(finished.values()))})
                        yield "[DONE]"
                        return
                else:
                    finished[i] = event
                    cancel_all(w, [j for j in jobs if j.index not in finished])
                    yield json.dumps({"error": {"message": event["message"], "type": event["kind"], "param": None,
                                                "code": event["status"]}})
                    return
                event = await jobs[0].events.get()
        finally:
            if len(finished) < len(jobs):
                cancel_all(w, [j for j in jobs if j.index not in finished])  # the client went away mid-stream

    return app


def error_event(event: dict[str, Any]) -> JSONResponse:
    """An engine's error event as the response (a scale-out 429 carries its code and Retry-After)."""
    return error(event["status"], event["message"], event["kind"], code=event.get("code"), headers=event.get("headers"))


def chunk(rid: str, obj: str, created: int, model: str, choice: dict[str, Any], include_usage: bool,
          extra: dict[str, Any] | None = None) -> str:
    body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                            "choices": [{"index": 0, **choice}]}
    if include_usage:
        body["usage"] = None
    if extra:
        body["specstack"] = extra
    return json.dumps(body)


def summary(stats: dict[str, Any]) -> dict[str, Any]:
    """What speculation did for one request: drafted, accepted, acceptance, mean accepted length, by source."""
    keys = ("drafter", "k_policy", "n_drafted", "n_accepted", "acceptance_rate", "mean_accepted_length", "by_source",
            "acceptance_by_position", "reused_prompt_tokens", "tokens_per_second", "stop_reason",
            "replica")  # replica: which Ray Serve replica ran it (``serve --ray`` only)
    times = stats.get("time_s", {})
    return {**{k: stats[k] for k in keys if k in stats},
            "time_to_first_token_s": times.get("first_token"), "inter_token_latency_s": times.get("inter_token")}


def wanted_logprobs(body: _Common) -> int | None:
    """Alternatives per token a request asks for (None: no logprobs): completions' ``logprobs: N``,
    chat's ``logprobs: true`` with ``top_logprobs: N``."""
    if isinstance(body, ChatRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)


class LogprobsOut:
    """A response's ``logprobs`` in the OpenAI shape of its endpoint, from the engine's ``TokenLogprob``s.

    Completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (text -> logprob) and ``text_offset``;
    chat: ``content``, a list of ``{token, logprob, bytes, top_logprobs}``.
    """

    def __init__(self, target: Any, chat: bool, offset: int = 0) -> None:
        self._target, self.chat, self.offset = target, chat, offset
        self.items: list[tuple[str, bytes, Any]] = []

    def add(self, event: dict[str, Any]) -> None:
        for lp in event.get("logprobs") or ():
            raw = self._target.token_bytes(lp.token)
            self.items.append((raw.decode("utf-8", "replace"), raw, lp))

    def body(self) -> dict[str, Any]:
        if self.chat:
            return {"content": [{"token": text, "logprob": lp.logprob, "bytes": list(raw),
                                 "top_logprobs": [self._alt(t, v) for t, v in lp.top]} for text, raw, lp in self.items]}
        offsets, at = [], self.offset
        for text, _, _ in self.items:
            offsets.append(at)
            at += len(text)
        return {"tokens": [t for t, _, _ in self.items], "token_logprobs": [lp.logprob for _, _, lp in self.items],
                "top_logprobs": [{self._text(t): v for t, v in lp.top} for _, _, lp in self.items],
                "text_offset": offsets}

    def _alt(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self._target.token_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    def _text(self, token: int) -> str:
        return self._target.token_bytes(token).decode("utf-8", "replace")


def total_usage(finals: list[dict[str, Any]]) -> dict[str, int]:
    """A request's usage over its choices: the prompt once (it was processed once), every choice's tokens."""
    prompt = finals[0]["usage"]["prompt_tokens"]
    completion = sum(f["usage"]["completion_tokens"] for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def final_body(rid: str, model: str, texts: list[str], finals: list[dict[str, Any]], chat: bool,
               logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A whole response: one choice per text (``index`` in order), the usage over all, and speculation's
    summary (per choice under ``speculative.choices`` when there are several)."""
    choices = []
    for i, (text, event) in enumerate(zip(texts, finals)):
        lp = logprobs[i] if logprobs is not None else None
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "finish_reason": event["finish_reason"], "logprobs": lp})
        else:
            choices.append({"index": i, "text": text, "finish_reason": event["finish_reason"], "logprobs": lp})
    spec = summary(finals[0]["stats"])
    if len(finals) > 1:
        spec = {**spec, "choices": [summary(f["stats"]) for f in finals]}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": total_usage(finals), "speculative": spec}
