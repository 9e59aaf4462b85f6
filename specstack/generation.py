"""One request's side of the engine: its settings, its state, and the text it streams.

A ``Generation`` is what ``Engine.generate`` returns.  Iterating it drives
the engine; its output, statistics and stop-string handling are its own.
``GenerationConfig`` is validated here, so a bad request fails before it
takes a slot.
"""

from __future__ import annotations

import codecs
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

from .draft_length import DraftLengthPolicy
from .drafters.base import Drafter, DrafterTraits
from .constraints import Constraints, ConstraintState
from .errors import InvalidParameterError
from .metrics import GenerationStats
from .sampling import MAX_LOGPROBS, PositionUniforms, SamplingParams
from .types import TokenLogprob

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(frozen=True)
class GenerationConfig:
    """Per-request settings.  How far to draft is the policy's (``draft_length``), not the request's."""

    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None  # None: none; n >= 0: each token's logprob and its n most likely alternatives
    constraints: Constraints = field(default_factory=Constraints)  # logit bias, penalties, min_tokens, grammar
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the generation as end-of-generation does (not output)
    grammar_drafts: bool = True  # a grammar's forced tokens are drafted (``drafters.grammar``); False to compare
    # False: the whole prompt is prefilled, no cached prefix reused (llama-server's cache_prompt: false)
    reuse_prompt: bool = True
    # The slot (target sequence) it must run in, None: any free one (llama-server's id_slot).  Where it is busy the
    # generation waits for it, and those queued behind that may take other slots first.  Speed only: a slot's
    # cached prefix is reused exactly, so the output is the same in any slot.
    slot: int | None = None
    # llama-server's post_sampling_probs: logprobs read from the sampled distribution (filters and temperature
    # applied), not the raw logits
    post_sampling_probs: bool = False

    def __post_init__(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidParameterError(f"logprobs must be in 0..{MAX_LOGPROBS} (got {self.logprobs})")
        if self.max_tokens < 1:
            raise InvalidParameterError(f"max_tokens must be >= 1 (got {self.max_tokens})")
        if any(not s for s in self.stop):
            raise InvalidParameterError("stop strings must be non-empty")


class _StopText:
    """Incremental detokenizer that withholds text which might begin a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.emitted = 0
        self.hit = False

    def feed(self, piece: bytes) -> bool:
        """Add one token's bytes; True when a stop string is now complete (text is cut there)."""
        self.text += self.decoder.decode(piece)
        if not self.stops:
            return False
        start = max(0, self.emitted - self.longest)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.hit = True
        return self.hit

    def take(self, final: bool) -> str:
        """Text that can be shown now: all of it when final, else all but a possible stop prefix."""
        if final and not self.hit:
            self.text += self.decoder.decode(b"", final=True)
        upto = len(self.text) if final else len(self.text) - self._partial_overlap()
        out = self.text[self.emitted : max(upto, self.emitted)]
        self.emitted += len(out)
        return out

    def _partial_overlap(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best


class Generation:
    """One request in an engine: iterate it for text pieces; ``stats``/``text`` are final once it is done.

    Iterating drives the engine, so other generations advance too (their
    pieces wait in their own queues).  ``cancel()`` (or leaving the
    iteration early) stops it between steps and frees its slot, KV cells
    and drafter state.
    """

    def __init__(self, engine: "Engine", prompt_ids: list[int], config: GenerationConfig,
                 drafter: Drafter, policy: DraftLengthPolicy) -> None:
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.config = config
        self.drafter = drafter
        self.traits = DrafterTraits.of(drafter)  # what it declares beyond ``Drafter``, read once
        self.policy = policy
        if self.traits.scored:
            policy.expect_scores(self.traits.scored)
        self.parent_policy: DraftLengthPolicy | None = None  # the engine's policy this one was forked from
        self.seq: int | None = None  # the target sequence (slot) while running
        self.status = "waiting"  # -> running -> done | cancelled
        self.output_ids: list[int] = []
        self.origins: list[str] = []  # per output token: the draft source that proposed it, or "target"
        self.logprobs: list[TokenLogprob] = []  # per output token, when config.logprobs is set
        self.step_logprobs: list[TokenLogprob] = []  # the current step's, before stop conditions cut it
        self.context = list(prompt_ids)  # committed tokens, including pending
        self.constraint: ConstraintState | None = None  # the logit controls' state, when the config has any
        # the configured k is the policy's (a fixed k, or where window and heuristic start); None where it has none
        self.stats = GenerationStats(drafter=drafter.name, k=getattr(policy, "k", None), k_policy=policy.name,
                                     n_prompt=len(prompt_ids))
        self.stop_text = _StopText(config.stop)
        self.rng = config.sampling.rng()
        self.uniforms = PositionUniforms(config.sampling.entropy_seed)  # deterministic drafts: seeded runs agree
        self.submitted = time.perf_counter()
        self.started = 0.0
        self._ready: deque[str] = deque()
        self._pieces: list[str] = []

    @property
    def done(self) -> bool:
        return self.status in ("done", "cancelled")

    def __iter__(self) -> Iterator[str]:
        """Text pieces as they are committed.  Leaving early (``break``, an exception, a closed stream)
        cancels the generation: its partial output is not filed as a finished answer (the suffix
        drafter's global tree, the policy's prior), and its slot is freed."""
        try:
            while True:
                while self._ready:
                    yield self._ready.popleft()
                if self.done:
                    return
                self.engine.step()
        finally:
            if not self.done:
                self.cancel()

    def run(self) -> "Generation":
        """Consume the whole generation (when streaming is not needed)."""
        for _ in self:
            pass
        return self

    def cancel(self) -> None:
        self.engine.cancel(self)

    def take_text(self) -> str:
        """Text produced since the last call (for callers that drive ``engine.step()`` themselves)."""
        text = "".join(self._ready)
        self._ready.clear()
        return text

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def _emit(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._ready.append(text)
