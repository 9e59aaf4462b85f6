"""``--drafter mtp`` on the bundled trained MTP model (``pycoder-6m-mtp``: pycoder-6m's trunk as glm4moe plus a
trained NextN head): lossless like every drafter, with drafts accepted.

- greedy output identical to plain decoding at k 1, 2, 4 and 16 under ``--exact on``, drafts accepted at
  every position the head reaches;
- the target's logits with hidden rows on are bitwise those without (prefill chunks and verification calls);
- four concurrent generations identical to their solo runs (one MTP context, batched draft calls);
- sampled output follows the target's distribution with the head's q (a chi-square test, small);
- prefix reuse: a prompt that shares a prefix with a slot's last one drafts from the head's kept cache;
- bad input: a model without NextN layers gets one line naming it and the drafters that work, without a load.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest

from specstack.draft_length import FixedK
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.errors import ModelLoadError, UnsupportedModelError
from specstack.generation import GenerationConfig
from specstack.llama import LlamaModel, ModelConfig, Segment
from specstack.calibration import calibrate_target
from specstack.paths import DEFAULT_TARGET, MODELS_DIR
from specstack.prompts import held_out_prompts
from specstack.sampling import SamplingParams, target_probs

MTP_MODEL = MODELS_DIR / "pycoder-6m-mtp.gguf"
PROMPTS = held_out_prompts(6)
MAX_TOKENS = 64


def exact_target(**config) -> LlamaModel:
    """The MTP model as a ``--exact on`` target (its exact call shapes measured, cached)."""
    return calibrate_target(LlamaModel(ModelConfig(MTP_MODEL, **config), role="target"), "on").target


@pytest.fixture(scope="module")
def mtp_target():
    model = exact_target()
    assert model.mtp_loaded
    yield model
    model.close()


@pytest.fixture(scope="module")
def plain_outputs():
    """Plain greedy decoding on the same file loaded without its NextN layers and without hidden rows."""
    model = exact_target(load_mtp=False)
    assert not model.keeps_hidden and not model.mtp_loaded
    engine = Engine(model, create("none", BuildContext(model)))
    out = [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)).run().output_ids for p in PROMPTS]
    model.close()
    return out


@pytest.mark.parametrize("k", [1, 2, 4, 16])
def test_greedy_mtp_equals_plain_decoding(mtp_target, plain_outputs, k):
    engine = Engine(mtp_target, create("mtp", BuildContext(mtp_target)), FixedK(k))
    drafted, accepted = [0] * k, [0] * k
    for prompt, expected in zip(PROMPTS, plain_outputs):
        gen = engine.generate(prompt, GenerationConfig(max_tokens=MAX_TOKENS)).run()
        assert gen.output_ids == expected, f"mtp k={k} diverged on {prompt[:60]!r}"
        for i, (d, a) in enumerate(zip(gen.stats.drafted_at, gen.stats.accepted_at)):
            drafted[i] += d
            accepted[i] += a
    rates = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
    print(f"mtp k={k} acceptance by position: " + " ".join(f"{r:.2f}" for r in rates[:8]))
    assert accepted[0] > 0.3 * drafted[0], f"the trained head's first draft is accepted {rates[0]:.2f} of the time"
    assert accepted[min(k, 2) - 1] > 0, "a chained draft position was never accepted"


@pytest.mark.parametrize("name", ["cascade:suffix,mtp", "fusion:suffix,mtp"])
def test_retrieval_stacked_in_front_of_mtp_is_lossless(mtp_target, plain_outputs, name):
    """Retrieval first, the head behind it: the head's rows follow every step, whichever source's draft was
    verified (fusion verifies its leading branch: trees are off for drafters that read hidden rows)."""
    engine = Engine(mtp_target, create(name, BuildContext(mtp_target)), FixedK(4))
    by_source: Counter = Counter()
    for prompt, expected in zip(PROMPTS, plain_outputs):
        gen = engine.generate(prompt, GenerationConfig(max_tokens=MAX_TOKENS)).run()
        assert gen.output_ids == expected, f"{name} diverged on {prompt[:60]!r}"
        for source, st in gen.stats.by_source.items():
            by_source[source] += st.n_accepted
    if name.startswith("cascade"):  # per-source statistics: both sources' drafts were accepted
        assert by_source["mtp"] > 0 and by_source["suffix"] > 0, by_source
    else:  # fused drafts are the fusion's (its parts are scored in the policy's book)
        assert sum(by_source.values()) > 0, by_source


def test_hidden_rows_leave_the_targets_logits_bitwise_unchanged(mtp_target):
    """Unmasked NextN rows make llama.cpp compute the last layer for every row; calls that output every row (an
    exact verification) or none (a prefill chunk) keep plain decoding's logits bit for bit."""
    plain = exact_target(load_mtp=False)
    assert plain.shapes == mtp_target.shapes
    with_rows = mtp_target
    with_rows.want_hidden()
    ids = with_rows.tokenize(PROMPTS[0])
    for model in (plain, with_rows):
        model.reset(0)
        model.prefill(ids[:-5], 0)
    for step in (ids[-5:-3], ids[-3:-2], ids[-2:]):
        a = plain.decode([Segment(0, step, 0)])[0].copy()
        b = with_rows.decode([Segment(0, step, 0)])[0].copy()
        assert np.array_equal(a, b)
    rows = with_rows.take_hidden(0)
    assert rows is not None and rows.start == 0 and rows.end == len(ids)
    with_rows.reset(0)
    plain.close()


