"""k policies on scripted acceptance and cost sequences, and the cost model's calibration."""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np
import pytest

from specstack.calibration import curve, modes
from specstack.calibration import calibrate, ensure_shapes, exact_mode
from specstack.calibration.curve import measure_curve
from specstack.calibration.modes import measure_exact_cost
from specstack.draft_length.costs import CostModel
from specstack.draft_length import (
    AcceptanceTracker,
    BatchLoad,
    CostK,
    FixedK,
    Go,
    HeuristicK,
    StepOutcome,
    WindowK,
    best_k,
    expected_accepted,
)
from specstack.errors import InvalidParameterError
from specstack.llama import INEXACT, BatchShapes, Segment
from specstack.drafters.prompt_lookup import match_probs
from specstack.types import Draft


# Tests of one mechanism that follow a policy through many scored drafts as one generation build it with ``floor=0.0``:
# the floor (tested on its own, ``test_a_generation_keeps_the_floor_...``) would hold back the drafts they script.


def outcome(drafted, accepted, source="s", draft_s=1e-6, verify_s=0.0):
    # verify_s=0 means "not measured": these tests script acceptance, not costs.
    return StepOutcome(source, drafted, accepted, draft_s, verify_s)


def next_k(p) -> int:
    return p.budget(64).max_tokens


def trim(p, source, n, probs=None) -> int:
    """Tokens of a chain of ``n`` from ``source`` the policy verifies (``probs``: a scored draft's path probabilities)."""
    return p.budget(64).worth(Draft(tuple(range(n)), source, probs=probs))


def linear_costs(base=1e-3, per_token=1e-4, n=40) -> CostModel:
    return CostModel([base + per_token * (i) for i in range(n)])


def test_a_generation_learns_its_own_prompt_over_what_earlier_ones_learnt():
    """Earlier generations learnt that a model's drafts are never accepted; this generation's first two drafts
    are. Its own outcomes must outweigh the inherited ones, and the cost policy then drafts: a model draft's
    acceptance differs by prompt (95% and 24% on two completions of the bundled pair), and carried whole, what
    the first generations learnt held for every later one."""
    parent = CostK(linear_costs(per_token=2e-5), k_max=8)
    for _ in range(60):
        parent.book.update("draft-model", 4, 0)
    child = parent.fork()
    assert child.book.tracker("draft-model").reached[0] == pytest.approx(0.25 * parent.book.tracker("draft-model").reached[0])
    for _ in range(2):
        child.book.update("draft-model", 1, 1)
    assert child.book.conditional("draft-model")[0] > 0.25  # carried whole: 0.10
    assert child.best_k_for("draft-model") > 0
    assert parent.book.conditional("draft-model")[0] < 0.05  # the parent's own book is untouched


def test_fixed_never_changes_and_refuses_k_below_one():
    p = FixedK(6)
    p.observe(outcome(6, 0))
    assert next_k(p) == 6 and trim(p, "s", 3) == 3
    assert trim(p, "s", 9) == 6  # never more than the budget
    with pytest.raises(InvalidParameterError):
        FixedK(0)


def test_window_grows_above_80_shrinks_below_60_within_bounds():
    p = WindowK(k=8, k_min=4, k_max=24, window=64)
    for _ in range(10):
        for _ in range(8):
            p.observe(outcome(8, 8))
    assert next_k(p) == 24  # capped at k_max
    for _ in range(20):
        for _ in range(8):
            p.observe(outcome(8, 2))
    assert next_k(p) == 4  # floored at k_min


def test_window_waits_for_a_full_window():
    p = WindowK(k=8, window=64)
    p.observe(outcome(8, 8))
    assert next_k(p) == 8


def test_heuristic_plus_two_minus_one():
    p = HeuristicK(k=4, k_max=10)
    p.observe(outcome(4, 4))
    assert next_k(p) == 6
    p.observe(outcome(6, 5))
    assert next_k(p) == 5
    for _ in range(10):
        p.observe(outcome(next_k(p), next_k(p)))
    assert next_k(p) == 10


def test_expected_accepted_is_sum_of_prefix_products():
    assert expected_accepted([0.5, 0.5, 0.5], 3) == pytest.approx(0.5 + 0.25 + 0.125)


def brute_force_best_k(cond, draft_cost, verify_cost, k_max):
    """Independent reference: enumerate acceptance outcomes explicitly."""
    best, best_rate = None, -1.0
    for k in range(0, k_max + 1):
        # P(exactly j accepted) for j = 0..k
        e = 0.0
        for j in range(k + 1):
            p = np.prod(cond[:j]) * (1 - cond[j] if j < k else 1.0)
            e += p * j
        rate = (e + 1) / (draft_cost(k) + verify_cost(k + 1))
        if rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return best


