"""`specstack serve` over real HTTP, driven by the official `openai` client (and raw httpx for the rest).

The server runs in this process on a free loopback port (uvicorn in a thread),
serving the bundled pair with two slots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from specstack.bench.serving import ServerFailed, free_port, wait_ready
from specstack.drafters import DEFAULT_DRAFTER, BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.prompts import held_out_prompts
from specstack.server.app import Limits, create_app
from specstack.server.roles import Role, default_roles, load_roles

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = held_out_prompts(3)[2]


class Server:
    """A real uvicorn server in a thread."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "Server":
        self.thread.start()
        wait_ready(self.url, timeout=300, interval=0.1)  # a first load measures shapes: a minute on a busy 2-core host
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server():
    # --exact on: these tests compare served output with plain decoding bit for bit.
    app = create_app(default_roles(parallel=2, exact="on"), Limits(max_tokens=512, max_body_bytes=64_000), api_key=KEY,
                     max_queue=1)
    with Server(app) as s:
        s.app = app
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def plain_ids(target, prompt: str, n: int) -> list[int]:
    engine = Engine(target, create("none", BuildContext(target)))
    return engine.generate(prompt, GenerationConfig(max_tokens=n)).run().output_ids


def test_completion_is_plain_decoding_and_reports_speculation(client, target):
    r = client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=48, temperature=0)
    assert r.choices[0].text == target.detokenize(plain_ids(target, PROMPT, 48))
    assert r.usage.completion_tokens == 48 and r.choices[0].finish_reason == "length"
    spec = r.model_extra["speculative"]
    assert spec["n_accepted"] > 0 and spec["by_source"][DEFAULT_DRAFTER]["accepted"] == spec["n_accepted"]


def test_per_request_speculation_changes_the_stats_not_the_text(client):
    texts, drafted = [], []
    for spec in ({"drafter": "none"}, {"drafter": "draft-model", "k_policy": "fixed", "k": 6},
                 {"drafter": "cascade:suffix,prompt-lookup", "k_policy": "fixed", "k": 8}):
        r = client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=40, temperature=0,
                                      extra_body={"speculative": spec})
        texts.append(r.choices[0].text)
        drafted.append(r.model_extra["speculative"])
    assert texts[0] == texts[1] == texts[2]
    assert drafted[0]["n_drafted"] == 0
    assert drafted[1]["by_source"]["draft-model"]["accepted"] > 0
    assert drafted[2]["n_accepted"] > 0 and drafted[2]["drafter"].startswith("cascade")


def test_streaming_with_usage_joins_to_the_same_text(client):
    whole = client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=32, temperature=0).choices[0].text
    chunks = list(client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32
    assert all(c.usage is None for c in chunks[:-1])
    tokens = [t for c in chunks for t in (c.model_extra.get("specstack") or {}).get("tokens", [])]
    assert "".join(t for t, _ in tokens) == whole and {s for _, s in tokens} >= {"target", DEFAULT_DRAFTER}


def test_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A stack class."}]
    r = client.chat.completions.create(model="pycoder-6m", messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 24
    stream = client.chat.completions.create(model="pycoder-6m", messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == r.choices[0].message.content
    assert parts[-1].usage.total_tokens == r.usage.total_tokens


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list()] == ["pycoder-6m"]
    health = httpx.get(server.url + "/health").json()  # open without a key
    assert health == {"status": "ok", "roles": {"pycoder-6m": {"exact": {"requested": "on", "mode": "on", "why": "--exact on"},
                                                              "lossy": None}}}
    assert client.models.list().data[0].model_extra["speculative"]["exact"] == health["roles"]["pycoder-6m"]["exact"]
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert f'specstack_spec_decode_num_accepted_tokens_total{{role="pycoder-6m",source="{DEFAULT_DRAFTER}"}}' in text
    assert "specstack_spec_decode_num_accepted_tokens_per_pos_total" in text and "specstack_busy_slots" in text


def test_errors_have_openai_bodies(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=8, extra_body={"speculative": {"drafter": "nope"}})
    assert e.value.body["param"] == "speculative.drafter"
    with pytest.raises(openai.BadRequestError) as e:  # checked by the drafter's own config, whichever drafter runs
        client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=8, extra_body={"speculative": {"p_min": 1.5}})
    assert e.value.body["param"] == "speculative" and "p_min must be in [0, 1)" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # not an option at all
        client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=8, extra_body={"speculative": {"kk": 1}})
    assert e.value.body["param"] == "speculative.kk"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="pycoder-6m", prompt="x " * 2000, max_tokens=8)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=10_000)
    assert e.value.body["param"] == "max_tokens"
    # One role serves whatever model name a client sends (clients often hard-code one); with several
    # roles an unknown name is a 404 (test_two_roles_pick_by_model).
    assert client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4).model == "pycoder-6m"
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bad = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    wrong = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "temperature": "hot"}, headers=headers)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "temperature"
    many = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "n": 17}, headers=headers)
    assert many.status_code == 400 and many.json()["error"]["param"] == "n"
    big = httpx.post(server.url + "/v1/completions", content=b" " * 70_000, headers=headers)
    assert big.status_code == 413
    assert httpx.get(server.url + "/nope", headers=headers).json()["error"]["type"] == "not_found_error"
    assert httpx.get(server.url + "/nope").status_code == 401  # as llama-server: only its public routes are open


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f", "parameters": {}}]),
    ("prediction", {"type": "content", "content": "x"}),
    ("response_format", {"type": "xml"}),  # honoured, but not this type: response_format.type
])
def test_fields_not_honoured_are_400_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="pycoder-6m", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       extra_body={field: value})
    assert e.value.body["param"] in (field, f"{field}.type")


