"""The speculative decoding loop: budget -> propose -> verify -> commit (drafters advance, policies observe).

Invariant: for each generation, its target sequence holds every committed
token except the last one (``pending``).  Each step evaluates ``[pending] +
draft`` for every running generation in one ``llama_decode`` batch (split
only where exactness requires), which yields k+1 rows of logits per
generation: row i predicts the token after ``pending + draft[:i]``.  After
verification the KV keeps ``pending`` and the accepted draft prefix; the
one target token (recovered or bonus) becomes the new ``pending``.  Plain
decoding is the same loop with an empty draft, and a single request is the
same path with one sequence.

Generations join between steps (continuous batching) into free slots, each
slot being one target sequence.  A finished generation's KV stays in its
slot, and a new prompt that shares a prefix with it reuses that prefix
instead of prefilling it again (least recently used slots are overwritten
first).

Where the slots share one pool of KV cells (``PooledTarget``: llama-server's -kvu), every sequence may grow to
the whole context, so the engine keeps their sum within the pool (``_pool_left``): a prompt is admitted once the
pool has room for all of it (it waits until then), the prompts being processed keep the cells they will need,
idle slots' cells are freed first when the pool runs short (their prefixes to the host prompt cache), a running
generation that finds no cell for its next token ends with stop reason "kv_pool" (the server answers it with
llama-server's 500 "Context size has been exceeded."), the one holding the most cells first, and drafts are cut
to the cells left.  llama.cpp's decode is never asked for cells the pool lacks.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .calibration import BackgroundCalibration, Measured, ensure_shapes
from .draft_length import DEFAULT_K, MAX_DRAFT, BatchLoad, Budget, DraftLengthPolicy, StepOutcome, make_policy
from .drafters.base import Drafter, DraftRequest, PrefixDrafter
from .constraints import ConstraintState, for_target
from .drafters.grammar import with_forced
from .errors import ContextOverflowError, InvalidParameterError, KVPoolFullError
from .generation import Generation, GenerationConfig
from .prompt_cache import MIN_REUSE, PromptCache, reusable, worth_reusing
from .sampling import SamplingParams, one_hot, target_probs, token_logprobs, token_probs
from .llama.target import EngineTarget, GrammarTarget, HiddenRowsTarget, PooledTarget
from .llama.batching import Segment, prefill_call
from .types import Draft, HiddenRows, VerifyResult
from .verify import verify_greedy, verify_sampling, verify_tree_greedy


@dataclass
class _Slot:
    """One target sequence: the tokens its KV holds (positions 0..), and who uses it."""

    seq: int
    cached: list[int] = field(default_factory=list)
    prefilled: int = 0  # leading cached tokens computed by a prefill (not by decode steps)
    writes: int = 0  # the target's write count for this sequence when ``cached`` was last true
    gen: Generation | None = None
    released: float = 0.0  # for least-recently-used reuse
    keeper: PrefixDrafter | None = None  # the last generation's drafter where it keeps state for ``cached``


def _open_to(gen: Generation, free: list[_Slot]) -> list[_Slot]:
    """The free slots ``gen`` may take: any, or the one its config names (``GenerationConfig.slot``)."""
    want = gen.config.slot
    return free if want is None else [s for s in free if s.seq == want]


@dataclass
class _Work:
    """One generation's part of a step."""

    gen: Generation
    budget: Budget
    draft: Draft = field(default_factory=lambda: Draft.empty(""))
    draft_s: float = 0.0
    dead_end: bool = False  # the constraints allowed no token at the step's last row: its token is a placeholder
    probs: np.ndarray | None = None  # the rows' sampled distribution p (None: greedy), for post-sampling probs
    declined: int = -1  # the first token of a draft the policy cut to nothing (``StepOutcome.shadow``)


def _drafter_prefix(slot: _Slot) -> tuple[Any, int]:
    """(state, bytes) the slot's last drafter keeps for the slot's cached prefix (``save_prefix``), or (None, 0)."""
    got = slot.keeper.save_prefix(slot.seq, slot.cached) if slot.keeper is not None else None
    return (None, 0) if got is None else got


