"""llama-server's /completion details, its ``llamacpp:*`` metrics, --sleep-idle-seconds and the flags its test suite
starts with, over real HTTP on the bundled model (llama.cpp's tools/server/tests: test_completion, test_metrics,
test_sleep, test_ignore_eos, test_basic's multiple addresses, test_speculative's synthetic acceptance).
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from specstack.server.app import Limits, create_app
from specstack.server.roles import default_roles
from test_cli_hardening import parsed, serve_cli, serve_roles
from test_serve import Server

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def http():
    """One role of the bundled model, two slots, --exact on (as test_llama_server_api's, whose calibration it shares)."""
    app = create_app(default_roles(parallel=2, exact="on"), Limits(max_tokens=256))
    with Server(app) as s, httpx.Client(base_url=s.url, timeout=300) as client:
        yield client


def llamacpp(text: str) -> dict[str, tuple[str, float]]:
    """The ``llamacpp:*`` samples of a /metrics text with their ``# TYPE`` (test_metrics.py's parse_metrics)."""
    types, out = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:") and "{" not in line:
            name, value = line.split(" ", 1)
            out[name] = (types[name], float(value))
    return out


# -- /completion ---------------------------------------------------------------------------------------------

def test_post_sampling_probs_are_probabilities_of_the_sampled_distribution(http):
    body = {"prompt": PROMPT, "n_probs": 10, "temperature": 1.0, "n_predict": 5, "post_sampling_probs": True}
    r = http.post("/completion", json=body)
    assert r.status_code == 200, r.text
    probs = r.json()["completion_probabilities"]
    assert len(probs) == 5 and r.json()["generation_settings"]["post_sampling_probs"] is True
    for tok in probs:
        assert set(tok) == {"id", "token", "bytes", "prob", "top_probs"} and 0 < tok["prob"] <= 1
        top = tok["top_probs"]
        assert all(0 < p["prob"] <= 1 for p in top) and [p["prob"] for p in top] == sorted((p["prob"] for p in top),
                                                                                          reverse=True)
        if len(top) < 10:  # fewer only where llama-server's defaults (top_k 40, top_p 0.95, min_p 0.05) left fewer
            assert sum(p["prob"] for p in top) == pytest.approx(1.0)
        assert tok["id"] in [p["id"] for p in top] or tok["prob"] <= top[-1]["prob"]
    greedy = http.post("/completion", json={**body, "temperature": 0}).json()["completion_probabilities"]
    assert all(t["prob"] == 1.0 and [p["id"] for p in t["top_probs"]] == [t["id"]] for t in greedy)
    raw = http.post("/completion", json={**body, "post_sampling_probs": False}).json()["completion_probabilities"]
    assert all("logprob" in t and "top_logprobs" in t and "prob" not in t for t in raw)


def test_a_json_prompt_object_is_its_prompt_string(http):
    plain = http.post("/completion", json={"prompt": PROMPT, "n_predict": 8, "temperature": 0}).json()
    obj = http.post("/completion", json={"prompt": {"prompt_string": PROMPT}, "n_predict": 8, "temperature": 0})
    assert obj.status_code == 200 and obj.json()["content"] == plain["content"]
    ids = http.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    both = http.post("/completion", json={"prompt": [ids, {"prompt_string": PROMPT}], "n_predict": 8,
                                          "temperature": 0}).json()
    assert [c["content"] for c in both] == [plain["content"]] * 2
    media = http.post("/completion", json={"prompt": {"prompt_string": "x <__media__>", "multimodal_data": ["iVBO"]}})
    assert media.status_code == 400 and "multimodal_data" in media.json()["error"]["message"]
    bad = http.post("/completion", json={"prompt": {"prompt": PROMPT}})
    assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]


def test_backend_sampling_is_accepted_and_changes_nothing(http):
    body = {"prompt": PROMPT, "n_predict": 8, "seed": 4242, "n_probs": 3, "post_sampling_probs": True}
    on = http.post("/completion", json={**body, "backend_sampling": True})
    off = http.post("/completion", json={**body, "backend_sampling": False})
    assert on.status_code == off.status_code == 200
    assert on.json()["completion_probabilities"] == off.json()["completion_probabilities"]


def test_ignore_eos_lists_its_end_of_generation_bans_in_generation_settings(http):
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "ignore_eos": True, "temperature": 0})
    bias = r.json()["generation_settings"]["logit_bias"]
    assert bias and all(set(b) == {"bias", "token"} and b["bias"] is None for b in bias)
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "logit_bias": [[5, 2.5]]})
    assert r.json()["generation_settings"]["logit_bias"] == [{"bias": 2.5, "token": 5}]