def test_image_parts_and_echo_with_logprobs_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="pycoder-6m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}])
    assert "image_url" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=4, echo=True, logprobs=1)
    assert e.value.body["param"] == "echo"


def test_seed_minus_one_is_random_not_a_500(client):
    r = client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=4, temperature=0.8, seed=-1)
    # Served, not a 500: a random draw may end at <eos> before 4 tokens (it did, once in many runs).
    assert 1 <= r.usage.completion_tokens <= 4 and r.choices[0].finish_reason in ("length", "stop")


def test_logprobs_and_echo_on_completions(client, target):
    r = client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 6
    assert all(t[lp.tokens[i]] == lp.token_logprobs[i] for i, t in enumerate(lp.top_logprobs))  # greedy: the top one
    echoed = client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == target.detokenize(target.tokenize(PROMPT)) + r.choices[0].text
    streamed = client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_api_key_is_enforced(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_v1_health_is_health_and_needs_no_key(server):
    """llama-server serves /v1/health as /health, both public (issue 37 item 14: it was 401 without the key, 404
    with it)."""
    health = httpx.get(server.url + "/health").json()
    assert httpx.get(server.url + "/v1/health").json() == health  # no key
    with_key = httpx.get(server.url + "/v1/health", headers={"Authorization": f"Bearer {KEY}"})
    assert with_key.status_code == 200 and with_key.json() == health
    assert httpx.get(server.url + "/v1/nothing").status_code == 401  # the rest of /v1 still needs the key


def test_every_error_answer_is_counted_by_its_kind(server):
    """Issue 37 item 16: ``specstack_requests_total`` read 2 after about 100 validation 400s; every 4xx/5xx counts,
    under its error type, once (a worker's failure too, which the worker counts itself)."""
    kinds = ("invalid_request_error", "authentication_error", "not_found_error")
    headers = {"Authorization": f"Bearer {KEY}"}

    def counts() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics", headers=AUTH).text
        return {k: count_metric(text, f'role="pycoder-6m",status="{k}"') for k in kinds}

    before = counts()
    bad = [("/v1/completions", {"prompt": "x", "bogus": 1}),  # unknown field (the request model)
           ("/v1/completions", {"prompt": "x", "max_tokens": "2"}),  # wrong type
           ("/v1/chat/completions", {"messages": "hi"}),
           ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}),  # over --max-tokens (the route)
           ("/v1/completions", {"prompt": "x", "max_tokens": 2, "speculative": {"p_min": 1.5}}),  # the worker's 400
           ("/tokenize", {"content": 5})]  # llama-server's routes too
    for path, body in bad:
        assert httpx.post(server.url + path, json=body, headers=headers).status_code == 400, (path, body)
    assert httpx.post(server.url + "/v1/completions", content=b"{not json", headers=headers).status_code == 400
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.url + "/v1/nothing", headers=headers).status_code == 404
    after = counts()
    assert {k: after[k] - before[k] for k in kinds} == {"invalid_request_error": len(bad) + 1,
                                                        "authentication_error": 1, "not_found_error": 1}


