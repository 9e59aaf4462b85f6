"""The ingress side of a role served by a Ray Serve deployment: what ``create_app``'s routes call.

``RemoteRole`` stands where a ``RoleWorker`` stands in the single-process
server (``app.RoleBackend``): the routes tokenize, check and build jobs as
always, and ``submit`` streams the jobs' events back from a replica chosen by
the role's router.  The ingress loads the model's vocabulary only (no
weights), and reads context size and exactness from a replica.

/metrics and /health read the role's ``MetricsBoard`` actor directly, not
through the deployment's handle: a call through the handle is a request like
any other, it waits for one of the replicas' ``max_ongoing_requests`` slots
and is refused once the queue is full.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from ...llama import VocabModel
from ..events import Delta, Failed
from ..session import SESSION
from ..chat import load_template
from ..roles import Role
from ..worker import Job
from .suffix_share import PULL_S

BOARD_S = 5.0  # /metrics and /health give up on the metrics board after this long
LIVE_S = 5 * PULL_S  # a replica whose metrics are older than this counts as down (not replaced yet)


@dataclass(frozen=True)
class ShapesView:
    """A replica's measured exactness, as ``responses.exactness`` reads ``target.shapes``."""

    settled: bool
    exact: bool
    why: str


class RemoteTarget:
    """The vocabulary, and the sizes a replica reported: what the routes read of a target (a
    ``llama.target.ServedTarget``)."""

    def __init__(self, vocab: VocabModel, info: dict[str, Any]) -> None:
        self.vocab = vocab
        self.capacity, self.n_vocab, self.n_ctx = info["capacity"], info["n_vocab"], info["n_ctx"]
        self.bos_id, self.eos_id = vocab.bos_id, vocab.eos_id
        exact = info["exact"]
        self.shapes = ShapesView(exact["mode"] is not None, exact["mode"] == "on", exact["why"])

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.vocab.tokenize(text, add_special, parse_special)

    def split_special(self, text: str) -> list[str | int]:
        return self.vocab.split_special(text)

    def detokenize(self, tokens: list[int]) -> str:
        return self.vocab.detokenize(tokens)

    def token_bytes(self, token: int) -> bytes:
        return self.vocab.token_bytes(token)

    def special_text(self, token: int) -> str:
        return self.vocab.special_text(token)

    def eog_ids(self) -> frozenset[int]:
        return self.vocab.eog_ids()

    def grammar_engine(self) -> None:
        """None: a request's grammar is built by the replica that runs it, not at the ingress."""
        return None