def test_a_cut_drops_the_hidden_rows_of_rejected_tokens(mtp_target):
    mtp_target.want_hidden()
    mtp_target.reset(0)
    mtp_target.prefill([0, 11, 12, 13], 0)
    mtp_target.decode([Segment(0, [14, 15, 16], 0)])
    mtp_target.truncate(5, 0)  # 4 prompt tokens and the first of the verified three kept
    rows = mtp_target.take_hidden(0)
    assert (rows.start, rows.end) == (0, 5)
    assert mtp_target.take_hidden(0) is None
    mtp_target.reset(0)


def test_four_concurrent_generations_equal_their_solo_runs(plain_outputs):
    multi = LlamaModel(ModelConfig(MTP_MODEL, n_slots=4), role="target")
    drafter = create("mtp", BuildContext(multi))
    engine = Engine(multi, drafter, FixedK(4))
    gens = [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)) for p in PROMPTS[:4]]
    calls_before = drafter.head.calls
    while engine.busy:
        engine.step()
    assert [g.output_ids for g in gens] == plain_outputs[:4]
    assert all(g.stats.n_accepted > 0 for g in gens)
    steps = max(g.stats.n_steps for g in gens)
    # one MTP call per draft position for all four (plus the prompts' catch-ups), not one per generation
    assert drafter.head.calls - calls_before < 4 * steps + 4
    multi.close()


def test_prefix_reuse_keeps_the_heads_cache(mtp_target, plain_outputs):
    """A second request on the same slot reuses the target's KV of the shared prefix; the head keeps its own cache
    of that prefix too (no catch-up from position 0) and drafts as well as from a cold start."""
    mtp_target.reset()
    drafter = create("mtp", BuildContext(mtp_target))
    engine = Engine(mtp_target, drafter, FixedK(4))
    rows = drafter.head.rows
    cold = engine.generate(PROMPTS[1], GenerationConfig(max_tokens=MAX_TOKENS)).run()
    cold_rows, rows = drafter.head.rows - rows, drafter.head.rows
    warm = engine.generate(PROMPTS[1], GenerationConfig(max_tokens=MAX_TOKENS)).run()
    warm_rows = drafter.head.rows - rows
    assert cold.stats.n_reused == 0 and warm.stats.n_reused > 0
    assert warm.output_ids == cold.output_ids == plain_outputs[1]
    assert warm_rows <= cold_rows - warm.stats.n_reused  # the reused prefix was not caught up again
    assert warm.stats.n_accepted >= 0.8 * cold.stats.n_accepted


