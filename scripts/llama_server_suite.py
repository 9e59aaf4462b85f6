"""llama.cpp's own server test suite (``tools/server/tests``) run against ``specstack serve``, beside llama-server.

    python scripts/llama_server_suite.py [--servers specstack,llama-server] [--model GGUF] [-k EXPR] [--out DIR]

The suite starts the server binary named by ``LLAMA_SERVER_BIN_PATH`` with llama-server's flags and downloads its
models from Hugging Face (``--hf-repo``), which cannot happen on a machine without the internet.  This script
copies the suite from the llama.cpp tree that ``scripts/build_llama_bins.sh`` unpacks, and points it at a small
launcher that swaps each ``--hf-repo``/``--hf-file``/``--model-url`` for a local GGUF (``--model``, the bundled
pycoder-6m unless given, the faster; Gemma 3 270M is the real model to try) and then starts the real server: ``specstack serve`` with every other flag untouched (``--offline`` included, as the suite
passes it: both servers must accept it), or
llama-server itself (the binary the build script made) with the same substitution.  The preset download step
(``load_server_presets``) is turned off by a ``conftest.py`` beside the tests, which also raises the suite's 60 s wait
for a server to start to ``--start-timeout`` (300 s: on 2 busy cores Gemma's starts can pass 60 s) for both servers
alike; nothing else of the suite changes.

Many of the suite's tests check the text of its own tiny models ("Ben", "Daddy" ...) or features that need them
(embeddings, rerank, vision, LoRA): they fail on any substitute.  So every test is run against both servers with
the same substitution, and what counts is the table of tests llama-server passes that specstack does not, which
the script prints with each failure's first line (``--out`` keeps the JUnit files and a JSON summary).
Tests marked ``slow`` (which download larger models) are left out, as the suite's own ``tests.sh`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BINS = Path(os.environ.get("SPECSTACK_LLAMA_BINS", Path.home() / ".cache" / "specstack" / "llama-bins"))
SUITE_IN_TREE = Path("tools") / "server" / "tests"
DRAFT_URL = "https://huggingface.co/ggml-org/tiny-llamas/resolve/main/stories15M-q4_0.gguf"  # test_speculative's
# Test files for llama-server features specstack does not offer, each with the reason (the exclusions and
# the web UI's agent): their tests are counted apart, not in the gap.
NOT_OFFERED = {
    "test_embedding.py": "embeddings (every role loads its model for generation; /v1/embeddings answers 501)",
    "test_rerank.py": "reranking (likewise)",
    "test_lora.py": "LoRA adapters (merge the adapter into the GGUF)",
    "test_vision_api.py": "vision (multimodal projectors; specstack serves text)",
    "test_router.py": "the router (models loaded on demand; roles are listed in a --config file instead)",
    "test_mcp_servers.py": "MCP servers (llama-server's web-UI agent)",
    "test_tools_builtin.py": "the web-UI agent's built-in file and shell tools (--tools)",
    "test_proxy.py": "the web UI's CORS proxy for MCP servers",
}
# Single tests of other files that need such a feature, by file::name prefix, each with the reason.
NOT_OFFERED_TESTS = {
    "test_speculative.py::test_synth_": "synthetic acceptance (--spec-synth-*: benchmarking only, llama.cpp warns "
                                        "its output is not valid), refused because it is not lossless",
    "test_speculative.py::test_with_and_without_draft": "its last part restarts the server with --spec-synth-rates "
                                                        "(synthetic acceptance, refused: not lossless)",
    "test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled": "the web-UI agent's built-in "
                                                                                    "tools (--tools)",
    "test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers": "the web UI's CORS proxy for MCP servers",
    "test_kv_keep_only_active.py::test_clear_and_restore": "llama-server's debug-log test tags of its eager idle-slot "
                                                           "save (__TEST_TAG_CACHE_IDLE_SLOT__); specstack saves a "
                                                           "slot's KV to --cache-ram when a new prompt would overwrite "
                                                           "it, and the test's requests reuse as the test expects "
                                                           "(the long prompt again: prompt_n 1, cache_n 126)",
    "test_slot_save.py::test_slot_save_restore_text_only_on_multimodal": "vision: a server with a multimodal "
                                                                         "projector (--mmproj), and slot files",
}
# The suite waits 60 s (utils.DEFAULT_HTTP_TIMEOUT) for a started server's /health.  Gemma 3 270M starts in about
# 5 s on 2 idle cores under either server, but while other processes keep both cores busy (load average 4-6)
# specstack serve missed the 60 s in 2 of test_completion.py's 39 tests (issue 55), failing tests on
# the machine's load, not on the server; the wait is raised for both servers alike (a timing, never a result).
START_TIMEOUT = 300
NEEDS = ("requests", "wget", "filelock", "aiohttp", "openai", "prometheus_client", "numpy")

# The launcher the suite runs as its server binary: swap model downloads for the local GGUF, then exec the server.
LAUNCHER = '''#!{python}
import os, sys
MODEL, SERVER = {model!r}, {server!r}
DROP = {{"--hf-repo": 1, "-hfr": 1, "--hf-file": 1, "-hff": 1, "--model-url": 1, "-mu": 1}}  # --offline is kept
args, i, model = [], 1, None
while i < len(sys.argv):
    a = sys.argv[i]
    if a in DROP:
        model = model or (MODEL if DROP[a] else None)
        i += 1 + DROP[a]
        continue
    if a in ("--model", "-m"):
        model = sys.argv[i + 1]
        i += 2
        continue
    args.append(a)
    i += 1
os.execvp(SERVER[0], SERVER + (["--model", model] if model else []) + args)
'''


def find_suite(explicit: str | None) -> Path:
    """The suite in the llama.cpp tree ``scripts/build_llama_bins.sh`` unpacked (or ``--suite``)."""
    if explicit:
        return Path(explicit)
    found = sorted((BINS / "src").glob(f"*/vendor/llama.cpp/{SUITE_IN_TREE}"))
    if not found:
        sys.exit(f"llama_server_suite: no llama.cpp tree under {BINS / 'src'}; run scripts/build_llama_bins.sh "
                 "first (it unpacks the tree that holds tools/server/tests), or pass --suite DIR")
    return found[-1]


def default_model() -> str:
    from specstack.paths import DEFAULT_TARGET

    return str(DEFAULT_TARGET)


def default_draft() -> str:
    from specstack.paths import DEFAULT_DRAFT

    return str(DEFAULT_DRAFT)


def server_command(name: str) -> list[str]:
    """The real server a launcher starts: ``specstack serve`` (this Python) or the built llama-server."""
    if name == "specstack":
        return [sys.executable, "-m", "specstack", "serve"]
    binary = BINS / "bin" / "llama-server"
    if not binary.exists():
        sys.exit(f"llama_server_suite: {binary} is missing; run scripts/build_llama_bins.sh")
    return [str(binary)]


def prepare(suite: Path, work: Path, model: str, draft: str, server: str, start_timeout: int = START_TIMEOUT) -> Path:
    """A copy of the suite under ``work`` with the launcher and the download-free conftest; the launcher's path.
    The draft model the speculative tests download (``download_file`` skips a file already in ``tmp/``) is ``draft``;
    the suite's default wait for a server to start (60 s) becomes ``start_timeout`` if that is longer."""
    tests = work / SUITE_IN_TREE  # at its place in the tree: tests read ../../../models/templates/*.jinja
    shutil.copytree(suite, tests, ignore=shutil.ignore_patterns("tmp", "__pycache__", ".pytest_cache"))
    templates = suite.parents[2] / "models" / "templates"
    if templates.is_dir():
        shutil.copytree(templates, work / "models" / "templates")
    (tests / "tmp").mkdir()
    (tests / "tmp" / DRAFT_URL.rsplit("/", 1)[-1]).symlink_to(Path(draft).resolve())
    (tests / "unit" / "conftest.py").write_text(
        "import pytest\nimport utils\n\n"
        "# scripts/llama_server_suite.py --start-timeout: ServerProcess.start's default wait for /health, the same for\n"
        "# both servers (a test's own longer timeout_seconds is kept)\n"
        f"utils.ServerProcess.start.__defaults__ = (max(utils.DEFAULT_HTTP_TIMEOUT, {start_timeout}),)\n\n\n"
        "@pytest.fixture(scope='session', autouse=True)\n"
        "def load_server_presets():\n    \"\"\"The models are local (scripts/llama_server_suite.py): nothing to download.\"\"\"\n")
    launcher = work / f"{server}-launcher"
    launcher.write_text(LAUNCHER.format(python=sys.executable, model=model, server=server_command(server)))
    launcher.chmod(0o755)
    return launcher


