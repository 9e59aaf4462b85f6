"""HTTP guards, before any route runs: body size, read time and nesting, the API key, and the request head's size.

Every refusal is OpenAI's error body (``responses.error``)."""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..json_schema import MAX_DEPTH
from .responses import error

class Guard:
    """Body size, body read time and API key, checked before any route runs: a plain ASGI middleware.

    Starlette's ``@app.middleware("http")`` wraps ``receive``, so a route's ``request.is_disconnected()``
    never saw a non-streaming client leave, and its generation held a slot for minutes (vLLM moved to a
    plain ASGI middleware for the same reason).  A body is read here whole, up to the size limit and within
    ``body_timeout_s``: one without a Content-Length (``Transfer-Encoding: chunked``) cannot reach the
    tokenizer by being unannounced, and one that stops arriving is a 408, not a connection held forever.
    """

    def __init__(self, app: Any, max_body_bytes: int, api_key: str | None, body_timeout_s: float = 30.0,
                 public: frozenset[str] = frozenset()) -> None:
        self.app, self.max_body_bytes, self.api_key = app, max_body_bytes, api_key
        self.body_timeout_s, self.public = body_timeout_s, PUBLIC_PATHS | public

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(len(k) + len(v) + 4 for k, v in scope.get("headers", [])) > MAX_HEAD_BYTES:
            # HeadLimitedH11 refuses such a head as it arrives; this catches one that came another way (a pipelined
            # request read whole in one go, or uvicorn's httptools protocol, which has no limit).
            return await error(431, HEAD_TOO_LARGE, code="request_header_fields_too_large",
                               headers={"Connection": "close"})(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(length, scope, receive, send)
        if self.api_key and needs_key(scope["path"], self.public) and \
                not authorized(headers.get("authorization"), self.api_key, headers.get("x-api-key")):
            return await error(401, "missing or wrong API key: send 'Authorization: Bearer KEY' (or 'X-Api-Key: KEY')",
                               "authentication_error",
                               code="invalid_api_key")(scope, receive, send)
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            try:
                body = await asyncio.wait_for(self._read_body(receive), self.body_timeout_s)
            except asyncio.TimeoutError:
                return await error(408, f"the request body did not arrive whole within {self.body_timeout_s:g} s "
                                        "(short of its Content-Length, or a chunked body never ended)",
                                   code="request_timeout", headers={"Connection": "close"})(scope, receive, send)
            except _BodyTooLarge:
                return await self._too_large(f"more than {self.max_body_bytes}", scope, receive, send)
            if body is None:  # the client went away
                return None
            deep = too_deep(body)
            if deep is not None:
                return await _too_deep(deep)(scope, receive, send)
            receive = _replay(body, receive)
            scope = as_json(scope, headers.get("content-type"))
        return await self.app(scope, receive, send)

    async def _read_body(self, receive: Any) -> bytes | None:
        """The whole body; None when the client disconnects, ``_BodyTooLarge`` when it grows past the limit."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def _too_large(self, size: str, scope: dict, receive: Any, send: Any) -> None:
        await error(413, f"the request body has {size} bytes; the limit is {self.max_body_bytes} "
                         "(start the server with a larger --max-body)", code="body_too_large")(scope, receive, send)


# What --api-key leaves open: llama-server's public endpoints (server-http.cpp's ``public_endpoints``: /health,
# /v1/health and its web UI at /) and nothing else.  Every other path needs the key, /metrics, /props, /openapi.json,
# llama-server's aliases without /v1 (/chat/completions/input_tokens) and an unknown path (401, as llama-server)
# included: a list of guarded paths left out each path it did not name, and those answered (and ran the template and
# tokenizer on 1 MiB bodies) without the key.
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/"})


# How deep a request body's JSON may nest.  Python's parser gives up near 1,000 levels, and FastAPI then answered
# "There was an error parsing the body" (a JSON schema nested 500 deep did that); no request needs more than this
# (a schema at the deepest the server takes, json_schema.MAX_DEPTH nodes, is about twice that many levels).
MAX_JSON_DEPTH = 256
# A JSON string (a key when a colon follows it) or a bracket: strings are skipped whole, so a bracket inside
# one is text.  Anything else (numbers, commas, literals) is not matched.
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"\s*:?|[\[\]{}]')


def too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> list[str] | None:
    """The keys leading to where ``body``'s JSON nests more than ``limit`` levels deep (objects and arrays alike);
    None where it does not.  A body with fewer opening brackets than that is not read at all."""
    if body.count(b"{") + body.count(b"[") <= limit:
        return None
    levels: list[str | None] = []  # per open level, the key that opened it
    key = None
    for token in _JSON_TOKEN.finditer(body):
        text = token.group()
        if text[:1] == b'"':
            key = text[1:text.rindex(b'"')].decode("utf-8", "replace") if text.endswith(b":") else key
        elif text in (b"{", b"["):
            levels.append(key)
            key = None
            if len(levels) > limit:
                return [k for k in levels if k is not None]
        elif levels:
            levels.pop()
    return None


def _too_deep(keys: list[str]) -> Any:
    """The 400 for a body nested past ``MAX_JSON_DEPTH``, naming the field it is in and the way down to it."""
    field = keys[0] if keys else None
    way = ".".join(keys[:6]) + (" ..." if len(keys) > 6 else "")
    return error(400, f"{field or 'the body'}: the request's JSON nests more than {MAX_JSON_DEPTH} levels deep (at "
                      f"{way or 'the top'}); a JSON schema may nest at most {MAX_DEPTH} levels: flatten it",
                 param=field, code="too_deep")


def as_json(scope: dict, content_type: str | None) -> dict:
    """A body sent without a JSON content type read as JSON, as llama-server reads every body (``curl -d`` sends
    application/x-www-form-urlencoded; without this FastAPI took the body as bytes and answered 400 on every
    route).  A body that is not JSON is then the schema's 400, which says how to send it."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind == "application/json" or kind.endswith("+json"):
        return scope
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def needs_key(path: str, public: frozenset[str] = PUBLIC_PATHS) -> bool:
    """Whether ``path`` needs the API key: every path but the ``public`` ones (a trailing slash aside)."""
    return (path.rstrip("/") or "/") not in public


class _BodyTooLarge(Exception):
    """A body that grew past --max-body while it was read."""


def authorized(header: str | None, key: str, api_key_header: str | None = None) -> bool:
    """``Authorization: Bearer KEY``, the scheme in any case (RFC 7235: auth schemes are case-insensitive), or
    Anthropic's ``X-Api-Key: KEY`` when there is no Authorization header (llama-server takes both)."""
    if header is None and api_key_header is not None:
        return hmac.compare_digest(api_key_header.strip().encode(), key.encode())
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


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


# The request line and headers together, at most: nginx's large_client_header_buffers (4 x 8 KiB) and
# h11's own default are in the same range.  A longer head is answered 431.
MAX_HEAD_BYTES = 32 << 10
HEAD_TOO_LARGE = (f"the request line and headers are over {MAX_HEAD_BYTES} bytes; send less (a long header value "
                  "such as a cookie, or a body sent as a header)")
LINGER_S = 2.0  # how long a refused connection's further input is read and dropped before it is closed


class HeadLimitedH11(H11Protocol):
    """uvicorn's h11 protocol, answering a request head over ``MAX_HEAD_BYTES`` with 431 in OpenAI's error body.

    httptools, the protocol uvicorn picks when it is installed, takes a head of any size (10 MiB of
    headers got a 200), and h11 limits only a head still incomplete when a read ends (a whole 200 KB head
    in one read passed; an unfinished one is a plain 400).  So the head is measured here as it arrives.
    The connection then lingers a moment, its input dropped, so that the client reads the answer before
    the close (closing with unread input resets the connection, and the client may never see the 431)."""

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # a request head is (still) arriving: count it to its blank line
            pending = self.conn.trailing_data[0] + data
            end = pending.find(b"\r\n\r\n")
            if (len(pending) if end < 0 else end + 4) > MAX_HEAD_BYTES:
                return self._refuse_head()
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        if len(self.conn.trailing_data[0]) <= MAX_HEAD_BYTES:  # h11's own limit (h11_max_incomplete_event_size)
            return super().send_400_response(msg)
        self._refuse_head()

    def _refuse_head(self) -> None:
        body = json.dumps({"error": {"message": HEAD_TOO_LARGE, "type": "invalid_request_error", "param": None,
                                     "code": "request_header_fields_too_large"}}).encode()
        # Written as bytes: h11 sends no response to a request it has not read (nor, in every state, to one it failed).
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.data_received = lambda data: None  # type: ignore[method-assign]  # the rest of the head is dropped
        self.loop.call_later(LINGER_S, self.transport.close)


def http_options() -> dict[str, Any]:
    """The uvicorn settings `specstack serve` runs with (``uvicorn.run(app, **http_options())``): the head limit."""
    return {"http": HeadLimitedH11, "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
