"""The request router of a role's deployment: the replica holding the prompt's prefix, else the session's,
else the least loaded.

Ray Serve calls ``choose_replicas`` for each request (in the caller's process,
the ingress) with the replicas running; it returns ranks, tried in order, and
within a rank Serve takes the replica with the shortest queue that accepts
(a replica with all its ``max_ongoing_requests`` taken refuses, and the next
rank is tried).  The ranks here:

1. ``prefix`` mode: the replica whose published prefixes (``record_routing_stats``, plus the prompts this
   router sent it since, as SGLang's approximate tree) match the most tokens of the prompt, when that is at
   least ``min_match`` tokens and the load is balanced: SGLang's guards, both must trip to count as
   imbalanced: the longest queue exceeds the shortest by ``balance_abs`` requests and by ``balance_rel``
   times.  An imbalanced load skips this rank, so one hot prefix cannot pile every request on one replica.
   Replicas matching equally many tokens (a shared system prompt) go by queue length, then by a stable
   hash of the prompt (``tie_break``).
2. ``prefix`` and ``session`` modes: the request's session (``x-session-id``, or the body's ``user``) on a
   consistent-hash ring (``ConsistentHashRouter``'s: a replica joining or leaving moves few sessions).
3. every replica: the shortest queue.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from typing import Any, List, Optional

from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from .prefix import CHUNK, MAX_PUBLISHED, chain, matched

MODES = ("prefix", "session", "pow2")  # pow2: Ray's default router, no affinity (set in ``deploy``)
RECENT_S = 60.0  # how long a prompt this router sent counts as held, if the replica never published it


class PrefixRouter(ConsistentHashRouter):
    """Longest reusable prefix unless overloaded, then session affinity, then the shortest queue."""

    def initialize_state(self, mode: str = "prefix", min_match: int = 2 * CHUNK, balance_abs: int = 2,
                         balance_rel: float = 1.5, **ring: Any) -> None:
        super().initialize_state(**ring)
        if mode not in MODES:
            raise ValueError(f"routing mode must be one of {', '.join(MODES)} (got {mode!r})")
        self._mode, self._min_match = mode, min_match
        self._balance_abs, self._balance_rel = balance_abs, balance_rel
        self._published: dict[ReplicaID, tuple[int, frozenset[int]]] = {}
        self._recent: dict[ReplicaID, OrderedDict[int, float]] = {}

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # all ranks full: wait, then try again
        ranks: list[list[RunningReplica]] = []
        if self._mode == "prefix":
            best = await self._prefix_holder(candidate_replicas, self._prompt_chain(pending_request))
            if best is not None:
                ranks.append([best])
        session = pending_request.metadata.session_id
        if session:
            owner = self._lookup_ranked_replicas(session)[:1]
            replica = self._replicas.get(owner[0]) if owner else None
            if replica is not None and [replica] not in ranks:
                ranks.append([replica])
        ranks.append(list(candidate_replicas))
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """The prompt is (about to be) in that replica's KV: count it as held there until it publishes."""
        recent = self._recent.setdefault(replica_id, OrderedDict())
        now = time.monotonic()
        for h in self._prompt_chain(pending_request):
            recent[h] = now
            recent.move_to_end(h)
        while len(recent) > MAX_PUBLISHED:
            recent.popitem(last=False)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for gone in set(self._recent) - self._replica_id_set:
            self._recent.pop(gone, None)
            self._published.pop(gone, None)

    # -- prefix -----------------------------------------------------------------

    @staticmethod
    def _prompt_chain(pending_request: PendingRequest) -> list[int]:
        args = pending_request.args
        payload = args[0] if args and isinstance(args[0], dict) else {}
        ids = payload.get("prompt_ids") or []
        return chain(ids)

    def _held(self, replica: RunningReplica) -> set[int] | frozenset[int]:
        stats = replica.routing_stats or {}
        version = stats.get("version", -1)
        cached = self._published.get(replica.replica_id)
        if cached is None or cached[0] != version:
            cached = self._published[replica.replica_id] = (version, frozenset(stats.get("prefixes") or ()))
        recent = self._recent.get(replica.replica_id)
        if not recent:
            return cached[1]
        horizon = time.monotonic() - RECENT_S
        while recent and next(iter(recent.values())) < horizon:
            recent.popitem(last=False)
        return cached[1] | recent.keys()

    async def _prefix_holder(self, candidates: List[RunningReplica], prompt: list[int]) -> RunningReplica | None:
        """The replica matching most of the prompt (at least ``min_match`` tokens), unless the load is imbalanced;
        of several matching as much, ``tie_break``'s."""
        if not prompt:
            return None
        scores = [(matched(prompt, self._held(r)), r) for r in candidates]
        top = max(s for s, _ in scores)
        if top < self._min_match:
            return None
        if len(candidates) < 2:
            return candidates[0]
        lens = await self._queue_lens(candidates)
        loads = [n for n in lens.values() if n is not None]
        if loads and max(loads) - min(loads) > self._balance_abs and max(loads) > self._balance_rel * min(loads):
            return None
        return tie_break([r for s, r in scores if s == top], lens, prompt[-1])

    async def _queue_lens(self, candidates: List[RunningReplica]) -> dict[ReplicaID, int | None]:
        """Each replica's ongoing requests: Serve's cache where fresh, else asked (as Serve's own routers do)."""
        lens: dict[ReplicaID, int | None] = {}
        missing = []
        for r in candidates:
            n = self._replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            lens[r.replica_id] = n
        for r, n in await self._probe_queue_lens(missing, 0) if missing else ():
            lens[r.replica_id] = n
        return lens


def tie_break(tied: List[RunningReplica], lens: dict[ReplicaID, int | None], key: int) -> RunningReplica:
    """One of the replicas matching equally many tokens: the shortest queue (unknown counts as longest), then
    the highest rendezvous hash of ``key`` (the prompt's last chunk hash) and the replica.

    Ties are common: a system prompt every request shares is soon held by every replica.  Taking the first
    listed would send them all to one replica until the load guard trips; the hash spreads distinct prompts
    evenly over replicas with equal queues, sends the same prompt to the same one, and moves few prompts when
    a replica joins or leaves."""
    def order(r: RunningReplica) -> tuple[float, int]:
        n = lens.get(r.replica_id)
        return (math.inf if n is None else n, -rendezvous(key, r.replica_id.unique_id))
    return min(tied, key=order)


def rendezvous(key: int, replica: str) -> int:
    """A hash of ``key`` with ``replica``, the same in every process (Python's ``hash`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(f"{key}:{replica}".encode(), digest_size=8).digest(), "little")
