"""Prompts processed inside decode steps (``Engine(batch_tokens=...)``): streams never wait for a whole prompt.

Each step runs the running generations' rows first, then prompt chunks within the token budget.  Every
output is checked against the same request run alone, and the speculative ones must accept drafts.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specstack.draft_length import BatchLoad, CostK, FixedK
from specstack.draft_length.budget import SOLO
from specstack.calibration import calibrate, ensure_shapes
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.paths import DEFAULT_TARGET
from specstack.prompts import held_out_prompts
from specstack.llama import LlamaModel, ModelConfig

LIB = Path(os.__file__).parent
SHORT = held_out_prompts(2)
# Longer than a step's budget (several 128-token chunks each).
LONG = [(LIB / name).read_text(encoding="utf-8")[:1300] for name in ("textwrap.py", "string.py")]
BUDGET, CAP = 192, 128


@pytest.fixture(scope="module")
def slots():
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_slots=3), role="target")
    ensure_shapes(model, "on")
    yield model
    model.close()


def _engine(model: LlamaModel, budget: int | None = BUDGET) -> Engine:
    return Engine(model, create("prompt-lookup", BuildContext(model)), FixedK(6), batch_tokens=budget, prefill_cap=CAP)


def _solo(model: LlamaModel, prompt: str, n: int) -> list[int]:
    return _engine(model, None).generate(prompt, GenerationConfig(max_tokens=n)).run().output_ids


def test_long_prompts_arriving_mid_stream_leave_every_output_unchanged(slots):
    engine = _engine(slots)
    stream = engine.generate(SHORT[0], GenerationConfig(max_tokens=80))
    for _ in range(4):
        engine.step()
    late = [engine.generate(p, GenerationConfig(max_tokens=40)) for p in LONG]
    assert all(len(slots.tokenize(p)) > BUDGET + CAP for p in LONG)
    grew_during_prefill = 0
    while any(g.status in ("waiting", "prefilling") for g in late):
        before = len(stream.output_ids)
        engine.step()
        grew_during_prefill += len(stream.output_ids) > before or stream.done
    assert grew_during_prefill >= 4  # the stream kept decoding while the long prompts were processed
    for g in [stream, *late]:
        g.run()
    assert stream.output_ids == _solo(slots, SHORT[0], 80) and stream.stats.n_accepted > 0
    for prompt, g in zip(LONG, late):
        assert g.output_ids == _solo(slots, prompt, 40)
        assert g.stats.n_prompt == len(slots.tokenize(prompt))


def test_one_step_takes_at_most_the_cap_of_one_prompt(slots):
    engine = _engine(slots)
    gen = engine.generate(LONG[0], GenerationConfig(max_tokens=4))
    seq_len = []
    while gen.status != "running" and not gen.done:
        engine.step()
        seq_len.append(slots.seq_len[gen.seq])
    steps = [b - a for a, b in zip([0] + seq_len, seq_len)]
    assert len(steps) > 2 and max(steps) <= CAP  # several steps, none over the cap
    assert all(n % 128 == 0 for n in seq_len[:-1])  # chunk edges where a solo run's prefill puts them
    gen.run()


def test_cancelling_a_prompt_mid_prefill_frees_its_slot(slots):
    engine = _engine(slots)
    stream = engine.generate(SHORT[1], GenerationConfig(max_tokens=60))
    engine.step()
    doomed = engine.generate(LONG[1], GenerationConfig(max_tokens=20))
    engine.step()
    assert doomed.status == "prefilling" and engine.running == 2
    seq = doomed.seq
    doomed.cancel()
    assert doomed.status == "cancelled" and engine.running == 1 and slots.seq_len[seq] == 0
    after = engine.generate(LONG[0], GenerationConfig(max_tokens=30))
    stream.run()
    after.run()
    assert stream.output_ids == _solo(slots, SHORT[1], 60)
    assert after.output_ids == _solo(slots, LONG[0], 30)


def test_choices_of_one_prompt_prefill_it_once(slots):
    engine = _engine(slots)
    gens = [engine.generate(LONG[0], GenerationConfig(max_tokens=24)) for _ in range(2)]
    for g in gens:
        g.run()
    assert engine.sibling_copies == 1  # the second copied the first's KV instead of prefilling it again
    assert gens[0].output_ids == gens[1].output_ids == _solo(slots, LONG[0], 24)


class _Recording(CostK):
    """The cost policy, keeping every load the engine priced a draft against."""

    seen: list[BatchLoad] = []

    def budget(self, cap: int, load: BatchLoad = SOLO, tree: bool = False):
        self.seen.append(load)
        return super().budget(cap, load, tree)


def test_draft_rows_are_priced_against_waiting_prompt_tokens(slots):
    """While prompts wait to be prefilled, the cost policy sees how many draft rows the step has free and
    what a displaced prompt token costs; once they are in, drafts displace nothing.  Output is unchanged."""
    _Recording.seen = []
    engine = Engine(slots, create("prompt-lookup", BuildContext(slots)), _Recording(calibrate(slots), k_max=16),
                    batch_tokens=BUDGET, prefill_cap=CAP)
    stream = engine.generate(SHORT[0], GenerationConfig(max_tokens=80))
    for _ in range(3):
        engine.step()
    late = [engine.generate(p, GenerationConfig(max_tokens=8)) for p in LONG]
    during = len(_Recording.seen)
    while any(g.status in ("waiting", "prefilling") for g in late):
        engine.step()
    squeezed = [load for load in _Recording.seen[during:] if load.free_rows is not None]
    assert squeezed and all(load.displaced_s > 0 for load in squeezed)
    # Both prompts want a capped chunk: the budget left for drafts is what the chunks leave.
    assert min(load.free_rows for load in squeezed) <= max(0, BUDGET - 1 - 2 * CAP)
    after = len(_Recording.seen)
    for g in [stream, *late]:
        g.run()
    assert all(load.free_rows is None for load in _Recording.seen[after:])
    assert stream.output_ids == _solo(slots, SHORT[0], 80) and stream.stats.n_accepted > 0
