"""One replica of a role: a ``RoleWorker`` (the role's engine and drafters on their thread) behind Serve.

The ingress sends a request's choices in one call; the replica answers with the
same events a worker gives the single-process routes (delta, done, error), as
a stream.  When the caller goes away Serve cancels the call, and the jobs are
cancelled between two steps, freeing the slot.

Between requests the replica publishes the prefixes its slots and host prompt
cache hold (``record_routing_stats``, read by ``router.PrefixRouter``), sends
finished outputs to the role's ``SuffixLog`` and pulls the other replicas',
and pushes its metrics to the role's ``MetricsBoard`` (where the ingress reads
/metrics and /health, never through the slots).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import time
from typing import Any, AsyncIterator, Callable

from prometheus_client import Gauge

from ...generation import GenerationConfig
from ..events import Delta, Done, Event, Failed
from ..responses import exactness
from ..prometheus import ServerMetrics
from ..roles import Role
from ..worker import Job, QueueFull, RoleWorker
from .prefix import published
from .suffix_share import PULL_S, OutputWindow, feed, suffix_drafters

SUFFIX_LOG = "suffix_log"  # the deployment-scoped actors' names
BOARD = "metrics_board"


class ReplicaWorker(RoleWorker):
    """A ``RoleWorker`` that also runs given functions on its engine thread, and reports finished outputs."""

    def __init__(self, role: Role, metrics: ServerMetrics, max_queue: int,
                 on_output: Callable[[list[int], list[int]], None] | None = None) -> None:
        super().__init__(role, metrics, max_queue)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._on_output = on_output

    def on_engine_thread(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` between two steps: drafter state belongs to the engine thread."""
        self._calls.put(fn)
        self._wake.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                break
            fn()
        super()._drain_inbox()

    def _finish(self, job: Job) -> None:
        gen = job.gen
        super()._finish(job)
        if self._on_output is not None and gen.stats.stop_reason != "cancelled" and gen.output_ids:
            self._on_output(list(job.prompt_ids), list(gen.output_ids))

    def held_sequences(self) -> list[list[int]]:
        """The token sequences whose KV this replica can reuse: its slots' and its host prompt cache's, newest first.

        Read without the engine thread's lock (copies of lists; at worst a step stale), for routing only."""
        engine = self.engine
        if engine is None:
            return []
        slots = sorted(engine._slots, key=lambda s: -s.released if s.gen is None else float("-inf"))
        seqs = [list(s.gen.prompt_ids) if s.gen is not None else list(s.cached) for s in slots]
        cache = engine.prompt_cache
        if cache is not None:
            seqs += [list(e.tokens) for e in sorted(list(cache.entries), key=lambda e: -e.used)]
        return [s for s in seqs if s]