@pytest.mark.parametrize("seed", range(25))
def test_cost_choice_equals_brute_force_argmax(seed):
    rng = np.random.default_rng(seed)
    k_max = 12
    cond = list(rng.uniform(0.05, 0.99, size=k_max))
    base, slope, curve = rng.uniform(1e-3, 5e-2), rng.uniform(0, 2e-2), rng.uniform(0, 3)
    verify = lambda n: base + slope * (n - 1) ** curve  # noqa: E731
    per_tok = rng.uniform(0, 1e-2)
    draft = lambda k: per_tok * k  # noqa: E731
    assert best_k(cond, draft, verify, k_max) == brute_force_best_k(cond, draft, verify, k_max)


def test_cost_picks_zero_when_drafts_are_never_accepted():
    p = CostK(linear_costs(), k_max=16)
    for _ in range(50):
        p.observe(outcome(trim(p, "s", next_k(p)) or 2, 0))
    assert p.best_k_for("s") == 0


def test_cost_picks_large_k_when_always_accepted_and_verification_is_cheap():
    p = CostK(linear_costs(base=1e-2, per_token=1e-5), k_max=16)
    for _ in range(60):
        k = max(trim(p, "s", next_k(p)), 1)
        p.observe(outcome(k, k))
    assert p.best_k_for("s") == 16


def test_cost_picks_small_k_when_verification_is_compute_bound():
    # Each extra verified token costs as much as a whole plain step.
    p = CostK(CostModel([1e-2 * n for n in range(1, 40)]), k_max=16)
    for _ in range(60):
        k = max(trim(p, "s", next_k(p)), 1)
        p.observe(outcome(k, min(k, 1)))
    assert p.best_k_for("s") <= 1


def test_rows_cost_more_the_deeper_the_generation_and_online_estimates_are_kept_at_the_curves_depth():
    """Every row attends over its context: t(n, d) = t(n) + n * row_depth_s * (d - depth0)."""
    costs = CostModel([0.010, 0.011, 0.012, 0.013], depth0=128, row_depth_s=2e-6)
    assert costs.batch_s((2,)) == pytest.approx(0.011)  # no depth given: the curve's own
    assert costs.batch_s((2,), (1128,)) == pytest.approx(0.011 + 2 * 2e-6 * 1000)
    assert costs.batch_s((2, 1), (1128, 128)) > costs.batch_s((2, 1), (128, 128))
    for _ in range(6):  # a size seen often is priced from its own online estimate, moved to depth0
        costs.observe_step((3,), 0.012 + 3 * 2e-6 * 2000, (2128,))
    assert costs.call_s(3) == pytest.approx(0.012)
    assert costs.batch_s((3,), (628,)) == pytest.approx(0.012 + 3 * 2e-6 * 500)
    assert BatchLoad(rows=(2, 1), depth=700, depths=(5,)).all_depths() == (5, None, 700)


def test_cost_drafts_less_deep_in_a_generation_where_rows_cost_more_there():
    """A row whose attention grows with the context (the 1B stand-in before the attention kernel: 28.8 ms per
    1000 tokens at -t 2, against a 22 ms step at depth 128) is worth fewer draft tokens deep in."""
    def k_at(depth):
        p = CostK(CostModel([0.022 + 0.004 * i for i in range(40)], depth0=128, row_depth_s=2.9e-5), k_max=16)
        for i in range(120):  # runs of 0-16 accepted tokens: each further token is a little less likely
            k = max(p.budget(64, BatchLoad(depth=depth)).worth(Draft(tuple(range(16)), "s")), 1)
            p.observe(outcome(k, min(k, (0, 1, 2, 3, 5, 8, 12, 16)[i % 8])))
        return p.best_k_for("s", BatchLoad(depth=depth))
    assert k_at(128) > k_at(1500) >= 0


def test_cost_drafts_less_when_draft_rows_displace_waiting_prompt_tokens():
    """A burst of prompts: draft rows past the step's free rows push prompt tokens out of the step."""
    p = CostK(linear_costs(base=1e-2, per_token=1e-4), k_max=16)
    for _ in range(60):  # acceptance 3 of every draft: worth a long draft when rows are free
        k = max(trim(p, "s", next_k(p)), 1)
        p.observe(outcome(k, min(k, 3)))
    free = p.best_k_for("s", BatchLoad(free_rows=64, displaced_s=1e-2))
    squeezed = p.best_k_for("s", BatchLoad(free_rows=0, displaced_s=1e-2))
    assert free == p.best_k_for("s") >= 3  # rows to spare: the prompt costs nothing
    assert squeezed < free  # each displaced row costs a plain step's worth of delay
    assert p.best_k_for("s", BatchLoad(free_rows=2, displaced_s=1e-2)) >= 2  # the free rows are still used
    assert BatchLoad(free_rows=2, displaced_s=0.5).displacement_s(5) == 1.5


