"""The speculative decoding loop: budget -> propose -> verify -> commit (drafters advance, policies observe).

Invariant: for each generation, its target sequence holds every committed
token except the last one (``pending``).  Each step evaluates ``[pending] +
draft`` for every running generation in one ``llama_decode`` batch (split
only where exactness requires), which yields k+1 rows of logits per
generation: row i predicts the token after ``pending + draft[:i]``.  After
verification the KV keeps ``pending`` and the accepted draft prefix; the
one target token (recovered or bonus) becomes the new ``pending``.  Plain
decoding is the same loop with an empty draft, and a single request is the
same path with one sequence.  What belongs to one generation (its tokens,
the step's draft and verification, statistics, drafter and policy) is its
record, ``engine_state.GenState``, whose ``commit`` is a step's last part;
the engine is the loop and the slots.

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

from .calibration import BackgroundCalibration, Measured, ensure_shapes
from .draft_length import DEFAULT_K, BatchLoad, Budget, DraftLengthPolicy, make_policy
from .drafters.base import Drafter, PrefixDrafter
from .constraints import ConstraintState, for_target
from .engine_state import GenState, StepTimes
from .errors import ContextOverflowError, InvalidParameterError, KVPoolFullError
from .generation import Generation, GenerationConfig
from .prompt_cache import MIN_REUSE, PromptCache, reusable, worth_reusing
from .llama.target import EngineTarget, GrammarTarget, HiddenRowsTarget, PooledTarget
from .llama.batching import Segment, prefill_call
from .types import HiddenRows


@dataclass
class _Slot:
    """One target sequence: the tokens its KV holds (positions 0..), and who uses it."""

    seq: int
    cached: list[int] = field(default_factory=list)
    prefilled: int = 0  # leading cached tokens computed by a prefill (not by decode steps)
    writes: int = 0  # the target's write count for this sequence when ``cached`` was last true
    gen: GenState | None = None
    released: float = 0.0  # for least-recently-used reuse
    keeper: PrefixDrafter | None = None  # the last generation's drafter where it keeps state for ``cached``


def _open_to(rec: GenState, free: list[_Slot]) -> list[_Slot]:
    """The free slots ``rec`` may take: any, or the one its config names (``GenerationConfig.slot``)."""
    want = rec.config.slot
    return free if want is None else [s for s in free if s.seq == want]


def _constraint(target: EngineTarget, config: GenerationConfig, eog: frozenset[int],
                grammar: Callable[[str], Any] | None) -> ConstraintState | None:
    """A generation's logit controls over ``target`` (a bad grammar or token id fails here, before a slot)."""
    bad = [t for t in config.stop_token_ids if not 0 <= t < target.n_vocab]
    if bad:
        raise InvalidParameterError(f"stop token id {bad[0]} is outside the vocabulary (0..{target.n_vocab - 1})")
    return for_target(config.constraints, target.n_vocab, eog, frozenset(config.stop_token_ids), grammar,
                      target.token_bytes)


