"""llama-server's -kvu on the bundled model (real llama.cpp): one KV pool of -c cells that the -np slots share.

Any one sequence may grow to all of -c; the pool running out never reaches llama.cpp: a prompt waits for room,
a generation that finds no cell for its next token ends with finish_reason length (its slot freed, the others
going on), drafts are cut to the free cells; the KV cache is -c, not -np x -c; exactness is off, and says why.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from specstack.constraints import Constraints
from specstack.errors import InvalidParameterError, KVPoolFullError
from specstack.generation import GenerationConfig
from specstack.llama import LlamaModel, ModelConfig
from specstack.loading import TargetSpec, build_engine, load_calibrated
from specstack.paths import DEFAULT_TARGET
from specstack.prompts import held_out_prompts
from specstack.server.app import Limits, create_app
from specstack.server.roles import Role, default_roles
from test_cli_hardening import serve_roles
from test_serve import Server

POOL = 512
PROMPTS = held_out_prompts(3)


def endless(n: int) -> GenerationConfig:
    """``n`` tokens whatever the model says (no end of text), greedy."""
    return GenerationConfig(max_tokens=n, constraints=Constraints(ignore_eos=True))


@pytest.fixture(scope="module")
def pooled():
    """The bundled target with 2 slots sharing one pool of 512 cells, calibrated as a server's (--exact auto)."""
    calibration = load_calibrated(TargetSpec(model=DEFAULT_TARGET, ctx=POOL, slots=2, kv_pool=True))
    yield calibration
    calibration.target.close()


def prompt_of(target, n: int) -> list[int]:
    """A prompt of exactly ``n`` tokens of held-out code."""
    ids = target.tokenize("\n".join(PROMPTS * 8))
    return ids[:n]


# -- the flags ---------------------------------------------------------------------------------------------------


def test_kvu_makes_one_pool_of_c_that_any_slot_may_fill():
    role = serve_roles("-c", "512", "-np", "2", "-kvu")[0]
    assert role.ctx == 512 and role.kv_unified and role.spec().kv_pool
    plain = serve_roles("-c", "512", "-np", "2")[0]
    assert plain.ctx == 256 and not plain.kv_unified
    assert serve_roles("-np", "-1")[0].kv_unified  # llama-server's auto: 4 slots on one pool
    # llama-server's --kv-unified-per-slot N sizes the pool -np x N, each slot N: the per-slot layout
    per_slot = serve_roles("-np", "2", "-kvu", "--kv-unified-per-slot", "300")[0]
    assert per_slot.ctx == 300 and not per_slot.kv_unified


def test_kvu_with_exact_on_is_refused_in_one_line():
    with pytest.raises(InvalidParameterError, match="exact = \"on\""):
        Role(name="r", parallel=2, kv_unified=True, exact="on")
    with pytest.raises(InvalidParameterError, match="--exact on cannot go with -kvu"):
        TargetSpec(slots=2, kv_pool=True, exact="on")
    TargetSpec(slots=1, kv_pool=True, exact="on")  # one slot: nothing is shared
    with pytest.raises(InvalidParameterError, match="--exact on cannot go with -kvu"):
        serve_roles("-np", "2", "-kvu", "--exact", "on")
    assert serve_roles("-np", "1", "-kvu", "--exact", "on")[0].exact == "on"


def test_kvu_beside_a_roles_file_is_refused(tmp_path):
    path = tmp_path / "roles.toml"
    path.write_text('[roles.a]\nparallel = 2\n')
    with pytest.raises(InvalidParameterError, match="-kvu would be ignored: set kv_unified = true"):
        serve_roles("--config", str(path), "-kvu")


# -- the model ---------------------------------------------------------------------------------------------------


def test_the_kv_cache_is_one_pool_of_c_cells(pooled):
    target = pooled.target
    assert target.pool == POOL and target.n_ctx == POOL and target.capacity == POOL
    assert int(target._lc.llama_n_ctx(target._ctx)) == POOL  # llama.cpp's cells: -c, not -np x -c
    assert target.kv.cells == POOL and "one pool of 512 cells shared by 2 slots" in target.kv.describe()
    separate = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=POOL, n_slots=2), role="target")
    try:
        assert separate.kv.cells == 2 * POOL and separate.pool is None
        assert target.kv.total_bytes * 2 == separate.kv.total_bytes
    finally:
        separate.close()


def test_a_call_past_the_pool_is_refused_and_changes_nothing(pooled):
    target = pooled.target
    target.reset()
    try:
        target.prefill(prompt_of(target, 400), 0)
        with pytest.raises(KVPoolFullError, match="shared KV pool is full"):
            target.prefill(prompt_of(target, 200), 1)
        assert target.seq_len[0] == 400 and target.seq_len[1] <= 112  # what fitted of whole chunks, nothing more
        assert target.pool_used() <= POOL
    finally:
        target.reset()


