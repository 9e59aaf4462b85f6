"""What the routes serve from: each role's backend (a ``RoleWorker`` here, or a Ray Serve deployment), the
request limits, and the one object every route module reads them from (``Served``, ``app.state.served``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from fastapi import Request

from .prometheus import ServerMetrics, note_answer
from .responses import ApiError
from .roles import Role
from .worker import Job

if TYPE_CHECKING:
    from ..llama.target import ServedTarget


class RoleBackend(Protocol):
    """What the routes need of a role: ``RoleWorker`` (one engine in this process, the default) or
    ``scaleout.remote.RemoteRole`` (a Ray Serve deployment of replicas).  One set of routes serves both."""

    role: Role
    ready: Any  # .is_set()
    load_error: str | None
    target: ServedTarget  # asleep, only its ``DescribedTarget`` part (``sleep.AsleepTarget``): other routes wake it
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
    max_tokens: int = 0  # the most a request may ask for; 0: no bound but the context's end (llama-server's)
    timeout_s: float = 600.0
    retry_after_s: int = 1
    # Choices per request (``n``).  Each is its own generation with its own slot; with more choices than
    # slots the rest wait in the queue (and take its places), as separate requests would.
    max_n: int = 16
    # Seconds a request's body may take to arrive whole: a client that stops sending mid-body (short of its
    # Content-Length, or a chunked body never ended) gets 408 instead of holding a connection open for good.
    body_timeout_s: float = 30.0
    # Tokens a request generates when it names no max_tokens (`serve --n-predict`, llama-server's -n); -1: to
    # the end of text or of the context, llama-server's default.
    default_max_tokens: int = -1


HealthProbe = Callable[[], Awaitable[dict[str, tuple[str | None, dict[str, Any]]]]]


@dataclass
class Served:
    """The roles' backends by name and what the routes share: plain data, read by every route module.

    ``render_metrics`` and ``role_health`` put another engine's figures behind /metrics and /health (``--ray``);
    ``slots`` False turns llama-server's ``GET /slots`` off; ``preserved`` caches each (role, tool format)'s
    control-token markers (``tools.preserved_tokens``)."""

    workers: dict[str, RoleBackend]
    limits: Limits
    metrics: ServerMetrics
    slots: bool = True
    render_metrics: Callable[[], Awaitable[bytes]] | None = None
    role_health: HealthProbe | None = None
    preserved: dict[tuple[str, str], dict[int, str]] = field(default_factory=dict)
    page: bool = True  # the live page at / (llama-server's --no-ui turns it off)
    verbose: bool = False  # OpenAI answers carry __verbose unless a request says otherwise (serve --verbose)
    metrics_endpoint: bool = True  # GET /metrics (off: 501, a llama-server command line without --metrics)

    def backend(self, model: str | None) -> RoleBackend:
        """The role a request names (``model``; none or an unknown one with a single role: that role), ready
        to take it: 404 for an unknown model among several, 503 while it loads or when it failed to."""
        workers = self.workers
        if model is not None and model not in workers:  # another of a role's names (llama-server's -a A,B)
            model = next((name for name, w in workers.items() if model in w.role.aliases), model)
        if model is None or model not in workers:
            if model is not None and len(workers) > 1:
                raise ApiError(404, f"model {model!r} is not served here; choose one of: {', '.join(workers)}",
                               "not_found_error", "model", "model_not_found")
            w = next(iter(workers.values()))
        else:
            w = workers[model]
        note_answer(role=w.role.name)  # the role an error answer from here on is counted under
        if not w.ready.is_set():
            raise ApiError(503, "the model is still loading; retry shortly", "unavailable_error", headers={"Retry-After": "2"})
        if w.load_error:
            raise ApiError(503, f"role {w.role.name!r} failed to load: {w.load_error}", "unavailable_error")
        return w


def served(request: Request) -> Served:
    """The app's ``Served`` (set by ``app.create_app``)."""
    return request.app.state.served