def test_full_queue_answers_429_with_retry_after(server, client):
    """Two slots and one queue place: a fourth concurrent request is refused; the client retries it by itself."""
    headers = {"Authorization": f"Bearer {KEY}"}
    results: list[int] = []

    def long_request() -> None:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "temperature": 0},
                       headers=headers, timeout=120)
        results.append(r.status_code)

    threads = [threading.Thread(target=long_request) for _ in range(3)]
    for t in threads:
        t.start()
    worker = next(iter(server.app.state.workers.values()))
    deadline = time.time() + 30
    while worker.active < 3 and time.time() < deadline:
        time.sleep(0.01)
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    patient = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=30)
    assert patient.completions.create(model="pycoder-6m", prompt="import os\n", max_tokens=2, temperature=0).usage.completion_tokens == 2
    for t in threads:
        t.join()
    assert results == [200, 200, 200]


def test_a_role_builds_its_grammar_engine_at_load_so_no_request_waits_for_it(server):
    """llguidance's tokenizer of a vocabulary took ~3 s on Gemma 3 (the first constrained request's time to first
    token went from 0.5 s to 3.9 s): a role builds it when it loads."""
    worker = next(iter(server.app.state.workers.values()))
    assert worker.grammars_warm is not None and worker.grammars_warm.done()
    built = worker.grammars_warm.result()
    assert built is not None and built is worker.target.grammar_engine()._tokenizer


def test_a_role_is_ready_only_once_its_grammar_engine_is_built(monkeypatch):
    """llguidance builds that tokenizer holding the GIL (1.4 s of Gemma 3's 3 s): built behind a role that said it
    was ready, it froze every request, /health too, for that long. So the role is ready only once it is built
    (here its build is held back until the test lets it finish)."""
    from concurrent.futures import Future

    from specstack.llama.grammar import GrammarCache
    from specstack.server.prometheus import ServerMetrics
    from specstack.server.worker import RoleWorker

    gate: Future = Future()
    asked = threading.Event()

    def warm(self) -> Future:
        asked.set()
        return gate

    monkeypatch.setattr(GrammarCache, "warm", warm)
    worker = RoleWorker(default_roles(parallel=1, exact="off")[0], ServerMetrics())
    worker.start()
    try:
        assert asked.wait(120), worker.load_error
        time.sleep(0.3)  # room for a role that would not wait to say it is ready
        assert not worker.ready.is_set()
        gate.set_result("built")
        assert worker.ready.wait(60) and worker.load_error is None
    finally:
        if not gate.done():
            gate.set_result(None)
        worker.stop()


def test_disconnect_mid_stream_frees_the_slot(server, client):
    """Regression test for llama-server's repeated bug: a client that goes away must stop its generation."""
    worker = next(iter(server.app.state.workers.values()))
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and json.loads(line[5:])["choices"]:
                break  # got a token: now hang up
    deadline = time.time() + 10
    while (worker.engine.running or worker.active) and time.time() < deadline:
        time.sleep(0.02)
    assert worker.engine.running == 0 and worker.active == 0
    assert all(worker.target.seq_pos_max(s) < 300 for s in range(worker.target.n_slots))  # nothing ran on to 500 tokens
    metrics = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert 'specstack_busy_slots{role="pycoder-6m"} 0.0' in metrics
    assert 'status="cancelled"' in metrics
    r = client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=8, temperature=0)  # the next request is served
    assert r.usage.completion_tokens == 8


