"""Engine behaviour: stop conditions, statistics, context limits, streaming text."""

from __future__ import annotations

import pytest

from specstack.draft_length import FixedK
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.engine_state import StopText
from specstack.generation import GenerationConfig
from specstack.errors import ContextOverflowError, InvalidParameterError

from specstack.prompts import held_out_prompts

PROMPT = held_out_prompts(3)[2]


def engine(target, name="prompt-lookup"):
    return Engine(target, create(name, BuildContext(target)))


def test_max_tokens_is_respected_exactly(target):
    gen = engine(target).generate(PROMPT, GenerationConfig(max_tokens=17), policy=FixedK(8)).run()
    assert len(gen.output_ids) == 17 and gen.stats.stop_reason == "length"


def test_streamed_pieces_join_to_detokenized_output(target):
    gen = engine(target).generate(PROMPT, GenerationConfig(max_tokens=40))
    pieces = list(gen)
    assert "".join(pieces) == target.detokenize(gen.output_ids)
    assert len(pieces) > 1  # really streamed, not one blob at the end


def test_stop_string_cuts_text_and_ends_generation(target):
    full = engine(target).generate(PROMPT, GenerationConfig(max_tokens=64)).run()
    stop = full.text[10:14]
    gen = engine(target).generate(PROMPT, GenerationConfig(max_tokens=64, stop=(stop,))).run()
    assert gen.stats.stop_reason == "stop"
    assert gen.text == full.text[: full.text.find(stop)]


def test_statistics_are_consistent(target):
    s = engine(target).generate(PROMPT, GenerationConfig(max_tokens=64), policy=FixedK(4)).run().stats
    assert s.n_tokens == 64
    assert s.n_committed == s.n_accepted + s.n_steps
    assert s.drafted_at[0] >= s.drafted_at[-1] and sum(s.drafted_at) == s.n_drafted
    assert sum(s.accepted_at) == s.n_accepted
    assert s.by_source["prompt-lookup"].n_drafted == s.n_drafted
    assert s.mean_accepted_length == pytest.approx(s.n_committed / s.n_steps)
    assert s.tokens_per_second > 0 and s.verify_s > 0


class _Skipping(FixedK):
    """Fixed k, with the drafter's own name skipped on every other step (``Budget.skip``)."""

    def __init__(self, name: str) -> None:
        super().__init__(4)
        self.name_skipped, self.steps = name, 0

    def budget(self, cap, load=None, tree=False):
        import dataclasses

        b, self.steps = super().budget(cap), self.steps + 1
        return dataclasses.replace(b, skip=frozenset({self.name_skipped})) if self.steps % 2 else b

    def fork(self):
        return self


def test_a_drafter_the_budget_skips_is_not_asked(target):
    """The cost policy skips a model source whose call would not pay (a draft model beside the grammar source):
    the engine does not ask a drafter whose name the budget skips, and the output is unchanged."""
    drafter = create("prompt-lookup", BuildContext(target))
    asked = []
    propose = drafter.propose
    drafter.propose = lambda requests: asked.append(len(requests)) or propose(requests)
    policy = _Skipping(drafter.name)
    gen = Engine(target, drafter).generate(PROMPT, GenerationConfig(max_tokens=48), policy=policy).run()
    plain = Engine(target, create("none", BuildContext(target))).generate(PROMPT, GenerationConfig(max_tokens=48)).run()
    assert gen.output_ids == plain.output_ids and gen.stats.n_accepted > 0
    assert 0 < len(asked) <= policy.steps // 2 + 1  # asked only on the steps that did not skip it


class _Declining(FixedK):
    """Fixed k, with every draft cut to nothing by the policy (``Budget.cut``), and the outcomes it is told."""

    def __init__(self) -> None:
        super().__init__(4)
        self.outcomes = []

    def budget(self, cap, load=None, tree=False):
        import dataclasses

        return dataclasses.replace(super().budget(cap), cut=lambda source, n, scores=None: 0)

    def observe(self, outcome):
        self.outcomes.append(outcome)

    def fork(self):
        return self


def test_a_plain_step_tells_the_policy_whether_the_draft_it_declined_was_right(target):
    """``StepOutcome.shadow``: after the policy cuts a draft to nothing, whether the plain step's token is the
    draft's first; -1 where nothing was drafted. The output is plain decoding's."""
    drafter = create("prompt-lookup", BuildContext(target))
    drafts = []
    propose = drafter.propose
    drafter.propose = lambda requests: drafts.append((len(requests[0].context), out := propose(requests))) or out
    policy = _Declining()
    gen = Engine(target, drafter).generate(PROMPT, GenerationConfig(max_tokens=48), policy=policy).run()
    plain = Engine(target, create("none", BuildContext(target))).generate(PROMPT, GenerationConfig(max_tokens=48)).run()
    assert gen.output_ids == plain.output_ids and gen.stats.n_drafted == 0
    tokens = target.tokenize(PROMPT) + gen.output_ids
    expected = [int(d[0].token_ids[0] == tokens[n]) for n, d in drafts if d[0].token_ids]
    assert [o.shadow for o in policy.outcomes if o.shadow >= 0] == expected
    assert len(policy.outcomes) - len(expected) == sum(o.shadow == -1 for o in policy.outcomes)
    assert expected.count(1) > 0 and expected.count(0) > 0  # both answers occur on this prompt


