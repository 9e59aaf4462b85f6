"""llama-server's surface on `specstack serve` (issue 31 items 3, 4 and 6), over real HTTP on the bundled model.

Each endpoint's shape as llama-server answers it (/completion in its native shape, streaming and not, with
its timings; /tokenize, /detokenize, /apply-template, /props, /slots), prompts as a list answered as several
choices, special tokens parsed in raw prompts, the developer role, the access log, embeddings refused with
501, and the logit controls: penalties, logit bias, min_tokens, ignore_eos and stop token ids over HTTP give
exactly the engine's plain decoding with the same controls, drafts accepted.  A role's defaults (penalties,
grammar) apply where a request sets none.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import openai
import pytest

from specstack.constraints import Constraints
from specstack.draft_length import FixedK
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.server.app import Limits, create_app
from specstack.server.chat import load_template, render
from specstack.server.request_constraints import ConstraintError, parse_logit_bias, request_constraints
from specstack.server.inputs import completion_prompts
from specstack.server.roles import Role, default_roles
from test_serve import KEY, PROMPT, Server

AUTH = {"Authorization": f"Bearer {KEY}"}
ALIAS = "coder-alias"
# A prompt the bundled model continues with repeats: prompt lookup drafts a lot, penalties change the text.
REPEATS = 'RECORD = {"name": "alpha", "size": 12, "ok": true}\nRECORD = {"name": "beta", "size": 7, "ok": false}\nRECORD = '
PENALTIES = {"repeat_penalty": 1.05, "repeat_last_n": 64, "frequency_penalty": 0.1, "presence_penalty": 0.05}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
          "additionalProperties": False}
# llama-server's /completion result keys (server-task.cpp to_json_non_oaicompat); specstack adds "speculative"
COMPLETION_KEYS = {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
                   "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
                   "tokens_cached", "timings"}
TIMINGS_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                "predicted_ms", "predicted_per_token_ms", "predicted_per_second", "draft_n", "draft_n_accepted"}


@pytest.fixture(scope="module")
def server():
    """Two roles of the bundled model: the first named by an alias, the second with penalties and a JSON schema as
    its defaults.  --exact on: outputs are compared with plain decoding token for token."""
    first = dataclasses.replace(default_roles(parallel=2, exact="on")[0], name=ALIAS)
    strict = Role(name="strict", parallel=1, exact="on", json_schema=json.dumps(SCHEMA), top_k=7, **PENALTIES)
    lines: list[str] = []
    app = create_app([first, strict], Limits(max_tokens=256), api_key=KEY, access_log=lines.append)
    with Server(app) as s:
        s.app, s.lines = app, lines
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as client:
        yield client


def plain(target, prompt: str | list[int], n: int, constraints: Constraints = Constraints(), drafter: str = "none",
          k: int = 1, stop_ids: tuple[int, ...] = ()):
    engine = Engine(target, create(drafter, BuildContext(target)), FixedK(k))
    return engine.generate(prompt, GenerationConfig(max_tokens=n, constraints=constraints, stop_token_ids=stop_ids)).run()


# -- the endpoints' shapes -----------------------------------------------------------------------------------

def test_tokenize_and_detokenize(http, target):
    text = "def add(a, b):"
    assert http.post("/tokenize", json={"content": text}).json() == {"tokens": target.tokenize(text, add_special=False)}
    with_bos = http.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert with_bos == target.tokenize(text, add_special=True) and with_bos[0] == target.bos_id
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == text and all(set(p) == {"id", "piece"} for p in pieces)
    special = "<|endoftext|>x"  # llama-server parses special tokens in /tokenize by default
    assert http.post("/tokenize", json={"content": special}).json()["tokens"][0] == target.bos_id
    assert len(http.post("/tokenize", json={"content": special, "parse_special": False}).json()["tokens"]) > 2
    ids = target.tokenize(text, add_special=True)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": "<|endoftext|>" + text}
    bad = http.post("/detokenize", json={"tokens": [target.n_vocab]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_apply_template_renders_as_chat_does_and_developer_is_system(http):
    messages = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "A stack class."}]
    prompt = http.post("/apply-template", json={"messages": messages}).json()["prompt"]
    as_system = [{**messages[0], "role": "system"}, messages[1]]
    assert prompt == render(as_system, load_template(Role(name="x").model)).text
    assert prompt.startswith("<|im_start|>system\nBe terse.<|im_end|>")  # no template in the GGUF: chatml
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200


def test_props_and_slots(http, server):
    props = http.get("/props").json()
    assert {"default_generation_settings", "total_slots", "model_path", "chat_template", "modalities",
            "build_info"} <= set(props)
    assert props["total_slots"] == 2 and props["model_alias"] == ALIAS
    assert {"active", "why_not", "key", "library", "isa"} <= set(props["specstack_kernels"])  # which CPU backend serves
    params = props["default_generation_settings"]["params"]
    assert params["repeat_penalty"] == 1.0 and params["samplers"][0] == "penalties"
    strict = http.get("/props", params={"model": "strict"}).json()["default_generation_settings"]["params"]
    assert strict["repeat_penalty"] == PENALTIES["repeat_penalty"] and "root ::=" in strict["grammar"]
    slots = http.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1] and not any(s["is_processing"] for s in slots)
    assert {"id", "id_task", "n_ctx", "speculative", "is_processing", "next_token"} <= set(slots[0])
    assert "params" not in slots[0]  # an idle slot has no task's params (llama-server's /slots)
    assert http.post("/props", json={}).status_code == 403  # read-only, as llama-server without --props


def test_completion_in_llama_servers_native_shape(http, target):
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 24, "temperature": 0}).json()
    assert COMPLETION_KEYS <= set(r) and TIMINGS_KEYS <= set(r["timings"])
    expected = plain(target, PROMPT, 24)
    assert r["content"] == expected.text and r["tokens"] == expected.output_ids
    assert r["stop"] is True and r["stop_type"] == "limit" and r["tokens_predicted"] == 24
    assert r["tokens_evaluated"] == len(target.tokenize(PROMPT)) and r["model"] == ALIAS
    assert r["generation_settings"]["n_predict"] == 24 and r["generation_settings"]["temperature"] == 0
    assert r["timings"]["predicted_n"] == 24 and r["timings"]["draft_n"] >= r["timings"]["draft_n_accepted"] > 0
    stopped = http.post("/completion", json={"prompt": PROMPT, "n_predict": 24, "temperature": 0,
                                             "stop": [expected.text[5:8]]}).json()
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == expected.text[5:8]
    assert stopped["content"] == expected.text[:expected.text.index(expected.text[5:8])]


def test_completion_streams_native_chunks_and_ends_with_the_result(http, target):
    with http.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                                  "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    chunks, last = events[:-1], events[-1]
    assert all(c["stop"] is False and {"index", "content", "tokens"} <= set(c) for c in chunks)
    assert last["stop"] is True and COMPLETION_KEYS <= set(last) and last["timings"]["predicted_n"] == 16
    expected = plain(target, PROMPT, 16)
    assert "".join(c["content"] for c in chunks) == expected.text
    assert [t for c in chunks for t in c["tokens"]] == expected.output_ids


def test_completion_takes_several_prompts_and_n_probs(http, target):
    results = http.post("/completion", json={"prompt": [PROMPT, "class Stack:"], "n_predict": 6,
                                             "temperature": 0}).json()
    assert isinstance(results, list) and [r["index"] for r in results] == [0, 1]
    assert [r["content"] for r in results] == [plain(target, p, 6).text for p in (PROMPT, "class Stack:")]
    probs = http.post("/completion", json={"prompt": PROMPT, "n_predict": 3, "temperature": 0, "n_probs": 2}).json()
    entries = probs["completion_probabilities"]
    assert len(entries) == 3 and all(len(e["top_logprobs"]) == 2 for e in entries)
    assert [e["id"] for e in entries] == probs["tokens"] and entries[0]["top_logprobs"][0]["id"] == entries[0]["id"]
    refused = http.post("/completion", json={"prompt": PROMPT, "echo": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"


def test_a_list_of_prompts_is_answered_as_several_choices(http, target):
    prompts = [PROMPT, "class Stack:"]
    r = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 5, "temperature": 0, "n": 2}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    texts = [plain(target, p, 5).text for p in prompts]
    assert [c["text"] for c in r["choices"]] == [texts[0], texts[0], texts[1], texts[1]]
    assert r["usage"]["prompt_tokens"] == sum(len(target.tokenize(p)) for p in prompts)
    mixed = http.post("/v1/completions", json={"prompt": [target.bos_id, "def add(a, b):"], "max_tokens": 5,
                                               "temperature": 0}).json()
    assert mixed["usage"]["prompt_tokens"] == 1 + len(target.tokenize("def add(a, b):", add_special=False))


def test_special_tokens_are_parsed_in_raw_prompts_not_in_chat(http, target):
    raw = http.post("/v1/completions", json={"prompt": "<|endoftext|>def f(", "max_tokens": 1}).json()
    assert raw["usage"]["prompt_tokens"] == len(target.tokenize("<|endoftext|>def f(", parse_special=True))
    assert completion_prompts("<|endoftext|>x", target)[0][:2] == [target.bos_id, target.bos_id]


def test_embeddings_are_501_naming_the_reason(http):
    for path in ("/v1/embeddings", "/embedding", "/embeddings"):
        r = http.post(path, json={"input": "x"})
        assert r.status_code == 501 and "no embedding role" in r.json()["error"]["message"]


def test_llama_server_routes_need_the_key_and_the_probes_do_not(server):
    for path in ("/completion", "/tokenize", "/apply-template"):
        assert httpx.post(server.url + path, json={}).status_code == 401
    assert httpx.get(server.url + "/props").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_alias_names_the_model(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [ALIAS, "strict"]
    r = http.post("/v1/completions", json={"model": ALIAS, "prompt": "x", "max_tokens": 1}).json()
    assert r["model"] == ALIAS


def test_one_access_log_line_per_request(http, server):
    before = len(server.lines)
    http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    http.get("/health")  # a probe: not logged
    http.post("/tokenize", json={"content": "x"})
    new = server.lines[before:]
    assert len(new) == 2, new
    assert new[0].startswith("specstack serve: POST /v1/completions 200 ") and new[0].endswith(
        f" ms {len(target_tokens(PROMPT))}+4 tokens")
    assert new[1].startswith("specstack serve: POST /tokenize 200 ") and new[1].endswith(" ms")


def target_tokens(text: str) -> list[int]:
    from specstack.llama.vocab import VocabModel
    from specstack.paths import DEFAULT_TARGET

    return VocabModel(DEFAULT_TARGET).tokenize(text)


# -- the logit controls over HTTP ------------------------------------------------------------------------------

def test_penalties_over_http_are_plain_decoding_with_the_same_penalties(http, target):
    """The same text and tokens as the engine's plain decoding with these penalties, with prompt lookup drafting
    (drafts accepted) and without; and the penalties changed the text."""
    expected = plain(target, REPEATS, 48, Constraints(**PENALTIES))
    assert expected.output_ids != plain(target, REPEATS, 48).output_ids
    accepted = 0
    for spec in ({"drafter": "none"}, {"drafter": "prompt-lookup", "k_policy": "fixed", "k": 4},
                 {"drafter": "suffix", "k_policy": "fixed", "k": 16}):
        r = http.post("/completion", json={"prompt": REPEATS, "n_predict": 48, "temperature": 0, **PENALTIES,
                                           "speculative": spec}).json()
        assert r["tokens"] == expected.output_ids, spec
        accepted += r["timings"]["draft_n_accepted"]
    assert accepted > 0
    vllm = http.post("/v1/completions", json={"prompt": REPEATS, "max_tokens": 48, "temperature": 0,
                                              **{**PENALTIES, "repetition_penalty": PENALTIES["repeat_penalty"]}})
    assert vllm.json()["choices"][0]["text"] == expected.text


def test_a_roles_defaults_apply_where_the_request_sets_none(http, target):
    """Role "strict" has the penalties and a JSON schema as defaults: a bare request gets both (valid JSON,
    plain decoding's tokens under the same controls); a request's own value wins over the default."""
    from specstack.llama.schema_gbnf import schema_to_gbnf

    expected = plain(target, REPEATS, 40, Constraints(**PENALTIES, grammar=schema_to_gbnf(SCHEMA)))
    r = http.post("/completion", json={"model": "strict", "prompt": REPEATS, "n_predict": 40, "temperature": 0}).json()
    assert r["tokens"] == expected.output_ids and set(json.loads(r["content"])) == {"name"}
    other = {"type": "object", "properties": {"size": {"type": "integer"}}, "required": ["size"],
             "additionalProperties": False}
    own = http.post("/completion", json={"model": "strict", "prompt": REPEATS, "n_predict": 40, "temperature": 0,
                                         "repeat_penalty": 1.0, "frequency_penalty": 0, "presence_penalty": 0,
                                         "json_schema": other}).json()
    assert own["tokens"] == plain(target, REPEATS, 40, Constraints(grammar=schema_to_gbnf(other))).output_ids
    assert set(json.loads(own["content"])) == {"size"}
    # An explicit free request turns the role's grammar off: grammar "" and response_format text alike.
    free = plain(target, REPEATS, 24, Constraints(**PENALTIES)).output_ids
    for off in ({"grammar": ""}, {"response_format": {"type": "text"}}):
        r = http.post("/completion", json={"model": "strict", "prompt": REPEATS, "n_predict": 24, "temperature": 0,
                                           **off}).json()
        assert r["tokens"] == free, off


def test_logit_bias_in_openai_and_llama_server_forms(http, target):
    free = plain(target, PROMPT, 12)
    first = free.output_ids[0]
    for bias in ({str(first): -100}, [[first, False]], [[target.detokenize([first]), False]]):
        r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 12, "temperature": 0, "logit_bias": bias,
                                           "speculative": {"drafter": "prompt-lookup", "k_policy": "fixed", "k": 4}})
        tokens = r.json()["tokens"]
        assert first not in tokens and tokens == plain(target, PROMPT, 12, Constraints(
            logit_bias=((first, float("-inf")),))).output_ids, bias
    bad = http.post("/v1/completions", json={"prompt": "x", "logit_bias": {"5": 500}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_min_tokens_ignore_eos_and_stop_token_ids(http, target):
    eog = target.eog_ids()
    for fields in ({"ignore_eos": True}, {"min_tokens": 30}):
        r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 30, "temperature": 0, **fields}).json()
        assert not set(r["tokens"]) & eog and r["tokens_predicted"] == 30
    free = plain(target, PROMPT, 24)
    stop = free.output_ids[6]
    for fields in ({"stop": [stop]}, {"stop_token_ids": [stop]}):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0, **fields}).json()
        cut = free.output_ids[: free.output_ids.index(stop)]
        assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == target.detokenize(cut)
    bad = http.post("/v1/completions", json={"prompt": "x", "stop": [target.n_vocab]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop"


def test_the_openai_client_sends_penalties_and_gets_plain_decoding(server, target):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    r = client.completions.create(model=ALIAS, prompt=REPEATS, max_tokens=32, temperature=0, frequency_penalty=0.3,
                                  presence_penalty=0.2, extra_body={"repeat_penalty": 1.1})
    c = Constraints(repeat_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2)
    assert r.choices[0].text == plain(target, REPEATS, 32, c).text


# -- controls without a server --------------------------------------------------------------------------------

def test_request_constraints_read_every_form_and_name_the_field(target):
    c, stops = request_constraints({"repetition_penalty": 1.2, "logit_bias": [[5, 3], ["7", False]],
                                    "stop": ["x", 9], "stop_token_ids": [11, 9], "min_tokens": 2}, vocab=target)
    assert c.repeat_penalty == 1.2 and dict(c.logit_bias) == {5: 3.0, 7: float("-inf")} and stops == (9, 11)
    assert parse_logit_bias({"def": 2}, target) == tuple((t, 2.0) for t in target.tokenize("def", add_special=False))
    for body, param in (({"repeat_penalty": 1.1, "repetition_penalty": 1.2}, "repetition_penalty"),
                        ({"frequency_penalty": 3}, "frequency_penalty"), ({"repeat_last_n": -2}, "repeat_last_n"),
                        ({"logit_bias": {"1": True}}, "logit_bias"), ({"logit_bias": [[1]]}, "logit_bias"),
                        ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"min_tokens": -1}, "min_tokens")):
        with pytest.raises(ConstraintError) as e:
            request_constraints(body, vocab=target)
        assert e.value.param == param, body


# -- issue 41 item 2: llama-server's request fields, defaults and bodies -------------------------------------

def test_completion_samples_with_llama_servers_defaults_unless_the_role_sets_one(http):
    """/completion: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05 where the request sets none (they were
    OpenAI's 1 / 0 / 1 / 0); a role's own default wins, and so does the request's."""
    llama = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "seed": 1}).json()
    assert {k: r["generation_settings"][k] for k in llama} == llama
    params = http.get("/props").json()["default_generation_settings"]["params"]
    assert {k: params[k] for k in llama} == llama
    strict = http.get("/props", params={"model": "strict"}).json()["default_generation_settings"]["params"]
    assert strict["top_k"] == 7 and strict["temperature"] == 0.8
    own = http.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "top_k": 3, "min_p": 0}).json()
    assert own["generation_settings"]["top_k"] == 3 and own["generation_settings"]["min_p"] == 0


