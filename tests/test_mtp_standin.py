"""``make-standin --mtp``: random-weight GGUFs with a NextN block, in three real layouts, at toy sizes.

- each layout (qwen35moe, qwen35, glm4moe) loads with its NextN layer, gives finite logits, and ``--drafter mtp``
  at temperature 0 equals plain decoding under ``--exact on``, with drafts that were really made and rejected;
- the hybrid (qwen35moe: gated delta net + attention) cuts its recurrent state back by llama.cpp's rollback and,
  forced, by checkpoints; ``cascade:suffix,mtp`` has drafts accepted (the random model's greedy output runs in
  repeats: see ``mtp_tensors.tensor_specs``) while the head drafts too, and stays lossless;
- a quantized (q4_k_m) stand-in stays finite and lossless;
- the CLI names the layouts when given an unknown one, and says the weights are random;
- step35 (2 chained NextN heads, sliding-window attention) drafts with head i at draft position i: lossless at
  k = 1, 2 and 3, drafts never longer than the head count, every head run; ``cascade:suffix,mtp`` too;
- gemma4 with its separate assistant (``-md``, ``modelfile.standin.gemma4``): llama.cpp's shared-KV mode, lossless at
  k = 1 and 3 with drafts made, every draft row at the last committed token's position; without -md, one clear line.

Random weights: nothing here measures acceptance.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from specstack.commands.bench import register_make_standin
from specstack.drafters.mtp import check_mtp_model
from specstack.errors import InvalidParameterError, UnsupportedModelError
from specstack.generation import GenerationConfig
from specstack.loading import TargetSpec, build_engine, load_calibrated
from specstack.modelfile.standin.gemma4 import make_gemma4_pair
from specstack.modelfile.standin.mtp import make_mtp_standin
from specstack.modelfile.standin.mtp_layouts import LAYOUTS, mtp_shape

PROMPTS = ["def f(", "import os\n", "class A:\n    def __init__(self):"]
MAX_TOKENS = 48
# (layout, trunk layers, experts): qwen35* need 4 layers for one full-attention layer (every 4th); glm4moe's
# 2 are its leading dense layer and an MoE one. Width 64 everywhere.
TINY = [("qwen35moe", 4, 4), ("qwen35", 4, None), ("glm4moe", 2, 4)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Each layout's toy stand-in (F16, width 64), written once for the module."""
    work = tmp_path_factory.mktemp("mtp-standin")
    out = {}
    for name, layers, experts in TINY:
        out[name] = work / f"{name}.gguf"
        make_mtp_standin(name, out[name], layers, width=64, experts=experts, progress=False)
    return out


class Loaded:
    """A stand-in loaded as a ``--exact on`` target at one thread, with its plain greedy outputs."""

    def __init__(self, path: Path, rollback: str = "auto") -> None:
        self.calibration = load_calibrated(TargetSpec(model=path, exact="on", threads=1, rollback=rollback))
        self.target = self.calibration.target
        self.plain = [g.output_ids for g in self.run("none")]

    def run(self, drafter: str, k: int = 3):
        engine = build_engine(self.calibration, drafter, "fixed", k=k)
        return [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)).run() for p in PROMPTS]

    def close(self) -> None:
        self.target.close()


def assert_lossless(loaded: Loaded, gens, what: str) -> None:
    for prompt, gen, expected in zip(PROMPTS, gens, loaded.plain):
        assert gen.output_ids == expected, f"{what} diverged from plain decoding on {prompt!r}"


