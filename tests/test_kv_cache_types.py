"""Issue 55, item 3: llama.cpp's KV cache types (-ctk/-ctv) on every command, through the one loader.

A quantized K cache keeps exactness (its shapes are measured for it, under its own cache key); a quantized V cache
needs flash attention in llama.cpp, so it runs with exactness off, and is refused where that cannot be.  Each type
must work as f16 does under rollback (drafts really rejected and accepted), prefix reuse and the host prompt cache.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from specstack.draft_length import FixedK
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.errors import InvalidParameterError
from specstack.generation import GenerationConfig
from specstack.loading import TargetSpec, load_calibrated
from specstack.prompts import held_out_prompts
from test_cli_hardening import parsed, roles_file, run_cli, serve_cli, serve_roles

PROMPTS = held_out_prompts(6)
MAX_TOKENS = 64


def calibrated(exact: str = "on", **types: str):
    """The bundled target with these KV types, loaded and calibrated as every command loads it (one thread, as the
    shapes' cache key then matches between tests)."""
    return load_calibrated(TargetSpec(exact=exact, tree_branches=1, ctx=512, threads=1, **types)).target


@pytest.fixture(scope="module")
def q8_k():
    """A q8_0 K cache (V f16) under --exact on: its exact call shapes measured now."""
    model = calibrated(cache_type_k="q8_0")
    yield model
    model.close()


def plain(model, prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    engine = Engine(model, create("none", BuildContext(model)))
    return engine.generate(prompt, GenerationConfig(max_tokens=max_tokens)).run().output_ids


# -- the KV estimate and what reaches llama.cpp --------------------------------------------------------------------

@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "f16"), ("f32", "bf16"), ("q4_0", "q8_0"),
                                           ("iq4_nl", "q5_1"), ("q4_1", "q5_0")])
def test_the_kv_estimate_is_the_cache_llama_cpp_allocates(capsys, type_k, type_v):
    """The estimate said at load (and checked against memory) is llama.cpp's own size, K and V apart: so the types
    reached the context, and ggml's block sizes are the estimate's."""
    from specstack.llama import LlamaModel, ModelConfig, set_verbose
    from specstack.paths import DEFAULT_TARGET

    config = ModelConfig(DEFAULT_TARGET, n_ctx=512, type_k=type_k, type_v=type_v, flash_attn=type_v in ("q8_0", "q5_1",
                                                                                                    "q5_0"))
    capsys.readouterr()
    set_verbose(True)
    try:
        model = LlamaModel(config, role="target")
    finally:
        set_verbose(False)
    model.close()
    line = next(l for l in capsys.readouterr().err.splitlines() if "llama_kv_cache: size =" in l)
    found = re.search(r"K \((\w+)\):\s+([\d.]+) MiB, V \((\w+)\):\s+([\d.]+) MiB", line)
    assert found and (found[1], found[3]) == (type_k, type_v), line
    assert f"{model.kv.total_bytes / 2**20:.2f}" == f"{float(found[2]) + float(found[4]):.2f}", line
    said = type_k if type_k == type_v else f"K {type_k}, V {type_v}"
    assert f"({said}, 512 positions x 1 sequence, 6 layers)" in model.kv.describe()


def test_a_q8_0_k_cache_computes_other_logits_than_f16(q8_k):
    """The type is really in the context: the same call gives other logits (so exact shapes measured on f16 could
    not stand for it, which is why the cache key holds the types)."""
    f16 = calibrated()
    try:
        ids = f16.tokenize(PROMPTS[0])[:40]
        a, b = f16.raw_call(ids), q8_k.raw_call(ids)
        q8_k.reset()
        assert not np.array_equal(a, b)
        assert np.abs(a - b).max() < 1.0  # rounded keys, not another model
    finally:
        f16.close()


