"""The engine: concurrent generations, cancellation, prefix reuse, the Budget contract, measured shapes.

Every equivalence check compares against plain decoding of the same
target, and every speculative run must really have accepted drafts.
"""

from __future__ import annotations


import numpy as np
import pytest

from specstack.calibration import ensure_shapes, measure_shapes, open_for_mode
from specstack.calibration.timing import filler
from specstack.draft_length import Budget, FixedK
from specstack.drafters import BuildContext, create
from specstack.drafters.base import DraftRequest
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.paths import DEFAULT_TARGET
from specstack.prompts import held_out_prompts
from specstack.llama import LlamaModel, ModelConfig, plan_calls

PROMPTS = held_out_prompts(6)


@pytest.fixture(scope="module")
def multi():
    """The bundled target with four slots (one KV stream each)."""
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_slots=4), role="target")
    yield model
    model.close()


def plain(target, prompt, n) -> list[int]:
    """Plain decoding, alone, on a one-slot target."""
    return Engine(target, create("none", BuildContext(target))).generate(prompt, GenerationConfig(max_tokens=n)).run().output_ids


def test_four_concurrent_generations_match_their_solo_plain_runs(target, multi):
    jobs = [("prompt-lookup", PROMPTS[0], 64), ("draft-model", PROMPTS[1], 48), ("suffix", PROMPTS[2], 80), ("none", PROMPTS[3], 40)]
    engine = Engine(multi, create("none", BuildContext(multi)))
    gens = [engine.generate(p, GenerationConfig(max_tokens=n), drafter=create(name, BuildContext(multi)), policy=FixedK(6))
            for name, p, n in jobs]
    assert engine.waiting == 4
    engine.step()
    assert engine.running == 4  # one batch carries all four
    for g in gens:
        g.run()
    for (name, prompt, n), g in zip(jobs, gens):
        assert g.output_ids == plain(target, prompt, n), name
        assert len(g.output_ids) == n
        if name != "none":
            assert g.stats.n_accepted > 0, name


def test_generations_join_and_leave_between_steps(target, multi):
    engine = Engine(multi, create("prompt-lookup", BuildContext(multi)))
    first = engine.generate(PROMPTS[0], GenerationConfig(max_tokens=60))
    for _ in range(5):
        engine.step()
    late = engine.generate(PROMPTS[4], GenerationConfig(max_tokens=30))
    short = engine.generate(PROMPTS[5], GenerationConfig(max_tokens=5))
    short.run()
    assert engine.running == 2  # the short one left, the others go on
    late.run(), first.run()
    assert first.output_ids == plain(target, PROMPTS[0], 60)
    assert late.output_ids == plain(target, PROMPTS[4], 30)
    assert short.output_ids == plain(target, PROMPTS[5], 5)
    assert first.stats.n_accepted > 0 and late.stats.n_accepted > 0


def test_more_generations_than_slots_wait_for_one(target, multi):
    engine = Engine(multi, create("prompt-lookup", BuildContext(multi)))
    gens = [engine.generate(p, GenerationConfig(max_tokens=24)) for p in PROMPTS]
    engine.step()
    assert engine.running == 4 and engine.waiting == 2
    for g in gens:
        g.run()
    assert [g.output_ids for g in gens] == [plain(target, p, 24) for p in PROMPTS]
    assert gens[-1].stats.queue_s > 0


@pytest.mark.parametrize("name", ["prompt-lookup", "draft-model", "suffix", "rest", "cascade:suffix,prompt-lookup,draft-model",
                                  "fusion:suffix,draft-model"])
def test_every_drafter_serves_concurrent_generations(target, multi, store, name):
    """One drafter instance, two generations: per-sequence state, lossless, drafts accepted in each."""
    drafter = create(name, BuildContext(multi, options={"datastore": store}))
    engine = Engine(multi, drafter, FixedK(5))
    a = engine.generate(PROMPTS[0], GenerationConfig(max_tokens=48))
    b = engine.generate(PROMPTS[2], GenerationConfig(max_tokens=40))
    for piece in a:  # streaming one drives both
        assert piece
    b.run()
    assert a.output_ids == plain(target, PROMPTS[0], 48)
    assert b.output_ids == plain(target, PROMPTS[2], 40)
    assert a.stats.n_accepted > 0 and b.stats.n_accepted > 0