def run(suite: Path, server: str, models: tuple[str, str], out: Path, select: str | None,
        timeout_s: int, start_timeout: int = START_TIMEOUT) -> dict[str, dict]:
    """One server through the suite (``models``: the target and the draft); each test's outcome and first line of
    failure, by test id."""
    with tempfile.TemporaryDirectory(prefix=f"suite-{server}-") as tmp:
        launcher = prepare(suite, Path(tmp), *models, server, start_timeout)
        junit = out / f"{server}.xml"
        cmd = [sys.executable, "-m", "pytest", "unit", "-q", "-p", "no:cacheprovider", "-m", "not slow",
               f"--junitxml={junit}", "-o", "junit_family=xunit1"]
        if select:
            cmd += ["-k", select]
        env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(launcher), "PORT": os.environ.get("PORT", "8080")}
        print(f"llama_server_suite: {server}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
        with open(out / f"{server}.log", "w") as log:
            try:
                subprocess.run(cmd, cwd=Path(tmp) / SUITE_IN_TREE, env=env, stdout=log, stderr=subprocess.STDOUT,
                               timeout=timeout_s)
            except subprocess.TimeoutExpired:
                print(f"llama_server_suite: {server}: stopped after {timeout_s} s (--timeout); the tests that "
                      "finished are counted", file=sys.stderr)
        return read_junit(junit) if junit.exists() else {}


def read_junit(path: Path) -> dict[str, dict]:
    """Outcome (passed, failed, error, skipped) and the first line of the reason, by ``file::test``."""
    results: dict[str, dict] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('file') or case.get('classname', '').replace('.', '/') + '.py'}::{case.get('name')}"
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                reason = (node.get("message") or node.text or "").strip().splitlines()[0:1]
                reason = reason[0][:200] if reason else ""
                break
        results[test_id] = {"outcome": outcome, "reason": reason}
    return results