def test_llama_servers_request_fields_are_accepted_or_refused_by_name(http):
    ok = [("/v1/completions", {"prompt": "def f(", "max_tokens": -1, "temperature": 0, "stop": ["\n"]}),
          ("/completion", {"prompt": "def f(", "n_predict": 4, "timings_per_token": True, "return_progress": True,
                           "typ_p": 1.0, "reasoning_format": "auto"}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                    "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low",
                                    "reasoning_format": "none"}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                    "reasoning_format": "deepseek-legacy"}),
          ("/v1/completions", {"prompt": "def f(", "max_tokens": 2, "reasoning_format": "deepseek"})]
    for path, body in ok:
        r = http.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
    refused = [({"typ_p": 0.9}, "typ_p"), ({"reasoning_format": "think"}, "reasoning_format"),
               ({"max_tokens": 0}, "max_tokens"), ({"samplers": ["temperature", "top_k"]}, "samplers")]
    for fields, param in refused:
        r = http.post("/v1/completions", json={"prompt": "x", **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
        assert param in r.json()["error"]["message"]


def test_max_tokens_minus_one_runs_to_the_servers_most(http):
    r = http.post("/v1/completions", json={"prompt": REPEATS, "max_tokens": -1, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256  # Limits(max_tokens=256)


def test_a_samplers_chain_without_penalties_turns_them_off(http, target):
    """llama-server builds its chain from ``samplers`` alone: a repeat_penalty beside a chain without
    "penalties" does nothing there, and now here (it was a 400 that never named the penalty)."""
    free = plain(target, REPEATS, 32).output_ids
    r = http.post("/completion", json={"prompt": REPEATS, "n_predict": 32, "temperature": 0, **PENALTIES,
                                       "samplers": ["top_k", "top_p", "min_p", "temperature"]})
    assert r.status_code == 200 and r.json()["tokens"] == free
    # the role "strict" has penalties as defaults: a chain without them turns those off too
    strict = http.post("/completion", json={"model": "strict", "prompt": REPEATS, "n_predict": 8, "temperature": 0,
                                            "grammar": "", "samplers": "kpmt"})
    assert strict.json()["tokens"] == free[:8]


def test_the_dotted_speculative_keys_are_k_and_p_min(http):
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "temperature": 0, "speculative.n_max": 3,
                                       "speculative.n_min": 2}).json()
    assert r["generation_settings"]["speculative"]["k"] == 3 and r["generation_settings"]["speculative"]["k_max"] == 3
    p_min = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "speculative.p_min": 0.5})
    assert p_min.status_code == 400 and p_min.json()["error"]["param"] == "speculative.p_min"
    assert "draft-model" in p_min.json()["error"]["message"]
    ok = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "speculative.p_min": 0.5,
                                        "speculative": {"drafter": "draft-model"}})
    assert ok.status_code == 200, ok.text
    both = http.post("/completion", json={"prompt": PROMPT, "speculative.n_max": 3, "speculative": {"k": 5}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "speculative.n_max"
    bad = http.post("/completion", json={"prompt": PROMPT, "speculative.n_max": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative.n_max"


def test_a_body_without_a_json_content_type_is_read_as_json(server):
    """curl -d sends application/x-www-form-urlencoded: llama-server reads the body as JSON, and so does this."""
    bodies = {"/completion": {"prompt": PROMPT, "n_predict": 2, "temperature": 0},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    for path, body in bodies.items():
        for kind in ("application/x-www-form-urlencoded", None):
            headers = {**AUTH, **({"Content-Type": kind} if kind else {})}
            r = httpx.post(server.url + path, content=json.dumps(body).encode(), headers=headers, timeout=120)
            assert r.status_code == 200, (path, kind, r.text)
    r = httpx.post(server.url + "/completion", content=b"prompt=hi", headers=AUTH, timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert "Content-Type: application/json" in r.json()["error"]["message"]


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(tmp_path):
    from specstack.server.jobs import template_kwargs
    from specstack.server.schema import ChatRequest

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}"
                    "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
                    "{% if reasoning_effort is defined %}[{{ reasoning_effort }}]{% endif %}")
    template = load_template(Role(name="x").model, str(path))
    messages = [{"role": "user", "content": "hi"}]

    def rendered(**fields) -> str:
        body = ChatRequest(messages=messages, **fields)
        return render(messages, template, extra=template_kwargs(body)).text

    assert rendered() == "hi"
    assert rendered(chat_template_kwargs={"enable_thinking": False}) == "hi/no_think"
    assert rendered(reasoning_effort="high") == "hi[high]"
    assert rendered(reasoning_effort="none") == "hi/no_think"


def test_aliases_tags_cors_the_x_api_key_and_no_ui_as_llama_server():
    """``-a A,B`` and ``--tags`` in /models (every alias picks the role), llama-server's CORS (any Origin echoed, a
    preflight answered before the key), ``X-Api-Key`` as the key, and ``--no-ui`` turning the page off."""
    role = dataclasses.replace(default_roles(parallel=1, exact="on")[0], name="code", aliases=("code", "fim"),
                               tags=("chat", "small"))
    app = create_app([role], Limits(max_tokens=8), api_key=KEY, cors_origins="*", page=False)
    with Server(app) as s, httpx.Client(base_url=s.url, timeout=120) as http:
        models = http.get("/models", headers=AUTH).json()["data"]
        assert [(m["id"], set(m["aliases"]), m["tags"]) for m in models] == [("code", {"code", "fim"}, ["chat", "small"])]
        r = http.post("/completion", json={"model": "fim", "prompt": "def f(", "n_predict": 2}, headers={"X-Api-Key": KEY})
        assert r.status_code == 200 and r.json()["model"] == "code", r.text
        assert http.post("/completion", json={"prompt": "x"}, headers={"X-Api-Key": "wrong"}).status_code == 401
        pre = http.options("/completions", headers={"Origin": "http://web.example", "Access-Control-Request-Method":
                                                    "POST"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://web.example"
        assert pre.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
        assert pre.headers["access-control-allow-credentials"] == "true"
        assert http.get("/health", headers={"Origin": "http://a.b"}).headers["access-control-allow-origin"] == "http://a.b"
        assert http.get("/").status_code == 404
        chat = http.post("/chat/completions", json={"messages": [{"role": "user", "content": "def f("}], "max_tokens": 2},
                         headers=AUTH)
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
        assert http.get("/metrics").status_code == 401  # behind the key, as llama-server's
        metrics = http.get("/metrics", headers=AUTH)
        assert metrics.headers["process-start-time-unix"].isdigit()  # llama-server's header (its spelling: the suite)
    local = create_app([role], Limits(max_tokens=8), cors_origins="localhost")
    with Server(local) as s, httpx.Client(base_url=s.url, timeout=120) as http:
        assert http.get("/health", headers={"Origin": "http://[::1]:3000"}).headers["access-control-allow-origin"] == \
            "http://[::1]:3000"
        assert "access-control-allow-origin" not in http.get("/health", headers={"Origin": "http://localhost.evil.com"}).headers
        assert http.get("/").status_code == 200


def test_cache_prompt_false_prefills_the_whole_prompt(http):
    """llama-server's ``cache_prompt: false``: no cached prefix is reused (``tokens_cached`` 0, the whole prompt
    prefilled), where the same prompt sent again with the default reuses it; the text is the same."""
    body = {"prompt": REPEATS, "n_predict": 8, "temperature": 0}
    first = http.post("/completion", json=body).json()
    again = http.post("/completion", json=body).json()
    fresh = http.post("/completion", json={**body, "cache_prompt": False}).json()
    assert again["tokens_cached"] > 0 and fresh["tokens_cached"] == 0
    assert fresh["timings"]["prompt_n"] == fresh["tokens_evaluated"] and fresh["content"] == first["content"]
