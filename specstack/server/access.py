"""One access-log line per request: method, path, status, milliseconds and tokens (prompt + generated).

A plain ASGI middleware, outermost, so that refusals before any route (401, 413, 408) are logged too.  A
route that generates puts the request's usage in ``request.state.usage``; the line is written once the
response's last byte has gone (a stream's too), or when the request ends without one (a client gone).
The probes (``GET /health``, ``GET /v1/health``, ``GET /metrics``) are not logged: a load balancer polls them every second.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

QUIET = {("GET", "/health"), ("GET", "/v1/health"), ("GET", "/metrics")}


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def access_line(method: str, path: str, status: int, ms: float, usage: dict[str, int] | None) -> str:
    """``POST /v1/completions 200 812 ms 12+48 tokens`` (prompt + generated; none for a request that generated
    nothing)."""
    tokens = f" {usage['prompt_tokens']}+{usage['completion_tokens']} tokens" if usage else ""
    return f"specstack serve: {method} {path} {status} {ms:.0f} ms{tokens}"


class AccessLog:
    def __init__(self, app: Any, write: Callable[[str], None] = stderr_line) -> None:
        self.app, self.write = app, write

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (scope.get("method"), scope.get("path")) in QUIET:
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        state = scope.setdefault("state", {})
        seen = {"status": None, "logged": False}

        def log(status: int | None) -> None:
            if not seen["logged"]:
                seen["logged"] = True
                self.write(access_line(scope.get("method", "?"), scope.get("path", "?"), status or 500,
                                       (time.perf_counter() - start) * 1000, state.get("usage")))

        async def send_logged(message: dict) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                log(seen["status"])

        try:
            await self.app(scope, receive, send_logged)
        except BaseException:
            log(seen["status"] or 500)
            raise
        log(seen["status"] or 499)  # no answer at all: the client went away first
