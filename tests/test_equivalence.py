"""Losslessness on the real bundled pair: speculative greedy output == plain greedy output.

Each speculative run must also have accepted draft tokens, so a drafter that
never drafts cannot pass.  Prompts are cut from the models' held-out files.
"""

from __future__ import annotations

import pytest

from specstack.draft_length import FixedK
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.sampling import SamplingParams

from specstack.prompts import held_out_prompts

PROMPTS = held_out_prompts(12)
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def plain_outputs(target):
    engine = Engine(target, create("none", BuildContext(target)))
    return [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)).run().output_ids for p in PROMPTS]


@pytest.mark.parametrize("name,k", [("prompt-lookup", 4), ("prompt-lookup", 8), ("draft-model", 4), ("draft-model", 2)])
def test_greedy_speculation_equals_plain_decoding(target, plain_outputs, name, k):
    engine = Engine(target, create(name, BuildContext(target)))
    for prompt, expected in zip(PROMPTS, plain_outputs):
        gen = engine.generate(prompt, GenerationConfig(max_tokens=MAX_TOKENS), policy=FixedK(k)).run()
        assert gen.output_ids == expected, f"{name} k={k} diverged on prompt {prompt[:60]!r}"
        # Per prompt: a prompt with nothing accepted would prove nothing about verification.
        assert gen.stats.n_accepted > 0, f"{name} k={k}: nothing accepted on {prompt[:60]!r}"


def test_draft_model_with_p_min_still_lossless(target, plain_outputs):
    engine = Engine(target, create("draft-model", BuildContext(target, options={"p_min": 0.5})))
    gens = [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS), policy=FixedK(8)).run() for p in PROMPTS[:4]]
    assert [g.output_ids for g in gens] == plain_outputs[:4]
    assert sum(g.stats.n_accepted for g in gens) > 0


@pytest.mark.parametrize("name", ["none", "prompt-lookup", "draft-model"])
def test_sampled_output_is_reproducible_with_a_seed(target, name):
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234)
    opts = {"seed": 1234}
    runs = []
    for _ in range(2):
        engine = Engine(target, create(name, BuildContext(target, options=opts, temperature=0.8)))
        runs.append(engine.generate(PROMPTS[1], GenerationConfig(max_tokens=48, sampling=sampling)).run())
    assert runs[0].output_ids == runs[1].output_ids
    if name != "none":
        assert runs[0].stats.n_drafted > 0


def test_a_seeded_run_samples_the_same_text_with_every_deterministic_drafter(target):
    """Each position is sampled at its own seeded uniform, and a deterministic draft token is accepted when it
    is the token drawn there: so a seeded run's text does not depend on the drafter (exact shapes here, so p is
    the same), and the drafters really did draft and get tokens accepted."""
    from specstack.draft_length import FixedK

    sampling = SamplingParams(temperature=0.9, top_k=40, seed=7)
    config = GenerationConfig(max_tokens=48, sampling=sampling)
    texts, accepted = {}, {}
    for name, opts in [("none", {}), ("prompt-lookup", {}), ("suffix", {}), ("draft-model", {"draft_temp": 0.0})]:
        engine = Engine(target, create(name, BuildContext(target, options=opts, temperature=0.9)), FixedK(4))
        runs = [engine.generate(p, config).run() for p in PROMPTS[:4]]
        texts[name] = [g.output_ids for g in runs]
        accepted[name] = sum(g.stats.n_accepted for g in runs)
    assert texts["prompt-lookup"] == texts["suffix"] == texts["draft-model"] == texts["none"]
    assert all(accepted[name] > 0 for name in ("prompt-lookup", "suffix", "draft-model"))


def test_draft_model_sampling_returns_q_and_gets_accepted(target):
    import numpy as np

    from specstack.drafters.base import propose_one

    sampling = SamplingParams(temperature=1.0, seed=5)
    drafter = create("draft-model", BuildContext(target, options={"seed": 5}, temperature=1.0))
    ids = target.tokenize(PROMPTS[0])
    drafter.begin(ids)
    draft = propose_one(drafter, ids, 4)
    assert draft.q is not None and draft.q.shape == (len(draft), target.n_vocab)
    assert np.allclose(draft.q.sum(axis=1), 1.0)  # each row is the distribution its token was sampled from
    assert all(draft.q[i, t] > 0 for i, t in enumerate(draft.token_ids))
    drafter.end(0)
    engine = Engine(target, drafter)
    gen = engine.generate(PROMPTS[0], GenerationConfig(max_tokens=64, sampling=sampling)).run()
    assert gen.stats.n_accepted > 0


@pytest.mark.parametrize("policy", ["cost", "window", "heuristic"])
@pytest.mark.parametrize("name", ["prompt-lookup", "draft-model"])
def test_every_k_policy_is_lossless(target, plain_outputs, name, policy):
    from specstack.draft_length.costs import CostModel
    from specstack.draft_length import make_policy

    costs = CostModel([1e-3 * (1 + 0.1 * n) for n in range(20)])  # cheap verification: adaptive k grows
    engine = Engine(target, create(name, BuildContext(target)), make_policy(policy, 4, costs=costs))
    gens = [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)).run() for p in PROMPTS[:4]]
    assert [g.output_ids for g in gens] == plain_outputs[:4]
    assert sum(g.stats.n_accepted for g in gens) > 0


