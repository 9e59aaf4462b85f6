"""Scale-out benchmark for `specstack serve --ray` (issue 21): throughput, routing, shared suffix statistics, drain.

Every run starts its own server as a subprocess (`specstack serve [--ray ...]`, a local Ray instance of its own
in a private temporary folder, no dashboard, a small object store), waits for /health and, under --ray, for
every replica to report in /metrics, warms it up, runs the load with the official async `openai` client
(streamed, greedy), then stops it with SIGTERM. The script and its servers run the specstack of the checkout
the script is in (its root goes first on sys.path and on the servers' PYTHONPATH, which Ray's workers inherit),
not whichever one is installed. Each run also reports the cores its engines, Serve's HTTP front (proxy and
ingress), the rest of Ray and this client kept busy: on a small machine they compete for the same cores.

Parts (--part, default all):

- throughput: the same closed load (--clients streams of held-out code prompts for --seconds) on 1 replica
  and on 2 replicas of --threads threads each, plus the single-process server as a reference row;
  aggregate tok/s and the ratio to 1 replica (goal: 2 replicas >= 1.8x). With the bundled 6M-parameter
  pair a token costs the engine so little that the HTTP path (proxy, ingress, one SSE chunk per token)
  is the bottleneck; a model whose decoding dominates (-m gemma-3-270m-q4_k_m.gguf) measures the engines.
- routing: --sessions users on 2 replicas, each running multi-turn chats back to back for --seconds (every
  turn resends the whole history under the chat's x-session-id), under --routing prefix, session and pow2;
  prefix reuse (the share of prompt tokens not prefilled, from each response's
  speculative.reused_prompt_tokens), TTFT p50/p99 and aggregate tok/s (goal: reuse >= 90% with prefix).
  "Resent history" is the share of prompt tokens that repeat the chat's previous turn: what a perfect
  per-chat cache would skip (the first turns, and the bundled model's 512 positions, bound it).
- suffix: a repetitive workload (--suffix-prompts code prompts asked --rounds times, in shuffled rounds,
  drafter suffix) on 1 replica that sees every request, and on 2 replicas with and without shared suffix
  statistics; acceptance (accepted / drafted) and tok/s of the repeat rounds (goal: shared reaches the
  1-replica acceptance).
- drain: SIGTERM to `specstack serve --ray` with --drain-streams long streams on 2 slots (the others queued):
  does every stream still end with its finish chunk, [DONE] and all its tokens, and does the server exit 0.

    python benchmarks/scaleout.py --part all --json scaleout.json
    python benchmarks/scaleout.py --part throughput --seconds 60 --clients 4
    python benchmarks/scaleout.py --part routing --seconds 60 --sessions 8
    python benchmarks/scaleout.py --part suffix --rounds 4
    python benchmarks/scaleout.py --part drain
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's specstack, here and (PYTHONPATH, below) in every server and replica

from specstack.bench.serving import (Column, Reply, ServerFailed, ServerProcess, Stats, closed_loop, cpu_seconds,
                                     percentile, specstack_serve, stream, table, with_client, write_json)
from specstack.paths import DEFAULT_DRAFT, DEFAULT_TARGET
from specstack.prompts import held_out_prompts

START_S = 300  # a deadline against a server that never comes up, not a performance bound
SETTLE_S = 5.0  # > 2 suffix pulls (suffix_share.PULL_S = 2 s): every replica has every earlier output


# -- servers --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """One server configuration: the single-process server (``ray=False``) or ``replicas`` Ray replicas."""

    name: str
    ray: bool = True
    replicas: int = 1
    threads: int = 1
    flags: tuple[str, ...] = ()


def server_flags(setup: Setup, args: argparse.Namespace, parallel: int) -> list[str]:
    flags = ["-np", str(parallel), "-t", str(setup.threads), "-m", args.model, "-md", args.model_draft, "--max-queue",
             "64", *setup.flags]
    if setup.ray:
        flags += ["--ray", "--replicas", str(setup.replicas)]
    return flags


def ray_env(tmp: Path) -> dict[str, str]:
    """This checkout first on the server's (and so Ray's workers') path, and a Ray instance of its own in ``tmp``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env["RAY_TMPDIR"] = str(tmp)
    env.setdefault("RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION", "0.01")  # ~1% of RAM: we pass no objects
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


