"""One generation's state, owned by the engine in one record: what it committed, its step, what it learns from.

The engine (``engine.py``) is the loop over all generations: budget -> propose -> verify -> commit, and the slots
they run in.  What belongs to one generation lives here, in its ``GenState``: the committed tokens, the step's
budget, draft and verification, the statistics, the constraint state, its drafter and policy, the slot it holds
(``seq``), the stop text.  A step's commit is one method of it (``commit``), as is the test of whether its drafts
may be trees (``tree_allowed``).  A caller reads the record through its ``Generation`` stream, which shows the
part ``generation.Progress`` declares and writes nothing.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .constraints import ConstraintState
from .draft_length import MAX_DRAFT, Budget, DraftLengthPolicy, StepOutcome
from .drafters.base import Drafter, DraftRequest, DrafterTraits
from .drafters.grammar import with_forced
from .generation import GenerationConfig, Progress
from .llama.target import EngineTarget
from .metrics import GenerationStats
from .sampling import PositionUniforms, one_hot, target_probs, token_logprobs, token_probs
from .types import Draft, HiddenRows, TokenLogprob, VerifyResult
from .verify import verify_greedy, verify_sampling, verify_tree_greedy


class StopText:
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


@dataclass(frozen=True)
class StepTimes:
    """One step's times, as one generation's share of them: what the verification call took, and the bookkeeping
    around it (the budgets before the drafts, the commits after the call), which is not the consumer's time."""

    clock: Callable[[], float]
    share: float  # 1 / the generations in the step
    verify_s: float  # the verification call's time, this generation's share
    before_s: float  # the budgets' time, all generations'
    verified_at: float  # when the verification call ended

    def overhead_s(self) -> float:
        """The bookkeeping's share until now (budgets, and the commits since the call)."""
        return (self.before_s + self.clock() - self.verified_at) * self.share


def fit_draft(draft: Draft, budget: Budget, target: EngineTarget) -> Draft:
    """Cut a draft to the budget; a tree also to what the target can verify exactly in one call.

    Trees are verified only greedily; with sampling the best branch is
    verified as a chain (deterministic, so rejection sampling stays exact).
    """
    bad = next((i for i, t in enumerate(draft.token_ids) if not 0 <= t < target.n_vocab), None)
    if bad is not None:  # a foreign id would make llama.cpp abort: keep what precedes it
        draft = draft.truncated(bad) if not draft.is_tree else draft.best_chain().truncated(0)
    if draft.is_tree and not budget.tree:
        draft = draft.best_chain()
    draft = draft.truncated(budget.worth(draft))
    if draft.is_tree:
        draft = draft.truncated(max(0, target.shapes.max_rows - 1))  # one call: within the exact shapes
    while draft.is_tree and draft.branches() > target.n_seq_max:
        draft = draft.truncated(len(draft) - 1)  # nodes are listed parents first
    return draft.depth_first()