@pytest.mark.parametrize("name", [t[0] for t in TINY])
def test_each_layout_drafts_with_mtp_losslessly(tiny, name):
    loaded = Loaded(tiny[name])
    target = loaded.target
    try:
        assert target.meta.architecture == LAYOUTS[name].arch
        assert target.n_nextn == 1 and target.mtp_loaded
        target.reset(0)
        logits = target.eval(target.tokenize(PROMPTS[2]), logits_from=0).copy()
        target.reset(0)
        assert np.isfinite(logits).all() and logits.std() > 0.1  # random, finite, not flat
        assert all(len(set(out)) > 1 for out in loaded.plain), "greedy output is one token repeated"
        gens = loaded.run("mtp")
        assert_lossless(loaded, gens, f"mtp on {name}")
        drafted = sum(g.stats.n_drafted for g in gens)
        accepted = sum(g.stats.n_accepted for g in gens)
        assert drafted >= len(PROMPTS) * MAX_TOKENS // 2 and accepted < drafted  # drafts made, and rejected
        hybrid = LAYOUTS[name].hybrid
        assert target.memory == ("hybrid" if hybrid else "attention")
        if hybrid:  # every rejection cut the recurrent state back
            assert all(g.stats.rewind == "rollback" for g in gens)
            assert sum(g.stats.rewound.rollbacks for g in gens) > 0
    finally:
        loaded.close()


@pytest.mark.parametrize("rollback", ["auto", "checkpoint"])
def test_hybrid_rewinds_and_stacked_drafts_stay_lossless(tiny, rollback):
    """qwen35moe: llama.cpp rolls its gated-delta-net state back (auto) or specstack restores checkpoints; with the
    suffix drafter in front of the head, some drafts are accepted (partial acceptance, then a cut) and the head
    still drafts where retrieval has nothing."""
    loaded = Loaded(tiny["qwen35moe"], rollback)
    try:
        strategy = "rollback" if rollback == "auto" else "checkpoint"
        assert loaded.target.strategy == strategy
        gens = loaded.run("cascade:suffix,mtp", k=4)
        assert_lossless(loaded, gens, f"cascade:suffix,mtp ({strategy})")
        stats = [g.stats for g in gens]
        assert all(s.rewind == strategy for s in stats)
        assert sum(s.n_accepted for s in stats) > 0
        assert sum(s.by_source["mtp"].n_drafted for s in stats if "mtp" in s.by_source) > 0
        assert sum(s.by_source["suffix"].n_accepted for s in stats if "suffix" in s.by_source) > 0
        if strategy == "rollback":
            assert sum(s.rewound.rollbacks for s in stats) > 0
        else:
            assert sum(s.rewound.checkpoints for s in stats) > 0 and sum(s.rewound.restores for s in stats) > 0
    finally:
        loaded.close()


STEP35_HEADS = 2


@pytest.fixture(scope="module")
def step35(tmp_path_factory) -> Path:
    """step35's toy stand-in: 4 trunk layers (1 full attention, 3 sliding window; 3 dense then MoE), 2 NextN heads."""
    path = tmp_path_factory.mktemp("mtp-step35") / "step35.gguf"
    make_mtp_standin("step35", path, 4, width=64, experts=4, nextn=STEP35_HEADS, progress=False)
    return path


class _HeadCalls:
    """Counts the MTP context's calls per head (``MtpContext.run``'s ``head``), around the real ones."""

    def __init__(self, ctx) -> None:
        self.ctx, self.real, self.by_head = ctx, ctx.run, {}
        ctx.run = self

    def __call__(self, entries, head: int = 0):
        self.by_head[head] = self.by_head.get(head, 0) + 1
        return self.real(entries, head)


def test_step35_chained_heads_draft_losslessly(step35, monkeypatch):
    loaded = Loaded(step35)
    target = loaded.target
    try:
        assert target.meta.architecture == "step35" and target.meta.mtp_mode == "chained heads"
        assert target.n_nextn == STEP35_HEADS and target.mtp_loaded
        assert all(len(set(out)) > 1 for out in loaded.plain), "greedy output is one token repeated"
        for k in (1, 2, 3):
            engine = build_engine(loaded.calibration, "mtp", "fixed", k=k)
            head = engine.drafter.head
            assert head.chained and head.n_heads == STEP35_HEADS
            calls = _HeadCalls(head)
            gens = [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)).run() for p in PROMPTS]
            assert_lossless(loaded, gens, f"mtp (chained heads) at k={k}")
            drafted = sum(g.stats.n_drafted for g in gens)
            steps = sum(g.stats.n_steps for g in gens)
            assert drafted >= len(PROMPTS) * MAX_TOKENS // 2, f"k={k}: too few drafts ({drafted})"
            assert drafted <= steps * min(k, STEP35_HEADS), f"k={k}: a draft longer than the heads (or k)"
            if k >= STEP35_HEADS:  # position 2 needs head 1: k = 3 is clipped to 2, not run past the heads
                assert drafted > steps, f"k={k}: no draft used the second head"
            # every catch-up and every draft runs each head once (a stopped draft still catches the later heads up)
            assert [calls.by_head.get(h, 0) for h in range(STEP35_HEADS)] == [calls.by_head[0]] * STEP35_HEADS, \
                f"k={k}: calls per head {calls.by_head}"
    finally:
        loaded.close()


