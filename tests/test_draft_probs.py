"""Retrieval drafters (suffix, rest) carry their per-token path probabilities in ``Draft.probs``."""

from __future__ import annotations

from specstack.retrieval.datastore import write_store
from specstack.draft_length import Budget
from specstack.drafters.base import propose_one
from specstack.drafters.rest import RestConfig, RestDrafter
from specstack.drafters.suffix import SuffixConfig, SuffixDrafter
from specstack.types import Draft


def test_suffix_chain_carries_probs_weighed_by_the_match():
    # The suffix drafter's docstring example: [3, 9] at path probability 1 each in the counts, after a 2-token
    # match seen once: each token goes on at 1 - 1/4, so the policy reads 3/4 and 9/16.
    d = SuffixDrafter()
    prompt = [7, 1, 2, 3, 9, 1, 2]
    d.begin(prompt)
    draft = propose_one(d, prompt, 8)
    assert (draft.token_ids, draft.probs, draft.parents) == ((3, 9), (0.75, 0.5625), None)


def test_a_long_copy_scores_above_a_coincidence():
    # One earlier occurrence each: a line copied after an 11-token match goes on at 12/13 a token, a 1-token
    # match at 2/3.
    line = list(range(100, 112))
    d = SuffixDrafter(SuffixConfig(max_spec_factor=4.0))
    d.begin(line + [5] + line[:-1])
    long = propose_one(d, line + [5] + line[:-1], 4)
    assert long.token_ids == (111, 5, 100, 101) and long.probs[0] == 1 - 1 / 13
    d.begin([7, 3, 8, 3], seq=1)
    short = propose_one(d, [7, 3, 8, 3], 4, seq=1)
    assert short.token_ids[0] == 8 and short.probs[0] == 1 - 1 / 3


def test_suffix_tree_carries_probs_aligned_with_nodes():
    d = SuffixDrafter(SuffixConfig(max_spec_factor=4.0, tree=True))
    d.begin([0])
    d.advance([1, 3, 5, 1, 4, 6, 1, 3, 5], 0)
    t = propose_one(d, [0, 1, 3, 5, 1, 4, 6, 1, 3, 5, 9, 1], Budget(4, tree=True))
    assert t.parents is not None and t.probs is not None and len(t.probs) == len(t.token_ids)
    for i, p in enumerate(t.parents):  # a path probability never grows along the path
        assert 0 < t.probs[i] <= (1.0 if p < 0 else t.probs[p])


def test_rest_chain_and_tree_carry_probs(tmp_path):
    # [5, 6] occurs 3 times: 7 follows twice (2/3), then `5 6 7 5` once (1/3).
    write_store(tmp_path / "s", [[5, 6, 7, 5, 6, 8, 5, 6, 7]], n_vocab=10)
    d = RestDrafter(RestConfig(datastore=str(tmp_path / "s"), min_token_prob=0.0))
    chain = propose_one(d, [4, 5, 6], 2)
    assert chain.token_ids == (7, 5) and chain.probs == (2 / 3, 1 / 3)
    tree = d.propose_tree([4, 5, 6], 3, depth=2)
    assert tree.token_ids == (7, 8, 5) and tree.probs == (2 / 3, 1 / 3, 1 / 3)


def test_draft_reshaping_keeps_probs_aligned():
    # Tree 0:a -> 1:b, 0:a -> 2:c, root -> 3:d; probs name their node.
    t = Draft((10, 11, 12, 13), "x", parents=(-1, 0, 0, -1), probs=(0.9, 0.5, 0.4, 0.1))
    assert t.truncated(2).probs == (0.9, 0.5)
    chain = t.best_chain()
    assert (chain.token_ids, chain.probs) == ((10, 11), (0.9, 0.5))
    u = Draft((10, 13, 11), "x", parents=(-1, -1, 0), probs=(0.9, 0.1, 0.5))
    dfs = u.depth_first()
    assert (dfs.token_ids, dfs.parents, dfs.probs) == ((10, 11, 13), (-1, 0, -1), (0.9, 0.5, 0.1))
    plain = Draft((1, 2), "x")
    assert plain.truncated(1).probs is None and plain.best_chain().probs is None