def test_cancel_frees_the_slot_cells_and_drafter_state(target, multi):
    drafter = create("draft-model", BuildContext(multi))
    engine = Engine(multi, drafter, FixedK(4))
    gen = engine.generate(PROMPTS[0], GenerationConfig(max_tokens=200))
    for _ in range(4):
        engine.step()
    seq = gen.seq
    assert multi.seq_len[seq] > 0 and multi.seq_pos_max(seq) >= 0
    gen.cancel()
    assert gen.status == "cancelled" and gen.stats.stop_reason == "cancelled"
    assert multi.seq_len[seq] == 0 and multi.seq_pos_max(seq) == -1  # llama.cpp really dropped the cells
    assert seq not in drafter._seqs and drafter.model.seq_pos_max(seq) == -1
    assert not engine.busy
    again = engine.generate(PROMPTS[0], GenerationConfig(max_tokens=32)).run()
    assert again.stats.n_reused == 0  # the next request sees an empty sequence
    assert again.output_ids == plain(target, PROMPTS[0], 32)


def test_a_waiting_generation_can_be_cancelled(multi):
    engine = Engine(multi, create("none", BuildContext(multi)))
    gens = [engine.generate(p, GenerationConfig(max_tokens=8)) for p in PROMPTS[:5]]
    engine.step()
    gens[4].cancel()
    assert engine.waiting == 0 and list(gens[4]) == []


def test_prefix_reuse_gives_the_cold_output(target):
    engine = Engine(target, create("prompt-lookup", BuildContext(target)))
    first = engine.generate(PROMPTS[1], GenerationConfig(max_tokens=32)).run()
    assert first.stats.n_reused == 0
    again = engine.generate(PROMPTS[1], GenerationConfig(max_tokens=32)).run()
    n_prompt = len(target.tokenize(PROMPTS[1]))
    assert again.stats.n_reused == n_prompt - 1  # F16: prefill and decode compute KV alike
    assert again.output_ids == first.output_ids
    # A follow-up that extends prompt + output reuses both; the output equals a cold run's.
    follow = target.tokenize(PROMPTS[1]) + first.output_ids + target.tokenize("\n\ndef", add_special=False)
    warm = engine.generate(follow, GenerationConfig(max_tokens=32)).run()
    assert warm.stats.n_reused >= n_prompt - 1 + len(first.output_ids) - 1
    assert warm.output_ids == plain(target, follow, 32)


def test_prefix_reuse_prefers_the_slot_with_the_longest_match(multi):
    engine = Engine(multi, create("none", BuildContext(multi)))
    for p in PROMPTS[:3]:
        engine.generate(p, GenerationConfig(max_tokens=4)).run()
    gen = engine.generate(PROMPTS[1], GenerationConfig(max_tokens=4)).run()
    assert gen.stats.n_reused == len(multi.tokenize(PROMPTS[1])) - 1


@pytest.mark.parametrize("name", ["none", "prompt-lookup", "draft-model", "suffix", "rest", "cascade:suffix,prompt-lookup",
                                  "fusion:suffix,draft-model"])
def test_a_drafter_never_returns_more_than_its_budget(target, store, name):
    drafter = create(name, BuildContext(target, options={"datastore": store, "tree": True}))
    ids = target.tokenize(PROMPTS[0])
    for seq in (0,):
        drafter.begin(ids, seq)
    for cap in (0, 1, 2, 3, 5, 8, 16):
        for tree in (False, True):
            draft = drafter.propose([DraftRequest(0, ids, Budget(cap, tree=tree))])[0]
            assert len(draft) <= cap
            assert tree or not draft.is_tree
    drafter.end(0)


