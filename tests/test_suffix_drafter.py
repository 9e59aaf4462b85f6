"""The suffix drafter (specstack.drafters.suffix): one behaviour per test, on literal tokens."""

from __future__ import annotations

from specstack.draft_length import Budget
from specstack.drafters.base import propose_one

import pytest

from specstack.drafters.base import BuildContext, create
from specstack.drafters.suffix import SuffixConfig, SuffixDrafter
from specstack.errors import InvalidParameterError, SpecstackError


def run_request(d: SuffixDrafter, prompt: list[int], output: list[int]) -> None:
    """One whole generation, committing ``output`` one token at a time."""
    d.begin(prompt)
    for t in output:
        d.advance([t], 0)
    d.end()


def test_docstring_example_request_tree():
    # `1, 2` was seen once before, followed by `3, 9`: m=2 allows 2 tokens, each at p = 1, since
    # the current occurrence (the context's own end, no continuation yet) is no evidence against it.
    d = SuffixDrafter()
    prompt = [7, 1, 2, 3, 9, 1, 2]
    d.begin(prompt)
    s = d.propose_chain(prompt, 8)
    assert (s.token_ids, s.probs, s.match_len) == ((3, 9), (1.0, 1.0), 2)
    assert propose_one(d, prompt, 8).token_ids == (3, 9)


def test_the_open_end_is_left_out_of_the_first_branch_only():
    # `1, 2` went on as `3, 4` once and `3, 5` once before the context's own `1, 2`: the first token is
    # certain (2 of 2 earlier occurrences), the second a coin (1 of 2), as a closed sequence would count.
    d = SuffixDrafter()
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    d.begin(prompt)
    s = d.propose_chain(prompt, 8)
    assert (s.token_ids, s.probs) == ((3, 4), (1.0, 0.5))
    # A context that is not the generation's (matched from scratch, its end not in the tree) has no open
    # end: both earlier occurrences of `1, 2` count, one went on as 3, one as 4.
    d.begin([1, 2, 3, 1, 2, 4], seq=1)
    assert d.propose_chain([1, 2, 3, 1, 2, 4, 1, 2], 8, seq=1).probs[0] == 0.5


def test_docstring_example_global_tree_loses_to_the_request_tree():
    # Earlier outputs went on from `1, 2` as `3, 9, 4` and as `5`: the global tree's draft has p = 1/2
    # and loses to the request tree's p = 1.
    d = SuffixDrafter()
    run_request(d, [5], [1, 2, 3, 9, 4])
    run_request(d, [6], [1, 2, 5])
    prompt = [7, 1, 2, 3, 9, 1, 2]
    d.begin(prompt)
    s = d.propose_chain(prompt, 8)
    assert (s.token_ids, s.probs) == ((3, 9), (1.0, 1.0))
    assert d.global_tree.next_counts([1, 2]) == {3: 1, 5: 1}


def test_global_tree_wins_with_a_longer_match():
    # The global tree matches `7, 1, 2` (m=3, three tokens allowed) where the request tree matches only
    # `1, 2` (two): the longer draft scores higher.
    d = SuffixDrafter()
    run_request(d, [5], [7, 1, 2, 3, 9, 4])
    prompt = [8, 1, 2, 3, 7, 1, 2]
    d.begin(prompt)
    s = d.propose_chain(prompt, 8)
    assert (s.token_ids, s.probs, s.match_len) == ((3, 9, 4), (1.0, 1.0, 1.0), 3)


def test_draft_is_deterministic_and_tagged():
    # Suffix drafts are point masses (q=None) from source "suffix".
    d = SuffixDrafter()
    d.begin([1, 2, 3, 1, 2])
    draft = propose_one(d, [1, 2, 3, 1, 2], 4)
    assert draft.source == "suffix" and draft.q is None and draft.parents is None
    assert draft.token_ids == (3, 1)


def test_nothing_to_draft_gives_an_empty_draft():
    # A context whose last token never appeared before has no match worth drafting.
    d = SuffixDrafter()
    d.begin([1, 2, 3, 4])
    assert propose_one(d, [1, 2, 3, 4], 8).token_ids == ()


def test_max_tokens_caps_the_draft():
    # k is a hard cap even when the match allows more.
    d = SuffixDrafter()
    run_request(d, [0], list(range(10, 30)))
    ctx = [0] + list(range(10, 20))
    d.begin(ctx)
    assert propose_one(d, ctx, 3).token_ids == (20, 21, 22)
    assert propose_one(d, ctx, 0).token_ids == ()


