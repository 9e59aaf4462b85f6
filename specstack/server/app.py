"""The OpenAI-compatible HTTP server, wired: roles' backends, guards, error handlers and the route modules.

Every error body is OpenAI's ``{"error": {message, type, param, code}}``; invalid input is a 400 that names the
field.  The layers, each its own module: ``schema`` (what a request may say), ``jobs`` (a request as jobs),
``session`` (jobs run, read, cancelled, collected), ``responses``/``streams``/``native`` (answers), ``guards``
(HTTP limits and the key), and ``routes/`` (thin: OpenAI's, llama-server's, OpenAI's Responses API, Anthropic's Messages API, the probes).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from sse_starlette.sse import AppStatus
from starlette.exceptions import HTTPException as StarletteHTTPException

from .access import AccessLog
from .cors import Cors
from .backends import HealthProbe, Limits, RoleBackend, Served
from .guards import Guard, http_options
from .prometheus import AnswerCounter, ServerMetrics
from .responses import ApiError, error
from .roles import Role
from .routes import anthropic, llama_server, openai, probes, responses as responses_api, vertex
from .vertex import VertexParams
from .schema import invalid_response
from .sleep import WakeOnUse
from .worker import RoleWorker

__all__ = ["Limits", "RoleBackend", "create_app"]


def create_app(roles: list[Role], limits: Limits = Limits(), api_key: str | None = None, max_queue: int = 16,
               backends: dict[str, RoleBackend] | None = None, render_metrics: Callable[[], Any] | None = None,
               role_health: HealthProbe | None = None, access_log: Callable[[str], None] | None = None,
               slots: bool = True, cors_origins: str = "*", page: bool = True,
               vertex_ai: VertexParams | None = None, verbose: bool = False, metrics_endpoint: bool = True,
               sleep_idle_s: float | None = None) -> FastAPI:
    """The API over ``roles``: by default one ``RoleWorker`` each in this process; ``backends`` (by role name),
    ``render_metrics`` and ``role_health`` put other engines behind the same routes (``specstack serve --ray``).

    ``role_health`` gives, by role name, why the role cannot take traffic yet (None: it can) and what its
    /health entry adds (replicas up, under --ray).  ``access_log`` gets one line per request (``access``; None:
    none); ``slots=False`` turns llama-server's ``GET /slots`` off (``--no-slots``), ``page=False`` the page at /
    (``--no-ui``), ``metrics_endpoint=False`` ``GET /metrics`` (501, as llama-server without ``--metrics``);
    ``cors_origins`` is llama-server's ``--cors-origins`` (``cors``); ``vertex_ai`` adds Vertex AI's prediction
    route (``vertex``: the server runs there); ``verbose`` (``--verbose``) gives OpenAI answers llama-server's
    ``__verbose`` unless a request's ``verbose`` says otherwise; ``sleep_idle_s`` unloads each role's model after
    that many idle seconds, reloaded by the next request that needs it (``sleep``: --sleep-idle-seconds)."""
    metrics = ServerMetrics()
    workers = backends if backends is not None else {r.name: RoleWorker(r, metrics, max_queue, sleep_idle_s)
                                                     for r in roles}

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
    app.state.workers, app.state.metrics = workers, metrics
    app.state.http_options = http_options()  # what uvicorn serves it with (`specstack serve`: the header limit)
    app.state.served = Served(workers, limits, metrics, slots, render_metrics, role_health, page=page,
                              verbose=verbose, metrics_endpoint=metrics_endpoint)
    add_error_handlers(app)
    if sleep_idle_s is not None:  # innermost: a request Guard refuses wakes no model
        app.add_middleware(WakeOnUse, workers=list(workers.values()))
    # Vertex AI's health route answers as /health does, and Vertex's probe sends no key
    public = frozenset({vertex_ai.health_route}) if vertex_ai is not None and vertex_ai.health_route else frozenset()
    app.add_middleware(Guard, max_body_bytes=limits.max_body_bytes, api_key=api_key,
                       body_timeout_s=limits.body_timeout_s, public=public)
    app.add_middleware(AnswerCounter, metrics=metrics, roles=list(workers))  # outside Guard: its refusals count
    app.add_middleware(Cors, origins=cors_origins)  # outside Guard: a browser's preflight carries no key
    if access_log is not None:  # outermost: Guard's refusals are logged too
        app.add_middleware(AccessLog, write=access_log)
    routers = [probes.router, openai.router, llama_server.router, responses_api.router, anthropic.router]
    if vertex_ai is not None:  # its instances name the other routes' POST paths
        routers.append(vertex.router_for(vertex_ai, [r.path for router in routers for r in router.routes
                                                     if isinstance(r, APIRoute) and "POST" in r.methods]))
    for router in routers:
        app.include_router(router)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal as OpenAI's error body: ``ApiError``s, schema failures, and Starlette's own (404, 405)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return invalid_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else "invalid_request_error")
