"""A model never measured here: its first token comes at once, its shapes and costs are measured beside it.

Each test has a cache dir of its own, so the bundled target is a model seen for the first time.
"""

from __future__ import annotations

import math

import pytest

from specstack.cli import main
from specstack.draft_length import make_policy
from specstack.calibration import cached_shapes, calibrate, calibrate_target, ensure_shapes
from specstack.calibration.curve import curve_cached
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.paths import DEFAULT_TARGET
from specstack.llama import INEXACT, LlamaModel, ModelConfig

# Repetitive code, so that prompt lookup has drafts to offer once drafting pays.
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n" * 6 + "def mul(a, b):\n"
TOKENS = 96


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """The bundled target, loaded with an empty cache: nothing about it is known.  Flash attention stays off
    (``-fa off``), so that calibration keeps this very target under every mode and ``_plain`` is its plain decoding."""
    monkeypatch.setenv("SPECSTACK_CACHE_DIR", str(tmp_path / "cache"))
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, flash_attn=False), role="target")
    yield model
    model.close()


def _plain(shapes, prompt: str = PROMPT) -> list[int]:
    """Plain decoding (no drafter) on a second copy of the target held to ``shapes``."""
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, flash_attn=False), role="target")
    try:
        model.set_shapes(shapes)
        engine = Engine(model, create("none", BuildContext(model)))
        return engine.generate(prompt, GenerationConfig(max_tokens=TOKENS)).run().output_ids
    finally:
        model.close()


def _engine(model: LlamaModel, exact: str, policy_name: str = "cost") -> tuple[Engine, object]:
    calibration = calibrate_target(model, exact, n_max=17, background=True)
    policy = make_policy(policy_name, 8, costs=calibration.costs)
    engine = Engine(model, create("prompt-lookup", BuildContext(model)), policy, background=calibration.background)
    return engine, calibration.costs


def test_first_tokens_come_before_the_measurement_and_equal_one_row_plain_decoding(fresh):
    engine, costs = _engine(fresh, "auto")
    background = engine.background
    assert background is not None and fresh.shapes.pending and costs.source == "provisional"
    assert fresh.shapes.min_rows == fresh.shapes.max_rows == 1  # one row per call: plain decoding itself
    gen = engine.generate(PROMPT, GenerationConfig(max_tokens=TOKENS))
    seen: list[int] = []  # tokens out when the engine first lent the measurement time
    lend = background.lend
    background.lend = lambda seconds: (seen.append(len(gen.output_ids)), lend(seconds))[1]
    engine.step()
    # The first token did not wait for the measurement: it was out before any time was lent.  (Whether the
    # measurement is done after that first lend depends on the machine's load: the step lends its own duration.)
    assert gen.output_ids and seen and seen[0] >= 1
    gen.run()
    assert gen.output_ids == _plain(INEXACT)  # INEXACT: unpadded one-token calls, as the provisional steps
    engine.finish_calibration()
    assert engine.background is None
    assert not fresh.shapes.pending and costs.source == "calibrated"
    cached = cached_shapes(fresh, "auto")  # what it measured went to the cache
    assert cached is not None and (cached.min_rows, cached.why) == (fresh.shapes.min_rows, fresh.shapes.why)
    again = LlamaModel(ModelConfig(DEFAULT_TARGET, flash_attn=False), role="target")  # a later run finds it all in the cache
    try:
        later = calibrate_target(again, "auto", n_max=17, background=True)
        assert later.background is None and again.shapes == fresh.shapes and later.costs.curve == costs.curve
    finally:
        again.close()


def test_after_the_measurement_drafts_are_accepted_and_output_equals_plain_decoding(fresh):
    engine, costs = _engine(fresh, "auto")
    engine.generate("x = 1\n", GenerationConfig(max_tokens=4)).run()
    engine.idle(math.inf)  # nothing runs: the measurement gets the cores until it is done, then is adopted
    assert engine.background is None and not fresh.shapes.pending
    gen = engine.generate(PROMPT, GenerationConfig(max_tokens=TOKENS)).run()
    assert gen.stats.n_accepted > 0
    assert gen.output_ids == _plain(fresh.shapes)


def test_shapes_that_keep_one_token_steps_unpadded_are_adopted_mid_generation(fresh):
    """--exact off needs no shapes, only the cost curve: it is adopted in the step after it is measured.  Fixed k, so
    that drafts are verified whatever the cost policy's state after other tests (in one whole-suite run the cost
    policy declined all but 2 drafted tokens here, and the check that drafts were accepted failed)."""
    engine, costs = _engine(fresh, "off", "fixed")
    assert not fresh.shapes.exact and costs.source == "provisional"
    gen = engine.generate(PROMPT, GenerationConfig(max_tokens=TOKENS))
    for _ in range(3):
        engine.step()
    before = len(gen.output_ids)
    engine.idle(math.inf)
    assert engine.background is None and costs.source == "calibrated" and not gen.done and before < TOKENS
    gen.run()
    assert gen.stats.n_accepted > 0
    assert gen.output_ids == _plain(INEXACT)


def test_exact_on_measures_before_the_first_token(fresh):
    calibration = calibrate_target(fresh, "on", n_max=17, background=True)
    costs = calibration.costs
    assert calibration.background is None and not fresh.shapes.pending and fresh.shapes.exact and costs.source == "calibrated"
    assert fresh.shapes == ensure_shapes(fresh, "on")


def test_a_measurement_given_up_ends_its_thread(fresh):
    engine, costs = _engine(fresh, "auto")
    background = engine.background
    engine.generate("x = 1\n", GenerationConfig(max_tokens=2)).run()
    background.abandon()
    assert not background._thread.is_alive() and background.result().shapes is None and fresh.shapes.pending


def test_a_target_reopened_with_flash_attention_prices_with_the_curve_measured_without_it(fresh):
    """-fa auto reopens a one-slot target with flash attention once auto's verdict is off (``open_for_mode``): the
    curve its first run measured without flash attention serves it, rather than a second measurement beside the
    next run's first generations (the online refinement corrects the few percent between them)."""
    measured = calibrate(fresh, n_max=17, exact="on")
    shapes = fresh.shapes
    reopened = fresh.reopen(flash_attn=True)
    try:
        reopened.set_shapes(shapes)
        assert reopened.flash_attn and curve_cached(reopened, 17)
        costs = calibrate(reopened, n_max=17, exact="on")
        assert costs.source == "cache" and costs.curve == measured.curve
    finally:
        reopened.close()


def test_generate_on_a_new_model_says_what_it_measures_then_finds_it_cached(fresh, capsys):
    # -fa auto: where auto's verdict comes out off, the second run is reopened with flash attention and reads the
    # curve the first measured without it
    args = ["generate", "-m", str(DEFAULT_TARGET), "-p", PROMPT, "-n", "16", "--drafter", "prompt-lookup"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "first run of pycoder-6m.gguf" in err and "measured pycoder-6m.gguf in" in err
    assert main(args) == 0
    assert "first run" not in capsys.readouterr().err