def count_metric(metrics: str, label: str) -> float:
    """The sum of specstack_requests_total's samples with ``label``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if label in line and line.startswith("specstack_requests_total"))


def test_a_chunked_body_over_the_limit_is_refused_before_parsing(server):
    """--max-body holds for a body sent without Content-Length (Transfer-Encoding: chunked)."""
    big = json.dumps({"prompt": "x " * 100_000, "max_tokens": 1}).encode()

    def chunks():
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"Authorization": f"Bearer {KEY}",
                   "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "--max-body" in r.json()["error"]["message"]
    small = json.dumps({"prompt": "def f(", "max_tokens": 2}).encode()
    r = httpx.post(server.url + "/v1/completions", content=iter([small[:10], small[10:]]),
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2  # a small chunked body still works


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "def f(\ud800", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2}, "messages[0].content"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, route, body, param):
    raw = json.dumps(body)  # ensure_ascii: the lone surrogate goes out as the escape \ud800, as clients send it
    r = httpx.post(server.url + route, content=raw, headers={"Authorization": f"Bearer {KEY}",
                   "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and "surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra, param", [
    ({"max_tokens": True}, "max_tokens"),  # was taken as 1
    ({"top_k": 2.5}, "top_k"),
    ({"temperature": True}, "temperature"),
    ({"speculative": {"drafter": "draft-model", "tree": True}}, "speculative.tree"),  # was ignored
    ({"speculative": {"drafter": "prompt-lookup", "n_min": 2}}, None),  # prompt-lookup's own option: accepted
])
def test_values_that_would_be_misread_or_ignored_are_400s(server, extra, param):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "def f(", "max_tokens": 2, **extra},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    if param is None:
        assert r.status_code == 200
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_n_choices_share_one_prefill_and_match_single_requests(server, client):
    """n = 3, greedy: every choice is the single request's text; the prompt is prefilled once (the other
    choices copy its KV) and counted once in usage; each choice has its own speculation summary."""
    worker = next(iter(server.app.state.workers.values()))
    one = client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=24, temperature=0)
    copies = worker.engine.sibling_copies
    three = client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=24, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.text == one.choices[0].text for c in three.choices)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert len(three.model_extra["speculative"]["choices"]) == 3
    assert worker.engine.sibling_copies > copies  # 2 slots: the second choice copied the first's prompt
    parts = client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=24, temperature=0, n=3, stream=True,
                                      stream_options={"include_usage": True})
    texts, finishes, usage = ["", "", ""], [None] * 3, None
    for c in parts:
        if c.usage is not None:
            usage = c.usage
        for choice in c.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [one.choices[0].text] * 3 and finishes == ["length"] * 3
    assert usage.prompt_tokens == one.usage.prompt_tokens and usage.completion_tokens == 72


def test_n_choices_sample_with_seed_plus_index(client):
    """Choice i of a seeded request is the single request with seed + i: reproducible per choice.  Fixed k:
    with the cost policy the drafts, and so the random draws of rejection sampling, follow what the role's
    policy learnt from earlier requests."""
    fixed = {"speculative": {"k_policy": "fixed"}}
    both = client.chat.completions.create(model="pycoder-6m", messages=[{"role": "user", "content": "def add(a, b):"}],
                                          max_tokens=16, temperature=0.9, seed=7, n=2, extra_body=fixed)
    for i in range(2):
        alone = client.chat.completions.create(model="pycoder-6m", messages=[{"role": "user", "content": "def add(a, b):"}],
                                               max_tokens=16, temperature=0.9, seed=7 + i, extra_body=fixed)
        assert both.choices[i].message.content == alone.choices[0].message.content
    assert both.choices[0].message.content != both.choices[1].message.content  # two seeds, two samples


def test_latency_is_reported_per_response_and_in_metrics(client, server):
    r = client.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=16, temperature=0)
    spec = r.model_extra["speculative"]
    assert spec["time_to_first_token_s"] > 0 and spec["inter_token_latency_s"] > 0
    metrics = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert 'specstack_inter_token_latency_seconds_count{role="pycoder-6m"}' in metrics
    assert 'specstack_time_to_first_token_seconds_count{role="pycoder-6m"}' in metrics


def test_roles_file(tmp_path):
    (tmp_path / "roles.toml").write_text(
        '[roles.frontdoor]\ndrafter = "prompt-lookup"\nparallel = 2\n\n'
        '[roles.coder]\ndrafter = "draft-model"\nk_policy = "fixed"\nk = 6\n'
    )
    roles = load_roles(tmp_path / "roles.toml")
    assert [r.name for r in roles] == ["frontdoor", "coder"] and roles[1].k == 6
    (tmp_path / "bad.toml").write_text('[roles.x]\nspeed = "fast"\n')
    with pytest.raises(Exception, match="unknown keys speed"):
        load_roles(tmp_path / "bad.toml")
    with pytest.raises(Exception, match="k_policy"):
        Role(name="x", k_policy="magic")


def test_two_roles_pick_by_model(tmp_path):
    # Fixed k: the cost policy may rightly draft nothing where verification is dear (an AVX2 build); exact on:
    # the two roles' outputs are compared bit for bit.
    roles = [Role(name="fast", drafter="prompt-lookup", k_policy="fixed", parallel=1, exact="on"),
             Role(name="careful", drafter="none", parallel=1, exact="on")]
    with Server(create_app(roles)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in c.models.list()] == ["fast", "careful"]
        a = c.completions.create(model="fast", prompt=PROMPT, max_tokens=24, temperature=0)
        b = c.completions.create(model="careful", prompt=PROMPT, max_tokens=24, temperature=0)
        assert a.choices[0].text == b.choices[0].text
        assert a.model_extra["speculative"]["n_accepted"] > 0 and b.model_extra["speculative"]["n_drafted"] == 0
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="gpt-4", prompt="x", max_tokens=2)


def spawn_server(*args: str) -> tuple[subprocess.Popen, str]:
    """A real `specstack serve` process on a free port, healthy."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specstack", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout=600, interval=0.1)  # a first start measures the machine: minutes on a busy host
    except ServerFailed as exc:
        proc.kill()
        raise RuntimeError(f"{exc}: {proc.communicate()[0][-2000:]}") from None
    return proc, url