@contextmanager
def running(setup: Setup, args: argparse.Namespace, parallel: int) -> Iterator[ServerProcess]:
    """A `specstack serve` subprocess for one run: started and ready (under --ray, every replica in /metrics) on
    enter, SIGTERM (a drain) on exit.

    Each run gets its own RAY_TMPDIR, so it never touches another Ray instance on the machine (nor /tmp/ray), and
    its logs go with it; the server's own output goes to a log file there, kept when the run fails."""
    tmp = Path(tempfile.mkdtemp(prefix="sb-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    server = specstack_serve(server_flags(setup, args, parallel), env=ray_env(tmp), cwd=REPO,
                             log=tmp / "server.log", replicas=setup.replicas if setup.ray else 0, own_group=True,
                             timeout=START_S)
    clean = False
    try:
        with server:
            yield server
        clean = server.returncode == 0
    finally:
        if clean:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"  server log kept: {server.log}", flush=True)


# -- where the CPU goes -------------------------------------------------------------------------------------------

def process_tree(root: int) -> dict[int, tuple[int, str]]:
    """``root`` and its descendants: pid -> (parent pid, command line)."""
    procs: dict[int, tuple[int, str]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                procs[int(d.name)] = (ppid, (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except (OSError, IndexError, ValueError):
                continue
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in tree:
            tree[pid] = procs[pid]
            todo += [p for p, (pp, _) in procs.items() if pp == pid]
    return tree


def kind(cmdline: str) -> str:
    """Which part of the serving stack a process is: the engines (role replicas), Serve's HTTP front (proxy and
    ingress), or the rest of Ray (controller, raylet, GCS, the driver). The single-process server is all
    "engines": its HTTP front runs in the engine's process."""
    if "ray::" in cmdline:
        if ":role-" in cmdline:
            return "engines"
        return "front" if ":ingress" in cmdline or "ProxyActor" in cmdline else "ray"
    return "engines" if " serve " in cmdline and "--ray" not in cmdline else "ray"


def stack_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server's process tree, by ``kind``, and of this client."""
    out = {"engines": 0.0, "front": 0.0, "ray": 0.0}
    for pid, (_, cmdline) in process_tree(root).items():
        try:
            out[kind(cmdline)] += cpu_seconds(pid)
        except (OSError, IndexError, ValueError):
            continue
    t = os.times()
    out["client"] = t.user + t.system
    return out


def cpu_cores(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """Cores each kind kept busy on average over ``wall`` seconds."""
    return {k: (after[k] - before[k]) / wall if wall else 0.0 for k in after}


# -- one request ----------------------------------------------------------------------------------------------


@dataclass
class RunStats(Stats):
    """What a run's requests add up to, with what their ``speculative`` objects say."""

    reused: int = 0
    drafted: int = 0
    accepted: int = 0
    history: int = 0  # routing: prompt tokens that resend the chat's previous turn (what a cache could skip)
    differ: int = 0  # throughput: outputs unlike an earlier run's for the same prompt (see ``closed_load``)
    replicas: Counter = field(default_factory=Counter)

    def add(self, r: Reply) -> None:
        super().add(r)
        self.reused += r.spec.get("reused_prompt_tokens", 0)
        self.drafted += r.spec.get("n_drafted", 0)
        self.accepted += r.spec.get("n_accepted", 0)
        self.replicas[r.spec.get("replica", "-")] += 1

    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def reuse(self) -> float:
        prompt = sum(self.prompt_tokens)
        return self.reused / prompt if prompt else 0.0

    def split(self) -> str:
        """Requests per replica, most first, e.g. '61/39' (percent)."""
        n = sum(self.replicas.values()) or 1
        return "/".join(f"{100 * c / n:.0f}" for _, c in self.replicas.most_common())


async def warm_up(client: openai.AsyncOpenAI, count: int) -> None:
    """A few short requests, not measured, so every replica has run (and its cost curve is loaded) before the
    clock starts. Short prompts (< 32 tokens) hold no routable prefix, and their outputs are not the workload's."""
    scratch = Stats()
    await asyncio.gather(*(stream(client, scratch, 16, prompt=f"def warm_up_{i}(x):\n") for i in range(count)))


def measured(server: ServerProcess, work: Callable[[openai.AsyncOpenAI], Any]) -> tuple[Any, dict[str, float]]:
    """``work(client)`` on ``server``, and the cores each part of the stack (the server's process tree, and this
    client) kept busy meanwhile: on a machine with few cores the HTTP front and the client compete with the
    engines, and this says how much."""
    assert server.pid is not None
    t0, before = time.perf_counter(), stack_cpu_seconds(server.pid)
    result = with_client(server.url, work)
    return result, cpu_cores(before, stack_cpu_seconds(server.pid), time.perf_counter() - t0)


# -- part 1: throughput ---------------------------------------------------------------------------------------


async def closed_load(client: openai.AsyncOpenAI, clients: int, seconds: float, n: int, prompts: list[str],
                      outputs: dict[str, str]) -> RunStats:
    """``clients`` users, each streaming the prompts in turn (offset by its index) until ``seconds`` pass.

    Each output is compared with the first output any run gave for its prompt: greedy outputs are the same
    whatever the replica or the batch only in exact mode (``--exact`` on, or auto where it settles on), so a
    difference is counted, not failed: it says the runs did not all decode exactly."""
    stats = RunStats()

    def compare(prompt: str, reply: Reply) -> None:
        outputs.setdefault(prompt, reply.text)
        stats.differ += outputs[prompt] != reply.text

    t0 = time.perf_counter()
    await closed_loop(client, clients, t0 + seconds, prompts, n, stats, compare)
    stats.wall = time.perf_counter() - t0
    return stats


def part_throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    """1 replica against 2 (each --threads threads), the same closed load; the single-process server beside."""
    setups = [Setup("ray, 1 replica", replicas=1, threads=args.threads),
              Setup("ray, 2 replicas", replicas=2, threads=args.threads)]
    setups += [Setup(f"single process, -t {t}", ray=False, threads=t) for t in args.single_threads]
    prompts, outputs, rows = held_out_prompts(args.prompts), {}, []
    for setup in setups:
        with running(setup, args, parallel=args.clients) as server:
            with_client(server.url, lambda c: warm_up(c, 2 * setup.replicas))
            stats, cpu = measured(server, lambda c: closed_load(c, args.clients, args.seconds, args.n, prompts,
                                                                outputs))
        rows.append(row(setup, server, stats, cpu, clients=args.clients))
        print(line("throughput", rows[-1], stats), flush=True)
    base = rows[0]["tok_s"] or 1.0
    for r in rows:
        r["vs_1_replica"] = r["tok_s"] / base
    return rows


def row(setup: Setup, server: ServerProcess, stats: RunStats, cpu: dict[str, float], **extra: Any) -> dict[str, Any]:
    """A run's numbers, as the tables and --json carry them (``cpu``: cores busy by part of the stack)."""
    return {"setup": setup.name, "ray": setup.ray, "replicas": setup.replicas if setup.ray else 1,
            "threads": setup.threads, "flags": list(setup.flags), "requests": stats.requests, "tokens": stats.tokens,
            "wall_s": stats.wall, "tok_s": stats.tok_s(), "ttft_p50_s": percentile(stats.ttft, 0.5),
            "ttft_p99_s": percentile(stats.ttft, 0.99), "prompt_tokens": sum(stats.prompt_tokens),
            "reused_tokens": stats.reused, "reuse": stats.reuse(), "drafted": stats.drafted, "accepted": stats.accepted,
            "acceptance": stats.acceptance(), "split": stats.split(), "rate_limited": stats.rate_limited,
            "reconnects": stats.reconnects, "outputs_differ": stats.differ,
            "failures": len(stats.failures), "failure_examples": stats.failures[:5], "start_s": server.start_s,
            "stop_s": server.stop_s, "exit_code": server.returncode, "cpu_cores": cpu,
            "cpu": " / ".join(f"{cpu.get(k, 0.0):.2f}" for k in ("engines", "front", "ray", "client")), **extra}


def line(part: str, r: dict[str, Any], stats: RunStats) -> str:
    text = (f"[{part}] {r['setup']}: {r['requests']} requests, {r['tok_s']:.1f} tok/s aggregate, TTFT p50 "
            f"{1000 * r['ttft_p50_s']:.0f} ms p99 {1000 * r['ttft_p99_s']:.0f} ms, "
            f"prompt reuse {100 * r['reuse']:.1f}%, "
            f"acceptance {100 * r['acceptance']:.1f}%, replicas {r['split']}, {r['rate_limited']} x 429, "
            f"{r['failures']} failures; cores busy engines/front/ray/client {r['cpu']}; start {r['start_s']:.1f} s, "
            f"stop {r['stop_s']:.1f} s (exit {r['exit_code']})")
    for f in stats.failures[:3]:
        text += f"\n  failure: {f}"
    return text


# -- part 2: routing ------------------------------------------------------------------------------------------

SYSTEM = ("You are a Python coding assistant. Answer with code only, in the style of the code you are shown: "
          "the same names, PEP 8, the standard library only, short functions with docstrings.")
FOLLOW_UPS = ("Continue the code.", "Add a docstring.", "Handle the errors.", "Write a test for it.",
              "Simplify it.", "Add type hints.", "Rename the variables.", "Make it faster.")


async def chats(client: openai.AsyncOpenAI, users: int, seconds: float, turns: int, n: int,
                snippets: list[str]) -> RunStats:
    """``users`` users, each running chats of ``turns`` turns back to back until ``seconds`` pass (a chat in
    progress finishes its turns). Every chat has its own session id and opens with the shared system prompt and
    a numbered code snippet, so its first turn shares only the system prompt with earlier chats."""
    stats = RunStats()
    stop = time.perf_counter() + seconds
    counter = iter(range(1 << 30))

    async def chat(cid: int) -> None:
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Chat {cid}. My code:\n{snippets[cid % len(snippets)]}"}]
        previous = 0  # the previous turn's prompt plus answer, in tokens: this turn resends them
        for turn in range(turns):
            reply = await stream(client, stats, n, messages=messages, session=f"chat-{cid}")
            if reply is None:
                return
            prompt = reply.prompt_tokens or 0
            stats.history += min(previous, prompt)
            previous = prompt + reply.tokens
            messages += [{"role": "assistant", "content": reply.text},
                         {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]

    async def user() -> None:
        while time.perf_counter() < stop:
            await chat(next(counter))

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(users)))
    stats.wall = time.perf_counter() - t0
    return stats


def part_routing(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The same chats on 2 replicas under each routing mode."""
    snippets = [p[:args.snippet_chars] for p in held_out_prompts()]
    rows = []
    for mode in args.routing:
        setup = Setup(f"2 replicas, --routing {mode}", replicas=2, threads=args.threads, flags=("--routing", mode))
        with running(setup, args, parallel=args.parallel) as server:
            with_client(server.url, lambda c: warm_up(c, 4))
            stats, cpu = measured(server, lambda c: chats(c, args.sessions, args.seconds, args.turns, args.chat_n,
                                                          snippets))
        prompt = sum(stats.prompt_tokens)
        rows.append(row(setup, server, stats, cpu, routing=mode, sessions=args.sessions, turns=args.turns,
                        history_share=stats.history / prompt if prompt else 0.0))
        print(line("routing", rows[-1], stats) + f"; resent history {100 * rows[-1]['history_share']:.1f}% of prompt "
              "tokens", flush=True)
    return rows


# -- part 3: shared suffix statistics ---------------------------------------------------------------------------


async def rounds(client: openai.AsyncOpenAI, clients: int, prompts: list[str], count: int, n: int,
                 seed: int) -> tuple[RunStats, RunStats]:
    """Every prompt once per round, in a shuffled order, over ``clients`` users; SETTLE_S between rounds, so every
    replica has pulled every earlier output before a prompt comes back (the steady state of a long run).
    Returns the first round's stats and the later rounds' (their wall: the rounds' own time, pauses left out)."""
    first, later = RunStats(), RunStats()
    rng = random.Random(seed)
    for r in range(count):
        stats = first if r == 0 else later
        todo = prompts[:]
        rng.shuffle(todo)

        async def user() -> None:
            while todo:
                await stream(client, stats, n, prompt=todo.pop())

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(clients)))
        stats.wall += time.perf_counter() - t0
        if r + 1 < count:
            await asyncio.sleep(SETTLE_S)
    return first, later


def part_suffix(args: argparse.Namespace) -> list[dict[str, Any]]:
    """1 replica seeing everything, 2 sharing suffix statistics, 2 not; drafter suffix, routing --suffix-routing.

    Routing: pow2 by default, so a prompt's repeats land on either replica. Prefix routing would send each
    repeat back to the replica that answered it first (which holds its KV), hiding what sharing is for:
    outputs one replica saw raising acceptance on another."""
    prompts = [p[:args.suffix_chars] for p in held_out_prompts()[:args.suffix_prompts]]
    flags = ("--drafter", args.suffix_drafter, "--routing", args.suffix_routing)
    setups = [Setup("1 replica (sees every request)", replicas=1, threads=args.threads, flags=flags),
              Setup("2 replicas, shared suffix", replicas=2, threads=args.threads, flags=flags),
              Setup("2 replicas, --no-share-suffix", replicas=2, threads=args.threads,
                    flags=(*flags, "--no-share-suffix"))]
    rows = []
    for setup in setups:
        with running(setup, args, parallel=args.clients) as server:
            (first, later), cpu = measured(server, lambda c: rounds(c, args.clients, prompts, args.rounds,
                                                                    args.suffix_n, args.seed))
        rows.append(row(setup, server, later, cpu, first_round_acceptance=first.acceptance(),
                        first_round_tok_s=first.tok_s(), rounds=args.rounds, prompts=len(prompts)))
        print(line("suffix", rows[-1], later) + f"; round 1: acceptance {100 * first.acceptance():.1f}%, "
              f"{first.tok_s():.1f} tok/s", flush=True)
    return rows


# -- part 4: drain on SIGTERM -----------------------------------------------------------------------------------


def part_drain(args: argparse.Namespace) -> list[dict[str, Any]]:
    """SIGTERM `specstack serve --ray` with --drain-streams long streams on 2 slots (the rest wait in the queue),
    as soon as the first chunk of any arrives: each should still end whole (finish chunk, [DONE], all its tokens)
    and the server exit 0.

    A stream still running at the signal, or not yet started (queued), shows the check tested something; when
    none was (a machine fast enough to finish them all first), the verdict is "inconclusive", not OK. Also
    records what a request sent during the drain gets (503 while the ingress drains, then 404 from Serve)."""
    setup = Setup("ray, 1 replica, 2 slots: SIGTERM mid-stream", replicas=1, threads=args.threads)
    first = threading.Event()
    streams: list[dict[str, Any]] = [{"first": first, "sent": threading.Event()} for _ in range(args.drain_streams)]
    late: dict[str, Any] = {}
    with running(setup, args, parallel=2) as server:
        with_client(server.url, lambda c: warm_up(c, 1))
        threads = [threading.Thread(target=drain_stream, args=(server.url, args.drain_n, i, s), daemon=True)
                   for i, s in enumerate(streams)]
        for t in threads:
            t.start()
        for s in streams:
            s["sent"].wait(60)
        first.wait(120)
        t0 = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        late_request(server.url, late)
        for t in threads:
            t.join(300)
        late["thread"].join(60)
        try:
            server.returncode = server.proc.wait(120)
        except subprocess.TimeoutExpired:
            server.returncode = None
        server.stop_s = time.perf_counter() - t0
    rows = [drain_row(setup, i, s, t0, args.drain_n, server, late) for i, s in enumerate(streams)]
    for r in rows:
        print(f"[drain] stream {r['stream']}: HTTP {r['status']}, {'[DONE]' if r['done'] else 'NO [DONE]'}, "
              f"finish {r['finish_reason']}, {r['tokens']}/{args.drain_n} tokens, {r['chunks_after_sigterm']} chunks "
              f"after SIGTERM ({'not started' if r['queued'] else 'streaming'} then), ended "
              f"{r['stream_end_s']:.1f} s after it, error {r['error']}; {'whole' if r['whole'] else 'NOT WHOLE'}",
              flush=True)
    verdict = drain_verdict(rows)
    for r in rows:
        r["ok"] = verdict
    print(f"[drain] server exit {server.returncode} {server.stop_s:.1f} s after SIGTERM; a request sent during the "
          f"drain: {late.get('status')}; {sum(r['in_flight'] for r in rows)} of {len(rows)} streams in flight at "
          f"SIGTERM ({sum(r['queued'] for r in rows)} not started: queued, or prefilling): {verdict}", flush=True)
    return rows


def drain_verdict(rows: list[dict[str, Any]]) -> str:
    """OK: every stream whole and the server exited 0, with at least one stream in flight at the signal."""
    if not all(r["whole"] for r in rows) or rows[0]["exit_code"] != 0:
        return "FAILED"
    return "OK" if any(r["in_flight"] for r in rows) else "inconclusive (no stream was in flight at SIGTERM)"


def drain_stream(url: str, n: int, i: int, out: dict[str, Any]) -> None:
    """One long greedy stream (no drafter: slower, so it is still running at SIGTERM), each line timed."""
    body = {"model": "default", "prompt": f"def main_{i}():\n", "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "speculative": {"drafter": "none"}}
    out["events"] = []
    try:
        with httpx.Client(timeout=300) as client:
            out["sent"].set()  # the response (headers too) comes with the first token: "sent" is all we can know
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                out["status"] = r.status_code
                for x in r.iter_lines():
                    if x.startswith("data: "):
                        out["events"].append((time.perf_counter(), x[6:]))
                        out["first"].set()
    except httpx.HTTPError as exc:
        out["exception"] = type(exc).__name__
    finally:
        out["sent"].set()


def drain_row(setup: Setup, i: int, s: dict[str, Any], sigterm: float, n: int, server: ServerProcess,
              late: dict[str, Any]) -> dict[str, Any]:
    events = s.get("events", [])
    chunks = [json.loads(p) for _, p in events if p != "[DONE]"]
    usage = next((c["usage"] for c in chunks if c.get("usage")), None)
    finish = [ch["finish_reason"] for c in chunks for ch in c.get("choices", ()) if ch.get("finish_reason")]
    r = {"setup": setup.name, "stream": i, "max_tokens": n, "status": s.get("status"),
         "done": bool(events) and events[-1][1] == "[DONE]", "finish_reason": finish[-1] if finish else None,
         "tokens": usage["completion_tokens"] if usage else None,
         "chunks_after_sigterm": sum(t > sigterm for t, _ in events),
         "stream_end_s": (events[-1][0] - sigterm) if events else 0.0,
         "error": next((c["error"] for c in chunks if "error" in c), None) or s.get("exception"),
         "exit_code": server.returncode, "exit_s": server.stop_s, "request_during_drain": late.get("status")}
    r["in_flight"] = not events or events[-1][0] > sigterm
    r["queued"] = not events or events[0][0] > sigterm  # no chunk before the signal: queued for a slot, or prefilling
    r["whole"] = bool(r["done"] and r["finish_reason"] in ("length", "stop") and r["tokens"] == n)
    return r


def late_request(url: str, out: dict[str, Any]) -> None:
    """A request sent just after SIGTERM, in the background: its status code, or the connection error's name."""

    def send() -> None:
        time.sleep(0.3)
        try:
            r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "x = 1\n", "max_tokens": 4},
                           timeout=30)
            out["status"] = str(r.status_code)
        except httpx.HTTPError as exc:
            out["status"] = type(exc).__name__

    out["thread"] = threading.Thread(target=send, daemon=True)
    out["thread"].start()


# -- output -----------------------------------------------------------------------------------------------------

def pct_text(v: float) -> str:
    return f"{100 * v:.1f}%"


def ms_text(v: float) -> str:
    return f"{1000 * v:.0f}"


COLUMNS: dict[str, list[Column]] = {
    "throughput": [("setup", "setup", str), ("requests", "requests", str), ("tok_s", "tok/s", "{:.1f}".format),
                   ("vs_1_replica", "x 1 replica", "{:.2f}".format), ("ttft_p50_s", "TTFT p50 ms", ms_text),
                   ("ttft_p99_s", "TTFT p99 ms", ms_text), ("acceptance", "acceptance", pct_text),
                   ("split", "replica split %", str), ("cpu", "cores: engines/front/ray/client", str),
                   ("outputs_differ", "outputs differ", str), ("failures", "failures", str)],
    "routing": [("routing", "routing", str), ("requests", "turns", str), ("reuse", "prefix reuse", pct_text),
                ("history_share", "resent history", pct_text), ("ttft_p50_s", "TTFT p50 ms", ms_text),
                ("ttft_p99_s", "TTFT p99 ms", ms_text), ("tok_s", "tok/s", "{:.1f}".format),
                ("split", "replica split %", str), ("cpu", "cores: engines/front/ray/client", str),
                ("failures", "failures", str)],
    "suffix": [("setup", "setup", str), ("first_round_acceptance", "round 1 acceptance", pct_text),
               ("acceptance", "repeat acceptance", pct_text), ("tok_s", "repeat tok/s", "{:.1f}".format),
               ("first_round_tok_s", "round 1 tok/s", "{:.1f}".format), ("split", "replica split %", str),
               ("cpu", "cores: engines/front/ray/client", str), ("failures", "failures", str)],
    "drain": [("stream", "stream", str), ("done", "[DONE]", str), ("finish_reason", "finish", str),
              ("tokens", "tokens", str), ("chunks_after_sigterm", "chunks after SIGTERM", str),
              ("queued", "not started at SIGTERM", str), ("stream_end_s", "ended s after SIGTERM", "{:.1f}".format),
              ("exit_code", "exit", str), ("exit_s", "exit s", "{:.1f}".format),
              ("request_during_drain", "request during drain", str), ("ok", "verdict", str)],
}


PARTS: dict[str, Callable[[argparse.Namespace], list[dict[str, Any]]]] = {
    "throughput": part_throughput, "routing": part_routing, "suffix": part_suffix, "drain": part_drain}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=(*PARTS, "all"), default="all")
    ap.add_argument("-m", "--model", default=str(DEFAULT_TARGET))
    ap.add_argument("-md", "--model-draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("-t", "--threads", type=int, default=1, help="threads per replica (default 1)")
    ap.add_argument("--json", type=Path, default=None, help="write every run's numbers here")
    ap.add_argument("--seconds", type=float, default=60, help="throughput and routing: seconds of load per run")
    g = ap.add_argument_group("throughput")
    g.add_argument("--clients", type=int, default=4, help="concurrent streams (also the suffix part's; default 4)")
    g.add_argument("-n", type=int, default=64, help="tokens per completion (default 64)")
    g.add_argument("--prompts", type=int, default=12, help="held-out code prompts cycled (default 12)")
    g.add_argument("--single-threads", type=lambda s: [int(x) for x in s.split(",") if x], default=[1],
                   help="reference rows: the single-process server at these thread counts, e.g. '1,2' ('' for none)")
    g = ap.add_argument_group("routing")
    g.add_argument("--routing", type=lambda s: s.split(","), default=["prefix", "session", "pow2"])
    g.add_argument("--sessions", type=int, default=8, help="concurrent chat users (default 8)")
    g.add_argument("--turns", type=int, default=8, help="turns per chat; every turn resends the history (default 8)")
    g.add_argument("--chat-n", type=int, default=24,
                   help="tokens per answer (default 24: 8 turns fit the bundled model's 512 positions)")
    g.add_argument("--snippet-chars", type=int, default=240, help="code in each chat's first message (default 240)")
    g.add_argument("-np", "--parallel", type=int, default=4, help="slots per replica (default 4)")
    g = ap.add_argument_group("suffix")
    g.add_argument("--rounds", type=int, default=4, help="times each prompt is asked (default 4)")
    g.add_argument("--suffix-prompts", type=int, default=54, help="distinct prompts (default 54: all held out)")
    g.add_argument("--suffix-chars", type=int, default=600, help="prompt length in characters (default 600)")
    g.add_argument("--suffix-n", type=int, default=96, help="tokens per completion (default 96)")
    g.add_argument("--suffix-drafter", default="suffix")
    g.add_argument("--suffix-routing", default="pow2", choices=("prefix", "session", "pow2"))
    g.add_argument("--seed", type=int, default=0, help="the rounds' shuffles")
    g = ap.add_argument_group("drain")
    g.add_argument("--drain-n", type=int, default=400, help="tokens of each stream in flight at SIGTERM (default 400)")
    g.add_argument("--drain-streams", type=int, default=4, help="streams in flight on 2 slots (default 4)")
    args = ap.parse_args()
    parts = list(PARTS) if args.part == "all" else [args.part]
    results: dict[str, list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    for part in parts:
        try:
            results[part] = PARTS[part](args)
        except ServerFailed as exc:
            raise SystemExit(str(exc)) from None
    print(f"\n{len(parts)} part(s) in {time.perf_counter() - t0:.0f} s\n")
    for part in parts:
        print(f"### {part}\n\n{table(results[part], COLUMNS[part])}\n")
    write_json(args.json, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