def test_call_plan_keeps_every_call_within_the_exact_shapes():
    for rows in ([1], [3, 1], [17], [2, 2, 2, 2], [9, 1, 4], [5] * 7):
        for min_rows, max_rows in ((1, 3), (2, 7), (2, 512), (1, 1)):
            calls = plan_calls(rows, list(range(len(rows))), min_rows, max_rows)
            done = [0] * len(rows)
            for call in calls:
                total = sum(p.count + p.pad for p in call)
                assert min(min_rows, max_rows) <= total <= max(max_rows, min_rows)
                assert len({p.count + p.pad for p in call}) == 1  # equal rows per sequence
                for p in call:
                    assert p.start == done[p.segment]  # pieces of a segment in order
                    done[p.segment] += p.count
            assert done == rows


def test_an_uneven_call_plan_pays_for_real_rows_only():
    """One unified cache (``even=False``): drafts of different lengths share a call unpadded."""
    for rows in ([1], [3, 1], [17], [2, 2, 2, 2], [9, 1, 4], [5] * 7):
        for min_rows, max_rows in ((1, 3), (2, 7), (1, 512), (1, 1)):
            calls = plan_calls(rows, list(range(len(rows))), min_rows, max_rows, even=False)
            done = [0] * len(rows)
            for call in calls:
                total = sum(p.count + p.pad for p in call)
                assert min(min_rows, max_rows) <= total <= max(max_rows, min_rows)
                assert sum(p.pad for p in call) == max(0, min_rows - sum(p.count for p in call))
                for p in call:
                    assert p.start == done[p.segment]
                    done[p.segment] += p.count
            assert done == rows
    assert len(plan_calls([5, 1, 1, 1], [0, 3, 5, 8], 1, 512, even=False)) == 1
    assert sum(p.pad for p in plan_calls([5, 1, 1, 1], [0, 3, 5, 8], 1, 512)[0]) == 12  # even: 4 rows of pads each


def test_exact_off_shares_one_unified_cache_and_verifies_uneven_drafts_in_one_call(multi):
    """Under --exact off a multi-slot target is reopened on one unified cache with flash attention: generations
    in scattered slots with drafts of different lengths are verified in one unpadded call per step."""
    off = open_for_mode(LlamaModel(ModelConfig(DEFAULT_TARGET, n_slots=4), role="target"), "off")
    try:
        assert off.unified and off.config.flash_attn and not off.shapes.exact and not off.shapes.even_rows
        assert "unified KV cache" in off.shapes.why
        assert open_for_mode(multi, "on") is multi and multi.shapes.even_rows  # exact mode keeps the streams
        calls: list[list[tuple[int, int, int]]] = []
        real = off._call
        off._call = lambda entries, *a, **k: (calls.append([(q, len(t), pad) for q, t, pad, _ in entries]),
                                              real(entries, *a, **k))[1]
        engine = Engine(off, create("none", BuildContext(off)))
        names = ["suffix", "none", "prompt-lookup", "none"]
        gens = [engine.generate(PROMPTS[i], GenerationConfig(max_tokens=48), drafter=create(name, BuildContext(off)),
                                policy=FixedK(6)) for i, name in enumerate(names)]
        engine.step()
        engine.cancel(gens[1])  # a hole in the slots: 0, 2 and 3 go on
        while engine.busy:
            engine.step()
        mixed = [c for c in calls if len({q for q, _, _ in c}) > 1 and len({n for _, n, _ in c}) > 1]
        assert mixed, "no step verified drafts of different lengths together"
        assert all(pad == 0 for c in mixed for _, _, pad in c)  # real rows only
        assert any({q for q, _, _ in c} == {0, 2, 3} for c in mixed)  # scattered slots, one call
        assert gens[1].stats.stop_reason == "cancelled"
        assert [len(g.output_ids) for g in (gens[0], gens[2], gens[3])] == [48] * 3
        assert gens[0].stats.n_accepted > 0 and gens[2].stats.n_accepted > 0
    finally:
        off.close()