def test_cost_verifies_none_of_a_draft_too_short_to_pay():
    """Where a 2-row call costs 2.4x a one-row call (the 1B stand-in, Q4_K_M), a retrieval draft that came back
    with 1 token loses whatever its acceptance: the policy planned a long draft, and cuts a short one to none."""
    p = CostK(CostModel([23.5, 56.7, 69.4, 77.1, 103.7, 115.0, 127.5, 103.6] + [103.6 + 6 * i for i in range(1, 12)]),
              k_max=16)
    for _ in range(60):  # every draft accepted whole: long drafts pay
        k = max(trim(p, "s", next_k(p)), 1)
        p.observe(outcome(k, k))
    assert next_k(p) >= 7
    assert trim(p, "s", 1) == 0 and trim(p, "s", 2) == 0  # verifying them would cost more than it gives
    assert trim(p, "s", 7) == 7


def test_cost_verifies_a_scored_draft_as_far_as_its_scores_pay_and_learns_when_they_lie():
    """A retrieval draft that scores its tokens (the suffix tree's counts) is judged by them, not by the source's
    average: on the saw-toothed stand-in curve, an average that says "never draft" must not stop a continuation
    seen many times from being verified whole, while a draft whose path splits is cut where it splits."""
    p = CostK(CostModel([23.5, 56.7, 69.4, 77.1, 103.7, 115.0, 127.5, 103.6] + [103.6 + 6 * i for i in range(1, 12)]),
              k_max=16, floor=0.0)
    for _ in range(40):  # the unscored average: 40% of first tokens accepted
        p.observe(outcome(2, 1 if _ % 5 < 2 else 0))
    assert p.best_k_for("s") == 0 and next_k(p) == 0  # unscored, the source is never asked
    while (probe := p.budget(64)).max_tokens == 0:  # but probed now and then
        p.observe(outcome(0, 0))
    assert probe.worth(Draft((1, 2), "s", probs=(1.0, 1.0))) == 0  # too short to pay even when sure (the 2-row saw)
    p.observe(outcome(0, 0))
    assert next_k(p) == 16  # once a source is known to score its drafts, it is asked for its longest every step
    sure = (1.0,) * 12
    assert trim(p, "s", 12, probs=sure) == 12
    assert trim(p, "s", 12, probs=sure[:3] + (0.2,) * 9) == 3  # the path splits after 3 tokens: cut there
    assert trim(p, "s", 12, probs=(0.3,) * 12) == 0
    for _ in range(80):  # the scores lie: sure drafts rejected at their first token
        n = trim(p, "s", 12, probs=sure)
        p.observe(outcome(n, 0) if n else outcome(0, 0))
    assert trim(p, "s", 12, probs=sure) == 0  # calibration learnt that "sure" means nothing here


def test_a_declined_scored_source_learns_from_the_plain_steps_whether_its_drafts_were_right():
    """A scored source whose calibration fell (sure drafts rejected early) is declined, so no verification can
    raise it again: a grounded edit whose answer then copies the prompt for 150 tokens was decoded plain. The plain
    step's token says whether the declined draft's first token was right (``StepOutcome.shadow``), and the
    calibration learns from that: right, the source is verified again; wrong, it stays declined."""
    curve = CostModel([23.5, 56.7, 69.4, 77.1, 103.7, 115.0, 127.5, 103.6] + [103.6 + 6 * i for i in range(1, 12)])
    sure = (1.0,) * 12
    for right, verified in ((1, True), (0, False)):
        p = CostK(curve, k_max=16, floor=0.0)
        p.expect_scores(frozenset({"s"}))
        for _ in range(20):  # the scores lie at first
            n = trim(p, "s", 12, probs=sure)
            p.observe(outcome(n, 0) if n else outcome(0, 0))
        assert trim(p, "s", 12, probs=sure) == 0
        for _ in range(20):  # declined: plain steps, each saying whether the draft's first token was the target's
            assert trim(p, "s", 12, probs=sure) == 0 or verified
            p.observe(dataclasses.replace(outcome(0, 0), shadow=right))
        assert (trim(p, "s", 12, probs=sure) > 0) == verified
        p.observe(outcome(0, 0))
        for _ in range(20):  # without the plain steps' word (no draft declined) nothing moves
            p.observe(outcome(0, 0))
        assert (trim(p, "s", 12, probs=sure) > 0) == verified


# t(n) in ms of Gemma 3 270M Q4_K_M at 1 thread on a 2-core AMD EPYC with AVX2 (a bench run's cost curve).
GEMMA_AVX2 = [43.6, 81.8, 131.4, 139.9, 189.0, 199.7, 248.9, 269.6, 314.3, 324.3, 373.7, 382.1, 431.8, 442.2, 488.2,
              491.7, 553.8, 560.7, 609.9, 621.7, 670.0, 678.4, 725.2, 737.3, 783.3, 796.5, 850.0, 857.4, 907.9, 919.1]