class RoleReplica:
    """A Serve deployment class: one engine of ``role``; ``share_suffix`` joins the role's suffix log."""

    async def __init__(self, role: Role, max_queue: int, share_suffix: bool = True) -> None:
        from ray import serve

        self.role = role
        self.id = serve.get_replica_context().replica_id.unique_id
        self.metrics = ServerMetrics()
        self._shared = Gauge("specstack_suffix_shared_outputs", "Other replicas' finished outputs pulled into this "
                             "replica's suffix trees", ["role"], registry=self.metrics.registry)
        self._loop = asyncio.get_running_loop()
        self._log = serve.get_deployment_actor(SUFFIX_LOG) if share_suffix else None
        self._board = serve.get_deployment_actor(BOARD)
        self._board_name = await self._board.name.remote()  # for the ingress (``describe``), which reads the board
        self.worker = ReplicaWorker(role, self.metrics, max_queue,
                                    on_output=self._send_output if self._log is not None else None)
        self.worker.start()
        await asyncio.to_thread(self.worker.ready.wait)
        if self.worker.load_error:  # Serve reports the replica as failed, with this message
            raise RuntimeError(f"role {role.name!r} failed to load: {self.worker.load_error}")
        self._version, self._pulled = 0, 0
        self._remote_outputs = OutputWindow()  # the newest outputs pulled, to seed drafters made later
        self._seeded: set[int] = set()
        self._stats_version = 0
        # apart: a pull waits for the engine thread between two steps; the metrics (and through them /health's
        # count of replicas up) must not wait behind a long step
        self._tasks = [self._loop.create_task(self._push_loop())]
        if self._log is not None:
            self._tasks.append(self._loop.create_task(self._pull_loop()))

    # -- what the ingress calls -------------------------------------------------

    async def describe(self) -> dict[str, Any]:
        """What the ingress needs to check requests as the worker's routes do (it holds no weights)."""
        w = self.worker
        return {"capacity": w.target.capacity, "n_vocab": w.target.n_vocab, "n_ctx": w.target.n_ctx,
                "exact": exactness(w), "board": self._board_name}

    async def generate(self, payload: dict[str, Any]) -> AsyncIterator[Event]:
        """Run a request's choices; yield their events until each is done or failed."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        remaining = payload.get("timeout_s")
        deadline = time.perf_counter() + remaining if remaining is not None else None
        jobs = [Job(payload["prompt_ids"], GenerationConfig(**c) if isinstance(c, dict) else c, spec, loop, events,
                    deadline, index=i) for i, (c, spec) in enumerate(payload["jobs"])]
        try:
            self.worker.submit(*jobs)
        except QueueFull as exc:
            yield Failed(0, 429, str(exc), "rate_limit_error", code="rate_limit_exceeded",
                         headers={"Retry-After": str(payload.get("retry_after_s", 1))})
            return
        ended: set[int] = set()
        try:
            while len(ended) < len(jobs):
                event = await events.get()
                if not isinstance(event, Delta):
                    ended.add(event.index)
                if isinstance(event, Done):
                    event = dataclasses.replace(event, stats={**event.stats, "replica": self.id})
                yield event
        finally:
            for job in jobs:  # cancelled by the caller (client gone) or the stream closed early
                if job.index not in ended:
                    self.worker.cancel(job)

    # -- Serve's hooks ----------------------------------------------------------

    def record_routing_stats(self) -> dict[str, Any]:
        """The prefixes this replica holds, as chained chunk hashes (``prefix``), for the router."""
        self._stats_version += 1
        return {"version": self._stats_version, "replica": self.id,
                "prefixes": published(self.worker.held_sequences()),
                "load": self.worker.active}

    def check_health(self) -> None:
        if not self.worker._thread.is_alive():
            raise RuntimeError(f"role {self.role.name!r}: the engine thread has stopped")

    async def __del__(self) -> None:  # Serve's graceful shutdown: in-flight requests have drained
        for task in getattr(self, "_tasks", ()):
            task.cancel()
        await asyncio.to_thread(self.worker.stop)

    # -- shared suffix statistics ------------------------------------------------

    def _send_output(self, prompt: list[int], output: list[int]) -> None:
        """On the engine thread: file a finished output, fire and forget (the actor call is made on the loop)."""
        self._loop.call_soon_threadsafe(lambda: self._log.add.remote(self.id, prompt, output))

    async def _push_loop(self) -> None:
        """This replica's metrics to the board at once (it counts as up from then), then every ``PULL_S``."""
        from ray import serve

        while True:
            try:  # awaited: a board that died raises here, and is asked for again
                await self._board.put.remote(self.id, self.metrics.render().decode())
            except Exception as exc:
                self._unreachable("the metrics board", exc)
                with contextlib.suppress(Exception):  # not registered again yet: the next round asks again
                    self._board = serve.get_deployment_actor(BOARD)
            await asyncio.sleep(PULL_S)

    async def _pull_loop(self) -> None:
        """Every ``PULL_S``: the other replicas' outputs from the log."""
        from ray import serve

        while True:
            await asyncio.sleep(PULL_S)
            try:
                await self.pull()
            except Exception as exc:  # an actor being replaced: ask for it again; drafts only lose freshness
                self._unreachable("the suffix log", exc)
                with contextlib.suppress(Exception):
                    self._log = serve.get_deployment_actor(SUFFIX_LOG)

    def _unreachable(self, what: str, exc: Exception) -> None:
        print(f"specstack replica {self.id}: {what} is unreachable ({type(exc).__name__}: {exc}); retrying",
              flush=True)

    async def pull(self) -> int:
        """Bring the other replicas' outputs since the last pull into every suffix drafter; returns how many."""
        version, entries = await self._log.since.remote(self._version)
        if version < self._version:  # a restarted actor numbers from its checkpoint: take all it has
            version, entries = await self._log.since.remote(0)
        theirs = [(p, o) for origin, p, o in entries if origin != self.id]
        self._version = version
        self._remote_outputs.extend(theirs)
        self._pulled += len(theirs)
        self._shared.labels(self.role.name).set(self._pulled)
        done = asyncio.Event()
        self.worker.on_engine_thread(lambda: (self._apply(theirs), self._loop.call_soon_threadsafe(done.set)))
        await done.wait()
        return len(theirs)

    def _apply(self, new: list[tuple[list[int], list[int]]]) -> None:
        """On the engine thread: new outputs into known drafters; the newest kept (``OutputWindow``) into drafters
        made since."""
        for drafter in suffix_drafters(self.worker._drafters.values()):
            for p, o in (new if id(drafter) in self._seeded else self._remote_outputs):
                feed(drafter, p, o)
            self._seeded.add(id(drafter))