class Engine:
    """One target serving many generations: continuous batching, prefix reuse, speculation per generation.

    ``drafter`` and ``policy`` are the defaults; ``generate`` may give a
    generation its own (a drafter instance keeps per-generation state by
    sequence, so share one instance across generations when you can: a
    draft model then batches their draft steps).  The policy owns k: without
    one, the engine's is a ``FixedK`` of ``DEFAULT_K`` (4) tokens.
    """

    def __init__(self, target: EngineTarget, drafter: Drafter, policy: DraftLengthPolicy | None = None,
                 prompt_cache_bytes: int = 0, background: BackgroundCalibration | None = None,
                 batch_tokens: int | None = None, prefill_cap: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.target = target
        # The optional capabilities (``llama.target``), checked once: hidden rows for a drafter that reads them,
        # a grammar for a request's constraints.
        self._take_hidden = target.take_hidden if isinstance(target, HiddenRowsTarget) else None
        self._grammar = target.grammar if isinstance(target, GrammarTarget) else None
        # One pool of KV cells all sequences share (-kvu), or None: each has its own n_ctx
        self._pool = target.pool if isinstance(target, PooledTarget) else None
        # Every time the engine measures (steps, drafts, prefill, first token) is read from ``clock``: the wall
        # clock, or a replayed run's (``bench.recorded.RecordedTarget.clock``: its target calls as priced).
        self.clock = clock
        self.prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        self.sibling_copies = 0  # prompts copied from a running generation instead of prefilled (n > 1)
        self.drafter = drafter
        self.policy = policy if policy is not None else make_policy("fixed", DEFAULT_K)  # forked per generation
        # A first run's measurements (``calibration.background``): each step lends them its own duration, and
        # the engine applies their result (``idle``).
        self.background = background
        if not target.shapes.settled:
            ensure_shapes(target)  # which call shapes keep output exact: measured once per model, cached
        self._eog = target.eog_ids()
        self._slots = [_Slot(s) for s in range(target.n_slots)]
        self._waiting: deque[Generation] = deque()
        self._running: list[Generation] = []
        # Prompts processed inside steps (``_prefill_some``): each step, after the running generations' rows,
        # at most ``batch_tokens`` prompt tokens, at most ``prefill_cap`` of one prompt.  None: a prompt is
        # prefilled whole when admitted (one caller, nobody to stall).
        self.batch_tokens = batch_tokens
        self.prefill_cap = prefill_cap if prefill_cap is not None else batch_tokens
        self._prefilling: list[Generation] = []
        self.prefill_token_s = 0.0  # seconds per prompt token, from chunks prefilled in steps (EMA)

    # -- requests ----------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig | None = None, *,
                 drafter: Drafter | None = None, policy: DraftLengthPolicy | None = None) -> Generation:
        """Queue a generation; it runs as it (or any other generation) is iterated, or on ``step()``."""
        config = config or GenerationConfig()
        prompt_ids = self.target.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not prompt_ids:
            raise InvalidParameterError("the prompt is empty; give at least one token of text")
        if len(prompt_ids) + 1 > self.target.capacity:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.target.capacity} "
                "(prompt plus at least one new token); shorten the prompt or raise --ctx-size"
            )
        if config.slot is not None and not 0 <= config.slot < len(self._slots):
            raise InvalidParameterError(f"slot {config.slot} does not exist: the engine has slots "
                                        f"0..{len(self._slots) - 1}")
        bad = [t for t in prompt_ids if not 0 <= t < self.target.n_vocab]
        if bad:
            raise InvalidParameterError(f"token id {bad[0]} is outside the vocabulary (0..{self.target.n_vocab - 1})")
        parent = None
        if policy is None:
            parent = self.policy
            policy = parent.fork()
        gen = Generation(self, prompt_ids, config, drafter or self.drafter, policy)
        gen.constraint = self._constraint(config)
        gen.parent_policy = parent
        gen.submitted = self.clock()
        self._waiting.append(gen)
        return gen

    def _constraint(self, config: GenerationConfig) -> ConstraintState | None:
        """A generation's logit controls over this target (a bad grammar or token id fails here, before a slot)."""
        target = self.target
        bad = [t for t in config.stop_token_ids if not 0 <= t < target.n_vocab]
        if bad:
            raise InvalidParameterError(f"stop token id {bad[0]} is outside the vocabulary (0..{target.n_vocab - 1})")
        return for_target(config.constraints, target.n_vocab, self._eog, frozenset(config.stop_token_ids),
                          self._grammar, target.token_bytes)

    def cancel(self, gen: Generation) -> None:
        """Stop a generation between steps; its KV cells and drafter state are freed."""
        if gen.done:
            return
        if gen.status == "waiting":
            self._waiting.remove(gen)
        elif gen.status == "prefilling":
            self._prefilling.remove(gen)
            self._release(gen, keep_cache=False)
        else:
            self._release(gen, keep_cache=False)
        gen.stats.stop_reason = gen.stats.stop_reason or "cancelled"
        gen.status = "cancelled"

    @property
    def busy(self) -> bool:
        """Whether any generation is running or waiting."""
        return bool(self._running or self._waiting or self._prefilling)

    @property
    def running(self) -> int:
        """Generations holding a slot: decoding, or still processing their prompt."""
        return len(self._running) + len(self._prefilling)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def step(self) -> None:
        """Admit waiting generations into free slots, then advance every running one by one step."""
        t0 = self.clock()
        self._admit()
        if not self._running and not self._prefilling:
            return
        try:
            rows = self._advance(list(self._running)) if self._running else 0
            if self._prefilling:
                self._prefill_some(rows)
        except BaseException:
            for gen in self._running + self._prefilling:  # never leave a half-done step behind
                self.cancel(gen)
            raise
        if self.background is not None:
            self.idle(self.clock() - t0)

    def idle(self, seconds: float) -> bool:
        """Lend ``seconds`` to the background measurement, if one is left, and apply its result when it can be.
        Returns whether one is still left."""
        background = self.background
        if background is None:
            return False
        background.lend(seconds)
        measured = background.result()
        if measured is not None and self._apply(measured):
            background.report(self.target.shapes)
            self.background = None
        return self.background is not None

    def finish_calibration(self) -> None:
        """Run what is left of the background measurement to its end now (nothing runs), then apply it."""
        if self.background is not None:
            self.background.say_finishing()
            self.idle(math.inf)

    def _apply(self, measured: Measured) -> bool:
        """Put a finished background measurement in force, if it is compatible with what is running: shapes that
        change how one-token steps are padded wait until no generation holds a slot, as KV decoded with the other
        padding would not extend exactly.  True once nothing is left to do (applied, or failed: the provisional
        settings then stay)."""
        shapes = measured.shapes
        if shapes is None:
            return True
        changes_steps = shapes.exact and shapes.min_rows != self.target.shapes.min_rows
        if changes_steps and self.running:
            return False
        if changes_steps:
            self.forget_decoded()
        self.target.set_shapes(shapes)
        if measured.costs is not None and measured.provisional is not None:  # the model the policies share
            measured.provisional.adopt(dataclasses.replace(measured.costs, shapes=self.target.shapes))
        return True

    def forget_decoded(self) -> None:
        """Forget every prefix the slots and the host cache hold (their KV stays until overwritten): shapes that
        pad one-token steps differently were adopted, and KV decoded before would not extend exactly."""
        for slot in self._slots:
            slot.cached, slot.prefilled = [], 0
        if self.prompt_cache is not None:
            self.prompt_cache.clear()

    # -- slots and prefix reuse -------------------------------------------

    def _admit(self) -> None:
        while self._waiting:
            free = [s for s in self._slots if s.gen is None]
            # the first waiting generation that may run in a free slot (one bound to a busy slot waits for it)
            gen = next((g for g in self._waiting if _open_to(g, free)), None)
            if gen is None:
                return
            if any(p.prompt_ids == gen.prompt_ids for p in self._prefilling):
                return  # another choice of the same prompt (n > 1) is prefilling it: copy its KV when done
            free = _open_to(gen, free)
            for s in free:
                if self.target.writes[s.seq] != s.writes:  # someone else wrote this sequence since
                    s.cached, s.prefilled = [], 0
            slot = max(free, key=lambda s: (worth_reusing(self.target, s.cached, s.prefilled, gen.prompt_ids), -s.released))
            if not self._pool_admits(gen, slot):
                return  # the shared KV pool lacks room for its prompt now: it waits, and so do those behind it
            self._waiting.remove(gen)
            try:
                reuse = 0
                if gen.config.reuse_prompt:
                    self._swap(slot, gen.prompt_ids, gen.traits.prefix, self._room(slot))
                    reuse = reusable(self.target, slot.cached, slot.prefilled, gen.prompt_ids)
                self._start(gen, slot, reuse)
            except BaseException:
                self.cancel(gen)
                raise

    def _swap(self, slot: _Slot, prompt: Sequence[int], keeper: PrefixDrafter | None, room: int | None = None) -> None:
        """Bring into ``slot`` the longest reusable prefix of ``prompt`` held elsewhere: a running sibling's
        KV (the other choices of an ``n > 1`` request, so a shared prompt is prefilled once) or the host
        prompt cache's, both copied as llama.cpp's per-sequence state, which computes what a prefill would.
        What the slot held goes to the host cache first, when it would be lost, with what its drafter kept
        for it (``save_prefix``), which a restore hands to the next generation's drafter (``keeper``: None
        where it keeps no such state).  ``room``: the most cells a copy may take (a shared KV pool's free cells and
        the slot's own; None: no bound)."""
        here = reusable(self.target, slot.cached, slot.prefilled, prompt)
        source, there = None, here
        if not self.target.is_recurrent:  # a recurrent state has moved past the prompt by the time it is copied
            for s in self._slots:
                n = worth_reusing(self.target, s.cached, s.prefilled, prompt) if s is not slot and s.gen else 0
                if n > there and (room is None or self.target.seq_len[s.seq] <= room):
                    source, there = s, n
        cache = self.prompt_cache
        saved, kept = cache.best(lambda e: worth_reusing(self.target, e.tokens, e.prefilled, prompt)
                                 if room is None or len(e.tokens) <= room else 0) if cache else (None, 0)
        if cache is not None and here < len(slot.cached) and len(slot.cached) >= MIN_REUSE:  # the slot's prefix would be lost
            cache.put(slot.cached, slot.prefilled, self.target.save_seq(slot.seq), *_drafter_prefix(slot))
        if saved is not None and kept > there:
            source, there = saved, kept
        if source is None:
            return
        if source is saved:
            tokens, prefilled, data, n = saved.tokens, saved.prefilled, saved.data, len(saved.tokens)
        else:
            tokens, prefilled, data, n = source.cached, source.prefilled, self.target.save_seq(source.seq), self.target.seq_len[source.seq]
        if not self.target.load_seq(slot.seq, data, n):
            slot.cached, slot.prefilled = [], 0  # load_seq emptied the sequence
            return
        slot.cached, slot.prefilled = list(tokens), prefilled
        if source is saved:
            cache.hits += 1
            if saved.drafter is not None and keeper is not None:
                keeper.restore_prefix(slot.seq, saved.drafter)
        else:
            self.sibling_copies += 1

    # -- the shared KV pool (-kvu) -------------------------------------------

    def _pool_left(self) -> int:
        """Cells of the shared pool that no sequence holds and no prompt being processed will need (its whole
        prompt: the last token goes in with its first step), less the pad rows a call may add."""
        target = self.target
        claimed = sum(len(g.prompt_ids) - target.seq_len[g.seq] for g in self._prefilling)
        return self._pool - sum(target.seq_len) - claimed - (target.min_batch - 1)

    def _room(self, slot: _Slot) -> int | None:
        """The cells ``slot`` may fill as it takes a prompt: the pool's free cells and its own (None: no pool)."""
        return None if self._pool is None else self._pool_left() + self.target.seq_len[slot.seq]

    def _pool_admits(self, gen: Generation, slot: _Slot) -> bool:
        """Whether ``gen``'s whole prompt fits the shared pool in ``slot`` now, freeing other idle slots' cells
        if that makes it fit; always, without a pool."""
        if self._pool is None:
            return True
        need = len(gen.prompt_ids) - self.target.seq_len[slot.seq]
        return self._free_idle(need, spare=slot)

    def _free_idle(self, need: int, spare: _Slot | None = None) -> bool:
        """Free idle slots' cells, least recently used first (``spare`` kept), until the pool has ``need``
        cells left; whether it has.  Their prefixes go to the host prompt cache, as llama-server's
        ``--cache-idle-slots`` saves idle slots before it clears them."""
        idle = sorted((s for s in self._slots if s.gen is None and s is not spare and self.target.seq_len[s.seq]),
                      key=lambda s: s.released)
        for slot in idle:
            if self._pool_left() >= need:
                break
            self._evict(slot)
        return self._pool_left() >= need

    def _evict(self, slot: _Slot) -> None:
        """Empty an idle slot's sequence, its prefix kept in the host prompt cache where worth reusing."""
        cache, target = self.prompt_cache, self.target
        if cache is not None and len(slot.cached) >= MIN_REUSE and target.writes[slot.seq] == slot.writes:
            cache.put(slot.cached, slot.prefilled, target.save_seq(slot.seq), *_drafter_prefix(slot))
        target.reset(slot.seq)
        self._hidden(slot.seq)
        slot.cached, slot.prefilled, slot.keeper, slot.writes = [], 0, None, target.writes[slot.seq]

    def _fit_pool(self, gens: list[Generation]) -> list[Generation]:
        """The running generations the shared pool has a cell for (their pending token): idle slots are freed
        first; then, while it still lacks cells, the generation holding the most ends, stop reason "kv_pool" (the
        server answers it as llama-server answers a slot its full unified cache fails: 500 "Context size has been
        exceeded.", though llama-server fails every running slot then, and the others go on here), its cells freed
        as its slot falls idle."""
        if self._pool is None:
            return gens
        gens = list(gens)
        while gens and not self._free_idle(len(gens)):
            longest = max(gens, key=lambda g: self.target.seq_len[g.seq])
            longest.stats.stop_reason = "kv_pool"
            self._finish(longest)
            gens.remove(longest)
        return gens

    def _verify_in_pool(self, work: list[_Work], gens: list[Generation]) -> list | None:
        """``_verify``; where llama.cpp finds no cells for it in the shared pool (it placed nothing: it prepares
        every ubatch first), once more after every idle slot's cells are freed, then ``_pool_ran_out`` (None)."""
        for attempt in range(2):
            try:
                return self._verify(work)
            except KVPoolFullError:
                if self._pool is None:
                    raise
                idle = [s for s in self._slots if s.gen is None and self.target.seq_len[s.seq]]
                if attempt == 0 and idle:
                    for slot in idle:
                        self._evict(slot)
                    continue
                self._pool_ran_out(gens)
        return None

    def _pool_ran_out(self, gens: list[Generation]) -> None:
        """llama.cpp found no cells for a step the pool's count said would fit (``_budgets``' spare): it placed
        nothing (it prepares every ubatch first), so the step is undone; as in ``_fit_pool`` the generation
        holding the most ends, stop reason "kv_pool", and the others take the next step."""
        longest = max(gens, key=lambda g: self.target.seq_len[g.seq])
        longest.stats.stop_reason = "kv_pool"
        self._finish(longest)

    def _start(self, gen: Generation, slot: _Slot, reuse: int) -> None:
        """Give ``gen`` its slot with ``reuse`` prompt tokens already there; its prompt's rest is prefilled now
        (``batch_tokens`` None) or chunk by chunk in the coming steps (``_prefill_some``)."""
        t0 = self.clock()
        slot.gen, gen.seq, gen.status, gen.started = gen, slot.seq, "prefilling", t0
        self._prefilling.append(gen)
        if reuse:
            self.target.truncate(reuse, slot.seq)
        else:
            self.target.reset(slot.seq)
        self._hidden(slot.seq)  # rows the slot's last user left behind are not this prompt's
        slot.cached, slot.prefilled = [], 0
        gen.stats.n_reused = reuse
        gen.stats.queue_s = t0 - gen.submitted
        if self.batch_tokens is None:
            self._prefill(gen, len(gen.prompt_ids))

    def _prefill_some(self, rows: int) -> None:
        """Fill what the step's ``rows`` left of ``batch_tokens`` with prompt chunks, first come first served,
        at most ``prefill_cap`` tokens of one prompt; at least one chunk a step, so prompts always advance.

        Chunks end where a cold prefill's calls end (multiples of ``prefill_chunk``, see ``LlamaModel.prefill``),
        one sequence per call: each prompt's KV is computed by the very calls a solo run makes, so neither its
        output nor that of the running generations (whose rows are in calls of their own) changes."""
        left = max(0, (self.batch_tokens or 0) - rows)
        for gen in list(self._prefilling):
            took = self._prefill(gen, max(1, min(left, self.prefill_cap or left)))
            left -= took
            if left <= 0:
                return

    def _prefill(self, gen: Generation, tokens: int) -> int:
        """Prefill up to ``tokens`` more of ``gen``'s prompt (rounded to chunk edges, at least to the next one);
        once all but its last token are in, it starts decoding.  Returns the tokens prefilled."""
        slot, target = self._slots[gen.seq], self.target
        t0 = self.clock()
        at, end = target.seq_len[slot.seq], len(gen.prompt_ids) - 1
        chunk = prefill_call(target.config.prefill_chunk, target.batch_cap)
        stop = end if at + tokens >= end else min(end, max((at // chunk + 1) * chunk, (at + tokens) // chunk * chunk))
        if stop > at:
            target.prefill(gen.prompt_ids[at:stop], slot.seq)
            self._observe_prefill(stop - at, self.clock() - t0)
        gen.stats.prefill_s += self.clock() - t0
        if stop >= end:
            self._begin(gen, slot)
        return max(0, stop - at)

    def _observe_prefill(self, tokens: int, seconds: float) -> None:
        """Learn what a prompt token costs, the price of a draft row that displaces one (``BatchLoad``).
        Short tails are skipped: a call's fixed cost would make their tokens look dear."""
        if tokens < 32 or seconds <= 0:
            return
        per = seconds / tokens
        self.prefill_token_s = per if self.prefill_token_s == 0 else self.prefill_token_s + 0.2 * (per - self.prefill_token_s)

    def _free_rows(self, gens: list[Generation]) -> int | None:
        """Draft rows this step can verify before they displace prompt tokens that are waiting for it: the
        budget, less every running generation's pending row and the prompt chunks the step would take
        (at most ``prefill_cap`` of each prompt).  None when no prompt waits: drafts displace nothing."""
        if self.batch_tokens is None or not self._prefilling:
            return None
        cap = self.prefill_cap or self.batch_tokens
        wanted = sum(min(cap, len(g.prompt_ids) - 1 - self.target.seq_len[g.seq]) for g in self._prefilling)
        return max(0, self.batch_tokens - len(gens) - wanted)

    @staticmethod
    def _prompt_token_estimate(gens: list[Generation]) -> float:
        """Before any chunk was timed here: a prompt token's cost from the cost curve's widest call."""
        costs = next((g.policy.costs for g in gens if g.policy.costs is not None), None)
        if costs is None:
            return 0.0
        n = len(costs.curve)
        return costs.call_s(n) / n

    def _begin(self, gen: Generation, slot: _Slot) -> None:
        """The prompt is in (all but the pending last token): the generation decodes from the next step."""
        t0 = self.clock()
        self._prefilling.remove(gen)
        self._running.append(gen)
        gen.status = "running"
        slot.cached, slot.prefilled = list(gen.prompt_ids[:-1]), len(gen.prompt_ids) - 1
        hidden = self._hidden(slot.seq)  # the target's rows of the prompt it computed (from the reused prefix on)
        if gen.traits.needs_hidden:  # indexing the prompt is prompt processing, like the prefill
            gen.drafter.begin(gen.prompt_ids, slot.seq, hidden=hidden)
        else:
            gen.drafter.begin(gen.prompt_ids, slot.seq)
        gen.stats.rewind = self.target.strategy
        if self.target.is_recurrent:
            gen.stats.trees = f"chains: a {self.target.memory} target needs one recurrent state per branch"
        gen.stats.prefill_s += self.clock() - t0

    def _hidden(self, seq: int) -> HiddenRows | None:
        """The target's hidden rows kept for ``seq`` since the last call here (``llama.hidden``), for a drafter that
        reads them (``Drafter.needs_hidden``); None where the target keeps none (no such drafter)."""
        return self._take_hidden(seq) if self._take_hidden is not None else None

    def _release(self, gen: Generation, keep_cache: bool) -> None:
        """Free the generation's slot; its KV stays for prefix reuse if ``keep_cache``."""
        slot = self._slots[gen.seq]
        began = gen.status != "prefilling"  # a prompt still being prefilled has no drafter state yet
        if gen in self._running:
            self._running.remove(gen)
        try:
            if began:
                gen.drafter.end(slot.seq, complete=keep_cache)
        finally:
            if keep_cache and self.target.can_truncate(len(gen.context) - 1, slot.seq):
                self.target.truncate(len(gen.context) - 1, slot.seq)  # a stop may cut accepted tokens
                slot.cached = gen.context[:-1]
            else:  # cancelled, or a recurrent state that cannot be cut back that far: nothing to reuse
                self.target.reset(slot.seq)
                slot.cached, slot.prefilled = [], 0
            slot.prefilled = min(slot.prefilled, len(slot.cached))
            slot.gen, slot.released, slot.keeper = None, self.clock(), gen.traits.prefix if keep_cache else None
            slot.writes = self.target.writes[slot.seq]

    def _finish(self, gen: Generation) -> None:
        gen._emit(gen.stop_text.take(final=True))
        gen.stats.n_tokens = len(gen.output_ids)
        # The clock stops at the last token: what a drafter does after the request
        # (the suffix drafter files the output into its global tree) is off the token path.
        end = self.clock()
        gen.stats.total_s = end - gen.started
        if gen.stats.n_tokens > 1 and gen.stats.ttft_s > 0:  # mean gap between tokens after the first
            gen.stats.itl_s = (end - gen.submitted - gen.stats.ttft_s) / (gen.stats.n_tokens - 1)
        if gen.stats.n_drafted == 0 and gen.traits.drafts and gen.stats.n_steps > 1:
            gen.stats.idle_why = gen.policy.why_idle(gen.stats)  # a named drafter's zero never stands alone
        self._release(gen, keep_cache=True)
        gen.status = "done"
        if gen.constraint is not None and gen.config.grammar_drafts and gen.traits.drafts:
            gen.constraint.learn(gen.output_ids)  # how the model spelled forced text: the grammar source's next drafts
        if gen.parent_policy is not None:
            gen.parent_policy.adopt(gen.policy)  # what it learnt is the next generation's prior

    # -- the step ------------------------------------------------------------

    def _advance(self, gens: list[Generation]) -> int:
        """One step of every running generation; returns the rows it verified."""
        t_begin = self.clock()
        gens = self._fit_pool(gens)
        if not gens:
            return 0
        work = self._budgets(gens)
        depths = tuple(self.target.seq_len[w.gen.seq] for w in work)  # each call's rows attend over these
        t0 = self.clock()
        self._propose(work)
        t1 = self.clock()
        rewind0 = self.target.rewind.seconds
        results = self._verify_in_pool(work, gens)
        if results is None:
            return 0
        t2 = self.clock()
        rewind_s = self.target.rewind.seconds - rewind0
        drafted = sum(1 for w in work if w.draft.token_ids)
        for cm in {id(w.gen.policy.costs): w.gen.policy.costs for w in work if w.gen.policy.costs is not None}.values():
            cm.observe_step(tuple(1 + len(w.draft) for w in work), t2 - t1 - rewind_s, depths)
            cm.observe_rewind(rewind_s, drafted)
        share = 1.0 / max(len(work), 1)
        for w, result in zip(work, results):
            gen = w.gen
            verify_s = (t2 - t1) * share
            gen.stats.record_step(w.draft.source, len(w.draft), result.n_accepted, w.draft_s, verify_s,
                                  w.draft.origins)
            committed = self._commit(gen, result.token_ids[:-1] if w.dead_end else result.token_ids)
            if gen.constraint is not None and not gen.stats.stop_reason:
                gen.constraint.commit(committed)
            if w.dead_end and not gen.stats.stop_reason:
                gen.stats.stop_reason = "constraint"  # nothing allowed: an error, never a quiet "stop" (or an EOS it bans)
            if gen.config.logprobs is not None:
                gen.logprobs.extend(gen.step_logprobs[: len(committed)])
            gen.origins.extend(w.draft.origin(i) if i < result.n_accepted else "target" for i in range(len(committed)))
            hidden = self._hidden(gen.seq)  # the kept rows: pending and the accepted draft (``_verify`` cut the rest)
            if gen.traits.needs_hidden:
                gen.drafter.advance(committed, result.n_accepted, gen.seq, hidden=hidden)
            else:
                gen.drafter.advance(committed, result.n_accepted, gen.seq)
            other = ((t0 - t_begin) + (self.clock() - t2)) * share  # bookkeeping, not the consumer's time
            shadow = -1 if w.declined < 0 or not committed else int(committed[0] == w.declined)
            gen.policy.observe(StepOutcome(w.draft.source, len(w.draft), result.n_accepted, w.draft_s, verify_s, other,
                                           shadow))
            gen._emit(gen.stop_text.take(final=False))
            if gen.stats.stop_reason:
                self._finish(gen)
        return sum(1 + len(w.draft) for w in work)

    def _budgets(self, gens: list[Generation]) -> list[_Work]:
        """Each generation's budget from its policy, valued against what the others already put in the step."""
        target, work = self.target, []
        rows: list[int] = []
        depths: list[int] = []
        tokens = 0.0
        free = self._free_rows(gens)
        displaced_s = 0.0 if free is None else self.prefill_token_s or self._prompt_token_estimate(gens)
        # draft rows the shared pool has cells for, after every generation's pending row (``_fit_pool``)
        spare = self._pool_left() - len(gens) if self._pool is not None else math.inf
        for i, gen in enumerate(gens):
            room = target.capacity - target.seq_len[gen.seq] - 1  # draft slots left after pending
            if room < 0:
                gen.stats.stop_reason = "context"
                self._finish(gen)
                continue
            cap = max(0, min(gen.config.max_tokens - len(gen.output_ids) - 1, room, MAX_DRAFT, target.max_draft, spare))
            if not gen.output_ids:
                # The first token comes from a plain step, as from llama-server's and vLLM's prefill: verifying
                # a long draft with it made the client wait for a 17-row call (time to first token p50 118-214 ms
                # against 85 ms for llama-server, one client, the 1B stand-in, serve_load code).
                cap = 0
            later = len(gens) - i - 1  # not decided yet: count them as plain steps
            depth = target.seq_len[gen.seq]
            load = (BatchLoad(depth=depth) if len(gens) == 1 and free is None else
                    BatchLoad(tuple(rows) + (1,) * later, tokens + later, free, displaced_s, depth,
                              tuple(depths) + tuple(target.seq_len[g.seq] for g in gens[i + 1:])))
            # A drafter that reads hidden rows gets chains: a tree's accepted path is not where its rows were kept.
            tree = (gen.config.sampling.greedy and gen.constraint is None and target.unified and target.n_slots == 1 and target.n_seq_max > 1
                    and not gen.traits.needs_hidden
                    and not target.is_recurrent
                    and (target.shapes.tree_exact is not False or not target.shapes.exact))  # measured (``BatchShapes``)
            budget = gen.policy.budget(cap, load, tree) if cap > 0 else Budget(0)
            spare -= budget.max_tokens
            rows.append(budget.rows if budget.rows is not None else 1 + budget.max_tokens)
            depths.append(depth)
            tokens += budget.expected
            if free is not None:
                free = max(0, free - (rows[-1] - 1))
            work.append(_Work(gen, budget))
        return work

    def _propose(self, work: list[_Work]) -> None:
        """Every drafter once per step, with all of its generations' requests (a draft model batches them)."""
        groups: dict[int, list[_Work]] = {}
        for w in work:
            w.draft = Draft.empty(w.gen.drafter.name)
            if w.budget.max_tokens > 0:
                groups.setdefault(id(w.gen.drafter), []).append(w)
        for group in groups.values():
            drafter = group[0].gen.drafter
            asked = [w for w in group if drafter.name not in w.budget.skip]  # the policy's: its call won't pay
            t0 = self.clock()
            proposed = drafter.propose([DraftRequest(w.gen.seq, w.gen.context, w.budget) for w in asked]) if asked else []
            drafts = dict(zip(map(id, asked), proposed))
            spent = (self.clock() - t0) / max(len(asked), 1)
            for w in group:
                draft = drafts.get(id(w), w.draft)
                w.draft_s = spent if id(w) in drafts else 0.0
                grammar = w.gen.constraint.grammar if w.gen.constraint is not None else None
                if grammar is not None and w.gen.config.grammar_drafts and w.gen.traits.drafts:
                    t1 = self.clock()  # cut at the grammar's first refusal, then what it forces after that
                    draft = with_forced(draft.best_chain(), grammar, w.budget.max_tokens, self._ask(w.gen))
                    w.draft_s += self.clock() - t1
                    grammar = None  # walked
                if draft.token_ids:
                    w.draft = self._fit(draft, w.budget, w.gen.config.sampling)
                    w.declined = -1 if w.draft.token_ids else draft.token_ids[0]
                    w.gen.stats.n_proposed += len(draft.token_ids)
                    w.gen.stats.n_declined += not w.draft.token_ids
                if grammar is not None and w.draft.token_ids:  # cut at the grammar's first refusal
                    w.draft = w.draft.truncated(w.gen.constraint.cut(w.draft.token_ids))

    @staticmethod
    def _ask(gen: Generation) -> Callable[[Sequence[int], int], Draft] | None:
        """How the grammar source asks ``gen``'s drafter for a draft after tokens it appended (None: it cannot)."""
        drafter = gen.drafter
        if not gen.traits.reads_context:
            return None
        return lambda extra, n: drafter.propose([DraftRequest(gen.seq, [*gen.context, *extra], Budget(n))])[0]

    def _fit(self, draft: Draft, budget: Budget, sampling: SamplingParams) -> Draft:
        """Cut a draft to the budget; a tree also to what the target can verify exactly in one call.

        Trees are verified only greedily; with sampling the best branch is
        verified as a chain (deterministic, so rejection sampling stays exact).
        """
        target = self.target
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

    def _verify(self, work: list[_Work]) -> list[VerifyResult]:
        """One target batch over every generation's ``[pending] + draft``; keep accepted tokens in the KV."""
        target = self.target
        if len(work) == 1 and work[0].draft.is_tree:
            return [self._verify_tree(work[0])]
        segments = [Segment(w.gen.seq, [w.gen.context[-1], *w.draft.token_ids]) for w in work]
        n_past = [target.seq_len[w.gen.seq] for w in work]
        for w, seg in zip(work, segments):  # a recurrent state must be able to come back
            self._charged(w.gen, target.protect, seg.seq, len(seg.tokens))
        all_logits = target.decode(segments)
        results = []
        for w, logits, start in zip(work, all_logits, n_past):
            sampling, constraint = w.gen.config.sampling, w.gen.constraint
            if constraint is not None:
                result = self._verify_constrained(w, logits, constraint)
                w.dead_end = constraint.dead_row is not None and len(result.token_ids) == constraint.dead_row + 1
            elif sampling.greedy:
                result = verify_greedy(w.draft.token_ids, logits.argmax(axis=1).tolist())
            else:
                uniforms = w.gen.uniforms.at(len(w.gen.output_ids), len(w.draft.token_ids) + 1)
                w.probs = target_probs(logits, sampling)
                result = verify_sampling(w.draft.token_ids, w.draft.q, w.probs, w.gen.rng, uniforms)
            self._charged(w.gen, target.truncate, start + 1 + result.n_accepted, w.gen.seq)
            self._note_logprobs(w.gen, logits, result if not w.dead_end else
                                VerifyResult(result.token_ids[:-1] + (0,), result.n_accepted), probs=w.probs)
            results.append(result)
        return results

    @staticmethod
    def _verify_constrained(w: _Work, logits: np.ndarray, constraint: ConstraintState) -> VerifyResult:
        """Verification with the generation's logit controls applied at every row, as plain decoding applies them."""
        gen, draft = w.gen, w.draft.token_ids
        n_out = len(gen.output_ids)
        if gen.config.sampling.greedy:
            return verify_greedy(draft, constraint.choose(logits, draft, gen.context, n_out))
        p = w.probs = constraint.probs(logits, draft, gen.context, n_out, gen.config.sampling)
        return verify_sampling(draft, w.draft.q, p, gen.rng, gen.uniforms.at(n_out, len(draft) + 1))

    @staticmethod
    def _note_logprobs(gen: Generation, logits: np.ndarray, result: VerifyResult, rows: Sequence[int] | None = None,
                       probs: np.ndarray | None = None) -> None:
        """Keep the logprobs of a step's tokens from the verification rows (``rows``: a tree's path), while the
        logits are still valid; the commit keeps as many as it commits.  With ``post_sampling_probs`` they are
        read from the distribution each token was sampled from (``probs``; None: greedy's, all on the argmax)."""
        if gen.config.logprobs is None:
            return
        n = len(result.token_ids)
        if gen.config.post_sampling_probs:
            p = probs[:n] if probs is not None else one_hot(logits.shape[-1], result.token_ids)
            gen.step_logprobs = token_probs(p, result.token_ids, gen.config.logprobs)
            return
        picked = logits[:n] if rows is None else logits[list(rows)]
        gen.step_logprobs = token_logprobs(picked, result.token_ids, gen.config.logprobs)

    def _charged(self, gen: Generation, call, *args) -> None:
        """A target call that may save, restore or roll back recurrent state; its cost goes to ``gen``'s stats."""
        if not self.target.is_recurrent:
            call(*args)
            return
        total = self.target.rewind
        before = total.copy()
        try:
            call(*args)
        finally:
            gen.stats.rewound.add_change(total, before)

    def _verify_tree(self, w: _Work) -> VerifyResult:
        target, draft, stats = self.target, w.draft, w.gen.stats
        parents = [-1] + [p + 1 for p in draft.parents]  # rows: 0 = pending, i+1 = node i
        logits = target.eval_tree([w.gen.context[-1], *draft.token_ids], parents)  # [n+1, V]
        result, path = verify_tree_greedy(draft.token_ids, draft.parents, logits.argmax(axis=1).tolist())
        self._note_logprobs(w.gen, logits, result, [0] + [i + 1 for i in path])
        before = target.tree_relayouts
        target.commit_tree([0] + [i + 1 for i in path])
        stats.n_tree_steps += 1
        stats.n_tree_relayouts += target.tree_relayouts - before
        return result

    def _commit(self, gen: Generation, token_ids: Sequence[int]) -> list[int]:
        """Append verified tokens one by one, ending at EOS, a stop string or max_tokens."""
        stats = gen.stats
        committed: list[int] = []
        if not gen.output_ids and token_ids:
            stats.ttft_s = self.clock() - gen.submitted
        for tok in token_ids:
            committed.append(tok)
            gen.context.append(tok)
            gen.output_ids.append(tok)
            if tok in self._eog or tok in gen.config.stop_token_ids:
                stats.stop_reason = "eos"
                break
            if gen.stop_text.feed(self.target.token_bytes(tok)):
                stats.stop_reason = "stop"
                break
            if len(gen.output_ids) >= gen.config.max_tokens:
                stats.stop_reason = "length"
                break
        return committed
