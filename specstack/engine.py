"""The speculative decoding loop: propose -> verify -> commit -> observe.

Invariant: the target's KV cache holds every committed token except the
last one (``pending``).  Each step evaluates ``[pending] + draft`` in one
batch, which yields k+1 rows of logits: row i predicts the token after
``pending + draft[:i]``.  After verification the KV keeps ``pending`` and the
accepted draft prefix; the one target token (recovered or bonus) becomes the
new ``pending``.  Plain decoding is the same loop with an empty draft.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .draft_length import DraftLengthPolicy, FixedK, StepOutcome
from .drafters.base import Drafter
from .errors import ContextOverflowError, InvalidParameterError
from .metrics import GenerationStats
from .sampling import SamplingParams, target_probs
from .target import LlamaModel
from .types import Draft, VerifyResult
from .verify import verify_greedy, verify_sampling, verify_tree_greedy


# Verification batches stay within 63 tokens: with flash attention on,
# llama.cpp switches kernels at 64 query rows (see README, "Exactness").
MAX_DRAFT = 62


@dataclass(frozen=True)
class GenerationConfig:
    """Per-request settings.  ``k`` is the fixed draft budget when no policy is given."""

    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    k: int = 4

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidParameterError(f"max_tokens must be >= 1 (got {self.max_tokens})")
        if self.k < 1:
            raise InvalidParameterError(f"k must be >= 1 (got {self.k}); use --drafter none for plain decoding")
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
    """A running generation: iterate for text pieces; ``stats``/``text`` are final after it ends."""

    def __init__(self, engine: "Engine", prompt_ids: list[int], config: GenerationConfig, policy: DraftLengthPolicy) -> None:
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.config = config
        self.policy = policy
        self.output_ids: list[int] = []
        self.stats = GenerationStats(drafter=engine.drafter.name, k=config.k, k_policy=policy.name, n_prompt=len(prompt_ids))
        self._pieces: list[str] = []
        self._iter = engine._run(self)

    def __iter__(self) -> Iterator[str]:
        for piece in self._iter:
            self._pieces.append(piece)
            yield piece

    def run(self) -> "Generation":
        """Consume the whole generation (when streaming is not needed)."""
        for _ in self:
            pass
        return self

    @property
    def text(self) -> str:
        return "".join(self._pieces)


class Engine:
    """One target, one drafter, one generation at a time."""

    def __init__(self, target: LlamaModel, drafter: Drafter, policy: DraftLengthPolicy | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.policy = policy
        self._eog = target.eog_ids()

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig | None = None) -> Generation:
        """Start a generation; nothing runs until it is iterated (or ``.run()``)."""
        config = config or GenerationConfig()
        prompt_ids = self.target.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not prompt_ids:
            raise InvalidParameterError("the prompt is empty; give at least one token of text")
        if len(prompt_ids) + 1 > self.target.capacity:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.target.capacity} "
                "(prompt plus at least one new token); shorten the prompt or raise --ctx-size"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.target.n_vocab]
        if bad:
            raise InvalidParameterError(f"token id {bad[0]} is outside the vocabulary (0..{self.target.n_vocab - 1})")
        policy = self.policy or FixedK(config.k)
        return Generation(self, prompt_ids, config, policy)

    # -- the loop ----------------------------------------------------------

    def _run(self, gen: Generation) -> Iterator[str]:
        target, drafter, cfg, stats = self.target, self.drafter, gen.config, gen.stats
        sampling = cfg.sampling
        rng = sampling.rng()
        stop_text = _StopText(cfg.stop)
        context = list(gen.prompt_ids)  # committed tokens, including pending
        t_start = time.perf_counter()
        target.reset()
        if len(context) > 1:
            target.eval(context[:-1], logits_from=len(context) - 1)  # prefill, no logits needed
        bind = getattr(drafter, "bind_policy", None)
        if bind is not None:
            bind(gen.policy)
        drafter.begin(context)  # indexing the prompt is prompt processing, like the prefill
        stats.prefill_s = time.perf_counter() - t_start
        try:
            while not stats.stop_reason:
                t_begin = time.perf_counter()
                room = target.capacity - target.n_past - 1  # draft slots left after pending
                if room < 0:
                    stats.stop_reason = "context"
                    break
                remaining = cfg.max_tokens - len(gen.output_ids)
                k = max(0, min(gen.policy.next_k(), remaining - 1, room, MAX_DRAFT))

                t0 = time.perf_counter()
                draft = drafter.propose(context, k) if k > 0 else Draft.empty(drafter.name)
                if draft.token_ids:
                    draft = self._fit(draft, min(k, gen.policy.trim(draft.source, len(draft))), sampling)
                t1 = time.perf_counter()
                result = self._verify(context[-1], draft, sampling, rng, stats)
                t2 = time.perf_counter()

                stats.record_step(draft.source, len(draft), result.num_accepted, t1 - t0, t2 - t1)
                committed = self._commit(gen, context, stop_text, result.token_ids)
                drafter.observe(committed, result.num_accepted)
                other = (t0 - t_begin) + (time.perf_counter() - t2)  # bookkeeping, not the consumer's time
                gen.policy.observe(StepOutcome(draft.source, len(draft), result.num_accepted, t1 - t0, t2 - t1, other))
                text = stop_text.take(final=False)
                if text:
                    yield text
            tail = stop_text.take(final=True)
            if tail:
                yield tail
        finally:
            # The clock stops at the last token: what a drafter does after the request
            # (the suffix drafter files the output into its global tree) is off the token path.
            stats.n_tokens = len(gen.output_ids)
            stats.total_s = time.perf_counter() - t_start
            drafter.end()

    def _fit(self, draft: Draft, budget: int, sampling: SamplingParams) -> Draft:
        """Cut a draft to the token budget; a tree also to the branches the target can hold.

        Trees are verified only greedily; with sampling the best branch is
        verified as a chain (deterministic, so rejection sampling stays exact).
        """
        bad = next((i for i, t in enumerate(draft.token_ids) if not 0 <= t < self.target.n_vocab), None)
        if bad is not None:  # a foreign id would make llama.cpp abort: keep what precedes it
            draft = draft.truncated(bad) if not draft.is_tree else draft.best_chain().truncated(0)
        if draft.is_tree and (not sampling.greedy or self.target.n_seq_max < 2):
            draft = draft.best_chain()
        draft = draft.truncated(budget)
        while draft.is_tree and draft.branches() > self.target.n_seq_max:
            draft = draft.truncated(len(draft) - 1)  # nodes are listed parents first
        return draft.depth_first()

    def _verify(self, pending: int, draft: Draft, sampling: SamplingParams, rng: np.random.Generator, stats: GenerationStats) -> VerifyResult:
        """One target batch over ``[pending] + draft``; keep the accepted tokens in the KV cache."""
        target = self.target
        n_past = target.n_past
        if draft.is_tree:
            parents = [-1] + [p + 1 for p in draft.parents]  # rows: 0 = pending, i+1 = node i
            logits = target.eval_tree([pending, *draft.token_ids], parents)  # [n+1, V]
            result, path = verify_tree_greedy(draft.token_ids, draft.parents, logits.argmax(axis=1).tolist())
            before = target.tree_relayouts
            target.commit_tree([0] + [i + 1 for i in path])
            stats.n_tree_steps += 1
            stats.n_tree_relayouts += target.tree_relayouts - before
            return result
        logits = target.eval([pending, *draft.token_ids], logits_from=0)  # [k+1, V]
        if sampling.greedy:
            result = verify_greedy(draft.token_ids, logits.argmax(axis=1).tolist())
        else:
            result = verify_sampling(draft.token_ids, draft.q, target_probs(logits, sampling), rng)
        target.truncate(n_past + 1 + result.num_accepted)
        return result

    def _commit(self, gen: Generation, context: list[int], stop_text: _StopText, token_ids: Sequence[int]) -> list[int]:
        """Append verified tokens one by one, ending at EOS, a stop string or max_tokens."""
        stats, target = gen.stats, self.target
        committed: list[int] = []
        for tok in token_ids:
            committed.append(tok)
            context.append(tok)
            gen.output_ids.append(tok)
            if tok in self._eog:
                stats.stop_reason = "eos"
                break
            if stop_text.feed(target.token_bytes(tok)):
                stats.stop_reason = "stop"
                break
            if len(gen.output_ids) >= gen.config.max_tokens:
                stats.stop_reason = "length"
                break
        return committed
