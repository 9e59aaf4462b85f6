"""How far one streamed chat request with tools walks through specstack before its first token, and in one
decoding step after it: the distinct files and functions it calls, and its layer crossings (issue 58).

The real server runs in-process (uvicorn in a thread, as the tests start it) on the bundled pycoder model with
llama.cpp's Llama 3.3 chat template (tests/fixtures), which renders tools; the official ``openai`` client sends
one streamed chat request with a tool (``tool_choice: auto``).  A warm-up request goes first, untraced, so that
what is counted is the request's own path, not a first request's one-time loading (``--cold`` traces the
first request instead).

Each thread's Python calls into the ``specstack`` package are traced (``threading.setprofile``) in two phases:

* first token: on the HTTP thread from the route's entry (``routes/openai.py: chat``) until the first delta event
  is shaped (the first return of ``streams.py: OpenAIChunks.delta``); on the role's engine thread from the
  job's arrival until the first delta is emitted (``worker.py: Job.emit``); the grammar thread counts with the
  HTTP thread, the background calibration thread not at all;
* one step: from there to the second delta, on each thread alike.

A crossing is a call whose caller and callee are both in specstack, in different modules; the distinct
(caller module, callee module) pairs are the layer crossings, and every such call is counted too.

    python scripts/request_walk.py [--cold] [--list]
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import specstack  # noqa: E402

PACKAGE = str(Path(specstack.__file__).resolve().parent)
TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "meta-llama-Llama-3.3-70B-Instruct.jinja"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "system", "content": "You are a weather assistant. Use the tools."},
            {"role": "user", "content": "What is the weather in Paris right now?"}]
ANONYMOUS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>", "<module>")
PHASES = ("first token", "one step")


def module_of(filename: str) -> str | None:
    """The dotted specstack module a code object's file is, or None outside the package."""
    if not filename.startswith(PACKAGE):
        return None
    rel = Path(filename).relative_to(Path(PACKAGE).parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


class Walk:
    """The calls of each phase, per thread: which functions, and which module called which."""

    def __init__(self) -> None:
        self.reset()
        self.phase: dict[str, int] = {}  # per thread kind ("http", "engine"): -1 not yet started, len(PHASES) done
        self.http: int | None = None  # the HTTP thread's id, once the route is entered
        self.lock = threading.Lock()

    def reset(self) -> None:
        """Nothing counted yet: per phase, each thread kind's functions and module pairs."""
        self.functions: list[dict[str, set[tuple[str, str]]]] = [defaultdict(set) for _ in PHASES]
        self.edges: list[dict[str, dict[tuple[str, str], int]]] = [defaultdict(lambda: defaultdict(int))
                                                                    for _ in PHASES]

    def kind(self) -> str | None:
        """The engine thread, the HTTP thread (with the grammar thread), or None: a thread not on the request's
        path (the background calibration, uvicorn's other work before the route is entered)."""
        thread = threading.current_thread()
        if thread.name == "specstack-grammar" or thread.ident == self.http:
            return "http"
        if thread.name.startswith("specstack-") and thread.name != "specstack-calibration":
            return "engine"
        return None

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        code = frame.f_code
        module = module_of(code.co_filename)
        if module is None:
            return
        if self.http is None and module == "specstack.server.routes.openai" and code.co_name == "chat":
            self.http = threading.get_ident()
        kind = self.kind()
        if kind is None:
            return
        if event == "return":
            self.on_return(kind, module, code.co_qualname, frame)
            return
        if kind == "http" and module == "specstack.server.routes.openai" and code.co_name == "chat":
            with self.lock:
                self.phase.setdefault("http", 0)
                self.phase.setdefault("engine", 0)
        phase = self.phase.get(kind, -1)
        if not 0 <= phase < len(PHASES):
            return
        with self.lock:
            if code.co_name not in ANONYMOUS:
                self.functions[phase][kind].add((module, code.co_qualname))
            caller = frame.f_back
            origin = module_of(caller.f_code.co_filename) if caller is not None else None
            if origin is not None and origin != module:
                self.edges[phase][kind][(origin, module)] += 1

    def on_return(self, kind: str, module: str, qualname: str, frame: FrameType) -> None:
        """The phase ends: on the engine thread after emitting a delta, on the HTTP thread after shaping one."""
        if kind == "engine" and module == "specstack.server.worker" and qualname == "Job.emit":
            event = frame.f_locals.get("event")
            if type(event).__name__ == "Delta" or (isinstance(event, dict) and event.get("type") == "delta"):
                self._advance("engine")
        elif kind == "http" and module == "specstack.server.streams" and qualname == "OpenAIChunks.delta":
            self._advance("http")

    def _advance(self, kind: str) -> None:
        with self.lock:
            if kind in self.phase:
                self.phase[kind] += 1

    def report(self, listing: bool) -> None:
        """Each phase's counts: the HTTP thread's (the request's own path), the engine thread's, and both."""
        for p, name in enumerate(PHASES):
            functions, edges = self.functions[p], self.edges[p]
            for kind in ("http", "engine"):
                show(f"{name}, {kind} thread", functions.get(kind, set()), edges.get(kind, {}), listing)
            merged: dict[tuple[str, str], int] = defaultdict(int)
            for pairs in edges.values():
                for pair, n in pairs.items():
                    merged[pair] += n
            show(f"{name}, both", set().union(*functions.values()), merged, False)


def show(name: str, functions: set[tuple[str, str]], edges: dict[tuple[str, str], int], listing: bool) -> None:
    """One count: files, functions, crossings, and per package (``listing``: every function and pair too)."""
    modules = {m for m, _ in functions}
    print(f"== {name}: {len(modules)} files, {len(functions)} functions, {len(edges)} layer crossings "
          f"(distinct module pairs), {sum(edges.values())} cross-module calls")
    packages: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for m in modules:
        packages[m.rpartition(".")[0]][0] += 1
    for m, _ in functions:
        packages[m.rpartition(".")[0]][1] += 1
    for _, b in edges:
        packages[b.rpartition(".")[0]][2] += 1
    for pkg in sorted(packages):
        f, fn, c = packages[pkg]
        print(f"   {pkg:32s} {f:3d} files {fn:4d} functions {c:4d} crossings into it")
    if listing:
        for m, q in sorted(functions):
            print(f"      {m}: {q}")
        for (a, b), n in sorted(edges.items()):
            print(f"      {a} -> {b} x{n}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(base: str) -> list[str]:
    """One streamed chat request with a tool; the chunks' contents as they came."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model="walk", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                            max_tokens=6, temperature=0, stream=True)
    return [c.model_dump_json() for c in stream]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", action="store_true", help="trace the server's first request (no warm-up)")
    parser.add_argument("--list", action="store_true", help="list every function and module pair")
    args = parser.parse_args()

    import httpx
    import uvicorn

    from specstack.server.app import Limits, create_app
    from specstack.server.roles import Role

    walk = Walk()
    threading.setprofile(walk.profile)  # every thread started from here on: uvicorn's, the engine's, the grammar's
    role = Role(name="walk", chat_template=str(TEMPLATE), ctx=512, parallel=1, threads=1)
    app = create_app([role], Limits(max_tokens=64))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the server did not come up")
        time.sleep(0.2)
    try:
        if not args.cold:
            walk.phase = {"http": len(PHASES), "engine": len(PHASES)}  # untraced warm-up
            ask(base)
            walk.phase = {}
            walk.reset()
        chunks = ask(base)
    finally:
        threading.setprofile(None)
        server.should_exit = True
        thread.join(30)
    print(f"{len(chunks)} chunks streamed")
    walk.report(args.list)


if __name__ == "__main__":
    main()
