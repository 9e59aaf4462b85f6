"""``--drafter dflash`` (issue 59, docs/design-eagle3-dflash.md steps 5-6): a DFlash head GGUF beside the bundled target
through llama.cpp's own ``dflash`` architecture, lossless like every drafter.

- the head's context (``llama.heads.DFlashContext``): a block's logits are what the head's tensors give (a numpy
  forward of the plain DFlash graph: injected context K/V, non-causal attention over context and block, the
  target's embeddings and output borrowed), the same whether the context went in at once or row by row, and the
  block's rows leave the cache with the call;
- greedy output with ``--drafter dflash`` under ``--exact on`` equals plain decoding through ``build_engine`` (one
  and three slots) and the CLI: on a random-weight head (drafts made, all rejected), on that head with an oracle that
  makes its first slots right (drafts accepted, the rest rejected and rolled back: the head's cache then holds
  exactly the rows of the context, as a fresh injection of it), and on the trained head
  (``specstack/models/pycoder-6m-dflash.gguf``), whose drafts are accepted;
- the host prompt cache keeps the head's cache beside the target's KV, and a restore brings back the head holding the
  whole context; ``--draft-p-min`` ends a draft at the first unsure slot; a plain run's rows go in every
  ``PENDING_MAX`` steps;
- sampled drafts carry q, the softmax of each slot's logged row, and a seeded sampled run is reproducible;
- bad input: no head, a draft model, a DSpark head, a head without a mask token or for another target: one line, before
  any load.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader

from specstack.calibration import calibrate_target
from specstack.cli import main
from specstack.draft_length import Budget, FixedK
from specstack.drafters import BuildContext, create
from specstack.drafters.base import Asked, DraftRequest, check_target
from specstack.engine import Engine
from specstack.errors import SpecstackError, UnsupportedModelError
from specstack.generation import GenerationConfig
from specstack.llama import LlamaModel, ModelConfig
from specstack.loading import build_engine
from specstack.modelfile.meta import read_gguf
from specstack.paths import DEFAULT_DRAFT, DEFAULT_TARGET, MODELS_DIR
from specstack.prompts import held_out_prompts
from specstack.sampling import SamplingParams
from test_head_fit import dflash, write_gguf

TRAINED = MODELS_DIR / "pycoder-6m-dflash.gguf"  # the trained head (issue 59 step 4, scripts/make_dflash_head.py)
PROMPTS = held_out_prompts(4)
MAX_TOKENS = 40
L = 8  # the heads' block size here


def dflash_weights(path: Path, *, layers=(1, 3, 5), seed: int = 0, scale: float = 0.05) -> Path:
    """A runnable DFlash head for pycoder-6m with random weights, in the layout of the design note's section 5 (the
    trained head's): n_embd 256 = the target's, 2 layers, 8 query / 4 KV heads of 32 with q/k norms, SwiGLU 768,
    block 8, mask token 0, the target's embeddings and output borrowed; F16 matrices, F32 norms (numpy shapes are
    ggml's ``ne`` reversed)."""
    n_embd, n_head, n_kv, hd, n_ff = 256, 8, 4, 32, 768
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float16)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    keys: dict[str, Any] = {"dflash.context_length": 512, "dflash.embedding_length": n_embd, "dflash.block_count": 2,
                            "dflash.feed_forward_length": n_ff, "dflash.attention.head_count": n_head,
                            "dflash.attention.head_count_kv": n_kv, "dflash.rope.freq_base": 10000.0,
                            "dflash.rope.dimension_count": hd, "dflash.attention.layer_norm_rms_epsilon": 1e-5,
                            "dflash.target_layers": layers, "dflash.block_size": L, "tokenizer.ggml.mask_token_id": 0}
    tensors = {"fc.weight": mat(n_embd, len(layers) * n_embd), "enc.output_norm.weight": norm(n_embd),
               "output_norm.weight": norm(n_embd)}
    for i in range(2):
        tensors.update({f"blk.{i}.{name}.weight": t for name, t in (
            ("attn_norm", norm(n_embd)), ("attn_q", mat(n_head * hd, n_embd)), ("attn_k", mat(n_kv * hd, n_embd)),
            ("attn_v", mat(n_kv * hd, n_embd)), ("attn_output", mat(n_embd, n_head * hd)), ("attn_q_norm", norm(hd)),
            ("attn_k_norm", norm(hd)), ("ffn_norm", norm(n_embd)), ("ffn_gate", mat(n_ff, n_embd)),
            ("ffn_up", mat(n_ff, n_embd)), ("ffn_down", mat(n_embd, n_ff)))})
    return write_gguf(path, "dflash", keys, tensors)


