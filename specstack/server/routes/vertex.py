"""Google Cloud Vertex AI's prediction route (``vertex``): ``POST /predict`` (``AIP_PREDICT_ROUTE``) runs each
instance on the route its ``@requestFormat`` names, and ``AIP_HEALTH_ROUTE`` answers as ``/health``.  Only there
when the server runs on Vertex AI (``AIP_MODE=PREDICTION``), so ``router_for`` builds it from those settings."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, Response

from ..vertex import VertexParams, aliases, call, instances_of, predict


def router_for(params: VertexParams, paths: list[str]) -> APIRouter:
    """The routes at ``params``' paths; ``paths``: the POST routes an instance may name (in the order the app
    includes them: the first to claim an alias keeps it)."""
    router = APIRouter()
    routes = {**{path: path for path in paths}, **aliases(paths)}  # a path or its alias (no alias starts with /)

    @router.post(params.predict_route)
    async def prediction(request: Request, body: Any = Body(...)) -> JSONResponse:
        return JSONResponse({"predictions": await predict(request, instances_of(body), routes)})

    if params.health_route:
        @router.get(params.health_route)
        async def health(request: Request) -> Response:
            status, body = await call(request, "/health", b"", method="GET")
            return Response(body, status_code=status, media_type="application/json")

    return router