def test_a_role_that_cannot_load_is_reported_by_health(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    app = create_app([Role(name="broken", model=bad, parallel=1)])
    s = Server(app)
    s.thread.start()
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                r = httpx.get(s.url + "/health")
                if "broken" in r.text:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert r.status_code == 503 and "broken.gguf" in r.json()["error"]["message"]  # never healthy, and says why
        c = httpx.post(s.url + "/v1/completions", json={"prompt": "x"})
        assert c.status_code == 503 and "failed to load" in c.json()["error"]["message"]
    finally:
        s.server.should_exit = True
        s.thread.join(30)


def test_a_disconnect_during_another_prompts_prefill_frees_everything(server, monkeypatch):
    """Stream A hangs up while B's long prompt is being prefilled inside the steps (the engine is held
    between two of B's chunks until A is gone): A's slot is freed, B's answer is plain decoding's, and
    nothing is left behind."""
    long_prompt = (Path(os.__file__).parent / "textwrap.py").read_text(encoding="utf-8")[:1200]
    # The module's server: a step takes at most 256 tokens of one prompt (the default --prefill-cap).
    worker = next(iter(server.app.state.workers.values()))
    engine = worker.engine
    held, resume = threading.Event(), threading.Event()
    step = engine.step

    def held_step() -> None:  # instrumentation, between steps: A decodes until B arrives, then B is held half in
        deadline = time.time() + 30
        while engine._running and not held.is_set() and worker.active < 2 and time.time() < deadline:
            time.sleep(0.005)
        if engine._running and engine._prefilling and engine.target.seq_len[engine._prefilling[0].seq] > 0 \
                and not held.is_set():
            held.set()
            resume.wait(30)
        step()

    monkeypatch.setattr(engine, "step", held_step)
    headers = {"Authorization": f"Bearer {KEY}"}
    cancelled = count_metric(httpx.get(server.url + "/metrics", headers=AUTH).text, 'status="cancelled"')
    answers: list[dict] = []

    def long_request() -> None:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 16, "temperature": 0},
                       headers=headers, timeout=120)
        answers.append(r.json())

    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()  # held, so that leaving the loop does not close the stream
        for line in lines:
            if line.startswith("data:") and json.loads(line[5:])["choices"]:
                break  # A is streaming
        b = threading.Thread(target=long_request)
        b.start()
        assert held.wait(30) and engine._prefilling  # B is half prefilled
    deadline = time.time() + 10  # A has hung up: the server notices while the engine is held, and queues the cancel
    while worker._inbox.empty() and time.time() < deadline:
        time.sleep(0.02)
    resume.set()
    b.join(60)
    while (engine.running or worker.active) and time.time() < deadline + 10:
        time.sleep(0.02)
    assert engine.running == 0 and worker.active == 0
    assert count_metric(httpx.get(server.url + "/metrics", headers=AUTH).text, 'status="cancelled"') == cancelled + 1
    ids = worker.target.tokenize(long_prompt + answers[0]["choices"][0]["text"])
    assert ids[len(worker.target.tokenize(long_prompt)):] == plain_ids(worker.target, long_prompt, 16)
    assert 'specstack_busy_slots{role="pycoder-6m"} 0.0' in httpx.get(server.url + "/metrics", headers=AUTH).text
    again = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert again.completions.create(model="pycoder-6m", prompt=PROMPT, max_tokens=8, temperature=0).usage.completion_tokens == 8