def test_host_prompt_cache_brings_back_the_heads_cache(mtp_target, plain_outputs):
    """One slot: prompt A, then B (A's KV goes to host memory, with the head's cache and rows), then A again: the
    target's KV is restored, and so is the head's, so the head catches up on nothing it had already seen."""
    mtp_target.reset()
    drafter = create("mtp", BuildContext(mtp_target))
    engine = Engine(mtp_target, drafter, FixedK(4), prompt_cache_bytes=64 << 20)
    rows = drafter.head.rows
    first = engine.generate(PROMPTS[1], GenerationConfig(max_tokens=MAX_TOKENS)).run()
    first_rows = drafter.head.rows - rows
    engine.generate(PROMPTS[2], GenerationConfig(max_tokens=MAX_TOKENS)).run()
    assert engine.prompt_cache.entries[0].drafter is not None
    rows = drafter.head.rows
    again = engine.generate(PROMPTS[1], GenerationConfig(max_tokens=MAX_TOKENS)).run()
    assert engine.prompt_cache.hits == 1 and again.stats.n_reused > 0
    assert again.output_ids == first.output_ids == plain_outputs[1]
    # Without the head's state it would start where the restored prefix ends, attending to nothing before it.
    assert drafter.head.pos_min(0) == 0
    assert drafter.head.rows - rows <= first_rows - again.stats.n_reused  # and caught up on none of it
    assert again.stats.n_accepted >= 0.8 * first.stats.n_accepted


class _Scripted(FixedK):
    """Draft 4 for a few steps, then plain for 40, then one probe, then real drafts again (a cost policy's course
    on a prompt where the head stops paying and starts again)."""

    def __init__(self) -> None:
        super().__init__(4)
        self.steps = 0

    def budget(self, cap, load=None, tree=False):
        from specstack.draft_length import Budget

        i, self.steps = self.steps, self.steps + 1
        if i < 3 or i > 44:
            return Budget(min(4, cap))
        if i == 44:
            return Budget(min(2, cap), probe=True)
        return Budget(0)

    def fork(self):
        return self


def test_plain_steps_cost_the_head_nothing_and_a_probe_reads_a_window(mtp_target, plain_outputs):
    """Plain steps used to catch the head up every 8 of them, drafting or not; now they cost it nothing, and a
    probe drafts from the last CATCH_UP pairs in a cache started afresh; the next real draft goes on from that
    window (it used to catch up the whole context first: a spike of two plain steps, accepted or not)."""
    from specstack.drafters.mtp import CATCH_UP

    mtp_target.reset()
    drafter = create("mtp", BuildContext(mtp_target))
    policy = _Scripted()
    engine = Engine(mtp_target, drafter, policy)
    rows_at: dict[int, int] = {}  # head rows run by the end of each policy step (budget)
    gen = engine.generate(PROMPTS[2], GenerationConfig(max_tokens=MAX_TOKENS + 32))
    for _ in gen:
        rows_at[policy.steps] = drafter.head.rows
        if policy.steps == 45:
            assert drafter.head.pos_min(0) > 0  # the probe's window: the cache starts at the last CATCH_UP pairs
    assert [rows_at[s] - rows_at[s - 1] for s in range(5, 45)] == [0] * 40  # plain steps: not a row
    assert 0 < rows_at[45] - rows_at[44] <= CATCH_UP + 1 + 2  # the probe: its window's pairs and its draft rows
    window_start = drafter.head.pos_min(0)
    assert window_start > 0  # the real drafts after the probe went on from its window
    assert max(rows_at[s] - rows_at[s - 1] for s in range(46, policy.steps + 1)) <= 12  # no catch-up of ~40 pairs
    assert gen.output_ids[:MAX_TOKENS] == plain_outputs[2] and gen.stats.n_accepted > 0


def test_loaded_without_nextn_layers_it_refuses_instead_of_aborting():
    model = LlamaModel(ModelConfig(MTP_MODEL, load_mtp=False), role="target")
    assert model.n_nextn == 1 and not model.mtp_loaded
    with pytest.raises(ModelLoadError, match="without its NextN layers"):
        create("mtp", BuildContext(model))
    model.close()


def test_a_model_without_nextn_layers_gets_one_line_before_any_load():
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "specstack", "generate", "-m", str(DEFAULT_TARGET), "--drafter", "mtp",
                          "-p", "def f(x):", "-n", "4"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    assert DEFAULT_TARGET.name in lines[0] and "NextN" in lines[0] and "prompt-lookup" in lines[0]
    assert "loaded" not in run.stderr and "measuring" not in run.stderr
    assert time.perf_counter() - t0 < 30
    from specstack.drafters.mtp import check_mtp_model

    with pytest.raises(UnsupportedModelError, match="cascade|prompt-lookup"):
        check_mtp_model(DEFAULT_TARGET, "cascade:suffix,mtp")