def test_step35_cascade_with_suffix_stays_lossless(step35):
    loaded = Loaded(step35)
    try:
        gens = loaded.run("cascade:suffix,mtp", k=4)
        assert_lossless(loaded, gens, "cascade:suffix,mtp on step35")
        stats = [g.stats for g in gens]
        assert sum(s.by_source["mtp"].n_drafted for s in stats if "mtp" in s.by_source) > 0
        assert sum(s.by_source["suffix"].n_accepted for s in stats if "suffix" in s.by_source) > 0
    finally:
        loaded.close()


def test_quantized_standin_is_finite_and_lossless(tmp_path):
    """Q4_K_M at width 256 (whole K-quant blocks), through llama.cpp's quantizer."""
    path = tmp_path / "qwen35moe-q4.gguf"
    make_mtp_standin("qwen35moe", path, 4, "q4_k_m", width=256, experts=4, progress=False)
    loaded = Loaded(path)
    try:
        target = loaded.target
        target.reset(0)
        assert np.isfinite(target.eval(target.tokenize(PROMPTS[0]), logits_from=0)).all()
        target.reset(0)
        assert_lossless(loaded, loaded.run("mtp"), "mtp on q4_k_m")
    finally:
        loaded.close()


def test_shapes_follow_the_real_layouts():
    full = mtp_shape("qwen35moe", 40)
    assert (full.n_embd, full.n_head, full.n_head_kv, full.n_expert, full.n_expert_used) == (2048, 16, 2, 256, 8)
    assert sum(not full.is_recurrent(i) for i in range(40)) == 10 and not full.is_recurrent(40)
    half = mtp_shape("glm4moe", 4, width=2048, experts=16)
    assert (half.n_head, half.n_head_kv, half.n_ff_exp, half.n_ff_shexp, half.n_expert) == (48, 4, 704, 704, 16)
    with pytest.raises(InvalidParameterError, match="--layers must be >= 4"):
        mtp_shape("qwen35", 3)
    with pytest.raises(InvalidParameterError, match="multiple of 32"):
        mtp_shape("qwen35", 4, width=100)
    step = mtp_shape("step35", 45)
    assert (step.n_block, step.n_head, step.n_head_swa, step.n_expert, step.n_nextn) == (48, 64, 96, 288, 3)
    assert [step.is_swa(i) for i in range(5)] == [False, True, True, True, False] and not step.is_swa(46)
    assert not step.is_moe(2) and step.is_moe(3) and not step.is_moe(45)
    assert mtp_shape("step35", 4, width=64, nextn=2).n_block == 6
    with pytest.raises(InvalidParameterError, match="--nextn must be in 1..3"):
        mtp_shape("step35", 4, nextn=4)


def _cli() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specstack bench")
    register_make_standin(parser.add_subparsers(dest="bench_command"))
    return parser


def test_cli_names_the_layouts_for_an_unknown_one(tmp_path):
    out = tmp_path / "x.gguf"
    args = _cli().parse_args(["make-standin", "--mtp", "qwen36", "--layers", "4", "-o", str(out)])
    with pytest.raises(InvalidParameterError, match="unknown MTP layout 'qwen36'; choose one of qwen35moe, qwen35, glm4moe"):
        args.func(args)
    assert not out.exists()