def _generation(parent: CostK, steps: int, right: bool) -> tuple[list[int], float, int]:
    """A generation whose scored source drafts 12 sure tokens every step, all right or all refused: the tokens
    verified each step, the step time the cost model prices (a plain step for each draft cut to nothing) and the
    tokens committed."""
    g = parent.fork()
    verified, spent, tokens = [], 0.0, 0
    for _ in range(steps):
        n = g.budget(64).worth(Draft(tuple(range(12)), "s", probs=(1.0,) * 12))
        accepted = n if right else 0
        g.observe(outcome(n, accepted) if n else outcome(0, 0))
        verified.append(n)
        spent += g.costs.batch_s((1 + n,))
        tokens += 1 + accepted
    parent.adopt(g)
    return verified, spent, tokens


def test_a_generation_risks_one_wager_and_then_keeps_the_floor():
    """Scores that earlier requests found right can be wrong on this one: priced by expectation alone, the cost
    policy went on verifying them (12 of 25 third-party completions on Gemma 3 270M lost 3-9% against plain
    decoding). The floor is now held with high probability (issue 56): a draft the evidence makes near-sure is
    wagered from the first step, and when it is refused whole, that refusal eats the generation's margin and
    reprices the evidence, so from then on the worst-case bound rules: the generation loses at most that one
    wager's rows beyond what it has won, ``STAKE`` plain steps and the floor's share of its plain decoding time.
    Without any floor the same generation loses far more; without the wager it loses no more than the bound."""
    from specstack.draft_length.policies import FLOOR, STAKE

    for floor, wager in ((FLOOR, True), (FLOOR, False), (0.0, False)):
        p = CostK(CostModel(GEMMA_AVX2), k_max=16, floor=floor, wager=wager)
        p.expect_scores(frozenset({"s"}))
        _generation(p, 60, right=True)  # an earlier request: the scores were right
        verified, spent, tokens = _generation(p, 96, right=False)
        plain = p.costs.batch_s((1,))
        if not floor:  # the bound is what keeps it: without it the same generation loses more
            assert spent > tokens * plain / 0.97
            continue
        wagered = p.costs.batch_s((1 + verified[0],)) - plain if wager else 0.0
        assert (verified[0] > 0) == wager  # the wager is taken at the first step, before anything is won
        assert max(verified[1:]) <= 1  # once refused, no second wager: the worst-case bound's single tokens only
        assert spent <= (tokens / floor + STAKE + 0.5) * plain + wagered  # (its share of each step, ``_affordable``)


def test_verbatim_evidence_is_verified_from_the_first_step():
    """A source whose sure drafts were accepted on earlier requests is verified at once on the next one (the wager,
    priced at the lower confidence bound of its calibrated evidence), where the worst-case bound alone waited for the
    generation to win a refused draft's price first; and one whose drafts are right drafts longer as it wins."""
    first = {}
    for wager in (True, False):
        p = CostK(CostModel(GEMMA_AVX2), k_max=16, wager=wager)
        p.expect_scores(frozenset({"s"}))
        _generation(p, 60, right=True)
        verified, spent, tokens = _generation(p, 60, right=True)
        first[wager] = verified[0]
        assert verified[-1] >= 11 and spent < 0.8 * tokens * p.costs.batch_s((1,))
    assert first[True] >= 4 and first[False] == 0


def test_a_floor_outside_zero_to_one_is_refused():
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(InvalidParameterError, match="floor"):
            CostK(CostModel(GEMMA_AVX2), floor=bad)


def test_a_look_at_a_scored_source_skips_an_idle_model_source_and_probes_it_now_and_then():
    """``cascade:suffix,mtp``: the head's drafts are never accepted, so its best k is 0, but the suffix drafter
    scores its drafts, so it is looked at every step. The look used to be off for the whole cascade once the
    head had been asked (and the head asked wherever suffix came up short); now the budget skips the head, and
    gives it a probe after a run of skipped steps, with the probe interval backing off as a plain run's does."""
    p = CostK(CostModel([23.5, 56.7, 69.4, 77.1, 103.7, 115.0, 127.5, 103.6] + [103.6 + 6 * i for i in range(1, 12)]),
              k_max=16)
    first = p.budget(64)  # nothing known: a first look at every source
    assert first.probe and not first.skip
    first.worth(Draft((1, 2, 3), "s", probs=(1.0, 1.0, 1.0)))  # suffix: a scored draft
    p.observe(outcome(3, 3, "s", verify_s=70.0))
    second = p.budget(64)  # suffix came up short: the head drafts one token (ruled token by token)
    assert second.max_tokens == 16 and not second.skip
    second.keep_going("m", [0.2], 1.0)
    p.observe(outcome(1, 0, "m", draft_s=1.0, verify_s=50.0))
    for _ in range(30):
        p.book.update("m", 2, 0)
    assert p.best_k_for("m") == 0
    skipped, probes = 0, []
    for step in range(200):
        b = p.budget(64)
        assert b.max_tokens == 16  # the scored source is looked at every step
        if "m" in b.skip:
            skipped += 1
            p.observe(outcome(3, 3, "s", verify_s=70.0))
        else:
            assert b.probe and not b.skip
            probes.append(step)
            b.keep_going("m", [0.2], 1.0)
            p.observe(outcome(1, 0, "m", draft_s=1.0, verify_s=50.0))
    assert skipped > 150 and len(probes) >= 2
    assert probes[1] - probes[0] > probes[0]  # backing off while the probes say no


