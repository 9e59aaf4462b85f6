"""Google Cloud Vertex AI's prediction route (``vertex``): ``POST /predict`` (``AIP_PREDICT_ROUTE``) runs each
instance on the route its ``@requestFormat`` names, and ``AIP_HEALTH_ROUTE`` answers as ``/health``.  Only there
when the server runs on Vertex AI (``AIP_MODE=PREDICTION``), so ``router_for`` builds it from those settings."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from ..vertex import VertexParams, aliases, call, instances_of, predict


def router_for(params: VertexParams) -> APIRouter:
    router = APIRouter()

    @router.post(params.predict_route)
    async def prediction(request: Request, body: Any = Body(...)) -> JSONResponse:
        instances = instances_of(body)
        paths = [r.path for r in request.app.routes if isinstance(r, APIRoute) and "POST" in r.methods
                 and r.path != params.predict_route]
        return JSONResponse({"predictions": await predict(request, instances, aliases(paths))})

    if params.health_route:
        @router.get(params.health_route)
        async def health(request: Request) -> Response:
            status, body = await call(request, "/health", b"", method="GET")
            return Response(body, status_code=status, media_type="application/json")

    return router
