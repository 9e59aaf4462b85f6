"""Verifier on crafted logits and distributions, plus a seeded statistical losslessness test."""

from __future__ import annotations

import numpy as np
import pytest

from specstack.verify import matched_length, verify_greedy, verify_sampling

V = 6


def onehot_rows(ids: list[int], eps: float = 0.0) -> np.ndarray:
    p = np.full((len(ids), V), eps)
    for i, t in enumerate(ids):
        p[i, t] = 1.0
    return p / p.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("draft,truth,n", [
    ([], [1, 2], 0), ([1, 2], [], 0), ([1, 2, 3], [1, 2, 3], 3),
    ([1, 2, 3], [1, 2], 2),  # the truth ran out: matched as far as it goes
    ([1, 9, 3], [1, 2, 3], 1),  # a later match after a mismatch does not count
])
def test_matched_length_of_a_chain_is_the_common_prefix(draft, truth, n):
    assert matched_length(draft, truth) == n


def test_matched_length_of_a_tree_follows_the_branch_the_truth_takes():
    # 4 -> (7 -> 1), (9); 2: the truth 4, 9 leaves the first branch for the second.
    tokens, parents = [4, 7, 1, 9, 2], [-1, 0, 1, 0, -1]
    assert matched_length(tokens, [4, 9, 5], parents) == 2
    assert matched_length(tokens, [4, 7, 1, 8], parents) == 3
    assert matched_length(tokens, [2, 4], parents) == 1
    assert matched_length(tokens, [5], parents) == 0
    chain = [4, 7, 1]
    assert matched_length(chain, [4, 7, 3], [-1, 0, 1]) == matched_length(chain, [4, 7, 3]) == 2


def test_greedy_empty_draft_returns_the_target_token():
    r = verify_greedy([], [3])
    assert r.token_ids == (3,) and r.n_accepted == 0


def test_greedy_all_accepted_adds_bonus():
    r = verify_greedy([1, 2, 3], [1, 2, 3, 4])
    assert r.token_ids == (1, 2, 3, 4) and r.n_accepted == 3


def test_greedy_rejection_at_position_zero_recovers_target_token():
    r = verify_greedy([5, 2], [1, 2, 3])
    assert r.token_ids == (1,) and r.n_accepted == 0


def test_greedy_stops_at_first_mismatch_even_if_later_tokens_match():
    # Position 2 matches, but it was conditioned on a rejected token.
    r = verify_greedy([1, 9, 3], [1, 2, 3, 4])
    assert r.token_ids == (1, 2) and r.n_accepted == 1


def test_sampling_deterministic_draft_accepted_when_target_is_certain():
    rng = np.random.default_rng(0)
    r = verify_sampling([2, 4], None, onehot_rows([2, 4, 1]), rng)
    assert r.token_ids == (2, 4, 1) and r.n_accepted == 2


def test_sampling_rejects_token_the_target_excludes_and_recovers_from_p():
    # q = None is a point mass at the draft token; p gives it zero mass.
    rng = np.random.default_rng(0)
    p = onehot_rows([3, 0])
    r = verify_sampling([1], None, p, rng)
    assert r.token_ids == (3,) and r.n_accepted == 0


def test_sampling_q_zero_for_proposed_token_is_accepted_only_inside_p_support():
    rng = np.random.default_rng(0)
    q = np.zeros((1, V))
    q[0, 0] = 1.0  # the draft claims it would never propose token 2
    p = onehot_rows([2, 5])
    r = verify_sampling([2], q, p, rng)
    assert r.token_ids == (2, 5) and r.n_accepted == 1


def test_sampling_empty_draft_samples_one_token_from_p():
    rng = np.random.default_rng(1)
    r = verify_sampling([], None, onehot_rows([4]), rng)
    assert r.token_ids == (4,) and r.n_accepted == 0


def test_sampling_rejects_row_count_mismatch():
    with pytest.raises(ValueError):
        verify_sampling([1, 2], None, onehot_rows([1, 2]), np.random.default_rng(0))


def _committed_marginals(q_mode: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Empirical distribution of committed tokens 1 and 2 over n verifications.

    The crafted target's conditionals do not depend on context, so under
    lossless verification token 1 ~ p[0] and token 2 (when present) ~ p[1].
    """
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V), size=3)
    q = rng.dirichlet(np.ones(V) * 0.5, size=2)
    q[:, 0] = 0.0  # a token the draft never proposes but the target likes
    q /= q.sum(axis=1, keepdims=True)
    first = np.zeros(V)
    second = np.zeros(V)
    for _ in range(n):
        if q_mode == "q":
            draft = [int(rng.choice(V, p=q[0])), int(rng.choice(V, p=q[1]))]
            r = verify_sampling(draft, q, p, rng)
        else:  # deterministic draft: always the same tokens
            r = verify_sampling([1, 2], None, p, rng)
        first[r.token_ids[0]] += 1
        if len(r.token_ids) > 1:
            second[r.token_ids[1]] += 1
    return first / first.sum(), second / second.sum(), p[0], p[1]


@pytest.mark.parametrize("q_mode", ["q", "point-mass"])
def test_rejection_sampling_reproduces_target_distribution(q_mode):
    first, second, p0, p1 = _committed_marginals(q_mode, 20000, seed=7)
    # Total variation bound: with 20k draws the sampling error is ~0.01.
    assert 0.5 * np.abs(first - p0).sum() < 0.02
    assert 0.5 * np.abs(second - p1).sum() < 0.03


def test_rejection_sampling_is_deterministic_under_a_seed():
    a = _committed_marginals("q", 500, seed=3)
    b = _committed_marginals("q", 500, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