def test_spec_factor_caps_draft_by_match_length():
    # With α = 1 a one-token match may draft only one token; α = 3 allows three.
    ctx = [9, 5]  # only `5` matches the history
    for factor, expect in ((1.0, (6,)), (3.0, (6, 7, 8))):
        d = SuffixDrafter(SuffixConfig(max_spec_factor=factor))
        run_request(d, [0], [5, 6, 7, 8, 4])
        d.begin(ctx)
        assert propose_one(d, ctx, 8).token_ids == expect


def test_spec_offset_adds_to_the_cap():
    # offset 2 lets a one-token match draft 1 * 1.0 + 2 = 3 tokens.
    d = SuffixDrafter(SuffixConfig(max_spec_offset=2.0))
    run_request(d, [0], [5, 6, 7, 8, 4])
    d.begin([9, 5])
    assert propose_one(d, [9, 5], 8).token_ids == (6, 7, 8)


def test_min_token_prob_stops_at_uncertain_branches():
    # After `1, 2` came 3 (twice) and 4 (twice): p(3) = 2/4 passes a 0.4 floor,
    # then `5` after `1 2 3` is certain; with a 0.6 floor nothing is drafted.
    history = [1, 2, 3, 5, 1, 2, 4, 1, 2, 3, 5, 1, 2, 4]
    for floor, expect in ((0.4, (3, 5)), (0.6, ())):
        d = SuffixDrafter(SuffixConfig(min_token_prob=floor))
        run_request(d, [0], history)
        d.begin([8, 1, 2])
        assert propose_one(d, [8, 1, 2], 2).token_ids == expect


def test_observe_feeds_the_request_tree():
    # Output tokens become matchable as soon as they are observed.
    d = SuffixDrafter()
    d.begin([0])
    d.advance([4, 5, 6], 0)
    d.advance([4, 5], 0)
    assert propose_one(d, [0, 4, 5, 6, 4, 5], 8).token_ids == (6, 4)


def test_context_out_of_step_with_observe_is_matched_from_scratch():
    # If the engine proposes on a context it never reported (or rolled back),
    # the draft must still continue *that* context.
    d = SuffixDrafter()
    d.begin([1, 2, 3, 4, 1, 2, 3, 4])
    assert propose_one(d, [1, 2, 3, 4, 1, 2], 2).token_ids == (3, 4)


def test_prompts_and_outputs_go_to_the_global_tree_unless_outputs_only():
    # By default a request is filed whole (a repeated prompt then drafts its old
    # output from the first step); global_prompts=False is ArcticInference's outputs-only cache.
    d = SuffixDrafter()
    run_request(d, [1, 2, 3], [4, 5, 6])
    assert d.global_tree.count([1, 2, 3, 4, 5, 6]) == 1
    d.begin([7, 2, 3])
    assert propose_one(d, [7, 2, 3], 8).token_ids == (4, 5)  # match [2, 3] (m=2, alpha=1)
    d = SuffixDrafter(SuffixConfig(global_prompts=False))
    run_request(d, [1, 2, 3], [4, 5, 6])
    assert d.global_tree.count([4, 5, 6]) == 1 and d.global_tree.count([1, 2]) == 0


def test_global_tree_persists_across_requests():
    # The point of the global tree: a second request can draft what the first output.
    d = SuffixDrafter()
    run_request(d, [0], [3, 4, 5, 6])
    d.begin([9, 3, 4])
    assert propose_one(d, [9, 3, 4], 8).token_ids == (5, 6)


def test_global_matches_follow_observed_tokens():
    # The global tree is matched by streaming committed tokens; the match must
    # move with every observe, not stay where the prompt left it.
    d = SuffixDrafter()
    run_request(d, [0], [3, 4, 5, 6])
    d.begin([9])
    d.advance([3], 1)
    d.advance([4], 0)
    assert propose_one(d, [9, 3, 4], 8).token_ids == (5, 6)


def test_request_tree_wins_ties():
    # Equal scores: the request's own text is preferred (it is this generation's).
    # Both trees have seen `5` once before, followed by 6 here and by 7 there: p = 1 each.
    d = SuffixDrafter()
    run_request(d, [0], [5, 7])
    d.begin([5, 6, 5])
    s = d.propose_chain([5, 6, 5], 1)
    assert (s.token_ids, s.probs) == ((6,), (1.0,))


