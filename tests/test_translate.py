"""Drafting across tokenizers: pycoder-6m (byte-level BPE) with pycoder-1m-spm (SentencePiece)."""

from __future__ import annotations

import pytest

from specstack.draft_length import FixedK
from specstack.drafters import BuildContext, create
from specstack.drafters.translate import TranslatingDrafter, translate
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.paths import MODELS_DIR
from specstack.prompts import held_out_prompts
from specstack.sampling import SamplingParams
from specstack.llama import LlamaModel, ModelConfig

SPM = MODELS_DIR / "pycoder-1m-spm.gguf"


@pytest.fixture(scope="module")
def spm():
    model = LlamaModel(ModelConfig(SPM, min_batch=1, exact=False), role="draft")
    yield model
    model.close()


def test_a_draft_with_another_vocabulary_is_translated_and_lossless(target):
    drafter = create("draft-model", BuildContext(target, options={"draft_model": SPM}))
    assert isinstance(drafter, TranslatingDrafter)
    plain = Engine(target, create("none", BuildContext(target)))
    spec = Engine(target, drafter, FixedK(4))
    for p in held_out_prompts(5):
        want = plain.generate(p, GenerationConfig(max_tokens=80)).run().output_ids
        gen = spec.generate(p, GenerationConfig(max_tokens=80)).run()
        assert gen.output_ids == want
        assert gen.stats.n_accepted > 0, p[:40]


def test_translated_drafts_with_sampling_run_and_reproduce_under_a_seed(target):
    sampling = SamplingParams(temperature=0.8, seed=7)
    runs = []
    for _ in range(2):
        drafter = create("draft-model", BuildContext(target, options={"draft_model": SPM, "seed": 7}, temperature=0.8))
        gen = Engine(target, drafter, FixedK(4)).generate(held_out_prompts(1)[0], GenerationConfig(max_tokens=48, sampling=sampling)).run()
        runs.append(gen.output_ids)
        assert gen.stats.n_drafted > 0
    assert runs[0] == runs[1]


@pytest.mark.parametrize("text", [
    "    return self._data\n",      # leading spaces and indentation
    " café → naïve",                 # multi-byte UTF-8
    "x = '日本語' + \"😀\"\n",         # characters the SentencePiece vocabulary spells with byte-fallback pieces
    "def f(x):\n\treturn x",         # a tab
])
def test_translation_keeps_only_whole_stable_target_tokens(target, spm, text):
    context = target.tokenize("import os\n")
    draft_ids = spm.tokenize(text, add_special=False)
    got = translate(target, spm, context, draft_ids, budget=64)
    want = target.tokenize(text.encode(), add_special=False)
    assert got == want[:-1]  # all but the last, which more text could still change
    assert b"".join(target.token_bytes(t) for t in got) == text.encode()[: len(b"".join(target.token_bytes(t) for t in got))]


def test_translation_respects_the_budget_and_an_unstable_boundary(target, spm):
    context = target.tokenize("fib")
    ids = translate(target, spm, context, spm.tokenize("onacci(n - 1)", add_special=False), budget=2)
    assert len(ids) <= 2
    assert translate(target, spm, context, [], budget=4) == []


def test_tli_sampler_follows_the_target_distribution(target):
    """Token-level intersection: the draft samples shared tokens only, q over the target's ids; the first
    sampled token must still follow p (the same check as test_equivalence's, with a cross-tokenizer draft)."""
    import numpy as np

    from specstack.sampling import target_probs

    sampling = dict(temperature=1.0, top_k=6)
    ids = target.tokenize(held_out_prompts(4)[3])[:40]
    target.reset()
    p = target_probs(target.eval(ids, logits_from=len(ids) - 1).copy(), SamplingParams(**sampling))[0]
    target.reset()
    drafter = create("draft-model", BuildContext(target, options={"draft_model": SPM, "seed": 0}, temperature=1.0))
    assert drafter.to_target is not None and drafter.overlap > 0.5  # TLI is on for this pair
    engine = Engine(target, drafter)
    counts = np.zeros_like(p)
    n, drafted, accepted = 500, 0, 0
    for seed in range(n):
        gen = engine.generate(ids, GenerationConfig(max_tokens=3, sampling=SamplingParams(**sampling, seed=seed)), policy=FixedK(2)).run()
        counts[gen.output_ids[0]] += 1
        drafted += gen.stats.n_drafted
        accepted += gen.stats.n_accepted
    assert drafted > 0 and accepted > 0
    assert 0.5 * np.abs(counts / n - p).sum() < 0.1
