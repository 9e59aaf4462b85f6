"""Speculation on recurrent and hybrid targets (``specstack.llama.recurrent``): lossless under both strategies.

Two real GGUFs: ``pycoder-lfm2`` (a trained LFM2 hybrid: short convolutions plus
attention; llama.cpp can roll its state back) and ``pycoder-mamba2-random`` (a
pure Mamba-2 with random weights wired to copy from context; llama.cpp cannot
roll it back, so its state is checkpointed).  The rollback-capable model is also
run with checkpoints forced.  Every greedy run must equal plain decoding *and*
have accepted draft tokens on every prompt, so a drafter that never drafts, or a
strategy that is never exercised, cannot pass.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specstack.calibration import calibrate
from specstack.draft_length import FixedK, make_policy
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.errors import InvalidParameterError, UnsupportedModelError
from specstack.paths import DEFAULT_DRAFT, MODELS_DIR
from specstack.prompts import held_out_prompts
from specstack.llama.recurrent import RollbackError
from specstack.sampling import SamplingParams
from specstack.llama import LlamaModel, ModelConfig

from test_golden import Oracle

LFM2 = MODELS_DIR / "pycoder-lfm2.gguf"
MAMBA2 = Path(__file__).parent / "fixtures" / "pycoder-mamba2-random.gguf"
SPM_DRAFT = MODELS_DIR / "pycoder-1m-spm.gguf"
# Held-out prompts on which the random Mamba-2 does not just repeat a newline.
PROMPTS = [held_out_prompts(8)[i] for i in (1, 5, 6)]
MAX_TOKENS = 48

# (name, model, forced strategy, the strategy it must get, a draft model that agrees with it)
SETUPS = [
    ("lfm2-rollback", LFM2, "auto", "rollback", DEFAULT_DRAFT),
    ("lfm2-checkpoint", LFM2, "checkpoint", "checkpoint", DEFAULT_DRAFT),
    # Random weights: only the model itself drafts what it will say (a recurrent draft model, too).
    ("mamba2-checkpoint", MAMBA2, "auto", "checkpoint", MAMBA2),
]


class Setup:
    def __init__(self, name: str, path: Path, rollback: str, strategy: str, draft: Path) -> None:
        self.name, self.draft = name, draft
        self.target = LlamaModel(ModelConfig(path, rollback=rollback), role="target")
        assert self.target.strategy == strategy
        self.plain = [g.output_ids for g in self.run("none")]

    def run(self, drafter: str, options: dict | None = None, k: int = 4, policy=None):
        opts = {"draft_model": self.draft, **(options or {})}
        engine = Engine(self.target, create(drafter, BuildContext(self.target, options=opts)), policy)
        return [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS), policy=None if policy else FixedK(k)).run()
                for p in PROMPTS]


@pytest.fixture(scope="module", params=SETUPS, ids=[s[0] for s in SETUPS])
def setup(request):
    s = Setup(*request.param)
    yield s
    s.target.close()


def assert_lossless(setup: Setup, gens, what: str) -> None:
    for prompt, gen, expected in zip(PROMPTS, gens, setup.plain):
        assert gen.output_ids == expected, f"{setup.name} {what}: diverged on {prompt[:50]!r}"
        assert gen.stats.n_accepted > 0, f"{setup.name} {what}: nothing accepted on {prompt[:50]!r}"
        assert gen.stats.rewind == setup.target.strategy


DRAFTERS = [
    ("prompt-lookup", {}),
    ("suffix", {}),
    ("draft-model", {}),
    ("cascade:suffix,prompt-lookup,draft-model", {}),
    ("fusion:suffix,draft-model", {}),
]


@pytest.mark.parametrize("drafter,options", DRAFTERS, ids=[d[0] for d in DRAFTERS])
def test_greedy_speculation_equals_plain_decoding(setup, drafter, options):
    gens = setup.run(drafter, options, k=6)
    assert_lossless(setup, gens, drafter)
    stats = [g.stats for g in gens]
    if setup.target.strategy == "checkpoint":
        assert sum(s.rewound.checkpoints for s in stats) > 0
    if drafter.startswith("fusion"):  # trees need one state per branch: verified as chains, and said so
        assert all(s.n_tree_steps == 0 and "chains" in s.trees for s in stats)


def test_rest_datastore_drafter(setup, tmp_path):
    """A datastore of what this model wrote before, as token ids (random weights would match nothing else)."""
    from specstack.retrieval.datastore import write_store

    target = setup.target
    write_store(tmp_path / "store", [target.tokenize(p) + out for p, out in zip(PROMPTS, setup.plain)], n_vocab=target.n_vocab)
    assert_lossless(setup, setup.run("rest", {"datastore": tmp_path / "store"}), "rest")


def test_cost_policy_learns_the_rewind_cost(setup, monkeypatch):
    from specstack.drafters import draft_model

    # Probes read the whole context here: the random-weight Mamba-2 agrees with the draft only given all of it,
    # and a probe drafting from a 32-token tail (``PROBE_CONTEXT``) never got a token accepted, which would
    # leave this test nothing verified to learn a rewind from.
    monkeypatch.setattr(draft_model, "PROBE_CONTEXT", 10**6)
    costs = calibrate(setup.target, n_max=8)
    policy = make_policy("cost", 4, costs)
    gens = setup.run("draft-model", policy=policy)
    # The policy may stop drafting where it does not pay (that is its job), so acceptance is
    # required over the run, identity on every prompt.
    assert [g.output_ids for g in gens] == setup.plain
    assert sum(g.stats.n_accepted for g in gens) > 0
    if setup.target.strategy == "checkpoint":
        assert costs.rewind_s > 0  # a checkpoint costs something, and the policy prices it
        assert costs.batch_s((4,)) > costs.call_s(4)


def test_always_right_and_always_wrong_drafters(setup):
    """Full acceptance (nothing to cut) and rejection at position 0 (cut everything but the pending token)."""
    target = setup.target
    for prompt, plain in zip(PROMPTS[:2], setup.plain):
        ids = target.tokenize(prompt)
        for right in (True, False):
            gen = Engine(target, Oracle(len(ids), plain, right, target.n_vocab), FixedK(7)).generate(
                ids, GenerationConfig(max_tokens=MAX_TOKENS)).run()
            assert gen.output_ids == plain
            assert gen.stats.n_drafted > 0
            assert gen.stats.n_accepted == (gen.stats.n_drafted if right else 0)
            if not right and target.strategy == "rollback":
                assert gen.stats.rewound.rollbacks > 0 and gen.stats.rewound.restores == 0
            if not right and target.strategy == "checkpoint":
                assert gen.stats.rewound.restores > 0


def test_sampling_is_reproducible_with_a_seed(setup):
    sampling = SamplingParams(temperature=0.8, top_k=40, seed=1234)
    runs = []
    for _ in range(2):
        drafter = create("draft-model", BuildContext(setup.target, options={"draft_model": setup.draft, "seed": 7}, temperature=0.8))
        runs.append(Engine(setup.target, drafter).generate(PROMPTS[0], GenerationConfig(max_tokens=40, sampling=sampling)).run())
    assert runs[0].output_ids == runs[1].output_ids
    assert runs[0].stats.n_drafted > 0


def test_a_run_that_hits_the_context_end(setup):
    """A small context: speculation stops where plain decoding stops, with the same tokens."""
    path = setup.target.path
    with LlamaModel(ModelConfig(path, n_ctx=256, rollback=setup.target.config.rollback)) as small:
        ids = small.tokenize(PROMPTS[0])[-(small.n_ctx - 30):]  # 64 new tokens do not fit
        plain = Engine(small, create("none", BuildContext(small))).generate(ids, GenerationConfig(max_tokens=64)).run()
        spec = Engine(small, create("prompt-lookup", BuildContext(small))).generate(ids, GenerationConfig(max_tokens=64), policy=FixedK(8)).run()
    assert plain.stats.stop_reason == spec.stats.stop_reason == "context"
    assert spec.output_ids == plain.output_ids and spec.stats.n_drafted > 0


# -- the target layer ----------------------------------------------------------------------------


def _tokens(model: LlamaModel, n: int) -> list[int]:
    return model.tokenize(PROMPTS[1])[:n]


def test_rollback_limits():
    """llama.cpp's seq_rm returns True for a rollback past the last call's first token, yet leaves a
    wrong state (measured): specstack refuses it before touching the state, or restores a checkpoint."""
    with LlamaModel(ModelConfig(LFM2, rollback="rollback", rollback_depth=4)) as m:
        assert m.strategy == "rollback" and m.rollback_depth == 4 and m.max_draft == 3
        toks = _tokens(m, 40)
        m.prefill(toks[:20])
        ref = m.eval(toks[20:30], logits_from=0).copy()
        with pytest.raises(RollbackError, match="deeper|past|n_rs_seq"):
            m.truncate(21)  # 9 back > n_rs_seq = 4
        assert m.seq_len[0] == 30 and not m.can_truncate(21)  # refused before touching the state
        m.truncate(27)  # 3 back: a real rollback
        assert m.rewind.rollbacks == 1
        with pytest.raises(RollbackError, match="already used"):
            m.truncate(26)  # one rollback per call
        np.testing.assert_array_equal(m.eval(toks[27:30], logits_from=0), ref[7:10])
        # A checkpoint lets any depth come back, by restoring and re-decoding.
        m.reset()
        m.prefill(toks[:20])
        m.checkpoint(0)
        m.eval(toks[20:24])
        m.eval(toks[24:30])
        m.truncate(22)  # reaches past the last call: restore at 20, re-decode 20..21
        assert m.rewind.restores == 1 and m.rewind.redecoded == 2
        np.testing.assert_array_equal(m.eval(toks[22:30], logits_from=0), ref[2:10])


def test_rollback_refused_where_the_architecture_cannot():
    with pytest.raises(UnsupportedModelError, match="cannot roll back.*--rollback checkpoint"):
        LlamaModel(ModelConfig(MAMBA2, rollback="rollback"))
    with pytest.raises(InvalidParameterError, match="rollback must be one of"):
        ModelConfig(MAMBA2, rollback="sometimes")


def test_checkpoint_restore_is_exact_and_seq_rm_alone_is_refused():
    with LlamaModel(ModelConfig(MAMBA2)) as m:
        assert (m.memory, m.strategy) == ("recurrent", "checkpoint")
        toks = _tokens(m, 30)
        m.prefill(toks[:10])
        m.eval(toks[10:15])
        with pytest.raises(RollbackError, match="no checkpoint"):
            m.truncate(12)
        assert m.seq_len[0] == 15
        m.reset()
        m.prefill(toks[:10])
        m.checkpoint(0)
        ref = m.eval(toks[10:20], logits_from=0).copy()
        m.truncate(13)
        np.testing.assert_array_equal(m.eval(toks[13:20], logits_from=0), ref[3:10])


def test_recurrent_prefix_reuse_only_from_the_whole_state():
    """A finished generation's state can serve a prompt that extends it, never a shorter prefix of it."""
    with LlamaModel(ModelConfig(MAMBA2)) as m:
        engine = Engine(m, create("prompt-lookup", BuildContext(m)))
        first = engine.generate(PROMPTS[0], GenerationConfig(max_tokens=16)).run()
        follow = engine.generate(m.tokenize(PROMPTS[0]) + first.output_ids + m.tokenize("\n", False),
                                 GenerationConfig(max_tokens=16)).run()
        assert follow.stats.n_reused > 0
        other = engine.generate(PROMPTS[0][: len(PROMPTS[0]) // 2], GenerationConfig(max_tokens=16)).run()
        assert other.stats.n_reused == 0
        fresh = Engine(m, create("none", BuildContext(m))).generate(PROMPTS[0][: len(PROMPTS[0]) // 2],
                                                                    GenerationConfig(max_tokens=16)).run()
        assert other.output_ids == fresh.output_ids


def test_cross_tokenizer_draft_for_a_hybrid_target():
    """The SentencePiece draft, translated through text (``translate``), verifies on the LFM2 target."""
    with LlamaModel(ModelConfig(LFM2), role="target") as t:
        plain = Engine(t, create("none", BuildContext(t))).generate(PROMPTS[0], GenerationConfig(max_tokens=MAX_TOKENS)).run()
        engine = Engine(t, create("draft-model", BuildContext(t, options={"draft_model": SPM_DRAFT})))
        gen = engine.generate(PROMPTS[0], GenerationConfig(max_tokens=MAX_TOKENS), policy=FixedK(4)).run()
    assert gen.output_ids == plain.output_ids and gen.stats.n_accepted > 0


def test_a_recurrent_draft_model_for_an_attention_target(target):
    """The LFM2 model drafting for the bundled llama target: the *draft's* state is checkpointed."""
    plain = Engine(target, create("none", BuildContext(target))).generate(PROMPTS[0], GenerationConfig(max_tokens=MAX_TOKENS)).run()
    drafter = create("draft-model", BuildContext(target, options={"draft_model": LFM2}))
    gen = Engine(target, drafter).generate(PROMPTS[0], GenerationConfig(max_tokens=MAX_TOKENS), policy=FixedK(4)).run()
    assert gen.output_ids == plain.output_ids and gen.stats.n_accepted > 0
    draft = drafter.model
    assert draft.is_recurrent and draft.rewind.checkpoints > 0 and draft.rewind.restores > 0


def test_served_hybrid_target_over_http():
    """`specstack serve -m pycoder-lfm2.gguf`: two slots, the official client, speculation on and off agree."""
    import openai

    from specstack.server.app import Limits, create_app
    from specstack.server.roles import default_roles
    from test_serve import Server

    app = create_app(default_roles(parallel=2, model=LFM2), Limits(max_tokens=256, max_body_bytes=64_000))
    with Server(app) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["pycoder-lfm2"]
        texts, stats = [], []
        for spec in ({"drafter": "none"}, {"drafter": "prompt-lookup", "k_policy": "fixed", "k": 6},
                     {"drafter": "draft-model", "k_policy": "fixed", "k": 4}):
            r = client.completions.create(model="pycoder-lfm2", prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                          extra_body={"speculative": spec})
            texts.append(r.choices[0].text)
            stats.append(r.model_extra["speculative"])
    assert texts[0] == texts[1] == texts[2]
    assert stats[1]["n_accepted"] > 0 and stats[2]["n_accepted"] > 0