def reference_block(head: Path, features: np.ndarray, tokens: list[int], pos0: int) -> np.ndarray:
    """The plain DFlash graph (llama.cpp's src/models/dflash.cpp) in numpy: ``features`` (rows of positions 0..) give
    each layer's context K/V; the block ``tokens`` at ``pos0``.. runs non-causally over context and block; returns
    the logits of every block row, through the target's tied embeddings."""
    w = {t.name: np.asarray(t.data, np.float32).reshape([int(x) for x in reversed(t.shape)])
         for t in GGUFReader(str(head)).tensors}
    emb = {t.name: t for t in GGUFReader(str(DEFAULT_TARGET)).tensors}["token_embd.weight"]
    emb = np.asarray(emb.data, np.float32).reshape(4096, 256)
    eps, hd, n_head, n_kv = 1e-5, 32, 8, 4

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    def rope(x: np.ndarray, pos: np.ndarray) -> np.ndarray:  # NEOX: dimension i pairs with i + hd/2
        half = hd // 2
        theta = pos[:, None] * 10000.0 ** (-np.arange(half) / half)
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    def heads(x: np.ndarray, wname: str, n: int, norm: str, pos: np.ndarray) -> np.ndarray:
        return rope(rms((x @ w[wname].T).reshape(len(x), n, hd), w[norm]), pos)

    ctx_pos = np.arange(len(features), dtype=np.float64)
    blk_pos = np.arange(pos0, pos0 + len(tokens), dtype=np.float64)
    g = rms(features @ w["fc.weight"].T, w["enc.output_norm.weight"])
    x = emb[tokens]
    for i in range(2):
        p = f"blk.{i}."
        k_ctx = heads(g, p + "attn_k.weight", n_kv, p + "attn_k_norm.weight", ctx_pos)
        v_ctx = (g @ w[p + "attn_v.weight"].T).reshape(len(g), n_kv, hd)
        h = rms(x, w[p + "attn_norm.weight"])
        q = heads(h, p + "attn_q.weight", n_head, p + "attn_q_norm.weight", blk_pos)
        k = np.concatenate([k_ctx, heads(h, p + "attn_k.weight", n_kv, p + "attn_k_norm.weight", blk_pos)])
        v = np.concatenate([v_ctx, (h @ w[p + "attn_v.weight"].T).reshape(len(h), n_kv, hd)])
        out = np.empty((len(x), n_head, hd))
        for j in range(n_head):
            s = q[:, j] @ k[:, j // (n_head // n_kv)].T / np.sqrt(hd)
            a = np.exp(s - s.max(1, keepdims=True))
            out[:, j] = (a / a.sum(1, keepdims=True)) @ v[:, j // (n_head // n_kv)]
        x = x + out.reshape(len(x), -1) @ w[p + "attn_output.weight"].T
        f = rms(x, w[p + "ffn_norm.weight"])
        gate, up = f @ w[p + "ffn_gate.weight"].T, f @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    return rms(x, w["output_norm.weight"]) @ emb.T


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("dflash")
    return {"random": dflash_weights(folder / "random.gguf"), "two": dflash_weights(folder / "two.gguf", layers=(2, 4),
                                                                                    seed=1)}


@pytest.fixture(scope="module")
def target():
    model = calibrate_target(LlamaModel(ModelConfig(DEFAULT_TARGET), role="target"), "on").target
    yield model
    model.close()


@pytest.fixture(scope="module")
def plain_outputs(target):
    """Plain greedy decoding, on a target that keeps no hidden rows."""
    assert not target.keeps_hidden
    engine = Engine(target, create("none", BuildContext(target)))
    return [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)).run().output_ids for p in PROMPTS]


