"""The Serve application of ``specstack serve --ray``, and the command's start, wait and stop.

One deployment per role (``role-NAME``): ``replicas`` engines, each
``num_cpus`` = its threads (``plan_layout``: by default the CPUs shared out
among the replicas, and a layout that cannot fit refused before anything is
deployed) and ``max_ongoing_requests`` = its slots; past the
slots, Serve's queue (``--max-queue``) and then 429 with ``Retry-After``.  Its
router is ``router.PrefixRouter``, and two deployment-scoped actors serve all
its replicas: the suffix log and the metrics board.  One ingress deployment
runs ``create_app`` (the same routes as the single-process server) over
``remote.RemoteRole`` backends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import ray
from ray import serve
from ray.serve.config import BackpressureConfig, DeploymentActorConfig, RequestRouterConfig

from ...errors import InvalidParameterError
from ...host.sysinfo import allowed_cpus
from ...llama import default_threads
from ..app import Limits, create_app
from ..responses import error
from ..roles import Role
from .metrics_merge import merge
from .remote import RemoteRole
from .replica import BOARD, SUFFIX_LOG, RoleReplica
from .router import MODES, PrefixRouter
from .suffix_share import MetricsBoard, SuffixLog

APP = "specstack"
STATS_PERIOD_S = 2.0  # how often replicas publish their prefixes to the routers


@serve.ingress()
class Ingress:
    """The HTTP front: ``create_app``'s routes, each role a ``RemoteRole`` over its deployment's handle."""

    def __init__(self, roles: list[Role], limits: Limits, api_key: str | None, max_queue: int,
                 handles: dict[str, Any], replicas: dict[str, int]) -> None:
        self.roles, self.limits, self.api_key, self.max_queue, self.handles = roles, limits, api_key, max_queue, handles
        self.replicas = replicas
        self.front: InFlight | None = None
        self.backends: dict[str, RemoteRole] = {}

    def __serve_build_asgi_app__(self) -> Any:
        self.backends = {r.name: RemoteRole(r, self.handles[r.name], self.limits.retry_after_s, self.replicas[r.name])
                         for r in self.roles}
        self.front = InFlight(create_app(self.roles, self.limits, self.api_key, self.max_queue, backends=self.backends,
                                         render_metrics=self.render_metrics, role_health=self.role_health),
                              self.limits.retry_after_s)
        return self.front

    async def drain(self) -> int:
        """Refuse new requests, and wait (up to ``--timeout``, else 600 s) until every request this ingress holds
        has ended; returns how many are left.

        Run before the application is deleted: deleting stops the role replicas once their own requests end, and
        a request still queued here for a slot (past the replicas' ``max_ongoing_requests``) would then wait for a
        replica that never comes, until Serve gives up on the deletion."""
        assert self.front is not None
        self.front.draining = True
        deadline = time.monotonic() + (self.limits.timeout_s or 600)
        while self.front.active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self.front.active

    async def render_metrics(self) -> bytes:
        """Every replica of every role, labelled ``replica``, and ``replica="total"`` per role: read from each
        role's metrics board, so /metrics neither waits for a generation slot nor fails when the queue is full."""
        texts: dict[str, str] = {}
        for role_texts in await asyncio.gather(*(b.replica_metrics() for b in self.backends.values())):
            texts.update(role_texts)
        if self.front is not None:  # the errors the ingress answered itself, before any replica (``AnswerCounter``)
            texts["ingress"] = self.front.app.state.metrics.render().decode()
        return merge(texts)

    async def role_health(self) -> dict[str, tuple[str | None, dict[str, Any]]]:
        """Each role's replicas up, from its metrics board (``RemoteRole.health``)."""
        checks = await asyncio.gather(*(b.health() for b in self.backends.values()))
        return dict(zip(self.backends, checks))


class InFlight:
    """ASGI wrapper of the ingress's app: counts HTTP requests until their response has been sent (a stream's
    ``[DONE]`` included), and once ``draining`` answers new ones 503 with ``Retry-After`` in the API's error shape
    (so the drain ends under a steady load, and /health tells load balancers to go elsewhere)."""

    def __init__(self, app: Any, retry_after_s: int) -> None:
        self.app, self.retry_after_s = app, retry_after_s
        self.active, self.draining = 0, False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan: the app's own start-up and shutdown
            return await self.app(scope, receive, send)
        if self.draining:
            refusal = error(503, "the server is shutting down; retry on another server or later", "server_error",
                            code="shutting_down", headers={"Retry-After": str(self.retry_after_s)})
            return await refusal(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


def plan_layout(roles: list[Role], replicas: int | None, cpus: int, node_cpus: int | None = None,
                cap: int | None = None) -> list[Role]:
    """``roles`` with every replica's threads set so that all replicas fit in ``cpus`` (the largest node:
    ``node_cpus``), or ``InvalidParameterError`` naming the numbers.

    Each replica asks Ray for its threads as CPUs.  Threads used to default to all cores per replica, so
    on 2 cores ``--replicas 2`` left the second replica unscheduled and /health at "1/2 replicas ready"
    forever.  A role without threads now gets an equal share of the CPUs the roles with threads leave
    (at least 1, at most ``cap``: the physical cores where Ray runs here); ``replicas`` overrides every
    role's ``replicas`` key."""
    node_cpus = node_cpus or cpus
    counts = {r.name: replicas or r.replicas for r in roles}
    fixed = sum(r.threads * counts[r.name] for r in roles if r.threads)
    shared = sum(counts[r.name] for r in roles if not r.threads)
    share = max(1, min((cpus - fixed) // shared if shared else 1, node_cpus, cap or cpus))
    planned = [dataclasses.replace(r, threads=r.threads or share) for r in roles]
    need = sum(r.threads * counts[r.name] for r in planned)
    parts = "; ".join(f"role {r.name!r}: {counts[r.name]} replica(s) x {r.threads} thread(s)" for r in planned)
    threads = "the threads per replica (-t, or a role's threads key)"
    if need > cpus:
        raise InvalidParameterError(f"--ray: the replicas need {need} CPUs ({parts}; each replica asks Ray for its "
                                    f"threads as CPUs) and Ray has {cpus}; lower --replicas (or a role's replicas "
                                    f"key) or {threads}, or give Ray more CPUs")
    wide = next((r for r in planned if r.threads > node_cpus), None)
    if wide is not None:
        raise InvalidParameterError(f"--ray: a replica of role {wide.name!r} needs {wide.threads} CPUs on one node "
                                    f"and Ray's largest node has {node_cpus}; lower {threads}, or add a larger node")
    return planned


def cluster_cpus() -> tuple[int, int]:
    """CPUs of the Ray cluster this process is connected to: (all nodes, the largest node)."""
    nodes = [int(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    return sum(nodes), max(nodes, default=0)


def application(roles: list[Role], limits: Limits, api_key: str | None = None, max_queue: int = 16,
                replicas: int | None = None, routing: str = "prefix", suffix_log: Path | None = None,
                share_suffix: bool = True) -> Any:
    """The bound Serve application; ``replicas`` overrides every role's ``replicas`` key."""
    if routing not in MODES:
        raise ValueError(f"--routing must be one of {', '.join(MODES)} (got {routing!r})")
    handles, counts = {}, {}
    for role in roles:
        role = dataclasses.replace(role, threads=role.threads or default_threads())
        counts[role.name] = replicas or role.replicas
        handles[role.name] = _role_deployment(role, limits, max_queue, counts[role.name], routing,
                                              suffix_log, share_suffix).bind(role, max_queue, share_suffix)
    front_capacity = max(100, 4 * sum(r.parallel * (replicas or r.replicas) for r in roles) + max_queue)
    front = serve.deployment(Ingress).options(
        name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        # the front only waits on the roles: their queues (--max-queue) answer 429 in the API's shape, and this
        # one, far larger, only guards the process (past it Serve's proxy answers a plain 429 with Retry-After)
        max_ongoing_requests=front_capacity, max_queued_requests=front_capacity,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=limits.retry_after_s),
        graceful_shutdown_timeout_s=limits.timeout_s or 600)
    return front.bind(roles, limits, api_key, max_queue, handles, counts)


def _role_deployment(role: Role, limits: Limits, max_queue: int, replicas: int, routing: str,
                     suffix_log: Path | None, share_suffix: bool) -> Any:
    router = RequestRouterConfig(request_routing_stats_period_s=STATS_PERIOD_S)
    if routing != "pow2":
        router = RequestRouterConfig(request_router_class=PrefixRouter, request_router_kwargs={"mode": routing},
                                     request_routing_stats_period_s=STATS_PERIOD_S)
    actors = [DeploymentActorConfig(name=BOARD, actor_class=ray.remote(MetricsBoard), actor_options={"num_cpus": 0})]
    if share_suffix:
        actors.append(DeploymentActorConfig(
            name=SUFFIX_LOG, actor_class=ray.remote(SuffixLog), actor_options={"num_cpus": 0},
            init_kwargs={"path": _log_path(suffix_log, role), "vocab": f"{role.model.name}"}))
    return serve.deployment(RoleReplica).options(
        name=f"role-{role.name}", num_replicas=replicas, ray_actor_options={"num_cpus": role.threads},
        max_ongoing_requests=role.parallel, max_queued_requests=max_queue,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=limits.retry_after_s),
        request_router_config=router, deployment_actors=actors,
        graceful_shutdown_timeout_s=limits.timeout_s or 600)


def _log_path(base: Path | None, role: Role) -> str | None:
    """The role's suffix log file: ``--suffix-log`` itself, or beside it per role when a folder is given."""
    if base is None:
        return None
    base = base.expanduser()
    return str(base / f"{role.name}.suffix-log.json") if base.is_dir() else str(base)


def start(app: Any, address: str | None, host: str, port: int, num_cpus: int | None = None) -> bool:
    """Connect to ``address`` (or start a local Ray instance), then run the application; returns whether
    this process started Ray (and so must stop it)."""
    own = connect(address, num_cpus)
    run(app, host, port)
    return own


def connect(address: str | None, num_cpus: int | None = None) -> bool:
    """Join the Ray cluster at ``address``, or start a local instance (returns True: this process must stop it).

    ``ray.init`` replaces the SIGTERM handler with one that exits at once: a command's own handler goes after."""
    own = address is None
    ray.init(address=address, include_dashboard=False if own else None, num_cpus=num_cpus if own else None,
             logging_level="warning")
    return own


def run(app: Any, host: str, port: int) -> None:
    """Start Serve's HTTP proxy on ``host:port`` and deploy the application (returns once it is running)."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP, route_prefix="/", blocking=False)


def stop(own: bool) -> None:
    """Drain, then stop: the ingress refuses new requests (503) and waits for every request it holds, queued ones
    included (``Ingress.drain``); then the application is deleted (Serve's proxy answers 404) and, if started here,
    Serve and Ray stop."""
    try:
        try:
            left = serve.get_app_handle(APP).drain.remote().result()
            if left:
                print(f"specstack serve --ray: {left} request(s) still running after the drain timeout; stopping them",
                      flush=True)
        except Exception as exc:  # an ingress already gone: nothing of ours to wait for
            print(f"specstack serve --ray: could not drain the ingress ({type(exc).__name__}: {exc})", flush=True)
        serve.delete(APP)
        if own:
            serve.shutdown()
    finally:
        ray.shutdown()


def run_until_signal(roles: list[Role], replicas: int | None, build: Callable[[list[Role]], Any],
                     address: str | None, host: str, port: int,
                     started: Callable[[threading.Event], None] = lambda done: None) -> int:
    """``specstack serve --ray``: check the layout (``plan_layout``), deploy ``build(roles)``, call
    ``started`` (the command waits there for /health and says "ready"; it returns early once ``done`` is set),
    and run until SIGTERM or SIGINT; then drain and stop (Ray too, if started here).

    A Ray instance started here gets exactly this process's CPUs, so the layout is checked before it starts;
    a cluster's CPUs are known once joined, and checked before anything is deployed.  The handlers go in
    right after ``ray.init`` (whose own would exit at once), before the deployment: the application answers
    requests a little before ``serve.run`` returns, and a signal in that window must drain too (it is acted
    on as soon as the deployment returns)."""
    own = address is None
    cpus = len(allowed_cpus()) if own else None
    planned = plan_layout(roles, replicas, cpus, cap=default_threads()) if own else None
    done = threading.Event()
    connect(address, cpus)
    try:
        planned = planned or plan_layout(roles, replicas, *cluster_cpus())
    except InvalidParameterError:
        ray.shutdown()
        raise
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    run(build(planned), host, port)
    where = "(started here)" if own else "at " + address
    layout = ", ".join(f"{r.name} {replicas or r.replicas} x {r.threads} threads" for r in planned)
    print(f"specstack serve --ray: loading {layout} on Ray {where}; http://{host}:{port}/", flush=True)
    started(done)
    done.wait()
    print("specstack serve --ray: draining", flush=True)
    stop(own)
    return 0