def test_exactness_is_off_and_says_why(pooled):
    why = pooled.target.shapes.why
    assert not pooled.target.shapes.exact and "-kvu" in why and "share one KV pool of 512 cells" in why


# -- the engine --------------------------------------------------------------------------------------------------


def run_watched(engine, target) -> int:
    """Step until idle, checking the pool never runs over; returns the most cells held at once."""
    most = 0
    while engine.busy:
        engine.step()
        assert target.pool_used() <= target.pool
        most = max(most, target.pool_used())
    return most


def test_one_generation_may_use_more_than_its_share(pooled):
    target = pooled.target
    target.reset()
    engine = build_engine(pooled, "prompt-lookup", batch_tokens=512, prefill_cap=256)
    gen = engine.generate(prompt_of(target, 100), endless(300))
    most = run_watched(engine, target)
    assert gen.stats.stop_reason == "length" and len(gen.output_ids) == 300
    assert most > POOL // 2  # more than -c / -np


def test_a_full_pool_ends_one_generation_and_the_other_goes_on(pooled):
    target = pooled.target
    target.reset()
    engine = build_engine(pooled, "prompt-lookup", batch_tokens=512, prefill_cap=256)
    # each would fit alone (100 + 400, 60 + 300 <= 512), together they cannot
    gens = [engine.generate(prompt_of(target, 100), endless(400)), engine.generate(prompt_of(target, 60), endless(300))]
    most = run_watched(engine, target)
    reasons = sorted(g.stats.stop_reason for g in gens)
    assert reasons == ["kv_pool", "length"] and most == POOL
    ended = next(g for g in gens if g.stats.stop_reason == "kv_pool")
    assert 0 < len(ended.output_ids) < ended.config.max_tokens
    other = next(g for g in gens if g.stats.stop_reason == "length")
    assert len(other.output_ids) == other.config.max_tokens
    assert sum(g.stats.n_accepted for g in gens) > 0  # drafts ran, within the pool's free cells
    after = engine.generate(prompt_of(target, 50), endless(20))  # the engine keeps serving
    run_watched(engine, target)
    assert after.stats.stop_reason == "length" and len(after.output_ids) == 20


def test_a_prompt_that_does_not_fit_now_waits_for_room(pooled):
    target = pooled.target
    target.reset()
    engine = build_engine(pooled, "prompt-lookup", batch_tokens=512, prefill_cap=256)
    first = engine.generate(prompt_of(target, 300), endless(150))
    for _ in range(3):
        engine.step()
    assert first.status == "running"
    second = engine.generate(prompt_of(target, 250), endless(10))  # 300+ held and 250 more: > 512
    engine.step()
    assert second.status == "waiting" and engine.waiting == 1  # a free slot, but no room in the pool
    run_watched(engine, target)
    assert first.stats.stop_reason == "length" and len(first.output_ids) == 150
    assert second.stats.stop_reason == "length" and len(second.output_ids) == 10
    with pytest.raises(Exception, match="context holds 512"):  # could never fit: refused at once
        engine.generate(prompt_of(target, 512), endless(1))


# -- the server --------------------------------------------------------------------------------------------------


def test_the_server_fails_a_request_the_full_pool_ends_as_llama_server_and_keeps_serving():
    """The request the shared pool ran out under gets llama-server's 500 "Context size has been exceeded." (its
    unified cache answers so; llama.cpp's own test_completion_unified accepts it, not a shortened 200); the
    other goes on to its max_tokens."""
    app = create_app(default_roles(parallel=2, ctx=POOL, kv_unified=True), Limits())
    with Server(app) as s, httpx.Client(base_url=s.url, timeout=300) as client:
        worker = next(iter(app.state.workers.values()))
        target = worker.target
        assert target.pool == POOL and target.kv.cells == POOL
        health = client.get("/health").json()
        assert "-kvu" in str(health)
        prompts = [target.detokenize(prompt_of(target, 100)), target.detokenize(prompt_of(target, 60))]
        out: list[dict] = [{}, {}]

        def ask(i: int) -> None:
            body = {"prompt": prompts[i], "max_tokens": 450, "temperature": 0, "ignore_eos": True}
            r = client.post("/v1/completions", json=body)
            out[i] = {"status": r.status_code, **r.json()}

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [o for o in out if o["status"] == 500]
        assert len(failed) == 1 and failed[0]["error"]["message"] == "Context size has been exceeded."
        [done] = [o for o in out if o["status"] == 200]
        assert done["choices"][0]["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] > POOL // 2 - 100  # more than its share of the pool
        again = client.post("/v1/completions", json={"prompt": prompts[1], "max_tokens": 8, "temperature": 0,
                                                     "ignore_eos": True})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 8
        assert engine_idle(worker)


def engine_idle(worker) -> bool:
    """No slot held, nothing waiting (a finished request leaks nothing)."""
    return worker.engine.running == 0 and worker.engine.waiting == 0 and worker.active == 0