def test_a_scored_source_is_asked_before_its_first_draft():
    """``cascade:suffix,mtp`` on a prompt where suffix had nothing at the first look and the head drafted badly:
    only the head was a known source, so its best k (0) made every step plain, and suffix was never asked again
    until a probe. The drafter declares its scored sources (``expect_scores``), and they are asked from the start."""
    p = CostK(CostModel([23.5, 56.7, 69.4, 77.1, 103.7, 115.0, 127.5, 103.6] + [103.6 + 6 * i for i in range(1, 12)]),
              k_max=16)
    p.expect_scores(frozenset({"s"}))
    first = p.budget(64)
    first.keep_going("m", [0.2], 1.0)
    p.observe(outcome(1, 0, "m", draft_s=1.0, verify_s=50.0))
    for _ in range(30):
        p.book.update("m", 2, 0)
    b = p.budget(64)
    assert b.max_tokens == 16 and b.skip == {"m"}
    bare = CostK(p.costs, k_max=16)  # undeclared, the same course gives plain steps
    bare.budget(64).keep_going("m", [0.2], 1.0)
    bare.observe(outcome(1, 0, "m", draft_s=1.0, verify_s=50.0))
    for _ in range(30):
        bare.book.update("m", 2, 0)
    assert bare.budget(64).max_tokens == 0


def test_prompt_lookup_scores_a_draft_by_how_far_its_match_runs_back():
    from specstack.drafters.prompt_lookup import PromptLookupDrafter

    d = PromptLookupDrafter()
    line = list(range(100, 130))
    d.begin([7, 8, 9] + line + [1, 2, 3] + line[:20])  # copying the line: 20 tokens matched so far
    copy = d.propose([_request(0, 8)])[0]
    assert copy.token_ids == tuple(line[20:28])
    d.begin([5, 6, 7, 1, 2] + [50, 51] + [9, 7], seq=1)  # "7" seen once before: a one-token coincidence
    guess = d.propose([_request(1, 8)])[0]
    assert guess.token_ids[:1] == (1,)
    assert copy.scores()[0] > 0.95 > guess.scores()[0]
    assert copy.scores() == pytest.approx((1 - 1 / 22,) * 8)  # the same odds each token: 20 matched, (m+1)/(m+2)


def _request(seq: int, k: int):
    from specstack.draft_length import Budget
    from specstack.drafters.base import DraftRequest

    return DraftRequest(seq, [], Budget(k))


def test_cost_probes_after_a_run_of_plain_steps():
    p = CostK(linear_costs(), k_max=8, probe_every=4, probe_k=2)
    for _ in range(30):
        p.observe(outcome(2, 0))
    ks = []
    for _ in range(10):
        k = next_k(p)
        ks.append(k)
        p.observe(outcome(0, 0) if k == 0 else outcome(2, 0))
    assert 2 in ks and 0 in ks


def test_cost_probes_spend_at_most_their_share_of_plain_decoding_time():
    """A probe that cost 20 plain steps beyond what it won back waits until plain decoding has run long enough
    for it to be PROBE_SHARE of that time; counting steps alone probed every 16 to 64 steps whatever it cost."""
    from specstack.draft_length.policies import PROBE_SHARE

    step = 1e-3
    p = CostK(CostModel([step * (1 + 0.5 * i) for i in range(40)]), k_max=8, probe_every=4, probe_k=2)
    for _ in range(30):
        p.observe(outcome(2, 0))
    assert p.budget(64).max_tokens == 0
    p._plain_steps = 10**6  # the step count allows a probe: only its cost holds it back
    probe = p.budget(64)
    assert probe.probe and probe.max_tokens == 2
    p.observe(outcome(2, 0, draft_s=19 * step, verify_s=2 * step))  # 20 plain steps' worth more than its token
    plain_steps = 0
    while p.budget(64).max_tokens == 0:
        p.observe(outcome(0, 0, verify_s=step))
        plain_steps += 1
        p._plain_steps = max(p._plain_steps, 10**6)
        assert plain_steps < 10**5
    wanted = 0.5 * 20 * step / PROBE_SHARE / step  # the running mean starts from 0: half the first probe's cost
    assert wanted <= plain_steps <= wanted + 2


