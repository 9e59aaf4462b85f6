"""``specstack serve`` with a trained EAGLE-3 head (issue 59 step 7, docs/design-eagle3-dflash.md section 6).

- llama-server's own command line, ``-m pycoder-6m.gguf -md pycoder-6m-eagle3.gguf --spec-type draft-eagle3``,
  drafts with ``eagle3``: /v1/completions and llama-server's /completion answer with plain decoding's greedy text,
  and ``speculative.by_source`` (the timings' ``draft_n_accepted`` on /completion) shows the head's drafts accepted;
- a roles file with ``drafter = "eagle3"`` and ``draft = HEAD`` serves the same; a request asking for draft-model on
  it (the head is no draft model) or for eagle3 on a role without a head is a 400 naming why;
- ``-md HEAD`` alone picks eagle3 from the file's ``general.architecture`` (a NextN model: mtp; a model:
  draft-model, as before; a DFlash head: dflash, ``tests/test_serve_dflash.py``); ``--spec-type draft-dspark``, a
  DSpark head given alone, and a head given to ``--drafter draft-model`` are refused in one line, before any load;
- the bench's llama.cpp peer of eagle3 runs ``llama-speculative-simple --spec-type draft-eagle3 -md HEAD``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from specstack.bench.serving import ServerProcess, specstack_serve
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.llama import LlamaModel, ModelConfig
from specstack.paths import DEFAULT_DRAFT, DEFAULT_TARGET, MODELS_DIR
from specstack.prompts import held_out_prompts
from test_cli_hardening import serve_roles
from test_head_fit import dflash

HEAD = MODELS_DIR / "pycoder-6m-eagle3.gguf"  # the trained head for the bundled target
MTP_MODEL = MODELS_DIR / "pycoder-6m-mtp.gguf"
PROMPT = held_out_prompts(3)[2]
N = 40
# One thread and exact shapes: a quick load on a shared machine, and output comparable bit for bit; fixed k so the
# head drafts every step (the cost policy may rightly draft little with a head as costly as this 6M target's step)
LIGHT = ("-t", "1", "--exact", "on", "--k-policy", "fixed")


def serve(*flags: str) -> ServerProcess:
    """A ``specstack serve`` process with ``flags``, healthy (its log is in the failure's message otherwise)."""
    return specstack_serve(list(flags), timeout=120).start()


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def plain_text() -> str:
    """Plain greedy decoding of ``PROMPT`` on the bundled target."""
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_threads=1), role="target")
    try:
        engine = Engine(model, create("none", BuildContext(model)))
        return model.detokenize(engine.generate(PROMPT, GenerationConfig(max_tokens=N)).run().output_ids)
    finally:
        model.close()


@pytest.fixture(scope="module")
def eagle3_server() -> Iterator[ServerProcess]:
    """llama-server's command line naming the head, two slots."""
    with serve("-m", str(DEFAULT_TARGET), "-md", str(HEAD), "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3",
               "-np", "2", *LIGHT) as s:
        yield s


@pytest.fixture(scope="module")
def roles_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """``head`` drafts with eagle3 from ``draft = HEAD``; ``plain`` is the same model without a head."""
    path = tmp_path_factory.mktemp("roles") / "roles.toml"
    common = f'model = "{DEFAULT_TARGET}"\nparallel = 1\nthreads = 1\nexact = "on"\n'
    path.write_text(f'[roles.head]\n{common}drafter = "eagle3"\ndraft = "{HEAD}"\nk_policy = "fixed"\nk = 3\n\n'
                    f'[roles.plain]\n{common}')
    with serve("--config", str(path)) as s:
        yield s