def test_the_calibration_cache_key_holds_the_kv_types_and_f16s_is_unchanged(q8_k):
    from specstack.calibration.cache import entry_key, machine_key

    f16 = calibrated()
    try:
        assert machine_key(q8_k) == machine_key(f16) + [["q8_0", "f16"]]
        assert entry_key("shapes-", q8_k, {}) != entry_key("shapes-", f16, {})
        assert ["f16", "f16"] not in machine_key(f16)  # an f16 cache keeps the entries measured before -ctk existed
    finally:
        f16.close()


# -- exactness, rollback and the prompt cache ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["prompt-lookup", "draft-model"])
def test_greedy_speculation_on_a_q8_0_k_cache_equals_its_plain_decoding(q8_k, name):
    """--exact on with -ctk q8_0: every draft's rejected tail is cut from the quantized cache (KV seq removal), and
    the output is plain decoding's, with drafts really accepted."""
    assert q8_k.shapes.exact and q8_k.config.type_k == "q8_0"
    engine = Engine(q8_k, create(name, BuildContext(q8_k)), FixedK(4))
    accepted = rejected = 0
    for prompt in PROMPTS:
        gen = engine.generate(prompt, GenerationConfig(max_tokens=MAX_TOKENS)).run()
        assert gen.output_ids == plain(q8_k, prompt), f"{name} diverged on {prompt[:60]!r}"
        accepted += gen.stats.n_accepted
        rejected += gen.stats.n_drafted - gen.stats.n_accepted
    assert accepted > 0 and rejected > 0  # both verification outcomes ran: kept KV and KV cut back


def test_a_q8_0_k_cache_round_trips_through_the_host_prompt_cache(q8_k):
    """One slot: prompt A, then B (A's quantized KV goes to host memory), then A again: restored, not prefilled,
    and the same output as a cold plain run."""
    engine = Engine(q8_k, create("prompt-lookup", BuildContext(q8_k)), prompt_cache_bytes=64 << 20)
    a = PROMPTS[0] + "\n"
    first = engine.generate(a, GenerationConfig(max_tokens=24)).run()
    engine.generate(PROMPTS[1], GenerationConfig(max_tokens=24)).run()
    assert len(engine.prompt_cache.entries) == 1
    again = engine.generate(a, GenerationConfig(max_tokens=24)).run()
    assert engine.prompt_cache.hits == 1 and again.stats.n_reused == len(q8_k.tokenize(a)) - 1
    assert again.output_ids == first.output_ids == plain(q8_k, a, 24)