def report(runs: dict[str, dict[str, dict]]) -> dict:
    """Counts per server and test file; the tests llama-server passes and specstack does not."""
    from specstack.ui import table

    files = sorted({t.split("::")[0] for r in runs.values() for t in r})
    rows = []
    for f in files + ["all"]:
        row: list[object] = [f.split("/")[-1]]
        for r in runs.values():
            c = Counter(v["outcome"] for t, v in r.items() if f == "all" or t.startswith(f + "::"))
            row.append(f"{c['passed']}/{sum(c.values())}")
        rows.append(row)
    print(table(["file"] + [f"{name} passed" for name in runs], rows))
    summary: dict = {name: dict(Counter(v["outcome"] for v in r.values())) for name, r in runs.items()}
    if "specstack" in runs and "llama-server" in runs:
        ours, theirs = runs["specstack"], runs["llama-server"]
        missing = {t: ours.get(t, {"outcome": "not run", "reason": ""}) for t, v in theirs.items()
                   if v["outcome"] == "passed" and ours.get(t, {}).get("outcome") != "passed"}
        excluded = {t: v for t, v in missing.items() if _not_offered(t)}
        gap = {t: v for t, v in missing.items() if t not in excluded}
        ahead = [t for t, v in ours.items() if v["outcome"] == "passed" and theirs.get(t, {}).get("outcome") != "passed"]
        both = sum(1 for t, v in theirs.items() if v["outcome"] == "passed" and ours.get(t, {}).get("outcome") == "passed")
        print(f"\nof {both + len(missing)} tests llama-server passes with these models, specstack passes {both}; "
              f"specstack passes {len(ahead)} it does not; {len(excluded)} are of features specstack does not offer:")
        for name, why in {**NOT_OFFERED, **NOT_OFFERED_TESTS}.items():
            n = sum(1 for t in excluded if _not_offered(t) == why and name in t)
            if n:
                print(f"  {name} ({n}): {why}")
        print(f"the other {len(gap)}, one by one:")
        for t, v in sorted(gap.items()):
            print(f"  {t}: {v['outcome']}: {v['reason']}")
        summary.update(gap=gap, excluded=sorted(excluded), ahead=ahead, both=both)
    return summary


def _not_offered(test_id: str) -> str | None:
    """Why a test is of a feature specstack does not offer (its file's reason, or its own); None: it is not."""
    if _file(test_id) in NOT_OFFERED:
        return NOT_OFFERED[_file(test_id)]
    return next((why for name, why in NOT_OFFERED_TESTS.items() if test_id.split("/")[-1].startswith(name)), None)


def _file(test_id: str) -> str:
    return test_id.split("::")[0].rsplit("/", 1)[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--servers", default="specstack,llama-server", help="which servers run the suite, in order")
    ap.add_argument("--model", help="the local GGUF every downloaded model becomes (default: the bundled pycoder-6m, "
                    "fast enough for the suite's timeouts on 2 cores; Gemma 3 270M is the real model to try)")
    ap.add_argument("--draft", help="the draft model of the speculative tests (default: the bundled pycoder-1m)")
    ap.add_argument("--suite", help="tools/server/tests of a llama.cpp tree (default: the one the build script unpacked)")
    ap.add_argument("-k", dest="select", help="pytest -k expression: a subset of the tests")
    ap.add_argument("--out", default="llama-server-suite", help="folder for the JUnit files, logs and summary.json")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds a server's whole run may take")
    ap.add_argument("--start-timeout", type=int, default=START_TIMEOUT,
                    help="seconds the suite waits for a started server's /health, for both servers (the suite's "
                    "own 60 s is too short for Gemma 3 270M on 2 busy cores; a longer wait a test asks for is kept)")
    ap.add_argument("--report-only", action="store_true", help="print the tables from --out's JUnit files, run nothing")
    a = ap.parse_args()
    missing = [m for m in NEEDS if _absent(m)]
    if missing:
        sys.exit(f"llama_server_suite: the suite needs {', '.join(missing)}: pip install {' '.join(missing)} pytest")
    suite, model, draft = find_suite(a.suite), a.model or default_model(), a.draft or default_draft()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.report_only:
        runs = {s: read_junit(out / f"{s}.xml") for s in a.servers.split(",")}
    else:
        runs = {s: run(suite, s, (model, draft), out, a.select, a.timeout, a.start_timeout) for s in a.servers.split(",")}
    summary = report(runs)
    (out / "summary.json").write_text(json.dumps({"model": model, "draft": draft, "suite": str(suite), **summary}, indent=1))


def _absent(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


if __name__ == "__main__":
    main()