def test_the_generation_rate_leaves_out_the_first_token(http):
    one = http.post("/completion", json={"prompt": PROMPT, "n_predict": 1}).json()["timings"]
    assert one["predicted_n"] == 1 and one["predicted_per_second"] == 0.0 and one["predicted_per_token_ms"] == 0.0
    t = http.post("/completion", json={"prompt": PROMPT, "n_predict": 16, "ignore_eos": True}).json()["timings"]
    assert t["predicted_n"] == 16
    assert t["predicted_per_second"] == pytest.approx(1e3 / t["predicted_ms"] * 15)
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / 15)


# -- /metrics ------------------------------------------------------------------------------------------------

def test_llamacpp_metrics_count_what_the_timings_report(http):
    before = llamacpp(http.get("/metrics").text)
    timings = [http.post("/completion", json={"prompt": "the quick brown fox", "n_predict": n}).json()["timings"]
               for n in (1, 4, 4)]
    r = http.get("/metrics")
    assert r.status_code == 200 and "Process-Start-Time-Unix" in r.headers
    after = llamacpp(r.text)
    for name in ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
                 "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "spec_decode_num_drafts_total"):
        assert after[f"llamacpp:{name}"][0] == "counter" and f"# HELP llamacpp:{name} " in r.text
    for name in ("prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing", "requests_deferred",
                 "n_busy_slots_per_decode"):
        assert after[f"llamacpp:{name}"][0] == "gauge"

    def grew(name: str) -> float:
        return after[f"llamacpp:{name}"][1] - before[f"llamacpp:{name}"][1]

    assert grew("prompt_tokens_total") == sum(t["prompt_n"] for t in timings)
    assert grew("prompt_tokens_cached_total") == sum(t["cache_n"] for t in timings) > 0
    assert grew("tokens_predicted_total") == sum(t["predicted_n"] for t in timings)
    assert grew("n_decode_total") > 0 and after["llamacpp:requests_processing"][1] == 0
    assert "specstack_requests_total" in r.text  # specstack's own metrics stay beside them
    # a scrape starts the throughput window afresh: the next one, with nothing run between, reports none
    assert llamacpp(http.get("/metrics").text)["llamacpp:predicted_tokens_seconds"][1] == 0


def test_slots_are_idle_once_the_answer_is_sent(http):
    http.post("/completion", json={"prompt": PROMPT, "n_predict": 8})
    for slot in http.get("/slots").json():
        assert slot["is_processing"] is False and slot["next_token"][0]["n_remain"] == -1  # a list, as llama-server's
        assert slot["next_token"][0]["n_decoded"] == 0


def test_metrics_are_off_on_a_llama_server_command_line_without_metrics():
    from specstack.commands.llama_server_flags import metrics_endpoint

    def on(*argv: str) -> bool:
        args = parsed("serve", *argv)
        args.argv = list(argv)
        return metrics_endpoint(args)

    assert on() and on("-np", "2", "--temp", "0")  # specstack's own command lines: its page and benchmarks read it
    assert not on("--no-slots", "--no-jinja") and not on("--jinja", "-cb")  # llama-server's: off unless --metrics
    assert on("--no-slots", "--metrics")


# -- --sleep-idle-seconds ------------------------------------------------------------------------------------

