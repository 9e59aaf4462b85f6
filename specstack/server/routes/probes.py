"""What watches and introduces the server: ``/health`` (and llama-server's ``/v1/health``), ``/metrics``,
``/v1/models`` and the live page at ``/``.  ``/health``, ``/v1/health`` and the page are open without the API key,
as llama-server's public endpoints; ``/metrics`` and ``/v1/models`` need it, as in llama-server (``guards``)."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from ..backends import served
from ..responses import error, exactness

STATIC = Path(__file__).resolve().parent.parent / "static"
router = APIRouter()


@router.get("/health")
@router.get("/v1/health")  # llama-server serves both, neither behind the key
async def health(request: Request) -> JSONResponse:
    state = served(request)
    workers = state.workers
    failed = [f"{w.role.name}: {w.load_error}" for w in workers.values() if w.load_error]
    if failed:
        return error(503, "; ".join(failed), "unavailable_error", code="503")
    if not all(w.ready.is_set() for w in workers.values()):
        return error(503, "Loading model", "unavailable_error", code="503")
    extra = await state.role_health() if state.role_health is not None else {}
    down = [f"{name}: {why}" for name, (why, _) in extra.items() if why]
    if down:
        return error(503, "; ".join(down), "unavailable_error", code="503")
    return JSONResponse({"status": "ok", "roles": {
        w.role.name: {"exact": exactness(w), "lossy": getattr(w, "lossy", None),
                      **extra.get(w.role.name, (None, {}))[1]} for w in workers.values()}})


STARTED = int(time.time())  # when this server process started serving (llama-server's Process-Start-Time-Unix)


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    """specstack's metrics and llama-server's ``llamacpp:*`` (a scrape starts their throughput window afresh);
    501 where the endpoint is off (a llama-server command line without --metrics, as llama-server answers)."""
    state = served(request)
    if not state.metrics_endpoint:
        return error(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                     "not_supported_error", code="not_supported")
    if state.render_metrics is not None:
        body = await state.render_metrics()
    else:
        body = state.metrics.render(state.metrics.llamacpp.scrape())
    response = Response(body, media_type="text/plain; version=0.0.4")
    # spelled as llama-server spells it (Starlette would lower-case a header given by name): a client reading the
    # headers into a plain dict looks it up so
    response.raw_headers.append((b"Process-Start-Time-Unix", str(STARTED).encode()))
    return response


@router.get("/v1/models")
@router.get("/models")
async def models(request: Request) -> JSONResponse:
    """The roles as OpenAI's model list, with llama-server's ``aliases`` and ``tags``."""
    return JSONResponse({"object": "list", "data": [
        {"id": w.role.name, "object": "model", "created": 0, "owned_by": "specstack",
         "aliases": list(w.role.aliases or (w.role.name,)), "tags": list(w.role.tags),
         "speculative": {"drafter": w.role.drafter, "k_policy": w.role.k_policy, "k": w.role.k,
                         "parallel": w.role.parallel, "exact": exactness(w)},
         "chat_template": w.template.origin if w.template else None,
         "n_ctx": w.target.n_ctx if w.target else None}
        for w in served(request).workers.values()]})


@router.get("/")
async def page(request: Request) -> Response:
    if not served(request).page:  # --no-ui
        return error(404, "Not Found (the page is off: --no-ui)", "not_found_error")
    return FileResponse(STATIC / "index.html", media_type="text/html")