class RemoteRole:
    """A role whose engines are a Serve deployment's ``replicas`` (``replica.RoleReplica``), behind ``handle``."""

    def __init__(self, role: Role, handle: Any, retry_after_s: int = 1, replicas: int = 1) -> None:
        self.role, self.handle, self.retry_after_s, self.replicas = role, handle, retry_after_s, replicas
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.target: RemoteTarget | None = None
        self.template = None
        self._pumps: dict[int, asyncio.Task] = {}
        self._connecting: asyncio.Task | None = None
        self._board_name: tuple[str, str] | None = None  # the role's MetricsBoard: (Ray name, namespace)
        self._board: Any = None
        self._all_up = False  # every replica has loaded once (/health turned 200)

    def start(self) -> None:
        self._connecting = asyncio.get_running_loop().create_task(self._connect())

    def stop(self) -> None:
        if self.target is not None:
            self.target.vocab.close()

    async def _connect(self) -> None:
        try:
            self.template = load_template(self.role.model, self.role.chat_template)
            vocab = await asyncio.to_thread(VocabModel, self.role.model, f"tokenizer of role {self.role.name!r}")
            info = await self.handle.describe.remote()
            self.target, self._board_name = RemoteTarget(vocab, info), tuple(info["board"])
        except Exception as exc:  # /health and every request report it
            self.load_error = f"{type(exc).__name__}: {exc}"
        self.ready.set()

    # -- the metrics board: /metrics and /health ----------------------------------

    async def replica_metrics(self) -> dict[str, str]:
        """Every replica's Prometheus text by replica id, as last pushed (every ``PULL_S``); {} while unknown."""
        return await self._ask_board("all") or {}

    async def replicas_up(self) -> int | None:
        """How many replicas have loaded and still push their metrics; None while the board cannot be asked."""
        live = await self._ask_board("live", LIVE_S)
        return None if live is None else len(live)

    async def health(self) -> tuple[str | None, dict[str, Any]]:
        """What /health says of this role: why it cannot take traffic (None: it can), and what its entry adds.

        "Loading model" (503) until every replica has loaded once, as llama-server answers while it loads: a
        load balancer sending traffic earlier would pile it on the first replica up.  After that it can take
        traffic while one replica runs: a replica being replaced lowers ``replicas_ready``, it does not take
        the whole server out of a load balancer."""
        up = await self.replicas_up()
        shown = "?" if up is None else str(min(up, self.replicas))  # a replaced one lingers up to LIVE_S
        detail = {"replicas_ready": f"{shown}/{self.replicas}"}
        self._all_up = self._all_up or (up is not None and up >= self.replicas)
        if not self._all_up:
            return f"Loading model ({shown}/{self.replicas} replicas ready)", detail
        if up == 0:
            return "no replica is running; Serve is replacing them", detail
        return None, detail

    async def _ask_board(self, method: str, *args: Any) -> Any:
        """Call the board (asked for again once if it was replaced); None if it cannot answer in ``BOARD_S``."""
        import ray

        if self._board_name is None:
            return None
        for _ in range(2):
            try:
                if self._board is None:
                    name, namespace = self._board_name
                    self._board = await asyncio.to_thread(ray.get_actor, name, namespace=namespace)
                return await asyncio.wait_for(getattr(self._board, method).remote(*args), BOARD_S)
            except Exception:  # dead, being recreated, or slow: forget the handle, so the next call looks it up
                self._board = None
        return None

    def submit(self, *jobs: Job) -> None:
        """Send a request's choices to one replica; its events arrive on ``jobs[0].events``."""
        pump = asyncio.get_running_loop().create_task(self._pump(list(jobs), SESSION.get()))
        for job in jobs:
            self._pumps[id(job)] = pump

    def cancel(self, job: Job) -> None:
        """The client went away: cancel the call (the replica cancels its jobs between two steps)."""
        pump = self._pumps.pop(id(job), None)
        if pump is not None and not pump.done():
            pump.cancel()

    async def _pump(self, jobs: list[Job], session: str | None) -> None:
        from ray.exceptions import RayActorError, RayTaskError
        from ray.serve.exceptions import BackPressureError

        head = jobs[0]
        payload = {"prompt_ids": head.prompt_ids, "jobs": [(j.config, j.speculative) for j in jobs],
                   "timeout_s": None if head.deadline is None else max(0.0, head.deadline - time.perf_counter()),
                   "retry_after_s": self.retry_after_s}
        options: dict[str, Any] = {"stream": True}
        if session:
            options["session_id"] = session
        stream = self.handle.options(**options).generate.remote(payload)
        ended: set[int] = set()
        try:
            async for event in stream:
                if not isinstance(event, Delta):
                    ended.add(event.index)
                head.events.put_nowait(event)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except BackPressureError as exc:
            after = str(math.ceil(exc.retry_after_s or self.retry_after_s))
            head.events.put_nowait(Failed(0, 429, f"role {self.role.name!r}: every replica and the queue are full "
                                                  f"({exc}); retry later", "rate_limit_error",
                                          code="rate_limit_exceeded", headers={"Retry-After": after}))
        except (RayActorError, RayTaskError) as exc:
            self._fail(head, jobs, ended, f"the replica serving this request died ({type(exc).__name__}); retry: "
                                          "Serve is replacing it")
        except Exception as exc:  # anything else Serve raises: an error event, never a request left waiting
            self._fail(head, jobs, ended, f"the request could not be served ({type(exc).__name__}: {exc})")
        else:
            self._fail(head, jobs, ended, "the replica ended the stream early; retry")
        finally:
            for job in jobs:
                self._pumps.pop(id(job), None)

    def _fail(self, head: Job, jobs: list[Job], ended: set[int], why: str) -> None:
        """End the request with an error event, unless every choice has ended already."""
        if len(ended) < len(jobs):
            head.events.put_nowait(Failed(min(set(range(len(jobs))) - ended), 503, f"role {self.role.name!r}: {why}",
                                          "server_error"))