def chi2_ok(counts: Counter, p: np.ndarray, n: int, z: float = 3.719) -> tuple[bool, float, float]:
    """Chi-square goodness of fit at p = 1e-4 (Wilson-Hilferty quantile), small cells pooled."""
    support = [int(t) for t in np.flatnonzero(p > 0)]
    assert set(counts) <= set(support), "a token outside the target's support was sampled"
    cells = [(counts.get(t, 0), n * p[t]) for t in support]
    big = [(o, e) for o, e in cells if e >= 5]
    small = [(o, e) for o, e in cells if e < 5]
    if small:
        big.append((sum(o for o, _ in small), sum(e for _, e in small)))
    stat = sum((o - e) ** 2 / e for o, e in big if e > 0)
    df = max(len(big) - 1, 1)
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


def test_sampled_mtp_follows_the_target_distribution(mtp_target):
    """Rejection sampling with the head's q: the first draft position (the generation's second token) given the
    most frequent first token, over 800 seeded draws; the head's draws really are verified and accepted."""
    sampling = dict(temperature=0.9, top_p=0.9, min_p=0.05)
    n = 800
    ids = mtp_target.tokenize("import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv:\n")
    engine = Engine(mtp_target, create("mtp", BuildContext(mtp_target, options={"seed": 3}, temperature=0.9)), FixedK(3))
    firsts, seconds, accepted = Counter(), {}, 0
    for seed in range(n):
        gen = engine.generate(ids, GenerationConfig(max_tokens=3, sampling=SamplingParams(**sampling, seed=seed))).run()
        if len(gen.output_ids) < 2:  # the first token ended it (end of text)
            continue
        a, b = gen.output_ids[:2]
        firsts[a] += 1
        seconds.setdefault(a, Counter())[b] += 1
        accepted += gen.stats.n_accepted
    assert accepted > n // 5
    from specstack.drafters.base import propose_one

    draft = propose_one(engine.drafter, ids + [firsts.most_common(1)[0][0]], 2, seq=0)
    assert draft.q is not None and draft.q.shape == (len(draft), mtp_target.n_vocab)  # the head's q, for rejection
    top = firsts.most_common(1)[0][0]
    mtp_target.reset(0)
    p2 = target_probs(mtp_target.eval(ids + [top], logits_from=len(ids)).copy(), SamplingParams(**sampling))[0]
    mtp_target.reset(0)
    ok, stat, crit = chi2_ok(seconds[top], p2, firsts[top])
    assert ok, f"second token (after {top}) chi2 {stat:.1f} >= {crit:.1f}"


def test_model_tools_report_the_mtp_layers(tmp_path, capsys):
    """check, models scan and doctor read the NextN layers from metadata and name --drafter mtp."""
    import shutil

    from specstack.commands.check import render
    from specstack.host.doctor import run_doctor
    from specstack.modelfile.compat import check_pair
    from specstack.modelfile.scan import render as render_scan, scan

    assert "target MTP: 1 NextN layer (single head): --drafter mtp" in render(check_pair(MTP_MODEL, DEFAULT_TARGET))
    assert "MTP" not in render(check_pair(DEFAULT_TARGET, DEFAULT_TARGET)).replace("MTP:", "")
    shutil.copy(MTP_MODEL, tmp_path / MTP_MODEL.name)
    table = render_scan(scan([tmp_path], use_cache=False))
    assert "1 (--drafter mtp)" in table and "glm4moe" in table
    checks, _ = run_doctor(MTP_MODEL)
    assert any(c.name == "mtp" and "--drafter mtp" in c.message for c in checks)


def test_generate_without_a_drafter_says_once_that_mtp_is_available():
    run = subprocess.run([sys.executable, "-m", "specstack", "generate", "-m", str(MTP_MODEL), "-p", "def f(x):",
                          "-n", "4", "-t", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("--drafter mtp drafts from them") == 1