def test_cost_keeps_estimates_per_source():
    # Each verified token costs 10% of a plain step: worth it only for "good".
    p = CostK(linear_costs(base=1e-2, per_token=1e-3), k_max=8)
    for _ in range(40):
        p.observe(outcome(4, 4, source="good"))
        p.observe(outcome(4, 0, source="bad"))
    assert p.best_k_for("good") > 0 and p.best_k_for("bad") == 0
    assert trim(p, "bad", 8) == 0 and trim(p, "good", 8) > 0


def test_continue_rule_stops_on_low_confidence_when_verification_is_costly():
    # Each verified token adds 20% of a plain step.
    p = CostK(CostModel([1e-2 + 2e-3 * n for n in range(40)]), k_max=16)
    keep = p.budget(64).keep_going
    rule = lambda confs, spent: keep("draft-model", confs, spent)  # noqa: E731
    assert rule([0.99], 1e-4) == Go.MORE
    # Teach it: confident tokens are accepted, unsure ones rejected (and the second
    # position is usually rejected), then an unsure second token is not worth verifying.
    for _ in range(200):
        rule([0.99, 0.02], 1e-4)
        p.observe(outcome(2, 1, source="draft-model"))
    assert rule([0.99], 1e-4) >= Go.LAST
    assert rule([0.99, 0.02], 2e-4) == Go.DROP


def _teach_chain(p, source: str, first_s: float, chained_s: float, steps: int = 30) -> None:
    """Drafts of 4 tokens, all accepted, whose first call took ``first_s`` and each chained one ``chained_s``."""
    for _ in range(steps):
        keep = p.budget(64).keep_going
        for n in range(1, 5):
            keep(source, [0.9] * n, first_s + (n - 1) * chained_s)
        p.observe(outcome(4, 4, source=source, draft_s=first_s + 3 * chained_s))


def test_keep_going_counts_the_call_already_made_as_spent():
    # The bundled MTP model's shape: a 3 ms step whose first draft call (with catch-up rows) costs 1 ms and each
    # chained one 0.3 ms. Priced per token alike (1 ms), one more row never paid and drafts stopped at one token.
    p = CostK(CostModel([3e-3] * 40), k_max=16)
    _teach_chain(p, "mtp", 1e-3, 3e-4)
    assert p.source("mtp").draft_s(4) == pytest.approx(1e-3 + 3 * 3e-4)
    keep = p.budget(64).keep_going
    assert keep("mtp", [0.9], 1e-3) == Go.MORE
    assert keep("mtp", [0.9], 5e-3) == Go.MORE  # a slow first call is no reason to drop what it drafted


def test_keep_going_keeps_a_token_but_stops_when_the_next_call_costs_more_than_it_wins():
    p = CostK(CostModel([3e-3] * 40), k_max=16)
    _teach_chain(p, "mtp", 1e-3, 2e-2)  # a chained call costs 7 target steps
    keep = p.budget(64).keep_going
    assert keep("mtp", [0.9], 1e-3) == Go.LAST


def test_keep_going_drops_a_token_whose_row_costs_more_than_it_is_worth():
    p = CostK(CostModel([3e-3, 3e-3, 9e-3] + [1e-2] * 37), k_max=16)  # a third row triples the call
    for _ in range(100):  # the first token is accepted, an unsure second one never
        keep = p.budget(64).keep_going
        keep("mtp", [0.9], 1e-4)
        keep("mtp", [0.9, 0.01], 2e-4)
        p.observe(outcome(2, 1, source="mtp", draft_s=2e-4))
    keep = p.budget(64).keep_going
    assert keep("mtp", [0.9], 1e-4) == Go.LAST  # keep the first, do not draft a second
    assert keep("mtp", [0.9, 0.01], 2e-4) == Go.DROP  # and one drafted anyway is not verified


def test_a_model_source_whose_asks_are_dropped_stops_being_asked():
    # A 10 ms step, a 1 ms first call: its drafts pay while kept. On a prompt where
    # the head is unsure, every ask drafts one token that ``keep_going`` drops: the call is spent, nothing verified.
    p = CostK(CostModel([1e-2 + 1e-3 * n for n in range(40)]), k_max=16)  # a row: a tenth of a step
    for _ in range(30):  # kept drafts of 2 tokens, the first accepted, the second half the time
        keep = p.budget(64).keep_going
        keep("mtp", [0.9], 1e-3)
        keep("mtp", [0.9, 0.6], 1.3e-3)
        p.observe(outcome(2, 1 + _ % 2, source="mtp", draft_s=1.3e-3))
    assert next_k(p) > 0
    asks = 0
    for _ in range(50):
        budget = p.budget(64)
        if budget.max_tokens == 0:
            break
        asks += 1
        budget.keep_going("mtp", [0.05], 1e-3)  # drafted, then dropped: the call spent, nothing verified
        p.observe(outcome(0, 0, source="mtp", draft_s=1e-3))
    assert 1 < asks <= 12  # it stopped asking within a dozen steps, the drafts' acceptance unchanged
    assert p.book.conditional("mtp")[0] > 0.8
    child = p.fork()  # a new prompt: asked again, its prior only in part the last prompt's
    assert next_k(child) > 0
    _teach_chain(child, "mtp", 1e-3, 3e-4, steps=3)  # asks kept again: asked on
    assert next_k(child) > 0


