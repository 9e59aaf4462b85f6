"""Sampled speculative output follows the target's distribution, tested with enough power to see a
small bias: 6,000 draws per drafter, the first two draft positions, top-p and min-p, a point-mass drafter
(prompt lookup) and a draft model that returns q.  A chi-square test at p = 1e-4 against the
target's own probabilities; with 3,000 draws it detects a total-variation bias of 0.03 (the second draft
position is tested on the draws that share their first two tokens, about 2,000 of the 6,000 here)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from specstack.draft_length import FixedK
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.sampling import SamplingParams, target_probs

N = 6000
SAMPLING = dict(temperature=0.9, top_p=0.9, min_p=0.05)
PROMPT = "import os\nimport sys\nimport os\nimport sys\nimport os\n"


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_ok(counts: Counter, p: np.ndarray, n: int) -> tuple[bool, float, float]:
    support = [t for t in np.flatnonzero(p > 0)]
    assert set(counts) <= set(int(t) for t in support), "a token outside the target's support was sampled"
    cells = [(counts.get(int(t), 0), n * p[t]) for t in support]
    big = [(o, e) for o, e in cells if e >= 5]
    small = [(o, e) for o, e in cells if e < 5]
    if small:
        big.append((sum(o for o, _ in small), sum(e for _, e in small)))
    stat = sum((o - e) ** 2 / e for o, e in big if e > 0)
    crit = chi2_critical(max(len(big) - 1, 1))
    return stat < crit, stat, crit


def probs_after(target, ids) -> np.ndarray:
    target.reset()
    p = target_probs(target.eval(ids, logits_from=len(ids) - 1).copy(), SamplingParams(**SAMPLING))[0]
    target.reset()
    return p


@pytest.mark.parametrize("name", ["prompt-lookup", "draft-model"])
def test_two_positions_follow_the_target_distribution(target, name):
    """The first token comes from a plain step (``Engine._budgets``); the first verification step drafts from
    the second token on, so its first two draft positions are the generation's positions 2 and 3, tested
    given the most frequent tokens before them."""
    ids = target.tokenize(PROMPT)
    p1 = probs_after(target, ids)
    drafter = create(name, BuildContext(target, options={"seed": 3}, temperature=SAMPLING["temperature"]))
    engine = Engine(target, drafter, FixedK(3))
    firsts, seconds, thirds, drafted = Counter(), {}, {}, 0
    for seed in range(N):
        gen = engine.generate(ids, GenerationConfig(max_tokens=5, sampling=SamplingParams(**SAMPLING, seed=seed))).run()
        a, b, c = gen.output_ids[:3]
        firsts[a] += 1
        seconds.setdefault(a, Counter())[b] += 1
        thirds.setdefault((a, b), Counter())[c] += 1
        drafted += gen.stats.n_drafted
    assert drafted > N  # speculation really happened (and was verified) in most draws
    ok, stat, crit = chi2_ok(firsts, p1, N)
    assert ok, f"{name}: first token chi2 {stat:.1f} >= {crit:.1f}"
    top = firsts.most_common(1)[0][0]
    p2 = probs_after(target, ids + [top])
    ok, stat, crit = chi2_ok(seconds[top], p2, firsts[top])
    assert ok, f"{name}: second token (after {top}) chi2 {stat:.1f} >= {crit:.1f}"
    pair = max(thirds, key=lambda k: sum(thirds[k].values()))
    assert sum(thirds[pair].values()) > N // 4, "too few draws share their first two tokens for a test with power"
    p3 = probs_after(target, ids + list(pair))
    ok, stat, crit = chi2_ok(thirds[pair], p3, sum(thirds[pair].values()))
    assert ok, f"{name}: third token (after {pair}) chi2 {stat:.1f} >= {crit:.1f}"
