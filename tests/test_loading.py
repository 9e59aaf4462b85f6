"""One loader: a serve role gets every model option ``generate`` has, through ``loading.load_target``.

Fewer MoE experts on a role is lossy and says so in ``/health`` and in every response; a one-slot role with
``tree = true`` verifies token trees; a request for a tree that a role cannot verify is refused; and no
module of the library imports the CLI.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import httpx
import pytest

from specstack.paths import MODELS_DIR
from specstack.prompts import held_out_prompts
from specstack.server.app import Limits, create_app
from specstack.server.roles import Role, load_roles

MOE = MODELS_DIR / "pycoder-moe.gguf"
PACKAGE = Path(__file__).resolve().parents[1] / "specstack"
PROMPTS = held_out_prompts(4)


@pytest.fixture(scope="module")
def server():
    from test_serve import Server

    roles = [Role(name="moe-full", model=MOE, parallel=1, exact="on", drafter="none"),
             Role(name="moe-1", model=MOE, parallel=1, exact="on", drafter="prompt-lookup", experts=1),
             Role(name="trees", parallel=1, exact="off", drafter="suffix", k_policy="fixed", k=8, tree=True),
             Role(name="chains", parallel=2, exact="off", drafter="suffix", k_policy="fixed", k=8)]
    with Server(create_app(roles, Limits(max_tokens=256))) as s:
        yield s


def _complete(server, model: str, prompt: str, **extra) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 48,
                                                         "temperature": 0, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_role_with_fewer_experts_is_lossy_in_health_and_every_response(server):
    health = httpx.get(server.url + "/health").json()["roles"]
    assert health["moe-1"]["lossy"].startswith("LOSSY: the target runs 1 of 8 experts")
    assert health["moe-full"]["lossy"] is None
    differs = 0
    for prompt in PROMPTS:
        reduced, full = _complete(server, "moe-1", prompt), _complete(server, "moe-full", prompt)
        assert reduced["speculative"]["lossy"].startswith("LOSSY") and full["speculative"]["lossy"] is None
        differs += reduced["choices"][0]["text"] != full["choices"][0]["text"]
    assert differs > 0  # the label is honest: the role really runs fewer experts
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": "moe-1", "prompt": PROMPTS[0],
                                                                   "max_tokens": 8, "stream": True}) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    finals = [c["specstack"]["speculative"] for c in chunks if "speculative" in c.get("specstack", {})]
    assert len(finals) == 1 and finals[0]["lossy"].startswith("LOSSY")


def test_a_one_slot_role_with_tree_true_verifies_trees(server):
    """The worker used to load every role without tree sequences, so a tree draft became a chain."""
    trees = sum(_complete(server, "trees", p)["speculative"]["tree_steps"] for p in PROMPTS[:2] * 2)
    chains = sum(_complete(server, "chains", p)["speculative"]["tree_steps"] for p in PROMPTS[:2] * 2)
    assert trees > 0 and chains == 0


def test_a_request_for_a_tree_a_role_cannot_verify_is_refused(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "chains", "prompt": "import os", "max_tokens": 4,
                                                         "speculative": {"drafter": "suffix", "tree": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.tree"
    ok = httpx.post(server.url + "/v1/completions", json={"model": "trees", "prompt": "import os", "max_tokens": 4,
                                                          "speculative": {"drafter": "suffix", "tree": True}})
    assert ok.status_code == 200


def test_a_roles_file_takes_every_model_option(tmp_path):
    path = tmp_path / "roles.toml"
    path.write_text(f'[roles.coder]\nmodel = "{MOE}"\nexperts = 1\nrollback_depth = 9\nparallel = 1\ntree = true\n')
    (role,) = load_roles(path)
    spec = role.spec()
    assert (spec.experts, spec.rollback_depth, spec.verifies_trees) == (1, 9, True)
    path.write_text('[roles.coder]\nparallel = 2\ntree = true\n')
    with pytest.raises(Exception, match="tree = true needs parallel = 1"):
        load_roles(path)


def test_the_library_never_imports_the_cli():
    """Only ``commands/`` and ``cli.py`` may import ``specstack.commands`` (the server and the bench did)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "commands" or rel.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n.split(".")[-1] == "commands" or ".commands" in f".{n}" for n in names):
                offenders.append(str(rel))
    assert offenders == []