def test_global_budget_evicts_oldest_requests_first():
    # Memory bound: the global tree never holds more than the budget, and FIFO
    # eviction drops the oldest outputs first.
    d = SuffixDrafter(SuffixConfig(global_budget_tokens=10))
    for r in range(6):
        run_request(d, [0], [100 + r] * 4)
        assert d.global_tree.n_tokens <= 10
    assert d.global_tree.count([105]) == 4 and d.global_tree.count([104]) == 4
    assert d.global_tree.count([103]) == 0
    assert d.global_tree.check_integrity() == []


def test_request_longer_than_the_budget_keeps_its_end():
    # One huge output must not blow the budget.
    d = SuffixDrafter(SuffixConfig(global_budget_tokens=3))
    run_request(d, [0], [1, 2, 3, 4, 5])
    assert d.global_tree.n_tokens == 3 and d.global_tree.count([3, 4, 5]) == 1


def test_zero_budget_turns_the_global_tree_off():
    d = SuffixDrafter(SuffixConfig(global_budget_tokens=0))
    run_request(d, [0], [1, 2, 3])
    assert d.global_tree.n_tokens == 0


def test_save_and_load_round_trip_exactly(tmp_path):
    # A restored drafter holds the same tree, evicts in the same order, drafts the same.
    d = SuffixDrafter()
    for r in range(4):
        run_request(d, [0], [1, 2, 3 + r, 1, 2, 3])
    d.save(tmp_path / "g.npz")
    e = SuffixDrafter()
    e.load(tmp_path / "g.npz")
    assert e.global_tree.structure() == d.global_tree.structure()
    assert e.global_tree.seq_ids() == d.global_tree.seq_ids()
    for x in (d, e):
        x.begin([9, 1, 2])
    assert e.propose_chain([9, 1, 2], 4) == d.propose_chain([9, 1, 2], 4)


def test_cache_path_loads_at_start_and_saves_at_end(tmp_path):
    # A cache file carries the global tree across processes.
    cfg = SuffixConfig(cache_path=str(tmp_path / "suffix.npz"))
    run_request(SuffixDrafter(cfg), [0], [3, 4, 5, 6])
    d = SuffixDrafter(cfg)
    d.begin([9, 3, 4])
    assert propose_one(d, [9, 3, 4], 8).token_ids == (5, 6)


def test_corrupt_cache_is_a_clear_error(tmp_path):
    # A damaged cache names the file and how to fix it.
    bad = tmp_path / "suffix.npz"
    bad.write_text("garbage")
    with pytest.raises(SpecstackError, match=r"suffix\.npz.*delete"):
        SuffixDrafter(SuffixConfig(cache_path=str(bad)))


def test_propose_tree_has_parents():
    # The tree draft keeps both continuations of `1` (3 and 4) as siblings.
    d = SuffixDrafter(SuffixConfig(max_spec_factor=4.0, tree=True))
    run_request(d, [0], [1, 3, 5, 1, 4, 6, 1, 3, 5])
    d.begin([9, 1])
    assert propose_one(d, [9, 1], 4).parents is None  # a budget without trees gets a chain
    t = propose_one(d, [9, 1], Budget(4, tree=True))
    assert t.parents is not None and t.parents[0] == -1
    assert set(t.token_ids) >= {3, 4}
    assert sum(p == -1 for p in t.parents) == 2


def test_propose_before_begin_is_empty():
    # The engine may ask before a generation starts; never crash.
    assert propose_one(SuffixDrafter(), [1, 2], 4).token_ids == ()


@pytest.mark.parametrize(
    "field, value",
    [("max_depth", 0), ("max_spec_factor", -1.0), ("min_token_prob", 1.5), ("global_budget_tokens", -1)],
)
def test_invalid_config_is_rejected(field, value):
    with pytest.raises(InvalidParameterError, match=field):
        SuffixConfig(**{field: value})


def test_registered_as_suffix_and_built_from_options():
    # The CLI builds drafters by name from flag values; unrelated options are ignored.
    d = create("suffix", BuildContext(target=None, options={"max_depth": 8, "n_min": 2, "min_token_prob": None}))
    assert isinstance(d, SuffixDrafter)
    assert d.config.max_depth == 8 and d.config.min_token_prob == 0.1