@dataclass(eq=False, kw_only=True)
class GenState(Progress):
    """One generation's state, the engine's: ``Progress`` (what its stream shows) and what only the engine reads.

    Built by ``new``; each step the engine sets its ``budget`` (``plan``), hands it its draft (``settle_draft``),
    verifies (``verify_rows`` / ``verify_tree``) and commits (``commit``); it ends with ``wrap_up`` and ``learn``."""

    drafter: Drafter
    traits: DrafterTraits  # what the drafter declares beyond ``Drafter``, read once
    policy: DraftLengthPolicy
    parent_policy: DraftLengthPolicy | None  # the engine's policy this one was forked from (None: the caller's own)
    constraint: ConstraintState | None  # the logit controls' state, when the config has any
    context: list[int]  # committed tokens, prompt included, the last one pending (not in the target's KV yet)
    ends: frozenset[int]  # the tokens that end it: end of generation, and the config's stop ids
    token_bytes: Callable[[int], bytes]  # the target's vocabulary, for the stop text
    stop_text: StopText
    rng: np.random.Generator
    uniforms: PositionUniforms  # deterministic drafts: seeded runs agree
    # -- the step ---------------------------------------------------------------------------------
    budget: Budget = field(default_factory=lambda: Budget(0))
    draft: Draft = field(default_factory=lambda: Draft.empty(""))
    draft_s: float = 0.0
    dead_end: bool = False  # the constraints allowed no token at the step's last row: its token is a placeholder
    probs: np.ndarray | None = None  # the rows' sampled distribution p (None: greedy), for post-sampling probs
    declined: int = -1  # the first token of a draft the policy cut to nothing (``StepOutcome.shadow``)
    result: VerifyResult | None = None
    step_logprobs: list[TokenLogprob] = field(default_factory=list)  # the step's, before stop conditions cut it

    @classmethod
    def new(cls, prompt_ids: list[int], config: GenerationConfig, drafter: Drafter, policy: DraftLengthPolicy,
            parent_policy: DraftLengthPolicy | None, constraint: ConstraintState | None, eog: frozenset[int],
            token_bytes: Callable[[int], bytes], now: float) -> "GenState":
        """A queued generation's record; a policy is told which of its drafter's sources score their drafts."""
        traits = DrafterTraits.of(drafter)
        if traits.scored:
            policy.expect_scores(traits.scored)
        # the configured k is the policy's (a fixed k, or where window and heuristic start); None where it has none
        stats = GenerationStats(drafter=drafter.name, k=getattr(policy, "k", None), k_policy=policy.name,
                                n_prompt=len(prompt_ids))
        return cls(prompt_ids=prompt_ids, config=config, stats=stats, drafter=drafter, traits=traits, policy=policy,
                   parent_policy=parent_policy, constraint=constraint, context=list(prompt_ids),
                   ends=eog | frozenset(config.stop_token_ids), token_bytes=token_bytes, stop_text=StopText(config.stop),
                   rng=config.sampling.rng(), uniforms=PositionUniforms(config.sampling.entropy_seed),
                   submitted=now)

    # -- budget -------------------------------------------------------------------------------------

    def room(self, target: EngineTarget) -> int:
        """Draft tokens the context holds after the pending one (negative: not even that one)."""
        return target.capacity - target.seq_len[self.seq] - 1

    def draft_cap(self, room: int, target: EngineTarget, spare: float) -> int:
        """The most draft tokens this step may verify: within max_tokens (the pending row's token is one), the
        context's ``room``, the engine's and the target's limits, and the shared pool's ``spare`` cells."""
        if not self.output_ids:
            # The first token comes from a plain step, as from llama-server's and vLLM's prefill: verifying
            # a long draft with it made the client wait for a 17-row call (time to first token p50 118-214 ms
            # against 85 ms for llama-server, one client, the 1B stand-in, serve_load code).
            return 0
        return int(max(0, min(self.config.max_tokens - len(self.output_ids) - 1, room, MAX_DRAFT, target.max_draft,
                              spare)))

    def tree_allowed(self, target: EngineTarget) -> bool:
        """Whether this generation's drafts may be verified as trees on ``target`` (else its drafter is asked for
        chains, ``Budget.tree``).  Every term is a reason a tree could not be verified, or not exactly:

        - greedy sampling: trees are verified greedily only (``verify_tree_greedy``); rejection sampling needs one
          deterministic chain (``fit_draft`` verifies a tree's best branch then);
        - no constraints: logit controls are applied row by row along one chain (``ConstraintState.choose``), a
          tree's rows are not one sequence of tokens;
        - a unified KV cache, one slot, more than one sequence: a tree's branches are sequences sharing the
          pending token's prefix, which only a unified cache holds, and on a one-slot target the sequences past
          the slot's are free for them;
        - a drafter that reads no hidden rows: a tree's accepted path is not where the target kept its rows;
        - an attention-only target: a recurrent state would need one state per branch;
        - exact shapes that verify trees exactly (``BatchShapes.tree_exact``, measured), or exactness off."""
        return (self.config.sampling.greedy and self.constraint is None
                and target.unified and target.n_slots == 1 and target.n_seq_max > 1
                and not self.traits.needs_hidden
                and not target.is_recurrent
                and (target.shapes.tree_exact is not False or not target.shapes.exact))

    def plan(self, budget: Budget) -> None:
        """Start a step with the policy's ``budget``: nothing drafted, verified or noted yet."""
        self.budget, self.draft, self.draft_s = budget, Draft.empty(self.drafter.name), 0.0
        self.dead_end, self.probs, self.declined, self.result = False, None, -1, None

    # -- propose ------------------------------------------------------------------------------------

    def request(self) -> DraftRequest:
        return DraftRequest(self.seq, self.context, self.budget)

    def settle_draft(self, proposed: Draft | None, spent: float, target: EngineTarget,
                     clock: Callable[[], float]) -> None:
        """Take the drafter's draft (None: it was not asked) as the step's, ``spent`` seconds its share of the
        drafter's call: a grammar's forced tokens composed in (``drafters.grammar``), cut to the budget and to
        what the target verifies in one call, and at the grammar's first refusal."""
        draft = proposed if proposed is not None else self.draft
        self.draft_s = spent if proposed is not None else 0.0
        grammar = self.constraint.grammar if self.constraint is not None else None
        if grammar is not None and self.config.grammar_drafts and self.traits.drafts:
            t1 = clock()  # cut at the grammar's first refusal, then what it forces after that
            draft = with_forced(draft.best_chain(), grammar, self.budget.max_tokens, self._ask())
            self.draft_s += clock() - t1
            grammar = None  # walked
        if draft.token_ids:
            self.draft = fit_draft(draft, self.budget, target)
            self.declined = -1 if self.draft.token_ids else draft.token_ids[0]
            self.stats.n_proposed += len(draft.token_ids)
            self.stats.n_declined += not self.draft.token_ids
        if grammar is not None and self.draft.token_ids:  # cut at the grammar's first refusal
            self.draft = self.draft.truncated(self.constraint.cut(self.draft.token_ids))

    def _ask(self) -> Callable[[Sequence[int], int], Draft] | None:
        """How the grammar source asks this generation's drafter for a draft after tokens it appended (None: it
        cannot)."""
        if not self.traits.reads_context:
            return None
        return lambda extra, n: self.drafter.propose([DraftRequest(self.seq, [*self.context, *extra], Budget(n))])[0]

    # -- verify -------------------------------------------------------------------------------------

    def verify_rows(self, logits: np.ndarray) -> VerifyResult:
        """Verify the step's chain against the target's rows for ``[pending] + draft`` (greedy, rejection sampling,
        or either with the logit controls applied at every row, as plain decoding applies them)."""
        draft, sampling, constraint = self.draft, self.config.sampling, self.constraint
        n_out = len(self.output_ids)
        if constraint is not None:
            if sampling.greedy:
                result = verify_greedy(draft.token_ids, constraint.choose(logits, draft.token_ids, self.context, n_out))
            else:
                self.probs = constraint.probs(logits, draft.token_ids, self.context, n_out, sampling)
                result = verify_sampling(draft.token_ids, draft.q, self.probs, self.rng,
                                         self.uniforms.at(n_out, len(draft.token_ids) + 1))
            self.dead_end = constraint.dead_row is not None and len(result.token_ids) == constraint.dead_row + 1
        elif sampling.greedy:
            result = verify_greedy(draft.token_ids, logits.argmax(axis=1).tolist())
        else:
            uniforms = self.uniforms.at(n_out, len(draft.token_ids) + 1)
            self.probs = target_probs(logits, sampling)
            result = verify_sampling(draft.token_ids, draft.q, self.probs, self.rng, uniforms)
        self.result = result
        return result

    def verify_tree(self, target: EngineTarget) -> VerifyResult:
        """Verify the step's tree in one call, greedily; the target keeps the accepted path's KV."""
        draft, stats = self.draft, self.stats
        parents = [-1] + [p + 1 for p in draft.parents]  # rows: 0 = pending, i+1 = node i
        logits = target.eval_tree([self.context[-1], *draft.token_ids], parents)  # [n+1, V]
        result, path = verify_tree_greedy(draft.token_ids, draft.parents, logits.argmax(axis=1).tolist())
        self.result = result
        self.note_logprobs(logits, [0] + [i + 1 for i in path])
        before = target.tree_relayouts
        target.commit_tree([0] + [i + 1 for i in path])
        stats.n_tree_steps += 1
        stats.n_tree_relayouts += target.tree_relayouts - before
        return result

    def note_logprobs(self, logits: np.ndarray, rows: Sequence[int] | None = None) -> None:
        """Keep the logprobs of the step's verified tokens from the verification rows (``rows``: a tree's path),
        while the logits are still valid; the commit keeps as many as it commits (a dead end's placeholder token
        is noted as token 0).  With ``post_sampling_probs`` they are read from the distribution each token was
        sampled from (``probs``; None: greedy's, all on the argmax)."""
        config, result = self.config, self.result
        if config.logprobs is None:
            return
        if self.dead_end:
            result = VerifyResult(result.token_ids[:-1] + (0,), result.n_accepted)
        n = len(result.token_ids)
        if config.post_sampling_probs:
            p = self.probs[:n] if self.probs is not None else one_hot(logits.shape[-1], result.token_ids)
            self.step_logprobs = token_probs(p, result.token_ids, config.logprobs)
            return
        picked = logits[:n] if rows is None else logits[list(rows)]
        self.step_logprobs = token_logprobs(picked, result.token_ids, config.logprobs)

    def charged(self, target: EngineTarget, call: Callable[..., object], *args: object) -> None:
        """A target call that may save, restore or roll back recurrent state; its cost goes to these stats."""
        if not target.is_recurrent:
            call(*args)
            return
        total = target.rewind
        before = total.copy()
        try:
            call(*args)
        finally:
            self.stats.rewound.add_change(total, before)

    # -- commit -------------------------------------------------------------------------------------

    def begin(self, target: EngineTarget, hidden: HiddenRows | None) -> None:
        """The prompt is in: the drafter indexes it (with the target's ``hidden`` rows of it where it reads them)."""
        if self.traits.needs_hidden:  # indexing the prompt is prompt processing, like the prefill
            self.drafter.begin(self.prompt_ids, self.seq, hidden=hidden)
        else:
            self.drafter.begin(self.prompt_ids, self.seq)
        self.stats.rewind = target.strategy
        if target.is_recurrent:
            self.stats.trees = f"chains: a {target.memory} target needs one recurrent state per branch"

    def commit(self, times: StepTimes, hidden: HiddenRows | None) -> None:
        """Commit the verified step: the tokens up to a stop condition, the constraints past them, their logprobs
        and origins; the drafter advances (with the target's ``hidden`` rows kept for pending and the accepted
        draft) and the policy observes the step; the text that can be shown is streamed.  A stop condition met
        leaves ``stats.stop_reason`` set: the engine then finishes the generation."""
        result, draft, stats = self.result, self.draft, self.stats
        stats.record_step(draft.source, len(draft), result.n_accepted, self.draft_s, times.verify_s, draft.origins)
        committed = self._append(result.token_ids[:-1] if self.dead_end else result.token_ids, times.clock)
        if self.constraint is not None and not stats.stop_reason:
            self.constraint.commit(committed)
        if self.dead_end and not stats.stop_reason:
            stats.stop_reason = "constraint"  # nothing allowed: an error, never a quiet "stop" (or an EOS it bans)
        if self.config.logprobs is not None:
            self.logprobs.extend(self.step_logprobs[: len(committed)])
        self.origins.extend(draft.origin(i) if i < result.n_accepted else "target" for i in range(len(committed)))
        if self.traits.needs_hidden:
            self.drafter.advance(committed, result.n_accepted, self.seq, hidden=hidden)
        else:
            self.drafter.advance(committed, result.n_accepted, self.seq)
        shadow = -1 if self.declined < 0 or not committed else int(committed[0] == self.declined)
        self.policy.observe(StepOutcome(draft.source, len(draft), result.n_accepted, self.draft_s, times.verify_s,
                                        times.overhead_s(), shadow))
        self.emit(self.stop_text.take(final=False))

    def _append(self, token_ids: Sequence[int], clock: Callable[[], float]) -> list[int]:
        """Append verified tokens one by one, ending at EOS, a stop string or max_tokens."""
        stats = self.stats
        committed: list[int] = []
        if not self.output_ids and token_ids:
            stats.ttft_s = clock() - self.submitted
        for tok in token_ids:
            committed.append(tok)
            self.context.append(tok)
            self.output_ids.append(tok)
            if tok in self.ends:
                stats.stop_reason = "eos"
                break
            if self.stop_text.feed(self.token_bytes(tok)):
                stats.stop_reason = "stop"
                break
            if len(self.output_ids) >= self.config.max_tokens:
                stats.stop_reason = "length"
                break
        return committed

    def emit(self, text: str) -> None:
        """Stream ``text`` to the caller."""
        if text:
            self.pieces.append(text)
            self.ready.append(text)

    # -- the end ------------------------------------------------------------------------------------

    def wrap_up(self, end: float) -> None:
        """The last text and the final statistics; the clock stops at the last token (``end``): what a drafter does
        after the request (the suffix drafter files the output into its global tree) is off the token path."""
        self.emit(self.stop_text.take(final=True))
        stats = self.stats
        stats.n_tokens = len(self.output_ids)
        stats.total_s = end - self.started
        if stats.n_tokens > 1 and stats.ttft_s > 0:  # mean gap between tokens after the first
            stats.itl_s = (end - self.submitted - stats.ttft_s) / (stats.n_tokens - 1)
        if stats.n_drafted == 0 and self.traits.drafts and stats.n_steps > 1:
            stats.idle_why = self.policy.why_idle(stats)  # a named drafter's zero never stands alone

    def learn(self) -> None:
        """Done, its slot released: what it taught is kept for the next generations."""
        self.status = "done"
        if self.constraint is not None and self.config.grammar_drafts and self.traits.drafts:
            self.constraint.learn(self.output_ids)  # how the model spelled forced text: the grammar source's next drafts
        if self.parent_policy is not None:
            self.parent_policy.adopt(self.policy)  # what it learnt is the next generation's prior