# --- the head's context --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which,layers", [("random", (1, 3, 5)), ("two", (2, 4))])
def test_a_block_is_what_the_heads_tensors_give(heads, which, layers):
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=256), role="target")
    head = model.open_dflash(heads[which])
    assert head.target_layers == layers and (head.block_size, head.mask_id) == (L, 0)
    assert head.n_embd_enc == 256 * len(layers)
    model.want_hidden(head.target_layers)
    ids = model.tokenize(PROMPTS[0])[:30]
    model.prefill(ids[:-1], 0)
    feats = model.take_hidden(0).rows
    n = len(ids) - 1
    head.inject([(0, 0, feats)])
    assert head.pos_max(0) == n - 1
    got = head.block([(0, n, ids[-1])])[0]
    assert head.pos_max(0) == n - 1  # the block's rows are gone
    expected = reference_block(heads[which], feats, [ids[-1]] + [0] * (L - 1), n)[1:]
    assert got.shape == (L - 1, model.n_vocab)
    assert np.abs(got - expected).max() < 2e-2 * np.abs(expected).max()
    assert (got.argmax(1) == expected.argmax(1)).all()
    # a causal block would give other rows before the last: the causal flag is off
    causal = [reference_block(heads[which], feats, ([ids[-1]] + [0] * (L - 1))[: i + 2], n)[-1] for i in range(L - 1)]
    assert np.abs(got[0] - causal[0]).max() > 10 * np.abs(got - expected).max()
    # the context row by row, into a fresh sequence: the same block
    head.reset(0)
    for p in range(n):
        head.inject([(0, p, feats[p : p + 1])])
    assert np.allclose(head.block([(0, n, ids[-1])])[0], got, atol=1e-4)
    model.close()


def test_a_sequences_rows_follow_cuts_and_gaps():
    """The row store (``drafters.dflash._Seq``): rows handed again from an earlier position replace what followed (and
    the cache's rows from there are marked to cut); a gap is zeros; rows past a draft's end stay pending."""
    from specstack.drafters.dflash import _Seq
    from specstack.types import HiddenRows

    def rows(start: int, n: int, value: float) -> HiddenRows:
        return HiddenRows(start, np.full((n, 3), value, np.float32))

    st = _Seq()
    st.put(rows(0, 5, 1.0))
    first, r = st.take(3, 3)
    assert first == 0 and r[:, 0].tolist() == [1, 1, 1] and (st.n_kv, st.n_rows) == (3, 5)
    st.put(rows(4, 2, 2.0))  # position 4 again: the pending row there is replaced
    assert st.n_rows == 6 and not st.stale
    st.put(rows(1, 1, 3.0))  # position 1, which the cache holds: cut back
    assert (st.n_kv, st.n_rows, st.stale) == (1, 2, True)
    st.put(rows(4, 1, 4.0))  # positions 2, 3 never handed: zeros
    first, r = st.take(6, 3)
    assert first == 1 and r[:, 0].tolist() == [3, 0, 0, 4, 0]  # and zeros past what is known
    assert st.take(6, 3) == (6, None)


# --- losslessness -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,k", [("dflash", 3), ("dflash", 7), ("cascade:suffix,dflash", 4)])
def test_greedy_dflash_equals_plain_decoding(target, plain_outputs, heads, name, k):
    """A random head drafts (every draft rejected); rows follow every step, whichever source drafted it."""
    engine = build_engine(target, name, "fixed", k=k, drafter_options={"draft_model": heads["random"]})
    for prompt, expected in zip(PROMPTS, plain_outputs):
        gen = engine.generate(prompt, GenerationConfig(max_tokens=MAX_TOKENS)).run()
        assert gen.output_ids == expected, f"{name} diverged on {prompt[:60]!r}"
        assert gen.stats.n_drafted > 0


def _oracle(drafter, full: list[int], right: int) -> list[int]:
    """Make the head's first ``right`` slots of every block name the token plain decoding continues with (``full``:
    prompt and plain output), and later slots a wrong one, after the real block call (its cache work is real);
    returns a list that counts the blocks."""
    real = drafter.head.block
    seen: list[int] = []

    def block(entries):
        out = real(entries)
        for (seq, pos, token), logits in zip(entries, out):
            assert full[pos] == token
            for i in range(L - 1):
                at = pos + 1 + i
                want = full[at] if i < right and at < len(full) else (full[at] + 1) % 4096 if at < len(full) else 0
                logits[i] = 0.0
                logits[i, want] = 10.0
            seen.append(pos)
        return out

    drafter.head.block = block
    return seen


