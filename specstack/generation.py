"""One request as its caller sees it: its settings and the stream it reads.

A ``Generation`` is what ``Engine.generate`` returns: a read-only stream
over the engine's record of the request (``engine_state.GenState``, whose
caller-visible part is ``Progress``).  Iterating it drives the engine.
``GenerationConfig`` is validated here, so a bad request fails before it
takes a slot.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Iterator, Protocol, TypeVar

from .constraints import Constraints
from .errors import InvalidParameterError
from .metrics import GenerationStats
from .sampling import MAX_LOGPROBS, SamplingParams
from .types import TokenLogprob


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


@dataclass(eq=False, kw_only=True)
class Progress:
    """What a caller reads of one generation: the part of the engine's record (``engine_state.GenState``) that its
    ``Generation`` shows.  The engine writes it; the stream only reads it (and takes the text pieces it yields).
    Compared by identity: two choices of one prompt are two generations however alike."""

    prompt_ids: list[int]
    config: GenerationConfig
    stats: GenerationStats
    status: str = "waiting"  # -> prefilling -> running -> done | cancelled
    seq: int | None = None  # the target sequence (slot) while it holds one
    output_ids: list[int] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)  # per output token: the draft source that proposed it, or "target"
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, when config.logprobs is set
    pieces: list[str] = field(default_factory=list)  # the text streamed so far
    ready: deque[str] = field(default_factory=deque)  # pieces not taken by the caller yet
    submitted: float = 0.0  # when it was queued (the engine's clock)
    started: float = 0.0  # when its prefill began (0: still waiting)

    @property
    def done(self) -> bool:
        return self.status in ("done", "cancelled")


P = TypeVar("P", bound=Progress)


class Driver(Protocol[P]):
    """What a stream asks of the engine that runs it: a step (iterating drives the engine) and a cancellation."""

    def step(self) -> None: ...

    def cancel(self, gen: "Generation[P]") -> None: ...


class Generation(Generic[P]):
    """One request in an engine: iterate it for text pieces; ``stats``/``text`` are final once it is done.

    A read-only stream over the engine's record of the generation (``state``): the engine owns every piece of its
    state and writes none of the stream's.  Iterating drives the engine, so other generations advance too (their
    pieces wait in their own queues).  ``cancel()`` (or leaving the iteration early) stops it between steps and
    frees its slot, KV cells and drafter state.
    """

    def __init__(self, engine: Driver[P], state: P) -> None:
        self.engine = engine
        self.state = state

    # -- what the caller reads (the record's, read-only) --------------------------------------------

    @property
    def prompt_ids(self) -> list[int]:
        return self.state.prompt_ids

    @property
    def config(self) -> GenerationConfig:
        return self.state.config

    @property
    def stats(self) -> GenerationStats:
        return self.state.stats

    @property
    def status(self) -> str:
        return self.state.status

    @property
    def seq(self) -> int | None:
        return self.state.seq

    @property
    def output_ids(self) -> list[int]:
        return self.state.output_ids

    @property
    def origins(self) -> list[str]:
        return self.state.origins

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.state.logprobs

    @property
    def submitted(self) -> float:
        return self.state.submitted

    @property
    def started(self) -> float:
        return self.state.started

    @property
    def done(self) -> bool:
        return self.state.done

    @property
    def text(self) -> str:
        return "".join(self.state.pieces)

    # -- the stream -----------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[str]:
        """Text pieces as they are committed.  Leaving early (``break``, an exception, a closed stream)
        cancels the generation: its partial output is not filed as a finished answer (the suffix
        drafter's global tree, the policy's prior), and its slot is freed."""
        ready = self.state.ready
        try:
            while True:
                while ready:
                    yield ready.popleft()
                if self.done:
                    return
                self.engine.step()
        finally:
            if not self.done:
                self.cancel()

    def run(self) -> "Generation[P]":
        """Consume the whole generation (when streaming is not needed)."""
        for _ in self:
            pass
        return self

    def cancel(self) -> None:
        self.engine.cancel(self)

    def take_text(self) -> str:
        """Text produced since the last call (for callers that drive ``engine.step()`` themselves)."""
        ready = self.state.ready
        text = "".join(ready)
        ready.clear()
        return text
