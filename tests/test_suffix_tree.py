"""The suffix tree (specstack.retrieval.suffix_tree, suffix_match, suffix_draft) against a brute-force reference.

Small alphabets make matches, repeats and ties common, which is where counting
and compression go wrong.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specstack.errors import SpecstackError
from specstack.retrieval.suffix_draft import propose, propose_tree
from specstack.retrieval.suffix_match import SuffixMatcher
from specstack.retrieval.suffix_tree import SuffixTree

# --- the reference: counts by scanning, drafts by definition ---------------------------


def occurrences(seqs: list[list[int]], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(1 for s in seqs for i in range(len(s) - n + 1) if s[i : i + n] == pattern)


def ref_path(seqs, depth, context, m, cap, min_prob):
    """Greedy draft after context[-m:]: most frequent next token (smallest on ties)."""
    path = list(context[len(context) - m :])
    toks, probs, p = [], [], 1.0
    while len(toks) < cap and len(path) < depth:
        total = occurrences(seqs, path)
        nxt = {t: occurrences(seqs, path + [t]) for t in {x for s in seqs for x in s}}
        nxt = {t: c for t, c in nxt.items() if c}
        if not nxt:
            break
        t = max(nxt, key=lambda t: (nxt[t], -t))
        if nxt[t] != total:  # a ratio of 1 leaves p untouched, as inside a tree label
            p = p * nxt[t] / total
        if p < min_prob:
            break
        toks.append(t)
        probs.append(p)
        path.append(t)
    # Sum runs of equal p as p * run (the tree adds one label at a time).
    score, i = 0.0, 0
    while i < len(probs):
        j = i
        while j < len(probs) and probs[j] == probs[i]:
            j += 1
        score += probs[i] * (j - i)
        i = j
    return toks, probs, score


def ref_propose(seqs, depth, context, k, factor, offset, min_prob):
    best = ((), (), 0.0, 0)
    for m in range(1, min(len(context), depth) + 1):
        if occurrences(seqs, list(context[len(context) - m :])) == 0:
            break
        cap = max(0, min(k, int(m * factor + offset + 1e-6)))
        toks, probs, score = ref_path(seqs, depth, context, m, cap, min_prob)
        if score >= best[2]:  # ArcticInference: the longer match wins ties
            best = (tuple(toks), tuple(probs), score, m)
    return best


def build(seqs: list[list[int]], depth: int) -> SuffixTree:
    tree = SuffixTree(depth)
    for i, s in enumerate(seqs):
        tree.extend(i, s)
    return tree


tokens = st.integers(0, 2)
seq_lists = st.lists(st.lists(tokens, min_size=1, max_size=30), min_size=1, max_size=4)
depths = st.integers(1, 8)


# --- counts ------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(seq_lists, depths)
def test_node_counts_equal_occurrences(seqs, depth):
    # Every node's count must be the number of occurrences of its root path,
    # and every substring up to max_depth must be found with that count.
    tree = build(seqs, depth)
    assert tree.check_integrity() == []
    for path, count in tree.structure().items():
        if path:
            assert count == occurrences(seqs, list(path)), path
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                assert tree.count(s[i:j]) == occurrences(seqs, s[i:j])
    assert tree.n_tokens == sum(map(len, seqs))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), tokens), min_size=1, max_size=60), depths)
def test_interleaved_appends_give_the_same_tree(appends, depth):
    # Several open sequences growing in turns (a server) must give the tree that
    # adding them one after another gives: the tree depends only on its contents.
    tree, seqs = SuffixTree(depth), {}
    for sid, t in appends:
        tree.append(sid, t)
        seqs.setdefault(sid, []).append(t)
    assert tree.check_integrity() == []
    assert tree.structure() == build(list(seqs.values()), depth).structure()


@settings(max_examples=150, deadline=None)
@given(seq_lists, depths, st.randoms(use_true_random=False))
def test_remove_in_any_order_matches_a_fresh_tree(seqs, depth, rnd):
    # Removal must decrement, prune and re-compress exactly, in FIFO order (the
    # drafter's) and out of order (which re-points node references).
    tree = build(seqs, depth)
    live = dict(enumerate(seqs))
    order = list(live)
    rnd.shuffle(order)
    for sid in order:
        tree.remove(sid)
        del live[sid]
        assert tree.check_integrity() == []
        fresh = SuffixTree(depth)
        for i, s in live.items():
            fresh.extend(i, s)
        assert tree.structure() == fresh.structure()
    assert tree.structure() == {(): 0}
    assert tree.n_tokens == 0


def test_remove_unknown_sequence_is_a_key_error():
    # Removing twice is a caller bug; say so rather than corrupt counts.
    tree = build([[1, 2]], 4)
    tree.remove(0)
    with pytest.raises(KeyError):
        tree.remove(0)


def test_closed_sequence_cannot_grow():
    # The global tree seals finished requests; appending to one is a bug.
    tree = build([[1, 2]], 4)
    tree.close(0)
    with pytest.raises(ValueError, match="closed"):
        tree.append(0, 3)


def test_depth_bounds_the_suffixes():
    # With max_depth=2 only substrings of length <= 2 are indexed.
    tree = build([[1, 2, 3, 1, 2, 3]], 2)
    assert tree.count([1, 2]) == 2
    assert tree.count([1, 2, 3]) == 0
    assert max(len(p) for p in tree.structure()) == 2


def test_next_counts_worked_example():
    # The example in the SuffixTree docstring.
    tree = build([[1, 2, 3, 1, 2, 4]], 64)
    assert tree.count([1, 2]) == 2
    assert tree.next_counts([1, 2]) == {3: 1, 4: 1}
    d = propose(tree, [5, 1], 3)
    assert (d.token_ids, d.probs, d.match_len) == ((2,), (1.0,), 1)


# --- proposals ---------------------------------------------------------------------------
spec_params = st.tuples(
    st.integers(1, 8),  # k
    st.sampled_from([0.5, 1.0, 2.0]),  # max_spec_factor
    st.sampled_from([0.0, 1.0]),  # max_spec_offset
    st.sampled_from([0.0, 0.1, 0.3, 0.6]),  # min_token_prob
)


@settings(max_examples=200, deadline=None)
@given(seq_lists, depths, st.lists(tokens, min_size=1, max_size=12), spec_params)
def test_propose_equals_reference(seqs, depth, context, params):
    # Same draft, probabilities, score and match length as the definition: for
    # every match length, the greedy most-frequent path under the α-cap and the
    # probability floor; best score wins, longer match on ties.
    k, factor, offset, min_prob = params
    tree = build(seqs, depth)
    d = propose(tree, context, k, factor, offset, min_prob)
    toks, probs, score, m = ref_propose(seqs, depth, context, k, factor, offset, min_prob)
    if not toks:
        assert d.token_ids == ()
        return
    assert (d.token_ids, d.probs, d.score, d.match_len) == (toks, probs, score, m)
    assert d.parents == tuple(range(-1, len(toks) - 1))


@settings(max_examples=150, deadline=None)
@given(seq_lists, depths, st.lists(tokens, min_size=1, max_size=12), spec_params)
def test_drafts_follow_the_match_in_the_text(seqs, depth, context, params):
    # Whatever is drafted must really follow context[-m:] somewhere in the indexed
    # text, within the caps, above the probability floor.
    k, factor, offset, min_prob = params
    tree = build(seqs, depth)
    d = propose(tree, context, k, factor, offset, min_prob)
    if not d.token_ids:
        return
    m = d.match_len
    assert occurrences(seqs, list(context[-m:]) + list(d.token_ids)) > 0
    assert len(d) <= min(k, int(factor * m + offset + 1e-6))
    assert all(p >= min_prob for p in d.probs)
    assert list(d.probs) == sorted(d.probs, reverse=True)


@settings(max_examples=150, deadline=None)
@given(seq_lists, depths, st.lists(tokens, min_size=1, max_size=12), spec_params)
def test_tree_drafts_are_valid_best_first_trees(seqs, depth, context, params):
    # Each tree token continues its parent's path in the text, with the path's
    # true probability, at or above the floor, within the size cap; the first
    # token is the greedy one, so a tree never scores below the path.
    k, factor, offset, min_prob = params
    tree = build(seqs, depth)
    d = propose_tree(tree, context, k, factor, offset, min_prob)
    path = propose(tree, context, k, factor, offset, min_prob)
    assert d.score >= path.score - 1e-9
    if not d.token_ids:
        return
    prefix = list(context[len(context) - d.match_len :])
    assert len(d) <= min(k, int(factor * d.match_len + offset + 1e-6))
    for i, (t, par) in enumerate(zip(d.token_ids, d.parents)):
        assert -1 <= par < i
        branch, j = [t], par
        while j >= 0:
            branch.append(d.token_ids[j])
            j = d.parents[j]
        branch = prefix + branch[::-1]
        expect = Fraction(occurrences(seqs, branch), occurrences(seqs, prefix))
        assert d.probs[i] == pytest.approx(float(expect))
        assert d.probs[i] >= min_prob
    assert len(set(zip(d.token_ids, d.parents))) == len(d)  # no duplicate siblings


@settings(max_examples=100, deadline=None)
@given(seq_lists, depths, st.lists(tokens, min_size=1, max_size=40))
def test_matcher_streams_the_same_states_as_matching_from_scratch(seqs, depth, stream):
    # The streaming matcher (global tree, O(depth) per token) must agree with a
    # from-scratch match after every token, and resync when the tree changes.
    tree = build(seqs, depth)
    matcher = SuffixMatcher(tree)
    for i, t in enumerate(stream):
        matcher.extend([t])
        assert matcher.states() == tree.match_states(stream[: i + 1])
    tree.extend(99, stream)  # the tree changes under the matcher
    assert matcher.states() == tree.match_states(stream)


def test_active_states_are_the_sequences_own_matches():
    # The request tree answers matches for its own end without walking.
    tree = build([[1, 2, 3, 1, 2]], 8)
    assert tree.active_states(0) == tree.match_states([1, 2, 3, 1, 2])


# --- persistence -------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(seq_lists, depths, st.lists(tokens, min_size=1, max_size=8))
def test_save_load_round_trip_is_exact(tmp_path_factory, seqs, depth, context):
    # Same structure, same sequence order (FIFO eviction), same drafts.
    tree = build(seqs, depth)
    tree.remove(0)
    tree.close(1) if 1 in tree else None
    path = tmp_path_factory.mktemp("st") / "tree.npz"
    tree.save(path)
    back = SuffixTree.load(path)
    assert back.structure() == tree.structure()
    assert back.seq_ids() == tree.seq_ids()
    assert [back.sequence(s) for s in back.seq_ids()] == [tree.sequence(s) for s in tree.seq_ids()]
    assert propose(back, context, 4) == propose(tree, context, 4)
    assert back.check_integrity() == []
    if 1 in back:
        with pytest.raises(ValueError):
            back.append(1, 0)  # closed stays closed


def test_load_rejects_a_file_that_is_not_a_tree(tmp_path):
    # A corrupt cache must name the file and the fix, not crash later.
    bad = tmp_path / "cache.npz"
    bad.write_bytes(b"not a zip at all")
    with pytest.raises(SpecstackError, match="cache.npz.*delete"):
        SuffixTree.load(bad)


def test_load_rejects_an_unknown_version(tmp_path):
    # A file from a future format must be refused with the version named.
    path = tmp_path / "t.npz"
    build([[1, 2, 3]], 4).save(path)
    z = dict(np.load(path))
    z["version"] = np.array(99)
    np.savez(path, **z)
    with pytest.raises(SpecstackError, match="version 99"):
        SuffixTree.load(path)


def test_load_rejects_inconsistent_arrays(tmp_path):
    # Lengths that do not add up mean a damaged file.
    path = tmp_path / "t.npz"
    build([[1, 2, 3]], 4).save(path)
    z = dict(np.load(path))
    z["seq_lengths"] = np.array([5])
    np.savez(path, **z)
    with pytest.raises(SpecstackError, match="corrupt"):
        SuffixTree.load(path)
