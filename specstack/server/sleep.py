"""llama-server's ``--sleep-idle-seconds``: a role's model is unloaded after that long without work and loaded
again by the next request that needs it.

The worker (``RoleWorker``) decides when to sleep and reloads through the same loader it started with; this module
holds what the rest of the server needs meanwhile: the few facts of the unloaded model that the read-only endpoints
show (``AsleepTarget``), and the middleware that wakes the roles for every other request and keeps them awake until
its answer is sent (``WakeOnUse``).  As in llama-server, ``/health``, ``/props``, ``/models`` and ``/metrics`` never
wake a sleeping model: a monitor polling them must not keep it loaded.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from ..llama.target import DescribedTarget

# Paths answered from what a sleeping role keeps (llama-server's create_response(bypass_sleep = true)), by method
READ_ONLY = {("GET", "/health"), ("GET", "/v1/health"), ("GET", "/props"), ("GET", "/models"), ("GET", "/v1/models"),
             ("GET", "/metrics"), ("GET", "/"), ("OPTIONS", None)}


class AsleepTarget:
    """What the read-only endpoints read of a role's model while it sleeps (a ``llama.target.DescribedTarget``): its
    context, vocabulary size, exact shapes, end-of-generation ids and the pieces of its BOS and EOS tokens, copied
    before the model was freed.  Anything else is not there: every other route wakes the role first
    (``WakeOnUse``)."""

    def __init__(self, target: DescribedTarget) -> None:
        self.n_ctx, self.capacity, self.n_vocab = target.n_ctx, target.capacity, target.n_vocab
        self.shapes = target.shapes
        self.bos_id, self.eos_id = target.bos_id, target.eos_id
        self._eog = target.eog_ids()
        special = [t for t in (self.bos_id, self.eos_id) if t >= 0]
        self._bytes = {t: target.token_bytes(t) for t in special}
        self._texts = {t: target.special_text(t) for t in special}

    def token_bytes(self, token: int) -> bytes:
        return self._bytes.get(token, b"")

    def special_text(self, token: int) -> str:
        """A special token's spelling (``native.piece_bytes`` shows BOS and EOS so in /props)."""
        return self._texts.get(token, "")

    def eog_ids(self) -> frozenset[int]:
        """The model's end-of-generation ids (``/props`` lists ``ignore_eos``'s bans of them)."""
        return self._eog

    def close(self) -> None:
        """Nothing to free: the model was freed when the role went to sleep."""


def wakes(method: str, path: str) -> bool:
    """Whether a request needs the roles' models loaded (everything but the read-only endpoints)."""
    return (method, path) not in READ_ONLY and (method, None) not in READ_ONLY


class WakeOnUse:
    """ASGI middleware: a request that needs a model wakes every sleeping role (reloading its model, off the event
    loop) and holds the roles awake until its answer, streamed or whole, has been sent."""

    def __init__(self, app: Any, workers: Iterable[Any]) -> None:
        self.app = app
        self.workers = [w for w in workers if getattr(w, "sleep_idle_s", None) is not None]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.workers or not wakes(scope["method"], scope["path"]):
            return await self.app(scope, receive, send)
        held = []
        try:
            for w in self.workers:
                awake = w.hold()
                held.append(w)
                if not awake:  # asleep: wait for its reload on a thread, the event loop serving others
                    await asyncio.to_thread(w.wait_awake)
            await self.app(scope, receive, send)
        finally:
            for w in held:
                w.release()
