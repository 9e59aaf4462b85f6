"""``--drafter mtp`` in ``specstack serve``: flags, a roles file, a request's ``speculative`` object, and refusals.

Real ``specstack serve`` processes (``bench.serving.specstack_serve``) on the bundled trained MTP model
(``pycoder-6m-mtp``), one slot or two, one thread, ``--exact on`` so that served greedy output is compared with
plain decoding bit for bit; driven by the official ``openai`` client.

- ``serve -m MTP --drafter mtp``: completions (plain and streamed) and chat equal plain decoding, drafts from the
  head are accepted, and the response's ``speculative`` object, llama-server's ``timings`` and /metrics say so;
- a roles file: a role with ``drafter = "mtp"`` beside one with the default drafter, where a request's
  ``{"speculative": {"drafter": "mtp"}}`` drafts from the head (the target loads its NextN layers whatever the
  role's drafter); on a role whose model has none, that request is a 400 naming the model, the drafters that work
  and the fix;
- a model without NextN layers under ``--drafter mtp`` (flag or roles file): one line, before any load.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Iterator

import httpx
import openai
import pytest

from specstack.bench.serving import ServerProcess, specstack_serve
from specstack.drafters import DEFAULT_DRAFTER, BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.llama import LlamaModel, ModelConfig
from specstack.paths import DEFAULT_TARGET, MODELS_DIR
from specstack.prompts import held_out_prompts

MTP_MODEL = MODELS_DIR / "pycoder-6m-mtp.gguf"
PROMPT = held_out_prompts(3)[2]
N = 40
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A stack class."}]
# One thread and exact shapes: a quick load on a shared 2-core machine, and output comparable bit for bit.
LIGHT = ("-t", "1", "--exact", "on")


def serve(*flags: str) -> ServerProcess:
    """A ``specstack serve`` process with ``flags``, healthy (its log is in the failure's message otherwise)."""
    return specstack_serve(list(flags), timeout=120).start()


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def plain_text() -> str:
    """Plain greedy decoding of ``PROMPT`` on the MTP model's trunk (loaded without its NextN layers)."""
    model = LlamaModel(ModelConfig(MTP_MODEL, load_mtp=False, n_threads=1), role="target")
    try:
        engine = Engine(model, create("none", BuildContext(model)))
        return model.detokenize(engine.generate(PROMPT, GenerationConfig(max_tokens=N)).run().output_ids)
    finally:
        model.close()


@pytest.fixture(scope="module")
def mtp_server() -> Iterator[ServerProcess]:
    """``serve -m MTP --drafter mtp`` at fixed k = 4 (the cost policy may rightly draft little with a head this
    cheap against its target; fixed k makes acceptance certain), two slots."""
    with serve("-m", str(MTP_MODEL), "--drafter", "mtp", "--k-policy", "fixed", "-k", "4", "-np", "2", *LIGHT) as s:
        yield s


@pytest.fixture(scope="module")
def roles_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """A roles file: ``head`` drafts with mtp, ``lookup`` (same model) with the default drafter, ``small`` is
    the bundled pycoder-6m (no NextN layers)."""
    path = tmp_path_factory.mktemp("roles") / "roles.toml"
    common = 'parallel = 1\nthreads = 1\nexact = "on"\n'
    path.write_text(f'[roles.head]\nmodel = "{MTP_MODEL}"\ndrafter = "mtp"\nk_policy = "fixed"\nk = 4\n{common}\n'
                    f'[roles.lookup]\nmodel = "{MTP_MODEL}"\n{common}\n'
                    f'[roles.small]\nmodel = "{DEFAULT_TARGET}"\n{common}')
    with serve("--config", str(path)) as s:
        yield s


def test_serve_drafter_mtp_completions_equal_plain_decoding_with_drafts_accepted(mtp_server, plain_text):
    c = client(mtp_server)
    r = c.completions.create(model="x", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == plain_text and r.usage.completion_tokens == N
    spec = r.model_extra["speculative"]
    assert spec["drafter"] == "mtp" and spec["k_policy"] == "fixed"
    assert spec["n_accepted"] > 0 and spec["by_source"]["mtp"]["accepted"] == spec["n_accepted"]
    assert spec["acceptance_by_position"][0] > 0  # the head's first draft token is right some of the time
    chunks = list(c.completions.create(model="x", prompt=PROMPT, max_tokens=N, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain_text
    tokens = [t for ch in chunks for t in (ch.model_extra.get("specstack") or {}).get("tokens", [])]
    assert {source for _, source in tokens} == {"target", "mtp"}
    models = c.models.list().data[0].model_extra["speculative"]
    assert models["drafter"] == "mtp" and models["k"] == 4  # -k reaches the role
    metrics = httpx.get(mtp_server.url + "/metrics").text
    accepted = [line for line in metrics.splitlines()
                if line.startswith("specstack_spec_decode_num_accepted_tokens_total") and 'source="mtp"' in line]
    assert accepted and float(accepted[0].split()[-1]) > 0


def test_serve_drafter_mtp_chat_equals_the_same_chat_without_drafts(mtp_server):
    c = client(mtp_server)
    drafted = c.chat.completions.create(model="x", messages=MESSAGES, max_tokens=N, temperature=0)
    plain = c.chat.completions.create(model="x", messages=MESSAGES, max_tokens=N, temperature=0,
                                      extra_body={"speculative": {"drafter": "none"}})
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    assert drafted.usage.completion_tokens == N
    assert drafted.model_extra["speculative"]["by_source"]["mtp"]["accepted"] > 0
    assert plain.model_extra["speculative"]["n_drafted"] == 0


def test_llama_servers_native_completion_reports_the_heads_drafts(mtp_server, plain_text):
    r = httpx.post(mtp_server.url + "/completion", json={"prompt": PROMPT, "n_predict": N, "temperature": 0},
                   timeout=60).json()
    assert r["content"] == plain_text
    assert r["timings"]["draft_n_accepted"] > 0 and r["timings"]["draft_n"] >= r["timings"]["draft_n_accepted"]


def test_a_roles_file_role_with_drafter_mtp(roles_server, plain_text):
    c = client(roles_server)
    r = c.completions.create(model="head", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == plain_text
    assert r.model_extra["speculative"]["drafter"] == "mtp" and r.model_extra["speculative"]["n_accepted"] > 0
    listed = {m.id: m.model_extra["speculative"]["drafter"] for m in c.models.list().data}
    assert listed == {"head": "mtp", "lookup": DEFAULT_DRAFTER, "small": DEFAULT_DRAFTER}


def test_a_request_picks_mtp_on_a_role_whose_default_is_another_drafter(roles_server, plain_text):
    c = client(roles_server)
    default = c.completions.create(model="lookup", prompt=PROMPT, max_tokens=N, temperature=0)
    assert default.model_extra["speculative"]["drafter"] == DEFAULT_DRAFTER
    for spec in ({"drafter": "mtp", "k_policy": "fixed", "k": 3},
                 {"drafter": "cascade:suffix,mtp", "k_policy": "fixed"}):
        r = c.completions.create(model="lookup", prompt=PROMPT, max_tokens=N, temperature=0,
                                 extra_body={"speculative": spec})
        assert r.choices[0].text == default.choices[0].text == plain_text
        assert r.model_extra["speculative"]["by_source"]["mtp"]["accepted"] > 0, spec


def test_a_request_for_mtp_on_a_model_without_nextn_layers_is_a_400_naming_the_fix(roles_server):
    c = client(roles_server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="small", prompt=PROMPT, max_tokens=4, extra_body={"speculative": {"drafter": "mtp"}})
    body = e.value.body
    assert body["param"] == "speculative.drafter"
    message = body["message"]
    assert "'small'" in message and DEFAULT_TARGET.name in message and "NextN" in message
    assert "prompt-lookup, suffix or draft-model" in message and "ask for a role whose model has them" in message
    assert "--" not in message  # a request's words, not the command line's
    ok = c.completions.create(model="small", prompt=PROMPT, max_tokens=4, temperature=0)  # the role still serves
    assert ok.usage.completion_tokens == 4


def refused(*args: str) -> list[str]:
    """``specstack serve`` with ``args`` that must fail at startup: its non-empty output lines."""
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "specstack", "serve", "--port", "1", *args], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and time.perf_counter() - t0 < 30, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and "loading" not in run.stdout + run.stderr  # refused before any load
    return [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]


def test_drafter_mtp_on_a_model_without_nextn_layers_is_refused_in_one_line(tmp_path):
    lines = refused("-m", str(DEFAULT_TARGET), "--drafter", "mtp")
    assert len(lines) == 1, lines
    assert lines[0].startswith("specstack serve: error: --drafter mtp: ") and DEFAULT_TARGET.name in lines[0]
    assert "NextN" in lines[0] and "prompt-lookup" in lines[0] and "specstack check" in lines[0]
    (tmp_path / "roles.toml").write_text(f'[roles.coder]\nmodel = "{DEFAULT_TARGET}"\ndrafter = "cascade:suffix,mtp"\n')
    lines = refused("--config", str(tmp_path / "roles.toml"))
    assert len(lines) == 1 and "role 'coder'" in lines[0] and "cascade:suffix,mtp" in lines[0], lines
