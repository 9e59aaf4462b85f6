"""Every adaptive k policy with every draft source, trees, cascades and fusion: greedy output equals plain.

The policies change k between steps (and, for model drafts, token by token),
so each combination is a different verification schedule; each must still
give exactly plain decoding's tokens, with drafts accepted (and for trees,
trees verified) so that the comparison proves something.
"""

from __future__ import annotations

import pytest

from specstack.draft_length import make_policy
from specstack.calibration import ensure_shapes
from specstack.draft_length.costs import CostModel
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.paths import DEFAULT_TARGET
from specstack.prompts import held_out_prompts
from specstack.llama import LlamaModel, ModelConfig

PROMPTS = [held_out_prompts(7)[i] for i in (1, 5, 6)]  # prompts the small test datastore has matches for
MAX_TOKENS = 48
DRAFTERS = {  # name -> (drafter spec, options, whether it drafts trees)
    "suffix": ("suffix", {}, False),
    "rest": ("rest", {}, False),
    "suffix-tree": ("suffix", {"tree": True}, True),
    "rest-tree": ("rest", {"tree": True, "min_token_prob": 0.05}, True),
    "cascade": ("cascade:prompt-lookup,suffix,draft-model", {}, False),
    "fusion": ("fusion:suffix,draft-model", {"min_token_prob": 0.05}, True),
}


@pytest.fixture(scope="module")
def tree_target():
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_seq_max=4), role="target")
    ensure_shapes(model, "on")  # trees are verified as trees only where tree calls were measured exact
    yield model
    model.close()


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    engine = Engine(target, create("none", BuildContext(target)))
    return [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)).run().output_ids for p in PROMPTS]


@pytest.mark.parametrize("policy", ["cost", "window", "heuristic"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_adaptive_policy_with_every_drafter_is_lossless(tree_target, plain, store, name, policy):
    spec, options, trees = DRAFTERS[name]
    # Verification costs the same at any size (extra rows free) and far more than a draft's own time (0.1 s a call),
    # so the cost policy drafts wherever a source has some acceptance, whatever drafting costs on a busy machine
    # (the real curve of this tiny target often says k = 0, which would verify nothing; at 1 ms a call a fresh
    # clone's first drafts were slow enough to make rest decline every step).
    costs = CostModel([0.1] * 24)
    drafter = create(spec, BuildContext(tree_target, options={"datastore": store, **options}))
    engine = Engine(tree_target, drafter, make_policy(policy, 4, costs=costs))
    accepted = tree_steps = 0
    for prompt, expected in zip(PROMPTS, plain):
        gen = engine.generate(prompt, GenerationConfig(max_tokens=MAX_TOKENS)).run()
        assert gen.output_ids == expected, f"{name} under {policy} diverged on {prompt[:60]!r}"
        accepted += gen.stats.n_accepted
        tree_steps += gen.stats.n_tree_steps
    assert accepted > 0, f"{name} under {policy}: no draft token was accepted, so nothing was verified"
    if trees and tree_target.shapes.tree_exact:
        assert tree_steps > 0, f"{name} under {policy}: no tree was verified as a tree"
    elif trees:  # tree calls measured inexact on this CPU (an AVX2 build): exact mode verified chains
        assert tree_steps == 0, f"{name} under {policy}: a tree was verified although tree calls are inexact here"