def test_an_idle_role_sleeps_read_only_endpoints_keep_it_asleep_and_a_request_wakes_it():
    app = create_app(default_roles(parallel=1, exact="on"), Limits(max_tokens=64), sleep_idle_s=1,
                     metrics_endpoint=False)
    with Server(app) as s, httpx.Client(base_url=s.url, timeout=300) as http:
        assert http.post("/completion", json={"prompt": PROMPT, "n_predict": 4}).status_code == 200
        asleep = wait_asleep(http)
        assert asleep["is_sleeping"] is True and asleep["default_generation_settings"]["n_ctx"] > 0
        assert http.get("/health").status_code == 200 and http.get("/v1/models").json()["data"][0]["n_ctx"] > 0
        assert http.get("/metrics").status_code == 501  # off (metrics_endpoint=False): 501, and it wakes nothing
        assert http.get("/props").json()["is_sleeping"] is True
        assert app.state.workers["pycoder-6m"].engine is None  # the model is freed, not just reported asleep
        assert http.post("/tokenize", json={"content": "def"}).json()["tokens"]  # needs the model: wakes it
        assert http.get("/props").json()["is_sleeping"] is False
        wait_asleep(http)
        r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["timings"]["predicted_n"] == 4
        assert http.get("/props").json()["is_sleeping"] is False


def test_a_sleeping_role_keeps_its_grammar_engine_and_answers_as_before():
    """A wake built llguidance's tokenizer again (2.8 s on Gemma 3, 1.4 s of it holding the GIL): a role that
    sleeps keeps its grammar engine, and a constrained request after the wake answers as before it."""
    app = create_app(default_roles(parallel=1, exact="on"), Limits(max_tokens=64), sleep_idle_s=1)
    body = {"prompt": PROMPT, "n_predict": 24, "temperature": 0,
            "grammar": 'root ::= "items = [" [0-9]+ (", " [0-9]+)* "]"'}
    with Server(app) as s, httpx.Client(base_url=s.url, timeout=300) as http:
        worker = app.state.workers["pycoder-6m"]
        first = http.post("/completion", json=body).json()["content"]
        assert first.startswith("items = [")
        engine = worker.target.grammar_engine()
        assert engine._tokenizer is not None
        wait_asleep(http)
        assert worker.engine is None
        assert http.post("/completion", json=body).json()["content"] == first
        assert worker.target.grammar_engine() is engine and worker.grammars_warm.result() is engine._tokenizer


