"""prompt-lookup on literal token lists, one behaviour per test."""

from __future__ import annotations

from specstack.drafters.base import propose_one

import pytest

from specstack.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
from specstack.errors import InvalidParameterError


def drafter(prompt, n_min=1, n_max=3):
    d = PromptLookupDrafter(PromptLookupConfig(n_min=n_min, n_max=n_max))
    d.begin(prompt)
    return d


def test_copies_what_followed_the_matching_suffix():
    d = drafter([1, 2, 3, 9, 1, 2])
    assert propose_one(d, [], 4).token_ids == (3, 9, 1, 2)


def test_caps_draft_at_k():
    d = drafter([1, 2, 3, 9, 1, 2])
    assert propose_one(d, [], 2).token_ids == (3, 9)


def test_prefers_longest_match_over_more_recent_shorter_one():
    # Suffix (7, 8) matched at the start; the lone 8 is also followed by 5 later.
    d = drafter([7, 8, 1, 8, 5, 7, 8])
    assert propose_one(d, [], 1).token_ids == (1,)


def test_prefers_most_recent_of_equal_length_matches():
    d = drafter([4, 1, 4, 2, 4])
    assert propose_one(d, [], 1).token_ids == (2,)


def test_no_match_gives_empty_draft():
    d = drafter([1, 2, 3])
    assert len(propose_one(d, [], 4)) == 0


def test_respects_n_min():
    # Only a 1-gram matches; with n_min=2 that is not enough.
    d = drafter([5, 6, 7, 5], n_min=2)
    assert len(propose_one(d, [], 4)) == 0


def test_observe_extends_the_index_incrementally():
    d = drafter([1, 2, 3])
    d.advance([4, 1, 2], n_accepted=0)
    assert propose_one(d, [], 3).token_ids == (3, 4, 1)


def test_begin_resets_previous_request():
    d = drafter([1, 2, 1])
    d.begin([3, 4])
    assert len(propose_one(d, [], 2)) == 0


def test_invalid_config_is_refused():
    with pytest.raises(InvalidParameterError):
        PromptLookupConfig(n_min=3, n_max=2)