def test_generation_stops_cleanly_when_context_is_full(target):
    ids = target.tokenize(PROMPT)
    n_prompt = target.capacity - 5
    prompt_ids = (ids * 3)[:n_prompt]
    gen = engine(target).generate(prompt_ids, GenerationConfig(max_tokens=50)).run()
    assert gen.stats.stop_reason == "context"
    # 5 free slots hold the last prompt token and 4 outputs; the 6th output is
    # never evaluated, so it needs no slot.
    assert len(gen.output_ids) == 6


def test_prompt_longer_than_context_is_refused(target):
    with pytest.raises(ContextOverflowError, match="shorten the prompt"):
        engine(target).generate([1] * (target.n_ctx + 10))


def test_invalid_k_is_refused_by_the_policy_that_owns_it():
    with pytest.raises(InvalidParameterError, match="k must be at least 1"):
        FixedK(0)
    with pytest.raises(InvalidParameterError, match="k must be at most 62"):
        FixedK(63)


def test_without_a_policy_the_engine_drafts_a_fixed_k_of_4(target):
    e = engine(target)
    assert isinstance(e.policy, FixedK) and e.policy.k == 4
    gen = e.generate(PROMPT, GenerationConfig(max_tokens=32)).run()
    assert gen.stats.k == 4 and gen.stats.k_policy == "fixed" and len(gen.stats.drafted_at) <= 4


class _FailsMidway:
    """Drafts like prompt lookup, then raises in the middle of a generation (after KV was written)."""

    name = "fails-midway"

    def __init__(self, target, after: int) -> None:
        self.inner, self.after, self.calls = create("prompt-lookup", BuildContext(target)), after, 0

    def begin(self, prompt_ids, seq=0):
        self.inner.begin(prompt_ids, seq)

    def propose(self, requests):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("drafter broke")
        return self.inner.propose(requests)

    def advance(self, new_ids, n_accepted, seq=0):
        self.inner.advance(new_ids, n_accepted, seq)

    def end(self, seq=0, complete=True):
        self.inner.end(seq, complete)


def test_target_state_is_clean_after_a_failed_request(target):
    e = engine(target)
    first = e.generate(PROMPT, GenerationConfig(max_tokens=20)).run().output_ids
    with pytest.raises(ContextOverflowError):
        e.generate([1] * (target.n_ctx + 1))
    broken = Engine(target, _FailsMidway(target, after=5))
    gen = broken.generate(PROMPT, GenerationConfig(max_tokens=40))
    with pytest.raises(RuntimeError, match="drafter broke"):
        gen.run()
    assert len(gen.output_ids) > 0 and gen.status == "cancelled"  # it failed mid-generation...
    assert target.seq_pos_max(0) == -1 and not broken.busy  # ...and left no KV or slot behind
    assert e.generate(PROMPT, GenerationConfig(max_tokens=20)).run().output_ids == first


def test_stop_text_withholds_a_possible_stop_prefix():
    st = StopText(["END"])
    st.feed(b"abc E")
    assert st.take(final=False) == "abc "
    st.feed(b"N")
    assert st.take(final=False) == ""
    assert st.feed(b"D tail")
    assert st.take(final=True) == "" and st.text == "abc "


def test_stop_text_handles_split_utf8():
    st = StopText([])
    snake = "é".encode()
    st.feed(snake[:1])
    assert st.take(final=False) == ""
    st.feed(snake[1:])
    assert st.take(final=False) == "é"


class _ForeignDrafter:
    """Proposes a valid token, then an id outside the target's vocabulary."""

    name = "foreign"

    def begin(self, prompt_ids, seq=0):
        pass

    def propose(self, requests):
        from specstack.types import Draft

        return [Draft((int(r.context[-1]), 10**6), self.name) for r in requests]

    def advance(self, new_ids, n_accepted, seq=0):
        pass

    def end(self, seq=0, complete=True):
        pass


def test_out_of_vocabulary_draft_ids_are_dropped_not_sent_to_llama_cpp(target):
    plain = engine(target, "none").generate(PROMPT, GenerationConfig(max_tokens=12)).run().output_ids
    gen = Engine(target, _ForeignDrafter()).generate(PROMPT, GenerationConfig(max_tokens=12)).run()
    assert gen.output_ids == plain
    assert gen.stats.n_drafted > 0 and max(gen.stats.drafted_at[1:], default=0) == 0


def test_an_empty_prompt_is_refused_before_taking_a_slot(target):
    engine = Engine(target, create("none", BuildContext(target)))
    with pytest.raises(InvalidParameterError, match="the prompt is empty"):
        engine.generate([], GenerationConfig(max_tokens=4))
    assert not engine.busy


def test_the_first_token_comes_from_a_plain_step_and_drafting_starts_after_it(target):
    """Time to first token is a one-row step, as from llama-server's and vLLM's prefill: a draft verified
    with the first token would make the client wait for the whole verification call."""
    text = "def add(a, b):\n    return a + b\n\n" * 6
    gen = engine(target, "prompt-lookup").generate(text + "def add(a, b):\n", GenerationConfig(max_tokens=24), policy=FixedK(6))
    e = gen.engine
    while not gen.output_ids:
        e.step()
    assert len(gen.output_ids) == 1 and gen.stats.n_drafted == 0
    gen.run()
    assert gen.stats.n_accepted > 0  # the copied text is drafted and accepted from the second step on