def test_one_slot_under_autos_off_verdict_gets_flash_attention_on_the_loaded_weights(monkeypatch):
    """``-fa auto`` (``flash_attn`` None) on a one-slot target: once auto's cached verdict is off, the target is
    reopened with flash attention as llama.cpp's own default has it, on a new context over the weights already
    loaded (nothing is read again); explicit ``-fa off``, and a verdict of on, keep the target as it is."""
    import dataclasses
    import gc

    import specstack.calibration.load as load
    from specstack.llama import INEXACT

    verdicts = {"auto": dataclasses.replace(INEXACT, why="--exact auto: off (measured)")}
    monkeypatch.setattr(load, "cached_shapes", lambda target, mode: verdicts[mode])
    target = LlamaModel(ModelConfig(DEFAULT_TARGET), role="target")  # flash_attn None: auto, the default
    assert not target.flash_attn
    monkeypatch.setattr(LlamaModel, "_load_model", lambda self: pytest.fail("reopen read the weights again"))
    got = open_for_mode(target, "auto")
    del target
    gc.collect()  # the old object no longer owns the weights: freeing it must not free them
    try:
        assert got.flash_attn and got.config.flash_attn and not got.shapes.exact
        assert "one slot, with flash attention" in got.shapes.why
        out = Engine(got, create("prompt-lookup", BuildContext(got))).generate(PROMPTS[0], GenerationConfig(max_tokens=8)).run()
        assert len(out.output_ids) == 8  # the reopened context decodes on the weights it took over
    finally:
        got.close()
    monkeypatch.undo()
    for config, mode in ((ModelConfig(DEFAULT_TARGET, flash_attn=False), "auto"), (ModelConfig(DEFAULT_TARGET, flash_attn=None), "on")):
        kept = LlamaModel(config, role="target")
        try:
            assert open_for_mode(kept, mode) is kept and not kept.flash_attn
        finally:
            kept.close()


def test_a_server_measures_autos_verdict_before_choosing_how_its_slots_share_the_cache(tmp_path, monkeypatch):
    """``open_for_mode(measure=True)`` (the server's load): where auto's verdict is not cached, it is measured
    first, so a first run already has the layout the verdict calls for (one unified cache when it is off,
    the streams when it is on), instead of serving its whole life on streams."""
    from specstack.calibration import cached_shapes

    monkeypatch.setenv("SPECSTACK_CACHE_DIR", str(tmp_path))  # nothing cached: a first run
    streams = LlamaModel(ModelConfig(DEFAULT_TARGET, n_slots=3), role="target")
    assert cached_shapes(streams, "auto") is None
    assert open_for_mode(streams, "auto") is streams and not streams.shapes.settled  # without measure: kept as is
    served = open_for_mode(streams, "auto", measure=True)
    again = LlamaModel(ModelConfig(DEFAULT_TARGET, n_slots=3), role="target")
    try:
        verdict = cached_shapes(again, "auto")
        assert verdict is not None and served.shapes.settled  # measured (on the streams) and cached
        assert served.shapes.exact == verdict.exact
        if verdict.exact:
            assert served is streams and not served.unified
        else:
            assert served.unified and "unified KV cache" in served.shapes.why
    finally:
        served.close()
        again.close()


# -- stand-ins: shapes measured per weight type, exact at k = 16 ------------------------

@pytest.fixture(scope="module", params=["f16", "q8_0", "q4_k_m"])
def standin(request, tmp_path_factory):
    from specstack.modelfile.standin import make_standin

    out = tmp_path_factory.mktemp("standin") / f"s512-{request.param}.gguf"
    make_standin(DEFAULT_TARGET, out, width=512, layers=6, ftype=request.param, progress=False)
    model = LlamaModel(ModelConfig(out, n_ctx=512), role="target")
    ensure_shapes(model)
    yield request.param, model
    model.close()


