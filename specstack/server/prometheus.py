"""Prometheus metrics for the server, labelled by role and, for speculation, by draft source.

Names follow vLLM's spec-decode counters (``spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, and accepted tokens
per position), so the usual PromQL works: acceptance rate =
accepted / draft tokens, mean acceptance length = 1 + accepted / drafts.

``specstack_requests_total`` counts every answer by outcome: ``ok`` and ``cancelled`` generations, and every
error the server sends (4xx and 5xx) by its kind, the error body's ``type``.  A generation that fails is
counted where it fails (``RoleWorker``, in its replica under ``--ray``) and its event says so (``metered``);
every other error answer (a body the API refuses, a missing key, an unknown route, a full queue) is counted
as it is sent (``AnswerCounter``), so no answer is counted twice or not at all.
"""

from __future__ import annotations

import contextvars
import json
from typing import Any, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..metrics import GenerationStats
from .llamacpp_metrics import LlamaCppFigures, LlamaCppMetrics, render as render_llamacpp


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "specstack_"
        self.requests = Counter(p + "requests", "Requests finished, by outcome", ["role", "status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens received", ["role"], registry=r)
        self.generated_tokens = Counter(p + "generation_tokens", "Tokens generated", ["role"], registry=r)
        self.reused_tokens = Counter(p + "prompt_tokens_reused", "Prompt tokens whose KV was reused (not prefilled)", ["role"], registry=r)
        self.queue = Gauge(p + "queue_depth", "Requests waiting for a slot", ["role"], registry=r)
        self.busy = Gauge(p + "busy_slots", "Slots decoding a generation", ["role"], registry=r)
        self.drafts = Counter(p + "spec_decode_num_drafts", "Verification steps that carried a draft", ["role", "source"], registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified", ["role", "source"], registry=r)
        self.accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted", ["role", "source"], registry=r)
        self.accepted_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position",
                                    ["role", "source", "position"], registry=r)
        self.step_seconds = Counter(p + "step_seconds", "Decode time, split into draft, verify and other", ["role", "phase"], registry=r)
        self.k = Histogram(p + "draft_k", "Draft tokens verified per step (the k chosen)", ["role"],
                           buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Submission to first token", ["role"], registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Mean time between a request's tokens after the first",
                             ["role"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0), registry=r)

        self.llamacpp = LlamaCppMetrics()  # llama-server's llamacpp:* figures (``llamacpp_metrics``)

    def requests_started(self, role: str, n_prompt: int) -> None:
        self.prompt_tokens.labels(role).inc(n_prompt)

    def load(self, role: str, running: int, waiting: int) -> None:
        self.busy.labels(role).set(running)
        self.queue.labels(role).set(waiting)
        self.llamacpp.load(role, running, waiting)

    def decoded(self, role: str, n_busy: int) -> None:
        """One engine step of ``role`` that ran ``n_busy`` generations (llama-server's decode count)."""
        self.llamacpp.decoded(n_busy)

    def requests_finished(self, role: str, s: GenerationStats, status: str, n_answered: int | None = None) -> None:
        """A generation's figures; ``n_answered``: the tokens its answer counts (a stop string's cut), else all."""
        self.llamacpp.finished(s, s.n_tokens if n_answered is None else n_answered)
        self.requests.labels(role, status).inc()
        self.generated_tokens.labels(role).inc(s.n_tokens)
        self.reused_tokens.labels(role).inc(s.n_reused)
        for source, st in s.by_source.items():
            self.drafts.labels(role, source).inc(st.n_steps)
            self.draft_tokens.labels(role, source).inc(st.n_drafted)
            self.accepted.labels(role, source).inc(st.n_accepted)
            for pos, n in enumerate(st.accepted_at):
                self.accepted_pos.labels(role, source, str(pos)).inc(n)
        self.step_seconds.labels(role, "draft").inc(s.draft_s)
        self.step_seconds.labels(role, "verify").inc(s.verify_s)
        self.step_seconds.labels(role, "other").inc(s.other_s)
        for _, drafted, _ in s.steps:
            self.k.labels(role).observe(drafted)
        if s.ttft_s > 0:
            self.ttft.labels(role).observe(s.ttft_s)
        if s.itl_s > 0:
            self.itl.labels(role).observe(s.itl_s)

    def requests_failed(self, role: str, kind: str) -> None:
        self.requests.labels(role, kind).inc()

    def render(self, llamacpp: LlamaCppFigures | None = None) -> bytes:
        """specstack's metrics, and llama-server's ``llamacpp:*`` from ``llamacpp`` where given (``/metrics``)."""
        text = generate_latest(self.registry)
        return text if llamacpp is None else text + render_llamacpp(llamacpp).encode()


# What the routes tell ``AnswerCounter`` of the request being answered: ``role`` (the role it went to, once a
# route has chosen one) and ``metered`` (its error was counted already, by the worker that failed it).  A
# mutable dict per request, so what a route sets is seen whatever context copies the framework makes.
ANSWER: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("specstack_answer", default=None)


def note_answer(**facts: Any) -> None:
    """Record ``facts`` (``role=``, ``metered=``) about the request being answered, for ``AnswerCounter``."""
    answer = ANSWER.get()
    if answer is not None:
        answer.update(facts)


def error_kind(status: int, body: bytes) -> str:
    """An error answer's kind: its body's ``error.type`` (OpenAI's and llama-server's shape), else by status."""
    try:
        kind = json.loads(body)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        kind = None
    if isinstance(kind, str) and kind:
        return kind
    return "server_error" if status >= 500 else "invalid_request_error"


class AnswerCounter:
    """Plain ASGI middleware counting every error answer in ``specstack_requests_total`` by its kind.

    Validation happens in many places before a generation starts (the request model, the routes, Guard's
    key and size checks, the routing to a role), and only failures inside a worker used to be counted: 100
    refused bodies left the counter at 2.  Counting the answers as they leave catches every one.  The role
    is the one the request was routed to, else the only role; a request refused before it could be routed
    on a server of several roles is counted under ``role=""``.  A 499 is no answer (the client had gone; its
    generation counts as cancelled)."""

    def __init__(self, app: Any, metrics: ServerMetrics, roles: Sequence[str]) -> None:
        self.app, self.metrics = app, metrics
        self.default_role = roles[0] if len(roles) == 1 else ""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        answer: dict[str, Any] = {}
        token = ANSWER.set(answer)
        status: int | None = None

        async def counted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status is not None and not answer.get("counted"):
                answer["counted"] = True  # the first body chunk: JSON error bodies are sent whole
                self._count(answer, status, message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except BaseException:
            if status is None:  # Starlette answers an unhandled exception with a plain 500
                self._count(answer, 500, b"")
            raise
        finally:
            ANSWER.reset(token)

    def _count(self, answer: dict[str, Any], status: int, body: bytes) -> None:
        if status < 400 or status == 499 or answer.get("metered"):
            return
        self.metrics.requests_failed(answer.get("role") or self.default_role, error_kind(status, body))