def test_first_token_follows_target_distribution_with_a_warmer_or_colder_draft(target):
    """Rejection sampling keeps p whatever the draft temperature: compare with p computed directly."""
    import numpy as np

    from specstack.sampling import target_probs

    prompt = PROMPTS[3]
    sampling = dict(temperature=1.0, top_k=6)
    ids = target.tokenize(prompt)[:40]  # a short prompt keeps 1,200 generations cheap
    target.reset()
    p = target_probs(target.eval(ids, logits_from=len(ids) - 1).copy(), SamplingParams(**sampling))[0]
    target.reset()
    for draft_temp in (0.3, 2.0):
        engine = Engine(target, create("draft-model", BuildContext(target, options={"draft_temp": draft_temp, "seed": 0}, temperature=1.0)))
        counts = np.zeros_like(p)
        n, drafted = 500, 0
        for seed in range(n):
            gen = engine.generate(ids, GenerationConfig(max_tokens=3, sampling=SamplingParams(**sampling, seed=seed)), policy=FixedK(2)).run()
            counts[gen.output_ids[0]] += 1
            drafted += gen.stats.n_drafted
        assert drafted > 0
        assert 0.5 * np.abs(counts / n - p).sum() < 0.1, f"draft_temp={draft_temp}"


def test_a_probe_drafts_from_a_short_tail_and_a_real_draft_catches_up_on_the_whole_context(target, plain_outputs):
    """The draft reads the prompt with the prefill (``begin``); a probe (the cost policy checking whether drafting
    pays) after a long plain run must not make it read all it missed, and a real draft reads the whole context
    again, so its drafts are the full-context ones."""
    from specstack.draft_length import CostK
    from specstack.draft_length.budget import Budget
    from specstack.drafters.base import propose_one
    from specstack.drafters.draft_model import PROBE_CONTEXT

    drafter = create("draft-model", BuildContext(target))
    ids = target.tokenize(PROMPTS[0])
    assert len(ids) > 4 * PROBE_CONTEXT
    drafter.begin(ids)
    assert drafter.model.seq_len[0] == len(ids) - 1  # the prompt, read with the prefill
    first = propose_one(drafter, ids, Budget(4))
    assert drafter.model.seq_len[0] == len(ids) + len(first) - 1  # then only the pending token and the draft
    drafter.begin(ids[:PROBE_CONTEXT])  # a short prompt, then a long plain run: the context is far ahead
    probe = propose_one(drafter, ids, Budget(2, probe=True))
    assert len(probe) == 2 and drafter.model.seq_len[0] <= PROBE_CONTEXT + 1  # the tail, and one drafted token
    real = propose_one(drafter, ids, Budget(4))
    fresh = create("draft-model", BuildContext(target))
    fresh.begin(ids)
    assert real.token_ids == propose_one(fresh, ids, Budget(4)).token_ids == first.token_ids
    assert drafter.model.seq_len[0] == len(ids) + 3
    # and under the cost policy, which probes and drafts as it sees fit, output stays plain decoding's
    engine = Engine(target, create("draft-model", BuildContext(target)), CostK(target_costs(target)))
    assert [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)).run().output_ids
            for p in PROMPTS[:3]] == plain_outputs[:3]


def test_the_draft_keeps_what_the_slots_next_prompt_shares_with_its_last(target):
    """A conversation's next turn resends the earlier ones: the draft reads only what it has not read (as the target
    reuses its prefix), and drafts as a draft that read the whole prompt afresh."""
    from specstack.draft_length.budget import Budget
    from specstack.drafters.base import propose_one

    drafter = create("draft-model", BuildContext(target))
    read: list[int] = []
    evaluate = drafter._eval
    drafter._eval = lambda tokens: (read.append(sum(len(t) for t in tokens.values())), evaluate(tokens))[1]
    turn1 = target.tokenize(PROMPTS[0])
    drafter.begin(turn1)
    propose_one(drafter, turn1, Budget(4))
    drafter.end(0)
    turn2 = turn1 + target.tokenize("\n\ndef other(x):\n    return", add_special=False)
    read.clear()
    drafter.begin(turn2)
    assert read == [len(turn2) - 1 - len(turn1)]  # the new tokens only (turn 1 and its pending token were read)
    fresh = create("draft-model", BuildContext(target))
    fresh.begin(turn2)
    assert propose_one(drafter, turn2, Budget(4)).token_ids == propose_one(fresh, turn2, Budget(4)).token_ids
    drafter.end(0, complete=False)  # a cancelled generation's cache goes
    read.clear()
    drafter.begin(turn2)
    assert read == [len(turn2) - 1]


def target_costs(target):
    from specstack.calibration import calibrate

    return calibrate(target, n_max=17)
