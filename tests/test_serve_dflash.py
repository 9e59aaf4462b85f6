"""``specstack serve`` with a trained DFlash head (issue 59 step 7, docs/design-eagle3-dflash.md section 6).

- llama-server's own command line, ``-m pycoder-6m.gguf -md pycoder-6m-dflash.gguf --spec-type draft-dflash``,
  drafts with ``dflash``: /v1/completions and llama-server's /completion answer with plain decoding's greedy text,
  and ``speculative.by_source`` (the timings' ``draft_n_accepted`` on /completion) shows the head's drafts accepted;
- a roles file with ``drafter = "dflash"`` and ``draft = HEAD`` serves the same; a request asking for draft-model on
  it or for dflash on a role without a head is a 400 naming why;
- ``-md HEAD`` alone picks dflash from the file's ``general.architecture``, as llama-server infers draft-dflash;
- ``--spec-type draft-dspark`` and a DSpark head alone stay refused, and so do a DFlash head given to another head's
  type or an EAGLE-3 head to draft-dflash: one line each, before any load;
- the bench's llama.cpp peer of dflash runs ``llama-speculative-simple --spec-type draft-dflash -md HEAD``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from specstack.bench.serving import ServerProcess
from specstack.paths import DEFAULT_TARGET, MODELS_DIR
from test_cli_hardening import serve_roles
from test_head_fit import dflash
from test_serve_eagle3 import HEAD as EAGLE3_HEAD
from test_serve_eagle3 import plain_text  # noqa: F401 (a fixture, used by name)
from test_serve_eagle3 import LIGHT, N, PROMPT, client, refused, serve

HEAD = MODELS_DIR / "pycoder-6m-dflash.gguf"  # the trained head for the bundled target


@pytest.fixture(scope="module")
def dflash_server() -> Iterator[ServerProcess]:
    """llama-server's command line naming the head, two slots."""
    with serve("-m", str(DEFAULT_TARGET), "-md", str(HEAD), "--spec-type", "draft-dflash", "--spec-draft-n-max", "4",
               "-np", "2", *LIGHT) as s:
        yield s


@pytest.fixture(scope="module")
def roles_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """``head`` drafts with dflash from ``draft = HEAD``; ``plain`` is the same model without a head."""
    path = tmp_path_factory.mktemp("roles") / "roles.toml"
    common = f'model = "{DEFAULT_TARGET}"\nparallel = 1\nthreads = 1\nexact = "on"\n'
    path.write_text(f'[roles.head]\n{common}drafter = "dflash"\ndraft = "{HEAD}"\nk_policy = "fixed"\nk = 4\n\n'
                    f'[roles.plain]\n{common}')
    with serve("--config", str(path)) as s:
        yield s


def test_llama_servers_command_line_with_the_head_drafts_with_dflash(dflash_server, plain_text):
    c = client(dflash_server)
    r = c.completions.create(model="x", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == plain_text and r.usage.completion_tokens == N
    spec = r.model_extra["speculative"]
    assert spec["drafter"] == "dflash" and spec["n_accepted"] > 0
    assert spec["by_source"]["dflash"]["accepted"] == spec["n_accepted"]
    assert c.models.list().data[0].model_extra["speculative"]["drafter"] == "dflash"


def test_llama_servers_native_completion_reports_the_heads_drafts(dflash_server, plain_text):
    r = httpx.post(dflash_server.url + "/completion", json={"prompt": PROMPT, "n_predict": N, "temperature": 0},
                   timeout=60).json()
    assert r["content"] == plain_text
    assert r["timings"]["draft_n_accepted"] > 0 and r["timings"]["draft_n"] >= r["timings"]["draft_n_accepted"]


def test_a_roles_file_role_with_drafter_dflash_and_its_head_as_draft(roles_server, plain_text):
    c = client(roles_server)
    r = c.completions.create(model="head", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == plain_text
    assert r.model_extra["speculative"]["by_source"]["dflash"]["accepted"] > 0
    with pytest.raises(openai.BadRequestError) as e:  # the role's draft is a head: no draft model to draft with
        c.completions.create(model="head", prompt=PROMPT, max_tokens=4,
                             extra_body={"speculative": {"drafter": "draft-model"}})
    assert e.value.body["param"] == "speculative.drafter" and "dflash head" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # a role without a head
        c.completions.create(model="plain", prompt=PROMPT, max_tokens=4, extra_body={"speculative": {"drafter": "dflash"}})
    assert e.value.body["param"] == "speculative.drafter" and "DFlash head" in e.value.body["message"]


def test_md_alone_picks_dflash_from_the_files_kind(capsys, tmp_path):
    assert serve_roles("-md", str(HEAD))[0].drafter == "dflash"
    assert "drafts with dflash, as --spec-type draft-dflash does" in capsys.readouterr().err
    small = dflash(tmp_path / "small.gguf")  # metadata only: picked from the kind, nothing loaded
    assert serve_roles("-md", str(small))[0].drafter == "dflash"
    assert serve_roles("-md", str(HEAD), "--spec-type", "draft-dflash,ngram-mod")[0].drafter == "cascade:dflash,suffix"


def test_what_cannot_draft_is_refused_in_one_line(tmp_path):
    lines = refused("-m", str(DEFAULT_TARGET), "-md", str(HEAD), "--spec-type", "draft-dspark")
    assert len(lines) == 1 and "--spec-type draft-dspark is not offered" in lines[0], lines
    assert "no DSpark drafter yet" in lines[0] and "draft-dflash" in lines[0]
    lines = refused("-m", str(DEFAULT_TARGET), "-md", str(dflash(tmp_path / "spark.gguf", markov=True)))
    assert len(lines) == 1 and "is a dspark head" in lines[0] and "--spec-type draft-dspark" in lines[0], lines
    lines = refused("-m", str(DEFAULT_TARGET), "-md", str(EAGLE3_HEAD), "--spec-type", "draft-dflash")
    assert len(lines) == 1 and "is 'eagle3', not a DFlash head" in lines[0], lines
    lines = refused("-m", str(DEFAULT_TARGET), "-md", str(HEAD), "--spec-type", "draft-eagle3")
    assert len(lines) == 1 and "is 'dflash', not an EAGLE-3 head" in lines[0], lines
    lines = refused("-m", str(DEFAULT_TARGET), "-md", str(HEAD), "--spec-type", "draft-simple")
    assert len(lines) == 1 and "trained dflash head, not a model to draft with" in lines[0], lines
    assert "--drafter dflash" in lines[0]


def test_the_bench_peer_of_dflash_passes_the_head_and_its_spec_type(tmp_path):
    from specstack.bench.peers import peer_command
    from specstack.drafters.base import llama_peers
    from specstack.errors import InvalidParameterError

    assert llama_peers()["dflash"] == ("llama-draft-dflash",)
    (tmp_path / "llama-speculative-simple").write_text("")
    cmd = peer_command("llama-draft-dflash", "t.gguf", "p.txt", draft=str(HEAD), k=7, bins=tmp_path)
    assert Path(cmd[0]).name == "llama-speculative-simple"
    assert cmd[cmd.index("--spec-type") + 1] == "draft-dflash" and cmd[cmd.index("-md") + 1] == str(HEAD)
    assert cmd[cmd.index("--spec-draft-n-max") + 1] == "7"
    with pytest.raises(InvalidParameterError, match="the DFlash head, -md"):
        peer_command("llama-draft-dflash", "t.gguf", "p.txt", k=3, bins=tmp_path)