def _prompt_token_estimate(recs: list[GenState]) -> float:
    """Before any chunk was timed here: a prompt token's cost from the cost curve's widest call."""
    costs = next((r.policy.costs for r in recs if r.policy.costs is not None), None)
    if costs is None:
        return 0.0
    n = len(costs.curve)
    return costs.call_s(n) / n


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
        self._waiting: deque[GenState] = deque()
        self._running: list[GenState] = []
        # Prompts processed inside steps (``_prefill_some``): each step, after the running generations' rows,
        # at most ``batch_tokens`` prompt tokens, at most ``prefill_cap`` of one prompt.  None: a prompt is
        # prefilled whole when admitted (one caller, nobody to stall).
        self.batch_tokens = batch_tokens
        self.prefill_cap = prefill_cap if prefill_cap is not None else batch_tokens
        self._prefilling: list[GenState] = []
        self.prefill_token_s = 0.0  # seconds per prompt token, from chunks prefilled in steps (EMA)

    # -- requests ----------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig | None = None, *,
                 drafter: Drafter | None = None, policy: DraftLengthPolicy | None = None) -> Generation[GenState]:
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
        rec = GenState.new(prompt_ids, config, drafter or self.drafter, policy, parent,
                           _constraint(self.target, config, self._eog, self._grammar), self._eog,
                           self.target.token_bytes, self.clock())
        self._waiting.append(rec)
        return Generation(self, rec)

    def cancel(self, gen: Generation[GenState]) -> None:
        """Stop a generation between steps; its KV cells and drafter state are freed."""
        self._cancel(gen.state)

    def _cancel(self, rec: GenState) -> None:
        """``cancel`` of the engine's record of a generation (a failed step cancels every one it holds)."""
        if rec.done:
            return
        if rec.status == "waiting":
            self._waiting.remove(rec)
        elif rec.status == "prefilling":
            self._prefilling.remove(rec)
            self._release(rec, keep_cache=False)
        else:
            self._release(rec, keep_cache=False)
        rec.stats.stop_reason = rec.stats.stop_reason or "cancelled"
        rec.status = "cancelled"

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
            for rec in self._running + self._prefilling:  # never leave a half-done step behind
                self._cancel(rec)
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
            rec = next((r for r in self._waiting if _open_to(r, free)), None)
            if rec is None:
                return
            if any(p.prompt_ids == rec.prompt_ids for p in self._prefilling):
                return  # another choice of the same prompt (n > 1) is prefilling it: copy its KV when done
            free = _open_to(rec, free)
            for s in free:
                if self.target.writes[s.seq] != s.writes:  # someone else wrote this sequence since
                    s.cached, s.prefilled = [], 0
            slot = max(free, key=lambda s: (worth_reusing(self.target, s.cached, s.prefilled, rec.prompt_ids), -s.released))
            if not self._pool_admits(rec, slot):
                return  # the shared KV pool lacks room for its prompt now: it waits, and so do those behind it
            self._waiting.remove(rec)
            try:
                reuse = 0
                if rec.config.reuse_prompt:
                    self._swap(slot, rec.prompt_ids, rec.traits.prefix, self._room(slot))
                    reuse = reusable(self.target, slot.cached, slot.prefilled, rec.prompt_ids)
                self._start(rec, slot, reuse)
            except BaseException:
                self._cancel(rec)
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
        claimed = sum(len(r.prompt_ids) - target.seq_len[r.seq] for r in self._prefilling)
        return self._pool - sum(target.seq_len) - claimed - (target.min_batch - 1)

    def _room(self, slot: _Slot) -> int | None:
        """The cells ``slot`` may fill as it takes a prompt: the pool's free cells and its own (None: no pool)."""
        return None if self._pool is None else self._pool_left() + self.target.seq_len[slot.seq]

    def _pool_admits(self, rec: GenState, slot: _Slot) -> bool:
        """Whether ``rec``'s whole prompt fits the shared pool in ``slot`` now, freeing other idle slots' cells
        if that makes it fit; always, without a pool."""
        if self._pool is None:
            return True
        need = len(rec.prompt_ids) - self.target.seq_len[slot.seq]
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

    def _fit_pool(self, recs: list[GenState]) -> list[GenState]:
        """The running generations the shared pool has a cell for (their pending token): idle slots are freed
        first; then, while it still lacks cells, the generation holding the most ends, stop reason "kv_pool" (the
        server answers it as llama-server answers a slot its full unified cache fails: 500 "Context size has been
        exceeded.", though llama-server fails every running slot then, and the others go on here), its cells freed
        as its slot falls idle."""
        if self._pool is None:
            return recs
        recs = list(recs)
        while recs and not self._free_idle(len(recs)):
            recs.remove(self._end_longest(recs))
        return recs

    def _verify_in_pool(self, recs: list[GenState]) -> bool:
        """``_verify``; where llama.cpp finds no cells for it in the shared pool (it placed nothing: it prepares
        every ubatch first), once more after every idle slot's cells are freed.  Where it still finds none, though
        the pool's count said the step would fit (``_budgets``' spare), the step is undone: as in ``_fit_pool`` the
        generation holding the most ends, the others take the next step (False)."""
        for attempt in range(2):
            try:
                self._verify(recs)
                return True
            except KVPoolFullError:
                if self._pool is None:
                    raise
                idle = [s for s in self._slots if s.gen is None and self.target.seq_len[s.seq]]
                if attempt == 0 and idle:
                    for slot in idle:
                        self._evict(slot)
                    continue
                self._end_longest(recs)
        return False

    def _end_longest(self, recs: list[GenState]) -> GenState:
        """End the generation of ``recs`` holding the most cells of the shared pool, stop reason "kv_pool"."""
        longest = max(recs, key=lambda r: self.target.seq_len[r.seq])
        longest.stats.stop_reason = "kv_pool"
        self._finish(longest)
        return longest

    def _start(self, rec: GenState, slot: _Slot, reuse: int) -> None:
        """Give ``rec`` its slot with ``reuse`` prompt tokens already there; its prompt's rest is prefilled now
        (``batch_tokens`` None) or chunk by chunk in the coming steps (``_prefill_some``)."""
        t0 = self.clock()
        slot.gen, rec.seq, rec.status, rec.started = rec, slot.seq, "prefilling", t0
        self._prefilling.append(rec)
        if reuse:
            self.target.truncate(reuse, slot.seq)
        else:
            self.target.reset(slot.seq)
        self._hidden(slot.seq)  # rows the slot's last user left behind are not this prompt's
        slot.cached, slot.prefilled = [], 0
        rec.stats.n_reused = reuse
        rec.stats.queue_s = t0 - rec.submitted
        if self.batch_tokens is None:
            self._prefill(rec, len(rec.prompt_ids))

    def _prefill_some(self, rows: int) -> None:
        """Fill what the step's ``rows`` left of ``batch_tokens`` with prompt chunks, first come first served,
        at most ``prefill_cap`` tokens of one prompt; at least one chunk a step, so prompts always advance.

        Chunks end where a cold prefill's calls end (multiples of ``prefill_chunk``, see ``LlamaModel.prefill``),
        one sequence per call: each prompt's KV is computed by the very calls a solo run makes, so neither its
        output nor that of the running generations (whose rows are in calls of their own) changes."""
        left = max(0, (self.batch_tokens or 0) - rows)
        for rec in list(self._prefilling):
            took = self._prefill(rec, max(1, min(left, self.prefill_cap or left)))
            left -= took
            if left <= 0:
                return

    def _prefill(self, rec: GenState, tokens: int) -> int:
        """Prefill up to ``tokens`` more of ``rec``'s prompt (rounded to chunk edges, at least to the next one);
        once all but its last token are in, it starts decoding.  Returns the tokens prefilled."""
        slot, target = self._slots[rec.seq], self.target
        t0 = self.clock()
        at, end = target.seq_len[slot.seq], len(rec.prompt_ids) - 1
        chunk = prefill_call(target.config.prefill_chunk, target.batch_cap)
        stop = end if at + tokens >= end else min(end, max((at // chunk + 1) * chunk, (at + tokens) // chunk * chunk))
        if stop > at:
            target.prefill(rec.prompt_ids[at:stop], slot.seq)
            self._observe_prefill(stop - at, self.clock() - t0)
        rec.stats.prefill_s += self.clock() - t0
        if stop >= end:
            self._begin(rec, slot)
        return max(0, stop - at)

    def _observe_prefill(self, tokens: int, seconds: float) -> None:
        """Learn what a prompt token costs, the price of a draft row that displaces one (``BatchLoad``).
        Short tails are skipped: a call's fixed cost would make their tokens look dear."""
        if tokens < 32 or seconds <= 0:
            return
        per = seconds / tokens
        self.prefill_token_s = per if self.prefill_token_s == 0 else self.prefill_token_s + 0.2 * (per - self.prefill_token_s)

    def _free_rows(self, recs: list[GenState]) -> int | None:
        """Draft rows this step can verify before they displace prompt tokens that are waiting for it: the
        budget, less every running generation's pending row and the prompt chunks the step would take
        (at most ``prefill_cap`` of each prompt).  None when no prompt waits: drafts displace nothing."""
        if self.batch_tokens is None or not self._prefilling:
            return None
        cap = self.prefill_cap or self.batch_tokens
        wanted = sum(min(cap, len(r.prompt_ids) - 1 - self.target.seq_len[r.seq]) for r in self._prefilling)
        return max(0, self.batch_tokens - len(recs) - wanted)

    def _begin(self, rec: GenState, slot: _Slot) -> None:
        """The prompt is in (all but the pending last token): the generation decodes from the next step."""
        t0 = self.clock()
        self._prefilling.remove(rec)
        self._running.append(rec)
        rec.status = "running"
        slot.cached, slot.prefilled = list(rec.prompt_ids[:-1]), len(rec.prompt_ids) - 1
        rec.begin(self.target, self._hidden(slot.seq))  # the target's rows of the prompt from the reused prefix on
        rec.stats.prefill_s += self.clock() - t0

    def _hidden(self, seq: int) -> HiddenRows | None:
        """The target's hidden rows kept for ``seq`` since the last call here (``llama.hidden``), for a drafter that
        reads them (``Drafter.needs_hidden``); None where the target keeps none (no such drafter)."""
        return self._take_hidden(seq) if self._take_hidden is not None else None

    def _release(self, rec: GenState, keep_cache: bool) -> None:
        """Free the generation's slot; its KV stays for prefix reuse if ``keep_cache``."""
        slot = self._slots[rec.seq]
        began = rec.status != "prefilling"  # a prompt still being prefilled has no drafter state yet
        if rec in self._running:
            self._running.remove(rec)
        try:
            if began:
                rec.drafter.end(slot.seq, complete=keep_cache)
        finally:
            if keep_cache and self.target.can_truncate(len(rec.context) - 1, slot.seq):
                self.target.truncate(len(rec.context) - 1, slot.seq)  # a stop may cut accepted tokens
                slot.cached = rec.context[:-1]
            else:  # cancelled, or a recurrent state that cannot be cut back that far: nothing to reuse
                self.target.reset(slot.seq)
                slot.cached, slot.prefilled = [], 0
            slot.prefilled = min(slot.prefilled, len(slot.cached))
            slot.gen, slot.released, slot.keeper = None, self.clock(), rec.traits.prefix if keep_cache else None
            slot.writes = self.target.writes[slot.seq]

    def _finish(self, rec: GenState) -> None:
        """A generation met a stop condition: its last text and statistics, its slot released (its KV kept for
        prefix reuse), then what it taught kept."""
        rec.wrap_up(self.clock())
        self._release(rec, keep_cache=True)
        rec.learn()

    # -- the step ------------------------------------------------------------

    def _advance(self, recs: list[GenState]) -> int:
        """One step of every running generation: budget -> propose -> verify -> commit; returns the rows it
        verified."""
        t_begin = self.clock()
        recs = self._budgets(self._fit_pool(recs))
        if not recs:
            return 0
        depths = tuple(self.target.seq_len[r.seq] for r in recs)  # each call's rows attend over these
        t0 = self.clock()
        self._propose(recs)
        t1 = self.clock()
        rewind0 = self.target.rewind.seconds
        if not self._verify_in_pool(recs):
            return 0
        t2 = self.clock()
        rewind_s = self.target.rewind.seconds - rewind0
        drafted = sum(1 for r in recs if r.draft.token_ids)
        for cm in {id(r.policy.costs): r.policy.costs for r in recs if r.policy.costs is not None}.values():
            cm.observe_step(tuple(1 + len(r.draft) for r in recs), t2 - t1 - rewind_s, depths)
            cm.observe_rewind(rewind_s, drafted)
        share = 1.0 / len(recs)
        times = StepTimes(self.clock, share, (t2 - t1) * share, t0 - t_begin, t2)
        for rec in recs:
            rec.commit(times, self._hidden(rec.seq))  # the kept rows: pending and the accepted draft
            if rec.stats.stop_reason:
                self._finish(rec)
        return sum(1 + len(r.draft) for r in recs)

    def _budgets(self, recs: list[GenState]) -> list[GenState]:
        """Each generation's budget from its policy, valued against what the others already put in the step; the
        generations that take the step (one whose context is full ends)."""
        target, planned = self.target, []
        rows: list[int] = []
        depths: list[int] = []
        tokens = 0.0
        free = self._free_rows(recs)
        displaced_s = 0.0 if free is None else self.prefill_token_s or _prompt_token_estimate(recs)
        # draft rows the shared pool has cells for, after every generation's pending row (``_fit_pool``)
        spare = self._pool_left() - len(recs) if self._pool is not None else math.inf
        for i, rec in enumerate(recs):
            room = rec.room(target)
            if room < 0:
                rec.stats.stop_reason = "context"
                self._finish(rec)
                continue
            cap = rec.draft_cap(room, target, spare)
            later = len(recs) - i - 1  # not decided yet: count them as plain steps
            depth = target.seq_len[rec.seq]
            load = (BatchLoad(depth=depth) if len(recs) == 1 and free is None else
                    BatchLoad(tuple(rows) + (1,) * later, tokens + later, free, displaced_s, depth,
                              tuple(depths) + tuple(target.seq_len[r.seq] for r in recs[i + 1:])))
            budget = rec.policy.budget(cap, load, rec.tree_allowed(target)) if cap > 0 else Budget(0)
            spare -= budget.max_tokens
            rows.append(budget.rows if budget.rows is not None else 1 + budget.max_tokens)
            depths.append(depth)
            tokens += budget.expected
            if free is not None:
                free = max(0, free - (rows[-1] - 1))
            rec.plan(budget)
            planned.append(rec)
        return planned

    def _propose(self, recs: list[GenState]) -> None:
        """Every drafter once per step, with all of its generations' requests (a draft model batches them)."""
        groups: dict[int, list[GenState]] = {}
        for rec in recs:
            if rec.budget.max_tokens > 0:
                groups.setdefault(id(rec.drafter), []).append(rec)
        for group in groups.values():
            drafter = group[0].drafter
            asked = [r for r in group if drafter.name not in r.budget.skip]  # the policy's: its call won't pay
            t0 = self.clock()
            proposed = drafter.propose([r.request() for r in asked]) if asked else []
            drafts = dict(zip(map(id, asked), proposed))
            spent = (self.clock() - t0) / max(len(asked), 1)
            for rec in group:
                rec.settle_draft(drafts.get(id(rec)), spent, self.target, self.clock)

    def _verify(self, recs: list[GenState]) -> None:
        """One target batch over every generation's ``[pending] + draft``; keep accepted tokens in the KV."""
        target = self.target
        if len(recs) == 1 and recs[0].draft.is_tree:
            recs[0].verify_tree(target)
            return
        segments = [Segment(r.seq, [r.context[-1], *r.draft.token_ids]) for r in recs]
        n_past = [target.seq_len[r.seq] for r in recs]
        for rec, seg in zip(recs, segments):  # a recurrent state must be able to come back
            rec.charged(target, target.protect, seg.seq, len(seg.tokens))
        all_logits = target.decode(segments)
        for rec, logits, start in zip(recs, all_logits, n_past):
            result = rec.verify_rows(logits)
            rec.charged(target, target.truncate, start + 1 + result.n_accepted, rec.seq)
            rec.note_logprobs(logits)