def wait_asleep(http: httpx.Client, timeout_s: float = 60) -> dict:
    """/props once the role sleeps (it must within ``timeout_s``: one idle second, then the model is freed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        props = http.get("/props").json()
        if props["is_sleeping"]:
            return props
        time.sleep(0.1)
    raise AssertionError("the role did not go to sleep")


# -- the flags llama-server's suite starts with --------------------------------------------------------------

def test_backend_sampling_flags_are_accepted():
    for flag in ("-bs", "--backend-sampling", "--backend_sampling"):
        assert parsed("serve", flag).backend_sampling
    assert parsed("serve", "--no-spec-draft-backend-sampling").draft_backend_sampling


@pytest.mark.parametrize("flags", [["--spec-synth-len", "2.5"], ["--spec-synth-rates", "0.75,0.5"]])
def test_synthetic_acceptance_is_refused_as_not_lossless(capsys, flags):
    code, err = serve_cli(capsys, *flags)
    assert code == 2 and "cannot apply to specstack serve" in err and "lossless" in err


def test_kv_unified_gives_each_slot_the_whole_context():
    assert serve_roles("-c", "256", "-np", "4")[0].ctx == 64
    assert serve_roles("-c", "256", "-np", "4", "-kvu")[0].ctx == 256


def test_several_hosts_are_each_listened_on(capsys):
    from specstack.commands.serve import bind_sockets, host_list

    assert host_list("127.0.0.1, ::1") == ["127.0.0.1", "::1"]
    code, err = serve_cli(capsys, "--host", "127.0.0.1,")
    assert code == 2 and "--host has an empty address" in err
    try:
        socket.socket(socket.AF_INET6).close()
        hosts = ["127.0.0.1", "::1"]
        socks = bind_sockets(hosts, 0)
    except OSError:
        hosts, socks = ["127.0.0.1"], bind_sockets(["127.0.0.1"], 0)
    try:
        assert [s.family for s in socks] == [socket.AF_INET6 if ":" in h else socket.AF_INET for h in hosts]
    finally:
        for s in socks:
            s.close()


def test_a_completion_stream_reports_prompt_progress_first_with_its_timings(http):
    """llama-server's return_progress on /completion: partial chunks with prompt_progress before the first token,
    their timings (timings_per_token) never going back, the first before any prompt token; the text unchanged."""
    import json

    body = {"prompt": "import os\nimport sys\n" * 40 + "def main():", "n_predict": 6, "temperature": 0,
            "stream": True, "cache_prompt": False}

    def chunks(**extra):
        with http.stream("POST", "/completion", json={**body, **extra}) as r:
            assert r.status_code == 200
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]

    got = chunks(return_progress=True, timings_per_token=True)
    progress = [c for c in got if "prompt_progress" in c]
    assert len(progress) > 1 and got[:len(progress)] == progress  # all before the first token
    first = progress[0]["timings"]
    assert first["prompt_n"] == 0 and first["prompt_ms"] == 0.0 and first["predicted_n"] == 0
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    ms = [c["timings"]["prompt_ms"] for c in progress]
    assert ms == sorted(ms) and ms[-1] > 0 and all(v >= 0 for c in progress for v in c["timings"].values())
    plain = chunks()
    assert not any("prompt_progress" in c for c in plain)
    assert "".join(c["content"] for c in got) == "".join(c["content"] for c in plain)


# -- the OpenAI routes' bodies ---------------------------------------------------------------------------------

def test_every_openai_completion_body_and_chunk_carries_a_system_fingerprint(http):
    """llama-server puts ``system_fingerprint`` (its build, ``b<build>-<commit>``) in every /v1/completions and
    /v1/chat/completions body and stream chunk; its test_completion_with_openai_library checks that it starts
    with "b".  Streamed chunks include the usage chunk (stream_options.include_usage)."""
    import json

    bodies = []
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})):
        body = {**body, "max_tokens": 3, "temperature": 0}
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        bodies.append(r.json())
        with http.stream("POST", path, json={**body, "stream": True,
                                             "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert len(chunks) > 2 and chunks[-1]["choices"] == [] and "usage" in chunks[-1]
        bodies += chunks
    assert all(b["system_fingerprint"].startswith("b") for b in bodies), [b.get("system_fingerprint") for b in bodies]
    assert len({b["system_fingerprint"] for b in bodies}) == 1


def test_response_fields_cut_a_completion_result_to_the_fields_named(http):
    """llama-server's response_fields on /completion (json_get_nested_values): only the fields named, a nested one
    under its path at the top level, one that leads nowhere left out; a stream's final chunk likewise.  llama.cpp's
    test_completion_response_fields.  OpenAI's routes do not apply it, so there it is still refused."""
    import json

    fields = ["content", "generation_settings/n_predict", "prompt", "no/such/field"]
    body = {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "response_fields": fields}
    r = http.post("/completion", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert set(got) == {"content", "generation_settings/n_predict", "prompt"}
    assert got["generation_settings/n_predict"] == 4 and got["prompt"].endswith(PROMPT) and got["content"]
    whole = http.post("/completion", json={**body, "response_fields": []}).json()
    assert got["content"] == whole["content"] and "generation_settings" in whole and "timings" in whole
    with http.stream("POST", "/completion", json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert all(c["stop"] is False for c in chunks[:-1])
    assert set(chunks[-1]) == {"content", "generation_settings/n_predict", "prompt"} and chunks[-1]["content"] == ""
    assert "".join(c["content"] for c in chunks[:-1]) == got["content"]
    v1 = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "response_fields": ["content"]})
    assert v1.status_code == 400 and "response_fields" in v1.text