def _import_graph() -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """specstack's modules and what each imports (``from .x import y``, ``import specstack.x``, and lazily through
    ``import_module``/``importlib.import_module``), at module level, inside functions or ``if TYPE_CHECKING:``
    blocks (a type-only import is a dependency too: a circle through one is two modules that know each other);
    and which edges come from inside a function.  An ``import_module`` name built at run time
    (an f-string) stands for every module its constant start names (``f".commands.{name}"``: each command).
    Importing ``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` first, so those count too, except a
    package that holds the importing module (its ``__init__`` is already running)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = {m: set() for m in modules}
    deferred: set[tuple[str, str]] = set()
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        in_functions = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for n in ast.walk(node)}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (lazy := _lazy_import(node, package, modules)) is not None:
                names = lazy
            elif not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                names = [a.name for a in node.names]
            for name in names:
                if name not in modules:
                    continue
                parts = name.split(".")
                for i in range(1, len(parts) + 1):
                    target = ".".join(parts[:i])
                    if target in modules and target != mod and not mod.startswith(target + "."):
                        edges[mod].add(target)
                        if id(node) in in_functions:
                            deferred.add((mod, target))
    return edges, deferred


def _lazy_import(node: ast.Call, package: str, modules: dict) -> list[str] | None:
    """The modules an ``import_module(NAME, __package__)`` call may import (None: the call is no such import)."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        name, exact = arg.value, True
    elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        name, exact = arg.values[0].value, False  # f".commands.{name}": every module under .commands
    else:
        raise AssertionError(f"{package}: import_module of a name this test cannot read: {ast.unparse(arg)}")
    if name.startswith("."):
        dots = len(name) - len(name.lstrip("."))
        base = ".".join(package.split(".")[: len(package.split(".")) - dots + 1])
        name = base + "." + name[dots:] if name[dots:] else base
    if exact:
        return [name]
    return [m for m in modules if m.startswith(name) and m != name.rstrip(".")]


def _a_circle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        path.append(mod)
        for nxt in sorted(edges[mod]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[mod] = 2
        path.pop()
        return None

    return next((c for m in sorted(edges) if m not in state and (c := visit(m))), None)


def test_no_import_circle_in_the_package():
    """The import graph of specstack's modules, imports inside functions and type-only ones included, is acyclic
    (the engine imports calibration, calibration never the engine: it hands back what the engine applies)."""
    edges, _deferred = _import_graph()
    assert _a_circle(edges) is None
    assert "specstack.commands.generate" in edges["specstack.cli"]  # seen through import_module
    assert "specstack.generation" in edges["specstack.bench.records"]  # seen inside ``if TYPE_CHECKING:``
    assert "specstack.engine" in edges["specstack.loading"] and "specstack.calibration" in edges["specstack.engine"]
    calibration = {m for m in edges if m.startswith("specstack.calibration")}
    assert not any(t in ("specstack.engine", "specstack.loading", "specstack.generation")
                   for m in calibration for t in edges[m])
    assert not any(t.startswith("specstack.calibration") for m in edges if m.startswith("specstack.draft_length")
                   for t in edges[m])


def test_build_engine_puts_a_loaded_target_its_drafter_policy_and_calibration_together():
    from specstack.generation import GenerationConfig
    from specstack.loading import TargetSpec, build_engine, load_calibrated

    calibration = load_calibrated(TargetSpec(exact="on", tree_branches=1), n_max=5)  # on: measured now, not beside
    try:
        assert calibration.background is None and calibration.costs is not None and calibration.shapes.settled
        engine = build_engine(calibration, "prompt-lookup", "cost", k_max=4)
        assert engine.policy.costs is calibration.costs and engine.background is None
        assert build_engine(calibration, "none", k=3).policy.k == 3  # no policy named: a fixed k
        assert len(engine.generate("def f(x):\n", GenerationConfig(max_tokens=8)).run().output_ids) == 8
    finally:
        calibration.target.close()


def test_the_server_is_in_layers_and_its_routes_apart():
    """The server's route modules import no other route module (each is thin: schema -> jobs -> session ->
    responses), the session layer is the one both generating surfaces run through, and nothing below the
    server (the engine, loading, the drafters) imports it."""
    edges, _deferred = _import_graph()
    routes = {m for m in edges if m.startswith("specstack.server.routes.")}
    assert {"specstack.server.routes.openai", "specstack.server.routes.llama_server"} <= routes
    for m in routes:
        assert not edges[m] & (routes - {m}), m
        assert "specstack.server.app" not in edges[m], m
    for m in ("specstack.server.routes.openai", "specstack.server.routes.llama_server"):
        assert "specstack.server.session" in edges[m]
    core = [m for m in edges if not m.startswith(("specstack.server", "specstack.commands", "specstack.cli"))
            and m != "specstack"]
    assert not [m for m in core for t in edges[m] if t.startswith("specstack.server")]
    tools = {m for m in edges if m.startswith("specstack.server.tools.formats.")} - {"specstack.server.tools.formats"}
    for m in tools:  # a tool-call format is one module: it imports no other format but the one it extends
        assert len(edges[m] & tools) <= 1, m