@pytest.mark.parametrize("right,k", [(2, 4), (7, 7)])
def test_accepted_and_rejected_drafts_leave_the_head_holding_the_context(target, plain_outputs, heads, right, k):
    """Drafts accepted in part: output is plain decoding's, and the head's cache holds the rows of exactly the
    committed context (its block then gives what a fresh injection of the whole context gives): rejected tokens'
    rows never went in, and the block rows left with each call."""
    engine = build_engine(target, "dflash", "fixed", k=k, drafter_options={"draft_model": heads["random"]})
    drafter = engine.drafter
    ids = target.tokenize(PROMPTS[1])
    full = ids + plain_outputs[1]
    seen = _oracle(drafter, full, right)
    gen = engine.generate(PROMPTS[1], GenerationConfig(max_tokens=MAX_TOKENS)).run()
    assert gen.output_ids == plain_outputs[1]
    assert gen.stats.n_accepted > 0 and len(seen) > 0
    if right < k:
        assert gen.stats.n_accepted < gen.stats.n_drafted  # some rejected: rolled back
    st = drafter._seqs[0]
    assert st.tokens == full[: len(st.tokens)]
    drafter._inject([(0, st, len(st.tokens) - 1)])
    del drafter.head.block  # the real block again
    _holds_the_context(drafter, target, st.tokens)
    drafter.end(0, complete=False)


def test_p_min_stops_at_the_first_unsure_slot_and_k_at_the_block(target, heads):
    """``--draft-p-min``: the draft ends before the first slot whose top probability is below it; the budget and the
    block's slots cap it."""
    drafter = create("dflash", BuildContext(target, {"draft_model": heads["random"], "p_min": 0.9}))
    real = drafter.head.block
    probs = [0.95, 0.97, 0.5, 0.99, 0.99, 0.99, 0.99]

    def block(entries):
        out = real(entries)
        for logits in out:
            for i, p in enumerate(probs):  # slot i: token 10 + i at probability p, the rest spread evenly
                logits[i] = np.log((1 - p) / (logits.shape[1] - 1))
                logits[i, 10 + i] = np.log(p)
        return out

    drafter.head.block = block
    ids = target.tokenize(PROMPTS[0])
    drafter.begin(ids, 0)
    assert drafter.propose([DraftRequest(0, ids, Budget(7))])[0].token_ids == (10, 11)
    assert drafter.propose([DraftRequest(0, ids, Budget(1))])[0].token_ids == (10,)
    probs[2] = 0.92
    assert drafter.propose([DraftRequest(0, ids, Budget(20))])[0].token_ids == tuple(range(10, 17))  # 7 slots
    drafter.end(0, complete=False)


def test_a_plain_run_injects_its_rows_every_pending_max_steps(target, heads):
    """Steps that do not draft leave their rows pending, at most ``PENDING_MAX``; then they go into the head's cache in
    one call, so it keeps the whole context without the next draft paying for a long run."""
    from specstack.drafters.dflash import PENDING_MAX
    from specstack.types import HiddenRows

    drafter = create("dflash", BuildContext(target, {"draft_model": heads["random"]}))
    ids = target.tokenize(PROMPTS[0])[:20]
    width = drafter.head.n_embd_enc
    drafter.begin(ids, 0, HiddenRows(0, np.ones((len(ids) - 1, width), np.float32)))
    assert drafter.head.pos_max(0) == len(ids) - 2
    injects = drafter.head.injects
    for i in range(PENDING_MAX):
        pos = len(ids) - 1 + i
        drafter.advance([7], 0, 0, HiddenRows(pos, np.ones((1, width), np.float32)))
        flushed = i + 1 == PENDING_MAX
        assert drafter.head.injects - injects == int(flushed)
        assert drafter.head.pos_max(0) == (pos if flushed else len(ids) - 2)
    drafter.end(0, complete=False)


def _holds_the_context(drafter, target, full: list[int], seq: int = 0) -> None:
    """The head's cache for ``seq`` holds the rows of exactly ``full`` but its last token: its block gives what a fresh
    injection of the whole context's rows (one prefill) gives."""
    n = len(full)
    assert drafter.head.pos_min(seq) == 0 and drafter.head.pos_max(seq) == n - 2
    held = drafter.head.block([(seq, n - 1, full[n - 1])])[0]
    target.reset(seq)
    target.prefill(full[: n - 1], seq)
    drafter.head.reset(seq)
    drafter.head.inject([(seq, 0, target.take_hidden(seq).rows)])
    again = drafter.head.block([(seq, n - 1, full[n - 1])])[0]
    assert np.abs(held - again).max() < 1e-3 * max(1.0, np.abs(again).max())


