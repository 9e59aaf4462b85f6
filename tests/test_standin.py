"""Stand-in targets compute the source model's function with a bigger model's cost.

The decisive checks run the real bundled target in llama.cpp: a zero-padded, deepened copy must
give the same greedy tokens, and its quantized form must hold the very same quant blocks as the
equally quantized source.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")

from specstack.bench.standin import (  # noqa: E402
    LlamaShape,
    _use_more_bits,
    live_layer_slots,
    make_standin,
    plan_standin,
    quantize_gguf,
    read_shape,
    register_cli,
)
from specstack.errors import InvalidParameterError, ModelLoadError, SpecstackError, UnsupportedModelError  # noqa: E402
from specstack.paths import DATA_DIR, DEFAULT_TARGET  # noqa: E402

N_PROMPTS = 6
N_TOKENS = 48
SRC_SHAPE = LlamaShape(n_embd=256, n_layer=6, n_head=8, n_head_kv=4, head_dim=32, n_ff=768,
                       n_vocab=4096, tied_output=True)


def _prompts(n: int = N_PROMPTS) -> list[str]:
    lines = (DATA_DIR / "prompts" / "code-complete.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def _greedy(path: Path, prompts: list[str], n_tokens: int = N_TOKENS) -> list[tuple[list[int], list[float], np.ndarray]]:
    """Per prompt: greedy token ids, the top-1 minus top-2 logit margin at each step, and the
    logits of the first step."""
    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    out = []
    for prompt in prompts:
        llm.reset()
        llm.eval(llm.tokenize(prompt.encode()))
        ids, margins, first = [], [], np.array(llm.scores[llm.n_tokens - 1])
        for _ in range(n_tokens):
            logits = llm.scores[llm.n_tokens - 1]  # [n_vocab]
            top2 = np.partition(logits, -2)[-2:]
            ids.append(int(np.argmax(logits)))
            margins.append(float(top2[1] - top2[0]))
            llm.eval([ids[-1]])
        out.append((ids, margins, first))
    del llm
    return out


def _prompt_logits(path: Path, prompts: list[str]) -> list[np.ndarray]:
    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    out = []
    for prompt in prompts:
        llm.reset()
        llm.eval(llm.tokenize(prompt.encode()))
        out.append(np.array(llm.scores[: llm.n_tokens]))  # [n_prompt, n_vocab]
    del llm
    return out


def _assert_same_greedy(ref, got) -> None:
    for i, ((a, margins, _), (b, _, _)) in enumerate(zip(ref, got)):
        if a != b:
            k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            pytest.fail(f"prompt {i}: greedy tokens differ from step {k} "
                        f"(source margin top1-top2 there: {margins[k]:.3g}); source {a[k:k + 5]}, "
                        f"stand-in {b[k:k + 5]}")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("standin")


@pytest.fixture(scope="module")
def source_greedy():
    return _greedy(DEFAULT_TARGET, _prompts())


# ----------------------------------------------------------------------------- planning (pure)

def test_live_layers_keep_the_q4_k_m_type_pattern():
    # Q4_K_M gives attn_v/ffn_down of "use_more_bits" layers Q6_K; source layers must land on
    # slots with the same verdict, in order, or the quantized stand-in would differ.
    assert live_layer_slots(6, 6) == [0, 1, 2, 3, 4, 5]
    assert live_layer_slots(6, 8) == [1, 2, 3, 4, 5, 6]
    for n_out in range(6, 80):
        slots = live_layer_slots(6, n_out)
        assert slots == sorted(set(slots)) and len(slots) == 6 and slots[-1] < n_out
        assert [_use_more_bits(p, n_out) for p in slots] == [_use_more_bits(j, 6) for j in range(6)]


@pytest.mark.parametrize("width, copies, scale", [
    (256, 1, 1.0), (512, 2, 1.0), (768, 3, 1.0), (1024, 1, 0.5), (2048, 2, 0.5), (4096, 1, 0.25),
    (320, 1, (256 / 320) ** 0.5),
])
def test_residual_copies_make_the_norm_rescale_a_power_of_two(width, copies, scale):
    # W / (m d) must be a power of 4 for c = sqrt(m d / W) to be a power of two (exact rescale).
    plan = plan_standin(SRC_SHAPE, width, 8)
    assert (plan.copies, plan.norm_scale) == (copies, pytest.approx(scale))
    assert plan.bit_exact == (width != 320)


def test_plan_shape_keeps_head_dim_and_gqa_ratio():
    plan = plan_standin(SRC_SHAPE, 2048, 22, ffn=5632)
    o = plan.out
    assert (o.n_embd, o.n_layer, o.n_head, o.n_head_kv, o.head_dim, o.n_ff) == (2048, 22, 64, 32, 32, 5632)
    assert 1.0e9 < o.n_params < 1.1e9
    assert sum(plan.layer_live) == 6
    assert [plan.layer_source[i] for i, live in enumerate(plan.layer_live) if live] == list(range(6))
    assert plan_standin(SRC_SHAPE, 512, 8).out.n_ff == 1536  # FFN grows with the width by default


@pytest.mark.parametrize("kwargs, match", [
    (dict(width=128, layers=8), "smaller than the source"),
    (dict(width=544, layers=8), "multiple of 64"),
    (dict(width=512, layers=4), "fewer than the source"),
    (dict(width=512, layers=8, ffn=512), "smaller than the source's FFN"),
    (dict(width=512, layers=8, ftype="q5_0"), "unknown --ftype"),
    (dict(width=576, layers=8, ftype="q4_k_m"), "multiples of 256"),
])
def test_plan_rejects_bad_requests(kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        plan_standin(SRC_SHAPE, **kwargs)


def test_rejects_missing_and_non_llama_sources(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        make_standin(tmp_path / "nope.gguf", tmp_path / "out.gguf", 512, 8)
    w = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        make_standin(tmp_path / "gpt2.gguf", tmp_path / "out.gguf", 512, 8)
    assert not (tmp_path / "out.gguf").exists()


# ----------------------------------------------------------------------------- real model

@pytest.fixture(scope="module")
def standin_f16(work) -> Path:
    return make_standin(DEFAULT_TARGET, work / "w512-l8.gguf", 512, 8, progress=False)


def test_standin_header(standin_f16):
    r = gguf.GGUFReader(standin_f16)
    shape = read_shape(r)
    assert (shape.n_embd, shape.n_layer, shape.n_head, shape.n_head_kv, shape.n_ff) == (512, 8, 16, 8, 1536)
    assert shape.tied_output
    eps = r.fields["llama.attention.layer_norm_rms_epsilon"].contents()
    assert eps == pytest.approx(1e-5, rel=1e-6)  # two residual copies: W / (2 d) = 1
    assert r.fields["specstack.standin.residual_copies"].contents() == 2
    assert r.fields["tokenizer.ggml.tokens"].contents() == gguf.GGUFReader(DEFAULT_TARGET).fields[
        "tokenizer.ggml.tokens"].contents()


def test_standin_gives_the_same_greedy_tokens(standin_f16, source_greedy):
    # 6 held-out prompts x 48 greedy tokens. The rescaled norms are exact (two residual copies),
    # and zero weights only ever add exact zeros, so even the logits are bit-identical.
    got = _greedy(standin_f16, _prompts())
    _assert_same_greedy(source_greedy, got)
    for (_, _, ref_logits), (_, _, logits) in zip(source_greedy, got):
        np.testing.assert_array_equal(ref_logits, logits)


def _assert_same_quant_blocks(src_q: Path, standin_q: Path) -> None:
    a, b = gguf.GGUFReader(src_q), gguf.GGUFReader(standin_q)
    live = b.fields["specstack.standin.live_layers"].contents()
    by_name = {t.name: t for t in b.tensors}
    n_checked = 0
    for t in a.tensors:
        name = t.name
        if name.startswith("blk."):
            j = int(name.split(".")[1])
            name = name.replace(f"blk.{j}.", f"blk.{live[j]}.", 1)
        u = by_name[name]
        assert u.tensor_type == t.tensor_type, (t.name, t.tensor_type.name, u.tensor_type.name)
        if t.data.ndim == 2 and t.tensor_type.name not in ("F32", "F16"):
            x, y = np.asarray(t.data), np.asarray(u.data)  # [rows, bytes per row]
            assert np.array_equal(y[: x.shape[0], : x.shape[1]], x), t.name
            n_checked += 1
    assert n_checked == 1 + 7 * 6


def _quantized_pair(work: Path, ftype: str) -> tuple[Path, Path]:
    src_q, standin_q = work / f"src.{ftype}.gguf", work / f"w512-l8.{ftype}.gguf"
    if not src_q.exists():
        quantize_gguf(DEFAULT_TARGET, src_q, ftype)
    if not standin_q.exists():
        make_standin(DEFAULT_TARGET, standin_q, 512, 8, ftype, progress=False)
    return src_q, standin_q


@pytest.mark.parametrize("ftype", ["q8_0", "q4_k_m"])
def test_quantized_standin_holds_the_sources_quant_blocks(work, ftype):
    # Q4_K_M picks Q6_K for attn_v/ffn_down of some layers by layer index; the layer layout keeps
    # those choices, so every source block reappears byte for byte.
    _assert_same_quant_blocks(*_quantized_pair(work, ftype))


def test_q4_k_m_standin_gives_the_same_prompt_logits(work):
    src_q, standin_q = _quantized_pair(work, "q4_k_m")
    prompts = _prompts(1)
    for ref, got in zip(_prompt_logits(src_q, prompts), _prompt_logits(standin_q, prompts)):
        np.testing.assert_array_equal(ref, got)


def test_q8_0_standin_gives_the_same_greedy_tokens_as_q8_0_source(work):
    # Q8_0 rounds activations to int8 blocks, which amplifies any norm mismatch: with a plain
    # sqrt(d/W) rescale (one residual copy) this flipped prompt 5 at step 4 (margin 0.008).
    src_q, standin_q = _quantized_pair(work, "q8_0")
    prompts = _prompts()
    _assert_same_greedy(_greedy(src_q, prompts), _greedy(standin_q, prompts))


# ----------------------------------------------------------------------------- CLI

def test_cli_make_standin(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="specstack bench")
    register_cli(parser.add_subparsers(dest="bench_command"))
    out = tmp_path / "s.gguf"
    args = parser.parse_args(["make-standin", "--width", "512", "--layers", "7", "-o", str(out)])
    assert args.src == DEFAULT_TARGET and args.ftype == "f16"
    assert args.func(args) == 0
    assert "wrote" in capsys.readouterr().out and read_shape(gguf.GGUFReader(out)).n_layer == 7
    args = parser.parse_args(["make-standin", "--width", "100", "--layers", "7", "-o", str(out)])
    with pytest.raises(SpecstackError):
        args.func(args)


def test_moe_standin_keeps_the_routers_choice_and_the_logits(tmp_path):
    """Experts and router are padded like the dense matrices: the router reads the same normalised input,
    picks the same experts, and the stand-in's logits are bit-identical to the source's."""
    from specstack.paths import MODELS_DIR
    from specstack.target import INEXACT, LlamaModel, ModelConfig

    src_path = MODELS_DIR / "pycoder-moe.gguf"
    out = make_standin(src_path, tmp_path / "moe.gguf", width=384, layers=6, progress=False)
    shape = read_shape(gguf.GGUFReader(out))
    assert (shape.n_expert, shape.n_expert_used, shape.n_embd, shape.n_layer) == (8, 2, 384, 6)
    src, big = LlamaModel(ModelConfig(src_path, n_ctx=512)), LlamaModel(ModelConfig(out, n_ctx=512))
    for m in (src, big):
        m.set_shapes(INEXACT)
    for prompt in _prompts(2):
        ids = src.tokenize(prompt)[:150]
        a = src.eval(ids, logits_from=0).copy()
        b = big.eval(ids, logits_from=0).copy()
        assert np.array_equal(a, b)
        src.reset(), big.reset()
    src.close(), big.close()