def test_cli_writes_one_and_says_its_weights_are_random(tmp_path, capsys):
    parser = _cli()
    help_text = parser._subparsers._group_actions[0].choices["make-standin"].format_help()
    assert "--mtp LAYOUT" in help_text and "never for acceptance" in " ".join(help_text.split())
    out = tmp_path / "g.gguf"
    args = parser.parse_args(["make-standin", "--mtp", "glm4moe", "--layers", "2", "--width", "64", "--experts", "4",
                              "-o", str(out)])
    assert args.func(args) == 0
    said = capsys.readouterr().out
    assert "RANDOM weights" in said and "never acceptance" in said and out.is_file()
    args = parser.parse_args(["make-standin", "--mtp", "glm4moe", "--layers", "2", "--kv-heads", "2", "-o", str(out)])
    with pytest.raises(InvalidParameterError, match="--kv-heads: not used with --mtp"):
        args.func(args)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> tuple[Path, Path]:
    """A 2-layer gemma4 target (sliding-window, then full attention) and its 2-layer assistant, width 64 / 32."""
    return make_gemma4_pair(tmp_path_factory.mktemp("gemma4") / "gemma4.gguf")


class _Positions:
    """Wraps a drafter's ``propose`` and its MTP context's ``run``: per draft, the position of its last committed
    token (``len(context) - 1``) and the (position, rows) of every row block its calls ran."""

    def __init__(self, drafter) -> None:
        self.propose, self.run, self.drafts = drafter.propose, drafter.head.run, []
        drafter.propose, drafter.head.run = self._propose, self._run

    def _propose(self, requests):
        self.drafts.append(([len(r.context) - 1 for r in requests], []))
        return self.propose(requests)

    def _run(self, entries, head: int = 0):
        self.drafts[-1][1].extend((e.pos, len(e.tokens)) for e in entries)
        return self.run(entries, head)


def test_gemma4_assistant_drafts_losslessly(gemma4):
    target_path, assistant = gemma4
    loaded = Loaded(target_path)
    try:
        assert loaded.target.meta.architecture == "gemma4"
        for k in (1, 3):
            engine = build_engine(loaded.calibration, "mtp", "fixed", k=k, drafter_options={"draft_model": assistant})
            head = engine.drafter.head
            assert head.shared and not head.chained
            seen = _Positions(engine.drafter)
            gens = [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)).run() for p in PROMPTS]
            assert_lossless(loaded, gens, f"mtp (gemma4 assistant) at k={k}")
            drafted = sum(g.stats.n_drafted for g in gens)
            assert drafted >= len(PROMPTS) * MAX_TOKENS // 2, f"k={k}: too few drafts ({drafted})"
            if k > 1:
                assert drafted > sum(g.stats.n_steps for g in gens), f"k={k}: no draft longer than one token"
            # no catch-up (one row a call) and every row of a draft at its last committed token's position (pos0)
            assert seen.drafts and all(rows for _, rows in seen.drafts)
            for (pos0,), rows in seen.drafts:
                assert rows == [(pos0, 1)] * len(rows), f"k={k}: draft rows {rows}, expected all at {pos0}"
            assert max(len(rows) for _, rows in seen.drafts) == k, f"k={k}: no draft of k rows"
    finally:
        loaded.close()


def test_gemma4_without_assistant_names_the_fix(gemma4):
    target_path, assistant = gemma4
    with pytest.raises(UnsupportedModelError, match=r"separate MTP assistant model: give it with -md ASSISTANT\.gguf"):
        check_mtp_model(target_path)
    assert check_mtp_model(target_path, assistant=assistant) == assistant
    with pytest.raises(UnsupportedModelError, match="is an MTP assistant, not a model to generate with"):
        check_mtp_model(assistant)
    with pytest.raises(UnsupportedModelError, match="not the gemma4-assistant"):
        check_mtp_model(target_path, assistant=target_path)
    loaded = Loaded(target_path)
    try:
        with pytest.raises(UnsupportedModelError, match="-md ASSISTANT.gguf"):
            build_engine(loaded.calibration, "mtp", "fixed", k=2)
    finally:
        loaded.close()