def test_confidence_calibration_learns_an_overconfident_draft():
    from specstack.draft_length import ConfidenceCalibration

    cal = ConfidenceCalibration()
    for _ in range(300):
        cal.update([0.95, 0.95], 0)  # always sure, always rejected
    assert cal.prob(0.95) < 0.1 and cal.prob(0.15) == pytest.approx(0.5)


def test_acceptance_tracker_counts_reached_positions_only():
    t = AcceptanceTracker(k_max=4, decay=1.0, prior_a=0.0, prior_b=0.0)
    t.update(4, 1)  # pos 0 accepted, pos 1 rejected, pos 2-3 never reached
    assert t.reached == [1, 1, 0, 0] and t.accepted == [1, 0, 0, 0]


def test_cost_model_refines_online_and_stays_monotone():
    c = CostModel([1.0, 2.0, 3.0])
    for _ in range(200):
        c.observe_step((2,), 10.0)
    assert c.verify_s(2) > 9.0 and c.verify_s(3) >= c.verify_s(2)
    assert c.verify_s(5) >= c.verify_s(3)  # extrapolated


def test_cost_model_rescales_sizes_not_observed_yet():
    # Calibrated on a busy machine: everything twice too slow.  Steps of n=1 fix n=8 too.
    c = CostModel([2.0 * n for n in range(1, 9)])
    for _ in range(100):
        c.observe_step((1,), 1.0)
    assert c.verify_s(8) == pytest.approx(8.0, rel=0.05)