def test_host_prompt_cache_brings_back_the_heads_cache(target, plain_outputs, heads):
    """One slot: prompt A, then B (A's KV goes to host memory, with the head's cache), then A again: the target's
    KV is restored, and so is the head's, which then holds A's whole context, as a fresh injection of it."""
    target.reset()
    drafter = create("dflash", BuildContext(target, {"draft_model": heads["random"]}))
    engine = Engine(target, drafter, FixedK(4), prompt_cache_bytes=64 << 20)
    first = engine.generate(PROMPTS[1], GenerationConfig(max_tokens=MAX_TOKENS)).run()
    engine.generate(PROMPTS[2], GenerationConfig(max_tokens=MAX_TOKENS)).run()
    assert engine.prompt_cache.entries[0].drafter is not None
    again = engine.generate(PROMPTS[1], GenerationConfig(max_tokens=MAX_TOKENS)).run()
    assert engine.prompt_cache.hits == 1 and again.stats.n_reused > 0
    assert again.output_ids == first.output_ids == plain_outputs[1]
    # without the head's state it would start where the restored prefix ends, seeing nothing before it
    st = drafter._seqs[0]
    drafter._inject([(0, st, len(st.tokens) - 1)])
    _holds_the_context(drafter, target, st.tokens)
    drafter.end(0, complete=False)


def test_three_slots_at_once_equal_plain_decoding(plain_outputs, heads):
    """One head context for three generations: a step is one injection call and one block call for all of them."""
    multi = LlamaModel(ModelConfig(DEFAULT_TARGET, n_slots=3), role="target")
    engine = build_engine(multi, "dflash", "fixed", k=3, drafter_options={"draft_model": heads["random"]})
    head = engine.drafter.head
    gens = [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)) for p in PROMPTS[:3]]
    blocks, injects = head.blocks, head.injects
    while engine.busy:
        engine.step()
    assert [g.output_ids for g in gens] == plain_outputs[:3]
    steps = max(g.stats.n_steps for g in gens)
    assert head.blocks - blocks <= steps  # one block call a step for all, not one per generation
    assert head.injects - injects <= steps + 3  # (+ the prompts' rows, at begin)
    multi.close()


def test_cli_generate_with_dflash_prints_plain_decodings_text(capsys, heads):
    args = ["generate", "-p", PROMPTS[0], "-n", "24", "--exact", "on", "--json", "--k-policy", "fixed", "-k", "3"]
    assert main(args + ["--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--drafter", "dflash", "-md", str(heads["random"])]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["text"] == plain["text"] and spec["drafter"] == "dflash" and spec["n_drafted"] > 0


# --- the trained head ---------------------------------------------------------------------------------------------
# accepted/drafted at least this (measured on the 4 prompts: 58/96, 72/240, 76/508): later slots are surer to miss
FLOOR = {1: 0.4, 3: 0.2, 7: 0.1}


@pytest.mark.parametrize("k", sorted(FLOOR))
def test_the_trained_heads_drafts_are_accepted_and_output_is_plain(target, plain_outputs, k):
    engine = build_engine(target, "dflash", "fixed", k=k, drafter_options={"draft_model": TRAINED})
    drafted = accepted = 0
    for prompt, expected in zip(PROMPTS, plain_outputs):
        gen = engine.generate(prompt, GenerationConfig(max_tokens=MAX_TOKENS)).run()
        assert gen.output_ids == expected, f"dflash k={k} diverged on {prompt[:60]!r}"
        drafted, accepted = drafted + gen.stats.n_drafted, accepted + gen.stats.n_accepted
    print(f"trained dflash k={k}: {accepted}/{drafted} drafted tokens accepted")
    assert accepted > FLOOR[k] * drafted, f"the trained head's drafts are accepted {accepted}/{drafted}"


def test_the_trained_head_drafts_for_three_slots_at_once(plain_outputs):
    multi = LlamaModel(ModelConfig(DEFAULT_TARGET, n_slots=3), role="target")
    engine = build_engine(multi, "dflash", "fixed", k=4, drafter_options={"draft_model": TRAINED})
    gens = [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)) for p in PROMPTS[:3]]
    while engine.busy:
        engine.step()
    assert [g.output_ids for g in gens] == plain_outputs[:3]
    assert all(g.stats.n_accepted > 0 for g in gens)
    multi.close()


