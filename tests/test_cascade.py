"""The cascade's choice between sources, on scripted sources (no model needed).

The real-pair losslessness of cascades is in test_equivalence_retrieval.py;
here the selection rule itself is pinned down: order and min_len decide
when to stop asking, expected value decides among short drafts, and every
source learns from every step.
"""

from __future__ import annotations

from typing import Sequence

import pytest

from specstack.drafters.base import DraftRequest, propose_one
from specstack.drafters.cascade import CascadeConfig, CascadeDrafter, _outcome
from specstack.errors import InvalidParameterError
from specstack.types import Draft


class Scripted:
    """A source that proposes a fixed draft (truncated to the budget) and records what it saw."""

    def __init__(self, name: str, tokens: Sequence[int]) -> None:
        self.name = name
        self.tokens = tuple(tokens)
        self.asked = 0
        self.observed: list[list[int]] = []

    def begin(self, prompt_ids: Sequence[int], seq: int = 0) -> None:
        pass

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        self.asked += len(requests)
        return [Draft(self.tokens[: r.budget.max_tokens], self.name) for r in requests]

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0) -> None:
        self.observed.append(list(new_ids))

    def end(self, seq: int = 0, complete: bool = True) -> None:
        pass


def cascade(*sources: Scripted, min_len: int = 3) -> CascadeDrafter:
    return CascadeDrafter(list(sources), CascadeConfig(tuple(s.name for s in sources), min_len))


def test_first_long_enough_draft_stops_the_cascade():
    a, b = Scripted("a", [1, 2, 3]), Scripted("b", [4, 5, 6, 7])
    c = cascade(a, b)
    assert propose_one(c, [0], 8).source == "a"
    assert b.asked == 0  # later (costlier) sources are not asked


def test_a_source_the_budget_skips_is_not_asked():
    """The cost policy skips a model source whose call would not pay (``Budget.skip``) in a step that looks at a
    scored one: the cascade passes over it, short first draft or not, and asks the sources after it."""
    from specstack.draft_length import Budget

    a, b, c = Scripted("a", [1]), Scripted("b", [4, 5, 6, 7]), Scripted("c", [8, 9, 10])
    drafter = cascade(a, b, c)
    draft = propose_one(drafter, [0], Budget(8, skip=frozenset({"b"})))
    assert (a.asked, b.asked, c.asked) == (1, 0, 1) and draft.source in ("a", "c")
    propose_one(drafter, [0], Budget(8))
    assert b.asked == 1  # not skipped: asked as before


def test_a_later_source_replaces_a_short_first_draft_only_when_worth_more():
    a, b = Scripted("a", [1]), Scripted("b", [4, 5, 6, 7])
    c = cascade(a, b)
    for _ in range(30):  # the target follows b
        propose_one(c, [0], 8)
        c.advance([4, 5, 6, 7, 8], 4)
    assert propose_one(c, [0], 8).token_ids == (4, 5, 6, 7)
    assert a.asked == b.asked == 31
    for _ in range(60):  # now it follows a
        propose_one(c, [0], 8)
        c.advance([1, 2], 1)
    assert propose_one(c, [0], 8).token_ids == (1,)


def test_a_reliable_short_draft_beats_an_unreliable_long_one():
    a, b = Scripted("a", [1, 2]), Scripted("b", [4, 5, 6])
    c = cascade(a, b, min_len=4)
    for _ in range(30):  # the target keeps following a and never b
        propose_one(c, [0], 8)
        c.advance([1, 2, 9], 2)
    assert propose_one(c, [0], 8).source == "a"
    cond_b = c._own_book.conditional("b")
    assert cond_b[0] < 0.1  # b learnt from steps it did not win
    assert c._own_book.conditional("a")[0] > 0.9


def test_every_source_observes_every_step():
    a, b = Scripted("a", [1, 2, 3]), Scripted("b", [4])
    c = cascade(a, b)
    propose_one(c, [0], 4)
    c.advance([1, 2, 7], 2)
    assert a.observed == b.observed == [[1, 2, 7]]


def test_nothing_drafted_gives_an_empty_draft():
    c = cascade(Scripted("a", []), Scripted("b", []))
    draft = propose_one(c, [0], 4)
    assert len(draft) == 0 and draft.source.startswith("cascade")


@pytest.mark.parametrize(
    "draft, committed, expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], (3, 3)),  # all accepted, bonus after
        ([1, 2, 3], [1, 5], (2, 1)),  # rejected at position 1
        ([1, 2, 3], [9], (1, 0)),  # rejected at once
        ([1, 2, 3], [1, 2], (2, 2)),  # committed ran out: position 2 unknown
    ],
)
def test_counterfactual_outcome(draft, committed, expected):
    assert _outcome(draft, committed) == expected


def test_config_errors_name_the_fix():
    with pytest.raises(InvalidParameterError, match="twice"):
        CascadeConfig(("suffix", "suffix"))
    with pytest.raises(InvalidParameterError, match="min_len"):
        CascadeConfig(("suffix",), min_len=0)


@pytest.mark.parametrize("options,min_len", [({}, 3), ({"cascade_min_len": 2}, 2), ({"cascade_min_len": None}, 3)])
def test_cascade_min_len_option_sets_the_config_field(options, min_len):
    # The option is called cascade_min_len (one namespace for every drafter); the field is min_len.
    from specstack.drafters import BuildContext, create

    c = create("cascade:prompt-lookup,suffix", BuildContext(target=None, options=options))
    assert c.config.min_len == min_len
    assert c.config.sources == ("prompt-lookup", "suffix")


def test_a_later_source_that_keeps_failing_is_dropped():
    """Every verified token costs something, so a source that is never right loses to a plain step."""
    a, b = Scripted("a", []), Scripted("b", [4, 5, 6])
    c = cascade(a, b)
    assert len(propose_one(c, [0], 8)) > 0  # no history yet: worth a try
    for _ in range(30):
        propose_one(c, [0], 8)
        c.advance([9], 0)
    assert propose_one(c, [0], 8).token_ids == ()


def test_a_later_draft_is_cut_to_its_most_valuable_length():
    a, b = Scripted("a", []), Scripted("b", [4, 5, 6, 7, 8, 9])
    c = cascade(a, b)
    for _ in range(40):  # b is right for two tokens, then wrong
        propose_one(c, [0], 8)
        c.advance([4, 5, 1], 2)
    assert propose_one(c, [0], 8).token_ids == (4, 5)
