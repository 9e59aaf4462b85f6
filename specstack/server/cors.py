"""Cross-origin requests as llama-server answers them (``server-http.cpp``'s pre-routing handler, ``--cors-origins``).

A web page served from another origin (llama.cpp's web UI run on its own, an editor's webview) calls the API from
the browser, which asks first with ``OPTIONS`` and then checks ``Access-Control-Allow-Origin`` on every answer.
llama-server's default (``*`` with credentials) echoes the caller's ``Origin``; ``localhost`` echoes only a
localhost origin (``http://localhost``, ``http://127.0.0.1:3000``, ``http://[::1]``); any other value is sent as it
is.  A preflight ``OPTIONS`` is answered here, before the API key is checked: browsers send no key with it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

METHODS = "GET, POST, DELETE, OPTIONS"  # llama-server's cors_methods
LOCALHOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def origin_is_localhost(origin: str) -> bool:
    """``http(s)://localhost[:port]``, ``127.0.0.1`` or ``[::1]``; a bare ``localhost`` too (llama-server's check)."""
    host = urlsplit(origin if "//" in origin else "//" + origin).hostname
    return host in LOCALHOSTS


class Cors:
    """ASGI middleware: llama-server's CORS headers on every answer, and its preflight answer to ``OPTIONS``."""

    def __init__(self, app: Any, origins: str = "*") -> None:
        self.app, self.origins = app, origins

    def allowed(self, origin: str | None) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for a request from ``origin`` (None: no header)."""
        if self.origins == "*":
            return origin if origin is not None else None
        if self.origins == "localhost":
            return origin if origin is not None and origin_is_localhost(origin) else None
        return self.origins

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        allow = self.allowed(headers.get("origin"))
        extra = [(b"Access-Control-Allow-Origin", allow.encode("latin-1"))] if allow else []
        if scope.get("method") == "OPTIONS":
            # spelled as llama-server spells them: a client reading the headers into a plain dict looks them up so
            extra += [(b"Access-Control-Allow-Credentials", b"true"), (b"Access-Control-Allow-Methods", METHODS.encode()),
                      (b"Access-Control-Allow-Headers", b"*"), (b"content-type", b"text/html"),
                      (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 200, "headers": extra})
            return await send({"type": "http.response.body", "body": b""})
        if not extra:
            return await self.app(scope, receive, send)

        async def with_origin(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return await self.app(scope, receive, with_origin)
