"""Logit controls under speculation: a grammar, penalties, logit bias and min_tokens give the output plain
decoding gives with the same controls, with drafts accepted, and the grammar is llama.cpp's own engine."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specstack.constraints import Constraints, ConstraintState
from specstack.draft_length import FixedK
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.errors import InvalidParameterError
from specstack.generation import GenerationConfig
from specstack.llama.schema_gbnf import schema_to_gbnf
from specstack.sampling import SamplingParams

# A prompt the pycoder model continues with repeats, so prompt lookup and suffix trees draft a lot.
PROMPT = 'RECORD = {"name": "alpha", "size": 12, "ok": true}\nRECORD = {"name": "beta", "size": 7, "ok": false}\nRECORD = '
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"},
                                           "ok": {"type": "boolean"}}, "required": ["name", "size", "ok"],
          "additionalProperties": False}
PENALTIES = Constraints(repeat_penalty=1.05, repeat_last_n=64, frequency_penalty=0.1, presence_penalty=0.05)
DRAFTERS = [("none", 1), ("prompt-lookup", 4), ("suffix", 16), ("prompt-lookup", 16)]


def _run(target, drafter: str, k: int, constraints: Constraints, sampling: SamplingParams = SamplingParams(),
         max_tokens: int = 48):
    engine = Engine(target, create(drafter, BuildContext(target)), FixedK(k))
    cfg = GenerationConfig(max_tokens=max_tokens, constraints=constraints, sampling=sampling)
    return engine.generate(PROMPT, cfg).run()


@pytest.fixture(scope="module")
def json_grammar() -> str:
    return schema_to_gbnf(SCHEMA)


def test_json_schema_output_is_valid_and_identical_with_every_drafter(target, json_grammar):
    runs = {(d, k): _run(target, d, k, Constraints(grammar=json_grammar)) for d, k in DRAFTERS}
    plain = runs[("none", 1)]
    value = json.loads(plain.text)  # the grammar ends the object; the model's free run would not
    assert set(value) == {"name", "size", "ok"} and isinstance(value["size"], int)
    for key, gen in runs.items():
        assert gen.output_ids == plain.output_ids, f"{key} diverged from constrained plain decoding"
    assert sum(g.stats.n_accepted for k, g in runs.items() if k[0] != "none") > 0


def test_the_grammar_changes_the_output(target, json_grammar):
    """The identity above must not hold because the grammar did nothing."""
    free = _run(target, "none", 1, Constraints())
    bound = _run(target, "none", 1, Constraints(grammar=json_grammar))
    assert free.output_ids != bound.output_ids


def test_penalties_are_identical_to_plain_decoding_with_the_same_penalties(target):
    plain = _run(target, "none", 1, PENALTIES, max_tokens=64)
    assert plain.output_ids != _run(target, "none", 1, Constraints(), max_tokens=64).output_ids
    accepted = 0
    for d, k in DRAFTERS[1:]:
        gen = _run(target, d, k, PENALTIES, max_tokens=64)
        assert gen.output_ids == plain.output_ids, f"{d} k={k} diverged under penalties"
        accepted += gen.stats.n_accepted
    assert accepted > 0


def test_seeded_sampling_under_a_grammar_is_the_same_with_every_deterministic_drafter(target, json_grammar):
    sampling = SamplingParams(temperature=0.9, seed=11)
    c = Constraints(grammar=json_grammar, repeat_penalty=1.1)
    runs = [_run(target, d, k, c, sampling) for d, k in DRAFTERS]
    assert all(r.output_ids == runs[0].output_ids for r in runs)
    json.loads(runs[0].text)
    assert sum(r.stats.n_drafted for r in runs[1:]) > 0


def test_min_tokens_and_ignore_eos_keep_end_of_generation_away(target):
    eog = sorted(target.eog_ids())
    for c in (Constraints(min_tokens=40), Constraints(ignore_eos=True)):
        gen = _run(target, "prompt-lookup", 8, c, max_tokens=40)
        assert not set(gen.output_ids) & set(eog) and len(gen.output_ids) == 40


def test_logit_bias_bans_and_forces_tokens(target):
    free = _run(target, "none", 1, Constraints(), max_tokens=16)
    first = free.output_ids[0]
    banned = _run(target, "prompt-lookup", 4, Constraints(logit_bias=((first, float("-inf")),)), max_tokens=16)
    assert first not in banned.output_ids
    forced = _run(target, "none", 1, Constraints(logit_bias=((first, 100.0),)), max_tokens=8)
    assert set(forced.output_ids) == {first}


def test_stop_token_ids_end_the_generation(target):
    free = _run(target, "none", 1, Constraints(), max_tokens=24)
    stop = free.output_ids[5]
    engine = Engine(target, create("prompt-lookup", BuildContext(target)), FixedK(4))
    gen = engine.generate(PROMPT, GenerationConfig(max_tokens=24, stop_token_ids=(stop,))).run()
    assert gen.output_ids == free.output_ids[: free.output_ids.index(stop) + 1] and gen.stats.stop_reason == "eos"


def test_penalties_match_llama_cpps_own_penalty_sampler():
    """The formula is llama.cpp's: checked against ``llama_sampler_init_penalties`` on the same logits."""
    import ctypes

    import llama_cpp as lc

    rng = np.random.default_rng(0)
    logits = rng.normal(size=64).astype(np.float32) * 3
    history = [3, 5, 5, 9, 3, 5, 40, 63, 0]
    c = Constraints(repeat_penalty=1.4, repeat_last_n=6, frequency_penalty=0.3, presence_penalty=0.7)
    ours = ConstraintState(c, 64, frozenset()).shaped(logits, history[:-2], history[-2:], 10)
    smpl = lc.llama_sampler_init_penalties(64, 6, 1.4, 0.3, 0.7)  # n_vocab, last_n, repeat, freq, present
    for t in history:
        lc.llama_sampler_accept(smpl, t)
    data = (lc.llama_token_data * 64)(*[lc.llama_token_data(i, float(x), 0.0) for i, x in enumerate(logits)])
    arr = lc.llama_token_data_array(data, 64, -1, False)
    lc.llama_sampler_apply(smpl, ctypes.byref(arr))
    theirs = np.array([data[i].logit for i in range(64)], dtype=np.float32)
    lc.llama_sampler_free(smpl)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert not np.allclose(ours, logits)


def test_a_draft_is_cut_at_its_first_refused_token(target, json_grammar):
    state = ConstraintState(Constraints(grammar=json_grammar), target.n_vocab, target.eog_ids(),
                            grammar=target.grammar(json_grammar))
    good = target.tokenize('{"name": "x"', add_special=False)
    assert state.cut(good) == len(good)
    assert state.cut(good + target.tokenize("]", add_special=False)) == len(good)
    assert state.cut(target.tokenize("[", add_special=False)) == 0


def test_bad_controls_are_refused_with_the_field(target):
    with pytest.raises(InvalidParameterError, match="repeat_penalty"):
        Constraints(repeat_penalty=0)
    with pytest.raises(InvalidParameterError, match="frequency_penalty"):
        Constraints(frequency_penalty=3)
    with pytest.raises(InvalidParameterError, match="logit_bias"):
        Constraints(logit_bias=((1, 500.0),))
    with pytest.raises(InvalidParameterError, match="grammar"):
        _run(target, "none", 1, Constraints(grammar="root ::= (("))
    with pytest.raises(InvalidParameterError, match="outside the vocabulary"):
        _run(target, "none", 1, Constraints(logit_bias=((10**7, 1.0),)))