def test_llama_servers_command_line_with_the_head_drafts_with_eagle3(eagle3_server, plain_text):
    c = client(eagle3_server)
    r = c.completions.create(model="x", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == plain_text and r.usage.completion_tokens == N
    spec = r.model_extra["speculative"]
    assert spec["drafter"] == "eagle3" and spec["n_accepted"] > 0
    assert spec["by_source"]["eagle3"]["accepted"] == spec["n_accepted"]
    assert c.models.list().data[0].model_extra["speculative"]["drafter"] == "eagle3"


def test_llama_servers_native_completion_reports_the_heads_drafts(eagle3_server, plain_text):
    r = httpx.post(eagle3_server.url + "/completion", json={"prompt": PROMPT, "n_predict": N, "temperature": 0},
                   timeout=60).json()
    assert r["content"] == plain_text
    assert r["timings"]["draft_n_accepted"] > 0 and r["timings"]["draft_n"] >= r["timings"]["draft_n_accepted"]


def test_a_roles_file_role_with_drafter_eagle3_and_its_head_as_draft(roles_server, plain_text):
    c = client(roles_server)
    r = c.completions.create(model="head", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == plain_text
    assert r.model_extra["speculative"]["by_source"]["eagle3"]["accepted"] > 0
    with pytest.raises(openai.BadRequestError) as e:  # the role's draft is a head: no draft model to draft with
        c.completions.create(model="head", prompt=PROMPT, max_tokens=4,
                             extra_body={"speculative": {"drafter": "draft-model"}})
    assert e.value.body["param"] == "speculative.drafter" and "eagle3 head" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # a role without a head
        c.completions.create(model="plain", prompt=PROMPT, max_tokens=4, extra_body={"speculative": {"drafter": "eagle3"}})
    assert e.value.body["param"] == "speculative.drafter" and "EAGLE-3 head" in e.value.body["message"]


def test_md_alone_picks_the_drafter_from_the_files_kind(capsys):
    assert serve_roles("-md", str(HEAD))[0].drafter == "eagle3"
    assert "drafts with eagle3, as --spec-type draft-eagle3 does" in capsys.readouterr().err
    assert serve_roles("-m", str(MTP_MODEL), "-md", str(MTP_MODEL))[0].drafter == "mtp"
    assert serve_roles("-md", str(DEFAULT_DRAFT))[0].drafter == "draft-model"  # a model: as before
    assert serve_roles("-md", str(HEAD), "--drafter", "prompt-lookup")[0].drafter == "prompt-lookup"
    assert serve_roles("-md", str(HEAD), "--spec-type", "ngram-mod")[0].drafter == "suffix"


def refused(*args: str) -> list[str]:
    """``specstack serve`` with ``args`` that must fail at startup: its non-empty output lines."""
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "specstack", "serve", "--port", "1", *args], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and time.perf_counter() - t0 < 30, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and "loading" not in run.stdout + run.stderr  # refused before any load
    return [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]


def test_what_cannot_draft_is_refused_in_one_line(tmp_path):
    lines = refused("-m", str(DEFAULT_TARGET), "-md", str(HEAD), "--spec-type", "draft-dspark")
    assert len(lines) == 1 and "--spec-type draft-dspark is not offered" in lines[0], lines
    assert "no DSpark drafter yet" in lines[0] and "draft-eagle3" in lines[0]
    lines = refused("-m", str(DEFAULT_TARGET), "-md", str(dflash(tmp_path / "dspark.gguf", markov=True)))
    assert len(lines) == 1 and "is a dspark head" in lines[0] and "--spec-type draft-dspark" in lines[0], lines
    lines = refused("-m", str(DEFAULT_TARGET), "-md", str(HEAD), "--spec-type", "draft-simple")
    assert len(lines) == 1 and "trained eagle3 head, not a model to draft with" in lines[0], lines
    assert "--drafter eagle3" in lines[0]


def test_the_bench_peer_of_eagle3_passes_the_head_and_its_spec_type(tmp_path):
    from specstack.bench.peers import peer_command
    from specstack.drafters.base import llama_peers

    assert llama_peers()["eagle3"] == ("llama-draft-eagle3",)
    (tmp_path / "llama-speculative-simple").write_text("")
    cmd = peer_command("llama-draft-eagle3", "t.gguf", "p.txt", draft=str(HEAD), k=3, bins=tmp_path)
    assert Path(cmd[0]).name == "llama-speculative-simple"
    assert cmd[cmd.index("--spec-type") + 1] == "draft-eagle3" and cmd[cmd.index("-md") + 1] == str(HEAD)
