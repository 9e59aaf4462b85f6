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


# -- copying through the answer's edits (retrieval.rewrites) ------------------------------------------------------

DOC = [20, 21, 5, 1, 7, 8, 6, 1, 3, 4, 22, 23, 24]  # a document that uses the name 1 twice
ASK = [30, 31]  # the request after it; the answer starts copying the document


def copying(doc=DOC):
    d = drafter(doc + ASK + doc[:3], n_min=1, n_max=4)
    assert propose_one(d, [], 4).token_ids == tuple(doc[3:7])  # a 3-token match starts the copy
    return d


def test_a_rename_made_once_is_drafted_at_the_later_occurrences():
    d = copying()
    d.advance([9], n_accepted=0)  # the answer renames 1 to 9: the copy breaks
    d.advance([7, 8, 6], n_accepted=0)  # and goes on as the document does
    # The next match takes the document up again one token past the break: 1 -> 9 is learnt and applied.
    assert propose_one(d, [], 4).token_ids == (9, 3, 4, 22)
    d.advance([9, 3], n_accepted=2)
    assert propose_one(d, [], 2).token_ids == (4, 22)  # the cursor stepped over the rewrite


def test_a_rewrite_of_one_token_into_several_is_followed_token_by_token():
    d = copying()
    d.advance([9, 10, 11], n_accepted=0)
    d.advance([7, 8, 6], n_accepted=0)
    assert propose_one(d, [], 5).token_ids == (9, 10, 11, 3, 4)
    d.advance([9, 10], n_accepted=2)  # partly through the rewrite
    assert propose_one(d, [], 3).token_ids == (11, 3, 4)
    context = d._seqs[0].index.tokens + [11, 3]
    assert propose_one(d, context, 1).token_ids == (4,)  # after a draft that follows the copy, too


def test_a_rewrite_the_answer_does_not_make_again_is_forgotten_and_the_copy_goes_on():
    d = copying()
    d.advance([9, 7, 8, 6], n_accepted=0)
    assert propose_one(d, [], 1).token_ids == (9,)
    d.advance([1], n_accepted=0)  # this time the answer keeps the document's 1
    assert propose_one(d, [], 3).token_ids == (3, 4, 22)
    assert len(d._seqs[0].rewrites) == 0


def test_a_break_far_from_where_the_document_resumes_teaches_nothing():
    doc = [20, 21, 5, 1, 7, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 8, 6, 3, 4, 1, 22]
    d = copying(doc)
    d.advance([9, 8, 6, 3], n_accepted=0)  # the answer skipped 10 tokens of the document: not an edit's span
    assert propose_one(d, [], 3).token_ids == (4, 1, 22)
    assert len(d._seqs[0].rewrites) == 0


def test_rewrites_apply_to_copies_of_the_prompt_not_of_the_answer():
    d = copying()
    d.advance([9, 7, 8, 6], n_accepted=0)
    assert propose_one(d, [], 1).token_ids == (9,)  # the rename 1 -> 9 is learnt
    d.advance([50, 51, 52, 1, 53, 54], n_accepted=0)  # text of the answer's own, with a 1 in it
    d.advance([50, 51, 52], n_accepted=0)  # repeated: the copy of the answer keeps its 1
    assert propose_one(d, [], 3).token_ids == (1, 53, 54)