def test_measured_shapes_hold_on_fresh_tokens(standin):
    """Calls within the measured shapes reproduce plain decoding on tokens the measurement never saw;
    where the measurement found a limit, the next larger call really computes differently."""
    ftype, model = standin
    shapes = model.shapes
    depth, n = 100, 20
    toks = filler(model, depth + n + 8)[::-1]
    model.reset()
    model.prefill(toks[:depth])
    ref = []
    for j in range(n):  # plain decoding: one call per token, padded to min_rows
        ref.append(model.raw_call([toks[depth + j]] * 1 + [toks[depth + j]] * (shapes.min_rows - 1))[0].copy())
        model.truncate(depth + j + 1)
    model.truncate(depth)
    for t in range(shapes.min_rows, min(shapes.max_rows, n) + 1):
        rows = model.raw_call(toks[depth : depth + t])
        assert np.array_equal(rows, np.stack(ref[:t])), (ftype, t)
        model.truncate(depth)
    if shapes.max_rows < n:
        rows = model.raw_call(toks[depth : depth + n])
        assert not np.array_equal(rows, np.stack(ref)), ftype
    model.reset()


def test_standins_are_lossless_at_k16_with_drafts_accepted_beyond_8(standin):
    ftype, model = standin
    fresh = measure_shapes(model)
    assert (fresh.min_rows, fresh.max_rows) == (model.shapes.min_rows, model.shapes.max_rows)  # the cache is right
    none = Engine(model, create("none", BuildContext(model)))
    spec = Engine(model, create("prompt-lookup", BuildContext(model)), FixedK(16))
    deep = 0
    for p in held_out_prompts(4):
        want = none.generate(p, GenerationConfig(max_tokens=96)).run().output_ids
        gen = spec.generate(p, GenerationConfig(max_tokens=96)).run()
        assert gen.output_ids == want, ftype
        deep += sum(gen.stats.accepted_at[8:])
    assert deep > 0  # verification batches past 8 rows were accepted (split where the shapes require)


def test_host_prompt_cache_restores_a_prefix_exactly(target):
    """One slot: prompt A, then B (A's KV goes to host memory), then A again (restored, not prefilled)."""
    engine = Engine(target, create("prompt-lookup", BuildContext(target)), prompt_cache_bytes=64 << 20)
    a = PROMPTS[0] + "\n"
    first = engine.generate(a, GenerationConfig(max_tokens=24)).run()
    engine.generate(PROMPTS[1], GenerationConfig(max_tokens=24)).run()
    assert len(engine.prompt_cache.entries) == 1
    again = engine.generate(a, GenerationConfig(max_tokens=24)).run()
    assert engine.prompt_cache.hits == 1
    assert again.stats.n_reused == len(target.tokenize(a)) - 1
    assert again.output_ids == first.output_ids == plain(target, a, 24)


def test_a_cancelled_generation_is_not_filed_as_a_whole_answer(target):
    drafter = create("suffix", BuildContext(target))
    engine = Engine(target, drafter)
    gen = engine.generate(PROMPTS[0], GenerationConfig(max_tokens=100))
    for _ in range(5):
        engine.step()
    gen.cancel()
    assert drafter.global_tree.n_tokens == 0  # nothing learnt from the abandoned output
    engine.generate(PROMPTS[1], GenerationConfig(max_tokens=8)).run()
    assert drafter.global_tree.n_tokens > 0  # a finished one is filed


def test_a_stream_left_early_is_cancelled_not_filed(target):
    """A consumer that stops reading (``break``) abandons the generation: slot freed, output not learnt from."""
    drafter = create("suffix", BuildContext(target))
    engine = Engine(target, drafter)
    gen = engine.generate(PROMPTS[0], GenerationConfig(max_tokens=100))
    pieces = 0
    for _ in gen:
        pieces += 1
        if pieces == 3:
            break
    assert gen.status == "cancelled" and gen.stats.stop_reason == "cancelled"
    assert not engine.busy and target.seq_pos_max(0) == -1
    assert drafter.global_tree.n_tokens == 0
    finished = engine.generate(PROMPTS[1], GenerationConfig(max_tokens=8))
    assert "".join(finished) == finished.text and finished.status == "done"
    assert drafter.global_tree.n_tokens > 0
