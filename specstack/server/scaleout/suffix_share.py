"""Suffix statistics shared by every replica of a role: a log of finished outputs, pulled as versioned deltas.

Each replica's suffix drafters keep a global tree of earlier outputs (``drafters.suffix``); on one machine
every request feeds the one tree.  Split over replicas, each tree would see only its share.  So a replica
sends each finished output (token ids) to this log, fire and forget, and every few seconds pulls what the
other replicas added since the version it last saw, into its own trees, on its engine thread between steps.
No remote call sits on the draft path, and drafts stay proposals: output is unchanged, only acceptance moves.

``SuffixLog`` is plain Python (``deploy`` makes it a deployment-scoped Ray actor); with a ``path`` it
checkpoints the log atomically (write a temporary file, then rename, as ``--suffix-cache`` does) and loads
it back when it (re)starts, so a restarted actor, and through it every new replica, starts warm.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from ...drafters.suffix import SuffixDrafter
from ...errors import InvalidParameterError

FORMAT = "specstack-suffix-log/1"
PULL_S = 2.0  # how often a replica pulls the others' outputs
SAVE_S = 5.0  # at most one checkpoint per this many seconds (and one at shutdown)
BUDGET_TOKENS = 250_000  # the log keeps the newest outputs up to this many tokens, and so does each replica's copy


class SuffixLog:
    """Finished outputs (origin replica, prompt ids, output ids), numbered; the oldest go past ``budget_tokens``."""

    def __init__(self, path: str | None = None, budget_tokens: int = BUDGET_TOKENS, vocab: str = "") -> None:
        self.path, self.budget, self.vocab = (Path(path).expanduser() if path else None), budget_tokens, vocab
        self.entries: deque[tuple[int, str, list[int], list[int]]] = deque()
        self.version, self.tokens, self._saved_at, self._dirty = 0, 0, 0.0, False
        if self.path is not None and self.path.exists():
            self._load(self.path)

    def add(self, origin: str, prompt: Sequence[int], output: Sequence[int]) -> int:
        """File one finished output; returns its version."""
        self.version += 1
        self.entries.append((self.version, origin, [int(t) for t in prompt], [int(t) for t in output]))
        self.tokens += len(prompt) + len(output)
        while self.tokens > self.budget and len(self.entries) > 1:
            _, _, p, o = self.entries.popleft()
            self.tokens -= len(p) + len(o)
        self._dirty = True
        if time.monotonic() - self._saved_at >= SAVE_S:
            self.save()
        return self.version

    def since(self, version: int) -> tuple[int, list[tuple[str, list[int], list[int]]]]:
        """The current version and every entry after ``version`` (those still kept)."""
        return self.version, [(origin, p, o) for v, origin, p, o in self.entries if v > version]

    def save(self) -> None:
        """Write the log to ``path`` atomically (a reader never sees half a file)."""
        self._saved_at = time.monotonic()
        if self.path is None or not self._dirty:
            return
        body = {"format": FORMAT, "vocab": self.vocab, "version": self.version,
                "entries": [list(e) for e in self.entries]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._dirty = False

    def _load(self, path: Path) -> None:
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidParameterError(f"suffix log {path} cannot be read ({exc}); move it away or pass another "
                                        "--suffix-log path") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise InvalidParameterError(f"suffix log {path} is not a specstack suffix log ({FORMAT}); pass another "
                                        "--suffix-log path")
        if self.vocab and body.get("vocab") and body["vocab"] != self.vocab:
            raise InvalidParameterError(f"suffix log {path} was written for another vocabulary ({body['vocab']}, "
                                        f"this role's is {self.vocab}); pass another --suffix-log path")
        for v, origin, p, o in body.get("entries", ()):
            self.entries.append((int(v), str(origin), list(p), list(o)))
            self.tokens += len(p) + len(o)
        self.version = int(body.get("version", 0))


class OutputWindow:
    """The newest finished outputs (prompt ids, output ids) up to ``budget_tokens``, the oldest dropped first.

    A replica keeps the outputs it pulled from the others to seed suffix drafters made later; capped as the
    ``SuffixLog`` is, it never holds more than the log itself keeps, however long the replica runs."""

    def __init__(self, budget_tokens: int = BUDGET_TOKENS) -> None:
        self.budget, self.tokens = budget_tokens, 0
        self.entries: deque[tuple[list[int], list[int]]] = deque()

    def extend(self, outputs: Iterable[tuple[list[int], list[int]]]) -> None:
        for prompt, output in outputs:
            self.entries.append((prompt, output))
            self.tokens += len(prompt) + len(output)
        while self.tokens > self.budget and len(self.entries) > 1:  # as the log: the newest one always stays
            prompt, output = self.entries.popleft()
            self.tokens -= len(prompt) + len(output)

    def __iter__(self) -> Iterator[tuple[list[int], list[int]]]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def suffix_drafters(drafters: Iterable[Any]) -> list[SuffixDrafter]:
    """The suffix drafters among ``drafters``, inside cascades and fusions too."""
    found: list[SuffixDrafter] = []
    todo = list(drafters)
    while todo:
        d = todo.pop()
        if isinstance(d, SuffixDrafter):
            found.append(d)
        todo.extend(getattr(d, "drafters", ()))
        todo.extend(x for x in (getattr(d, "retrieval", None), getattr(d, "model", None)) if hasattr(x, "propose"))
    return found


def feed(drafter: SuffixDrafter, prompt: Sequence[int], output: Sequence[int]) -> None:
    """Put another replica's finished output in ``drafter``'s global tree, as its own ``end`` would have."""
    drafter._add_global(list(prompt) + list(output) if drafter.config.global_prompts else list(output))


class MetricsBoard:
    """Each replica's last Prometheus text (pushed once loaded, then every ``PULL_S``): the ingress reads
    /metrics and the replicas up for /health here, by an actor call that never waits for a generation slot."""

    STALE_S = 30.0  # a replica silent this long is gone (Serve replaced it)

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def all(self) -> dict[str, str]:
        now = time.monotonic()
        self.texts = {r: (t, x) for r, (t, x) in self.texts.items() if now - t < self.STALE_S}
        return {r: x for r, (_, x) in self.texts.items()}

    def live(self, within_s: float) -> list[str]:
        """The replicas that pushed within ``within_s`` seconds: loaded, and still running."""
        now = time.monotonic()
        return sorted(r for r, (t, _) in self.texts.items() if now - t < within_s)

    def name(self) -> tuple[str, str]:
        """This actor's Ray name and namespace.  The ingress is no replica of the role's deployment, so
        ``serve.get_deployment_actor`` is closed to it; a replica hands it this name instead.  The namespace is
        Serve's, where that function looks too (the runtime context's is the job's, not the name's)."""
        import ray
        from ray.serve._private.constants import SERVE_NAMESPACE

        return ray.get_runtime_context().get_actor_name(), SERVE_NAMESPACE