@pytest.mark.parametrize("type_k,type_v", [("q8_0", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0")])
def test_a_saved_sequence_restores_bit_for_bit(type_k, type_v):
    """llama.cpp's per-sequence state of a quantized cache (what --cache-ram keeps): restored into another
    sequence's place, the next call's logits are the original's bit for bit."""
    model = calibrated("on" if type_v == "f16" else "off", cache_type_k=type_k, cache_type_v=type_v)
    try:
        ids = model.tokenize(PROMPTS[2])[:60]
        model.prefill(ids[:-1])
        saved = model.save_seq(0)
        want = model.raw_call(ids[-1:], pad=model.min_batch - 1)
        model.reset()
        model.prefill(model.tokenize(PROMPTS[3])[:30])  # something else in its place
        assert model.load_seq(0, saved, len(ids) - 1)
        assert np.array_equal(model.raw_call(ids[-1:], pad=model.min_batch - 1), want)
    finally:
        model.close()


def test_a_quantized_v_cache_speculates_with_flash_attention_and_exactness_off():
    """-ctv q8_0 runs with flash attention (llama.cpp needs it) and --exact off: drafts are accepted and rejected
    tails cut back from the quantized cache (its last position is where the sequence ends)."""
    model = calibrated("off", cache_type_k="q8_0", cache_type_v="q8_0")
    try:
        assert model.flash_attn and not model.shapes.exact
        engine = Engine(model, create("prompt-lookup", BuildContext(model)), FixedK(4))
        gen = engine.generate(PROMPTS[0], GenerationConfig(max_tokens=MAX_TOKENS)).run()
        assert 0 < gen.stats.n_accepted < gen.stats.n_drafted and len(gen.output_ids) == MAX_TOKENS
        model.truncate(20)
        assert model.seq_pos_max(0) == 19
    finally:
        model.close()


# -- flags, roles and refusals -------------------------------------------------------------------------------------

def test_ctk_and_ctv_reach_the_target_on_generate_bench_and_serve(capsys):
    from specstack.commands.common import run_spec, target_spec

    spec = run_spec(parsed("generate", "-p", "x", "-ctk", "q8_0", "--exact", "on")).target
    assert (spec.cache_type_k, spec.cache_type_v, spec.exact) == ("q8_0", "f16", "on")
    assert spec.model_config().type_k == "q8_0"
    assert target_spec(parsed("bench", "run", "--workload", "x", "--cache-type-k", "q4_0")).cache_type_k == "q4_0"
    assert target_spec(parsed("generate", "-p", "x")).cache_type_k == "f16"
    role = serve_roles("-ctk", "q8_0", "--exact", "on")[0]
    assert (role.cache_type_k, role.cache_type_v, role.spec().cache_type_k) == ("q8_0", "f16", "q8_0")


def test_a_quantized_v_cache_turns_flash_attention_on_as_llama_server_does(capsys):
    """-fa auto (the default) turns flash attention on for -ctv q8_0, which under --exact auto runs as off, with a
    note; -ctv q8_0 under --exact off needs no note."""
    from specstack.commands.common import run_spec

    spec = run_spec(parsed("generate", "-p", "x", "-ctv", "q8_0")).target
    assert (spec.cache_type_v, spec.flash_attn, spec.exact) == ("q8_0", True, "off")
    assert "-ctv q8_0 turns flash attention on" in capsys.readouterr().err
    spec = run_spec(parsed("generate", "-p", "x", "-ctv", "q8_0", "--exact", "off")).target
    assert spec.model_config().flash_attn is True and capsys.readouterr().err == ""
    role = serve_roles("-ctv", "q4_0")[0]
    assert (role.cache_type_v, role.flash_attn, role.exact) == ("q4_0", "on", "off")


@pytest.mark.parametrize("command,flags,message", [
    ("generate", ["-ctv", "q8_0", "--exact", "on"], "-ctv q8_0 cannot go with --exact on: llama.cpp runs a quantized V "
                                                    "cache with flash attention (-fa on) only"),
    ("generate", ["-ctv", "q8_0", "-fa", "off"], "-ctv q8_0 needs flash attention (llama.cpp refuses a quantized V "
                                                 "cache without it): use -fa on"),
    ("generate", ["-ctk", "q3_k"], "argument -ctk/--cache-type-k: must be one of f32, f16, bf16, q8_0, q4_0, q4_1, "
                                   "iq4_nl, q5_0, q5_1 (got 'q3_k')"),
    ("serve", ["-ctv", "q4_0", "--exact", "on"], "-ctv q4_0 cannot go with --exact on"),
    ("serve", ["-ctv", "iq4_nl", "-fa", "off"], "-ctv iq4_nl needs flash attention"),
    ("serve", ["--cache-type-v", "f8"], "argument -ctv/--cache-type-v: must be one of"),
])
def test_what_a_kv_type_cannot_do_is_refused_in_one_line(capsys, command, flags, message):
    if command == "serve":
        code, err = serve_cli(capsys, *flags)
    else:
        code, _, err = run_cli(capsys, "generate", "-p", "x", *flags)
    assert code == 2 and message in err
    assert "Traceback" not in err and "loaded" not in err


def test_a_roles_file_takes_kv_types(capsys, tmp_path):
    from specstack.server.roles import load_roles

    (role,) = load_roles(roles_file(tmp_path, '[roles.a]\ncache_type_k = "q8_0"\nexact = "on"\n'))
    assert role.spec().model_config().type_k == "q8_0"
    (role,) = load_roles(roles_file(tmp_path, '[roles.a]\ncache_type_v = "q8_0"\nexact = "off"\n'))
    assert role.spec().model_config().flash_attn is True
    for body, message in (('cache_type_v = "q8_0"\n', 'cache_type_v = "q8_0" needs flash attention'),
                          ('cache_type_v = "q8_0"\nexact = "off"\nflash_attn = "off"\n', 'and so exact = "off"'),
                          ('cache_type_k = "q2_k"\n', "cache_type_k must be one of f32, f16")):
        with pytest.raises(InvalidParameterError, match=re.escape(message)):
            load_roles(roles_file(tmp_path, "[roles.a]\n" + body))
    code, err = serve_cli(capsys, "--config", roles_file(tmp_path, "[roles.a]\n"), "-ctk", "q8_0")
    assert code == 2 and "set cache_type_k in the file's [roles.NAME] tables" in err


def test_the_library_refuses_a_quantized_v_cache_it_cannot_run():
    with pytest.raises(InvalidParameterError, match="cannot go with --exact auto"):
        TargetSpec(cache_type_v="q8_0")
    with pytest.raises(InvalidParameterError, match="needs flash attention"):
        TargetSpec(cache_type_v="q8_0", exact="off", flash_attn=False)
    assert TargetSpec(cache_type_v="q8_0", exact="off").model_config().flash_attn is True
    from specstack.llama import ModelConfig
    from specstack.paths import DEFAULT_TARGET

    with pytest.raises(InvalidParameterError, match="a q4_0 V cache needs flash attention"):
        ModelConfig(DEFAULT_TARGET, type_v="q4_0")


def test_quantized_blocks_that_do_not_divide_a_head_are_refused_before_llama_cpp_aborts():
    """Without flash attention llama.cpp asserts (ending the process) on a quantized K whose blocks split a head."""
    from types import SimpleNamespace

    from specstack.llama.kv import check_kv_blocks

    meta = SimpleNamespace(architecture="llama", get={"llama.block_count": 2, "llama.embedding_length": 320,
                                                      "llama.attention.head_count": 4}.get)  # heads of 80
    check_kv_blocks(meta, "f16", "bf16", "m.gguf")
    with pytest.raises(InvalidParameterError, match="-ctk q8_0: its blocks of 32 do not divide m.gguf's heads of 80"):
        check_kv_blocks(meta, "q8_0", "f16", "m.gguf")


# -- served --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [("-ctk", "q8_0", "--exact", "on"), ("-ctk", "q8_0", "-ctv", "q8_0")])
def test_a_server_with_a_quantized_kv_cache_speculates_and_reuses_prompts(capsys, q8_k, flags):
    """``specstack serve -ctk q8_0`` (exact: its answer is plain decoding's on a q8_0 K cache) and ``-ctv q8_0`` too
    (flash attention, exactness off, two slots on one unified cache): drafts accepted, a repeated prompt's KV
    reused."""
    import httpx

    from specstack.server.app import Limits, create_app
    from test_serve import Server

    roles = serve_roles(*flags, "-np", "2", "--drafter", "prompt-lookup", "--k-policy", "fixed", "-t", "1")
    body = {"prompt": PROMPTS[0], "n_predict": 48, "temperature": 0}
    with Server(create_app(roles, Limits(max_tokens=64))) as s, httpx.Client(base_url=s.url, timeout=300) as http:
        first, again = http.post("/completion", json=body).json(), http.post("/completion", json=body).json()
        health = http.get("/health").json()
    err = capsys.readouterr().err
    assert first["timings"]["draft_n_accepted"] > 0 and again["timings"]["cache_n"] > 0
    assert again["content"] == first["content"]
    assert ("(K q8_0, V f16, " if "--exact" in flags else "(q8_0, ") in err  # the role's load line: the types it has
    if "--exact" in flags:
        engine = Engine(q8_k, create("none", BuildContext(q8_k)))
        assert first["content"] == engine.generate(PROMPTS[0], GenerationConfig(max_tokens=48)).run().text
    else:
        exact = health["roles"]["pycoder-6m"]["exact"]
        assert exact["mode"] == "off" and "one unified KV cache, with flash attention" in exact["why"]
        assert "-ctv q8_0 turns flash attention on" in err