def test_cli_generate_with_the_trained_head_accepts_drafts(capsys):
    args = ["generate", "-p", PROMPTS[2], "-n", "32", "--exact", "on", "--json", "--k-policy", "fixed", "-k", "4"]
    assert main(args + ["--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--drafter", "dflash", "-md", str(TRAINED)]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["text"] == plain["text"] and spec["n_accepted"] > 0


# --- sampled drafts -----------------------------------------------------------------------------------------------
def test_sampled_drafts_carry_q_of_each_slots_row(target, heads):
    drafter = create("dflash", BuildContext(target, {"draft_model": heads["random"], "seed": 3}, temperature=0.8))
    ids = target.tokenize(PROMPTS[1])
    drafter.begin(ids, 0)  # (no rows: the head drafts from the block alone, which is all this test needs)
    draft = drafter.propose([DraftRequest(0, ids, Budget(L + 3))])[0]
    drafter.end(0, complete=False)
    assert len(draft.token_ids) == L - 1  # capped at the block's slots
    assert draft.q is not None and draft.q.shape == (L - 1, target.n_vocab)
    assert np.allclose(draft.q.sum(axis=1), 1.0)
    assert all(draft.q[i, t] > 0 for i, t in enumerate(draft.token_ids))


def test_a_seeded_sampled_run_is_reproducible(target):
    def run() -> tuple[list[int], int]:
        drafter = create("dflash", BuildContext(target, {"draft_model": TRAINED, "seed": 5}, temperature=0.8))
        engine = Engine(target, drafter, FixedK(4))
        gen = engine.generate(PROMPTS[3], GenerationConfig(max_tokens=32, sampling=SamplingParams(temperature=0.8,
                                                                                                  seed=7))).run()
        return gen.output_ids, gen.stats.n_accepted

    first, again = run(), run()
    assert first == again and first[1] > 0


# --- bad input ----------------------------------------------------------------------------------------------------
def test_bad_heads_are_refused_in_one_line_from_metadata(tmp_path):
    meta = read_gguf(DEFAULT_TARGET, tensors=False)
    with pytest.raises(UnsupportedModelError, match=r"^--drafter dflash drafts from a trained DFlash head: .*-md"):
        check_target("dflash", meta, Asked("--drafter dflash"))
    with pytest.raises(UnsupportedModelError, match=r"is 'llama', not a DFlash head"):
        check_target("dflash", meta, Asked("--drafter dflash", {"draft_model": DEFAULT_DRAFT}))
    spark = dflash(tmp_path / "spark.gguf", markov=True)
    with pytest.raises(UnsupportedModelError, match=r"is a DSpark head .*--spec-type draft-dspark"):
        check_target("dflash", meta, Asked("--drafter dflash", {"draft_model": spark}))
    maskless = dflash(tmp_path / "maskless.gguf", mask=None)
    with pytest.raises(UnsupportedModelError, match=r"maskless.gguf cannot draft for pycoder-6m.gguf: .*mask"):
        check_target("dflash", meta, Asked("--drafter dflash", {"draft_model": maskless}))
    far = dflash(tmp_path / "far.gguf", layers=(1, 3, 7))
    with pytest.raises(SpecstackError, match=r"reads target layer 7 but pycoder-6m.gguf has 6 layers"):
        check_target("cascade:suffix,dflash", meta, Asked("--drafter dflash", {"draft_model": far}))


def test_cli_refuses_a_head_for_another_target_before_loading(tmp_path):
    t0 = time.perf_counter()
    wide = dflash(tmp_path / "wide.gguf", n_embd=512)
    run = subprocess.run([sys.executable, "-m", "specstack", "generate", "-m", str(DEFAULT_TARGET), "--drafter",
                          "dflash", "-md", str(wide), "-p", "def f(x):", "-n", "4"],
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode != 0 and len(lines) == 1, run.stderr
    assert "wide.gguf" in lines[0] and "512" in lines[0] and "loaded" not in run.stderr
    assert time.perf_counter() - t0 < 30