def test_calibration_is_positive_prices_nondecreasing_and_cached(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTACK_CACHE_DIR", str(tmp_path))
    first = calibrate(target, n_max=6)
    assert first.source == "calibrated"
    assert all(x > 0 for x in first.curve)
    prices = [first.call_s(n) for n in range(1, 7)]  # the curve as measured may saw; what a call costs may not
    assert all(b >= a for a, b in itertools.pairwise(prices))
    second = calibrate(target, n_max=6)
    assert second.source == "cache" and second.curve == pytest.approx(first.curve)


def test_a_cached_curve_that_no_longer_fits_the_machine_is_measured_again(target, tmp_path, monkeypatch):
    """A curve cached while the cores were taken (seen here: 1.85 s per call of a 0.6 ms model) would
    misprice every draft for as long as the cache lives; calibrate checks it against calls timed now."""
    import json

    monkeypatch.setenv("SPECSTACK_CACHE_DIR", str(tmp_path))
    calibrate(target, n_max=6)
    path = tmp_path / "costs.json"
    cache = json.loads(path.read_text())
    [key] = [k for k in cache if not k.startswith(("shapes-", "exact-auto-"))]
    cache[key]["curve_s"] = [1000.0 * (1 + 0.01 * n) for n in range(6)]  # a million times too slow
    path.write_text(json.dumps(cache))
    monkeypatch.setattr(curve, "_checked", set())  # as a new process finds it
    again = calibrate(target, n_max=6)
    assert again.source == "calibrated"
    assert json.loads(path.read_text())[key]["curve_s"] == pytest.approx(again.curve)  # the cache is fixed too


def test_exact_auto_keeps_exact_shapes_only_where_they_cost_little(target, tmp_path, monkeypatch):
    """--exact auto times what padding and splitting add here, then keeps exact shapes under the limit only,
    and says why; the mode a run gets is in ``shapes.why`` for every output."""
    from specstack.llama import BatchShapes

    monkeypatch.setenv("SPECSTACK_CACHE_DIR", str(tmp_path))
    before = target.shapes
    try:
        measured = BatchShapes(min_rows=2, max_rows=3, settled=True)  # as on Gemma 3 Q4_K_M: 17 rows take 6 calls
        cost = measure_exact_cost(target, measured)
        assert cost.rows == 17 and cost.pad >= 0 and cost.split > 0  # six calls cost more than one
        for limit, on in ((100.0, True), (-1.0, False)):
            monkeypatch.setattr(modes, "AUTO_EXACT_LIMIT", limit)
            target.set_shapes(BatchShapes(min_rows=2))  # not settled: measured (or read from the cache) again
            shapes = ensure_shapes(target, "auto")
            assert shapes.exact is on and shapes.why.startswith(f"--exact auto: {'on' if on else 'off'}")
            assert "pycoder-6m.gguf" in shapes.why and "padded one-token step" in shapes.why
        target.set_shapes(BatchShapes(min_rows=2))
        assert ensure_shapes(target, "on").why == "--exact on" and target.shapes.exact
    finally:
        target.set_shapes(before)


def test_exact_modes():
    assert (exact_mode(True), exact_mode(False), exact_mode("auto")) == ("on", "off", "auto")
    with pytest.raises(InvalidParameterError, match="auto, on, off"):
        exact_mode("sometimes")


def test_measure_curve_leaves_target_reusable(target):
    from specstack.drafters import BuildContext, create
    from specstack.engine import Engine
    from specstack.generation import GenerationConfig
    from specstack.prompts import held_out_prompts

    plain = Engine(target, create("none", BuildContext(target)))
    before = plain.generate(held_out_prompts(1)[0], GenerationConfig(max_tokens=24)).run().output_ids
    measure_curve(target, 3, reps=1)
    assert target.n_past == 0 and target.seq_pos_max(0) == -1  # nothing left in the KV cache
    fresh = Engine(target, create("none", BuildContext(target)))  # no cached prefix to lean on
    assert fresh.generate(held_out_prompts(1)[0], GenerationConfig(max_tokens=24)).run().output_ids == before


def test_without_exactness_calls_are_padded_to_their_cheapest_size_and_priced_so(target):
    """A saw-toothed curve (kernels taking rows in 4s): 5-7 rows cost what 8 do, because the target pads them."""
    saw = [1.0, 2.0, 2.5, 2.6, 3.6, 3.9, 4.3, 3.5]
    pad_to = curve.cheapest_sizes(saw)
    assert pad_to == (1, 2, 3, 4, 5, 8, 8, 8)
    model = CostModel(saw, shapes=dataclasses.replace(INEXACT, pad_to=pad_to))
    assert model.call_s(6) == model.call_s(7) == model.call_s(8) == 3.5 and model.call_s(5) == 3.6
    assert CostModel(saw, shapes=BatchShapes(min_rows=1)).call_s(8) == 4.3  # exact: never padded, never cheaper
    before = target.shapes
    calls = []
    real = target._call
    try:
        target.set_shapes(dataclasses.replace(INEXACT, pad_to=pad_to))
        target._call = lambda entries, *a, **k: (calls.append([(len(t), pad) for _, t, pad, _ in entries]),
                                                 real(entries, *a, **k))[1]
        target.reset()
        target.prefill(target.tokenize("def f(x):\n    return x\n"))
        n = target.seq_len[0]
        logits = target.decode([Segment(0, [target.bos_id] * 6, 0)])[0]
        assert calls[-1] == [(6, 2)] and logits.shape[0] == 6 and target.seq_len[0] == n + 6  # pads gone again
    finally:
        target._call = real
        target.set_shapes(before)
        target.reset()


# -- issue 55 item 7: a drafter that drafted nothing in a generation says why -------------------------------------

REPEATED = "def add(a, b):\n    return a + b\n\n\n" * 6 + "def add(a, b):\n"


def _idle_run(target, drafter: str, policy):
    from specstack.drafters import BuildContext, create
    from specstack.engine import Engine
    from specstack.generation import GenerationConfig

    engine = Engine(target, create(drafter, BuildContext(target)), policy)
    return engine.generate(REPEATED, GenerationConfig(max_tokens=24)).run().stats


def test_a_cost_policy_that_declines_every_draft_says_what_it_weighed(target):
    """Rows priced at 50 plain steps each: prompt lookup proposes the repeated function every step and the cost
    policy declines it; the statistics say so, with the row cost and the drafts' expected acceptance."""
    costs = CostModel([1e-3 + 5e-2 * n for n in range(24)])
    stats = _idle_run(target, "prompt-lookup", CostK(costs, k_max=8, floor=0.0))
    assert stats.n_drafted == 0 and stats.n_proposed > 0 and stats.n_declined > 0
    assert stats.idle_why.startswith(f"the cost policy declined all {stats.n_declined} drafts prompt-lookup proposed")
    cost = re.search(r"a verified row costs (\d+\.\d\d)x a plain step here \(t\(2\) [\d.]+ ms", stats.idle_why)
    assert cost and float(cost.group(1)) > 10, stats.idle_why  # the priced rows (refined online from the real calls)
    assert re.search(r"expected to be accepted \d+% at best$", stats.idle_why)
    assert stats.to_dict()["idle_why"] == stats.idle_why


def test_a_drafter_that_found_nothing_says_so_and_one_that_drafted_says_nothing(target):
    from specstack.metrics import GenerationStats

    said = FixedK(4).why_idle(GenerationStats(drafter="suffix", n_steps=12))
    assert said == "suffix proposed no draft in 12 steps: nothing in the prompt or output matched what it drafts from"
    drafted = _idle_run(target, "prompt-lookup", FixedK(4))
    assert drafted.n_drafted > 0 and drafted.idle_why == "" and "idle_why" not in drafted.to_dict()
