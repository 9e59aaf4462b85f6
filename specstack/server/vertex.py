"""Google Cloud Vertex AI's custom-container contract, as llama-server keeps it: with ``AIP_MODE=PREDICTION`` in
the environment the server listens on ``AIP_HTTP_PORT`` (8080), answers ``POST AIP_PREDICT_ROUTE`` (``/predict``)
and, where ``AIP_HEALTH_ROUTE`` is set, ``/health`` there too.

A prediction request is ``{"instances": [...]}``: each instance is a request to one of this server's POST routes,
named by its ``@requestFormat``, a route's camelCase alias (``/v1/chat/completions`` -> ``chatCompletions``,
``/apply-template`` -> ``applyTemplate``) or its path.  The instances run concurrently, each through the whole app
(its guards, key and limits too), never streamed; the answer is ``{"predictions": [...]}``, each instance's JSON
body (an error body for an instance that failed), in order.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from fastapi import Request

from .responses import ApiError

MAX_INSTANCES = 128  # llama-server's


@dataclass(frozen=True)
class VertexParams:
    """The routes and port Vertex AI gave this container (``vertex_params``)."""

    predict_route: str = "/predict"
    health_route: str | None = None
    port: int = 8080


def _route(value: str | None) -> str | None:
    return None if not value else value if value.startswith("/") else "/" + value


def vertex_params(environ: Mapping[str, str] = os.environ) -> VertexParams | None:
    """The Vertex AI settings in ``environ`` (None: ``AIP_MODE`` is not ``PREDICTION``, not on Vertex AI)."""
    if environ.get("AIP_MODE") != "PREDICTION":
        return None
    port = environ.get("AIP_HTTP_PORT") or "8080"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"AIP_HTTP_PORT must be a port number (got {port!r})")
    return VertexParams(_route(environ.get("AIP_PREDICT_ROUTE")) or "/predict", _route(environ.get("AIP_HEALTH_ROUTE")),
                        int(port))


def request_format(path: str) -> str:
    """A route's camelCase alias, as llama-server derives it: ``/v1/chat/completions`` -> ``chatCompletions``."""
    s = path[3:] if path.startswith("/v1") and len(path) > 3 else path
    out, cap = [], False
    for c in s.lstrip("/").split(":")[0]:
        if c in "/-_":
            cap = True
        else:
            out.append(c.upper() if cap else c)
            cap = False
    return "".join(out)


def aliases(paths: list[str]) -> dict[str, str]:
    """Each alias's path (the first route to claim an alias keeps it)."""
    out: dict[str, str] = {}
    for path in paths:
        out.setdefault(request_format(path), path)
    return out


def instances_of(body: Any) -> list[Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if not isinstance(body.get("instances"), list):
        raise ApiError(400, "request body must include an array field named instances", param="instances")
    if len(body["instances"]) > MAX_INSTANCES:
        raise ApiError(400, f"instances array exceeds maximum size of {MAX_INSTANCES}", param="instances")
    return body["instances"]


def _failed(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": "@requestFormat", "code": 400}}


async def predict(request: Request, instances: list[Any], routes: dict[str, str]) -> list[Any]:
    """Each instance's answer from its route (``routes``: a path, or its alias, to the path), run concurrently through the app (the request's headers with it)."""
    return list(await asyncio.gather(*(_one(request, instance, routes) for instance in instances)))


async def _one(request: Request, instance: Any, routes: dict[str, str]) -> Any:
    if not isinstance(instance, dict):
        return _failed("each instance must be a JSON object")
    fmt = instance.get("@requestFormat")
    if not isinstance(fmt, str):
        return _failed("each instance must include a string @requestFormat")
    path = routes.get(fmt)
    if path is None:
        return _failed(f"no handler registered for @requestFormat: {fmt}")
    payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
    if "stream" in payload:
        payload["stream"] = False  # a prediction is one JSON body
    _, body = await call(request, path, json.dumps(payload).encode())
    try:
        return json.loads(body) if body else None
    except ValueError:
        return body.decode("utf-8", "replace")


async def call(request: Request, path: str, body: bytes, method: str = "POST") -> tuple[int, bytes]:
    """``method path`` with ``body`` through the whole app, in this process (the request's headers, client and state;
    its client leaving cancels it as it would the route's own request): the status and body."""
    headers = [(k, v) for k, v in request.scope["headers"] if k not in (b"content-length", b"content-type")]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {**request.scope, "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers}
    for key in ("route", "endpoint", "path_params"):  # the outer route's, which routing sets again
        scope.pop(key, None)
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()  # the body was read: this waits for the client to leave

    status, chunks = 500, []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await request.app(scope, receive, send)
    return status, b"".join(chunks)
