"""The serving benchmarks' harness: ports, server processes and readiness, streamed requests, stats, tables.

``benchmarks/serve_load.py`` (specstack serve against llama-server) and ``benchmarks/scaleout.py`` (``serve
--ray``) run their loads through here, and the server tests take their ports and readiness wait from here.
``httpx`` and ``openai`` are the test extra's; they are imported where they are used, so importing this
module needs neither.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Sequence, TypeVar

from ..errors import SpecstackError
from ..ui import markdown_table

if TYPE_CHECKING:
    import openai

T = TypeVar("T")
START_S = 300.0  # a deadline against a server that never comes up, not a performance bound
STALE_RETRIES = 3
TICK = os.sysconf("SC_CLK_TCK")


class ServerFailed(SpecstackError):
    """A server exited or never became ready; the message says which, with its command and the end of its log."""


# -- ports and readiness ------------------------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = START_S, replicas: int = 0,
               interval: float = 0.25) -> None:
    """Return once ``url``/health answers 200 and (``replicas`` > 0) that many Ray replicas report in /metrics.

    Raises ``ServerFailed`` when ``proc`` exits first or ``timeout`` seconds pass. Under Ray /health turns 200
    once every replica has loaded; the replicas in /metrics are checked too, so a server from before that (200
    as soon as one replica had loaded) is waited for right.  /metrics needs the API key where the server has one
    (``$SPECSTACK_API_KEY``, as the benchmark's client sends it)."""
    import httpx

    key = os.environ.get("SPECSTACK_API_KEY")
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerFailed(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200 and (
                    replicas == 0 or len(replica_ids(httpx.get(url + "/metrics", headers=auth, timeout=10).text)) >= replicas):
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise ServerFailed(f"the server at {url} was not ready after {timeout:.0f} s")


def replica_ids(metrics: str) -> set[str]:
    """The Ray replicas that report in a /metrics text."""
    return set(re.findall(r'replica="([^"]+)"', metrics)) - {"total"}


# -- servers ------------------------------------------------------------------------------------------------------


class Server:
    """A server under test at ``url``. This one is already running (``--url``): nothing to start or stop."""

    def __init__(self, name: str, url: str, label: str = "") -> None:
        self.name, self.url, self.label = name, url, label  # label: its settings, for reports

    @property
    def pid(self) -> int | None:
        return None

    def log_text(self) -> str:
        return ""

    def start(self) -> "Server":
        return self

    def stop(self, timeout: float = 120) -> None:
        pass

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class ServerProcess(Server):
    """A server subprocess on ``port``: started and ready on ``start`` (or enter), SIGTERM (a drain) on ``stop``.

    Its output goes to ``log`` (a new temporary file if None), kept for the report. ``own_group`` starts it in
    a process group of its own, killed whole when SIGTERM does not end it in time (so no Ray process of its
    outlives the run). ``start_s``, ``stop_s`` and ``returncode`` say how starting and stopping went."""

    def __init__(self, name: str, command: Sequence[str], port: int, *, label: str = "",
                 env: Mapping[str, str] | None = None, cwd: Path | None = None, log: Path | None = None,
                 replicas: int = 0, own_group: bool = False, timeout: float = START_S) -> None:
        super().__init__(name, f"http://127.0.0.1:{port}", label)
        self.command, self.port, self.env, self.cwd, self.log = list(command), port, env, cwd, log
        self.replicas, self.own_group, self.timeout = replicas, own_group, timeout
        self.proc: subprocess.Popen | None = None
        self.start_s = self.stop_s = 0.0
        self.returncode: int | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log is not None and self.log.exists() else ""

    def start(self) -> "ServerProcess":
        if self.proc is not None:
            return self
        if self.log is None:
            self.log = Path(tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")[1])
        t0 = time.perf_counter()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                         env=dict(self.env) if self.env is not None else None, cwd=self.cwd,
                                         start_new_session=self.own_group)
        try:
            wait_ready(self.url, self.proc, self.timeout, self.replicas)
        except ServerFailed as exc:
            self.stop(timeout=30)
            tail = "\n".join(self.log_text().splitlines()[-20:])
            raise ServerFailed(f"{self.name}: {exc}: {' '.join(self.command)}\n{tail}") from None
        except BaseException:
            self.stop(timeout=30)
            raise
        self.start_s = time.perf_counter() - t0
        return self

    def stop(self, timeout: float = 120) -> None:
        """SIGTERM and wait: the server drains its requests (under --ray, then stops its Ray). One that does not
        end in ``timeout`` seconds is killed (with its group, if ``own_group``)."""
        if self.proc is None or self.proc.poll() is not None:
            self.returncode = None if self.proc is None else self.proc.returncode
            return
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            if self.own_group:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()
            self.returncode = self.proc.wait()
        self.stop_s = time.perf_counter() - t0


def specstack_serve(flags: Sequence[str], *, name: str = "specstack", port: int | None = None,
                    **kw: Any) -> ServerProcess:
    """``specstack serve`` (this interpreter's) with ``flags`` on a free port; ``kw`` as ``ServerProcess`` takes."""
    port = port or free_port()
    return ServerProcess(name, [sys.executable, "-m", "specstack", "serve", "--port", str(port), *flags], port, **kw)


def llama_server_binary() -> Path:
    """llama.cpp's ``llama-server`` among the peer binaries (``bench.peers.bin_dir``)."""
    from .peers import bin_dir

    return bin_dir() / "llama-server"


def llama_server(flags: Sequence[str], *, name: str = "llama-server", port: int | None = None,
                 **kw: Any) -> ServerProcess:
    """llama.cpp's ``llama-server`` with ``flags`` on a free loopback port; ``kw`` as ``ServerProcess`` takes."""
    port = port or free_port()
    return ServerProcess(name, [str(llama_server_binary()), "--port", str(port), "--host", "127.0.0.1", *flags], port,
                         **kw)


# -- processes ----------------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds so far of one process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mb(pid: int | None) -> float:
    """A process's resident memory in MiB (0 for none, or one that has gone)."""
    if pid is None:
        return 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# -- requests -----------------------------------------------------------------------------------------------------


@dataclass
class Reply:
    """One streamed request: its text, token counts (``prompt_tokens`` None where the server sent no usage), its
    latency and client-side TTFT (the first chunk with text), its longest gap between two text chunks, and the
    ``speculative`` object specstack adds."""

    text: str
    prompt_tokens: int | None
    tokens: int
    latency: float
    ttft: float | None
    gap: float = 0.0
    spec: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)  # llama-server's (draft_n, draft_n_accepted, ...)


@dataclass
class Stats:
    """What a run's requests add up to: counts, retries, failures, and each request's latencies."""

    requests: int = 0
    tokens: int = 0
    prompt_tokens: list[int] = field(default_factory=list)
    rate_limited: int = 0
    reconnects: int = 0
    failures: list[str] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # per request: the mean gap between its tokens after the first
    stall: list[float] = field(default_factory=list)  # per request: its longest gap between two chunks
    wall: float = 0.0

    def add(self, r: Reply) -> None:
        self.requests += 1
        self.tokens += r.tokens
        self.latency.append(r.latency)
        if r.prompt_tokens is not None:
            self.prompt_tokens.append(r.prompt_tokens)
        if r.ttft is not None:
            self.ttft.append(r.ttft)
            self.stall.append(r.gap)
            if r.tokens > 1:
                self.itl.append((r.latency - r.ttft) / (r.tokens - 1))

    def tok_s(self) -> float:
        """Completion tokens over the run's wall time."""
        return self.tokens / self.wall if self.wall else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by rank; 0 for no values."""
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0


def openai_client(url: str) -> "openai.AsyncOpenAI":
    """The official async client for a server at ``url`` (key: $SPECSTACK_API_KEY), without retries of its own."""
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=os.environ.get("SPECSTACK_API_KEY", "none"),
                              max_retries=0, timeout=600)


def with_client(url: str, work: Callable[["openai.AsyncOpenAI"], Awaitable[T]]) -> T:
    """Run ``work(client)`` on a fresh event loop with a client closed before the loop ends (else httpx's cleanup
    fails on a closed loop and prints tracebacks)."""

    async def main() -> T:
        async with openai_client(url) as client:
            return await work(client)

    return asyncio.run(main())


def chunk_text(chunk: Any) -> str:
    """The text a streamed chunk carries, completions (``text``) or chat (``delta.content``)."""
    parts = []
    for choice in chunk.choices:
        delta = getattr(choice, "delta", None)
        parts.append((delta.content if delta is not None else choice.text) or "")
    return "".join(parts)


async def stream(client: "openai.AsyncOpenAI", stats: Stats, n: int, prompt: str | None = None,
                 messages: list[dict[str, str]] | None = None, session: str | None = None,
                 body: dict[str, Any] | None = None) -> Reply | None:
    """One streamed greedy completion (``prompt``) or chat turn (``messages``, under ``session``'s x-session-id),
    added to ``stats``; None if it failed (the failure is in ``stats``). ``body``: extra request fields (a
    ``grammar``, both servers' field of that name).

    A 429 waits its Retry-After and is sent again. A kept-alive connection the server closed just as it was
    reused fails before any response (llama-server: a few per hundred requests); clients send that again, up to
    ``STALE_RETRIES`` times. Anything else is a failure, and the run goes on."""
    import openai

    extra: dict[str, Any] = {"extra_headers": {"x-session-id": session}} if session else {}
    if body:
        extra["extra_body"] = body
    common = dict(model="default", max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True},
                  **extra)
    stale = 0
    while True:
        t0 = time.perf_counter()
        first = last = None
        gap = 0.0
        parts: list[str] = []
        usage, spec, timings = None, {}, {}
        try:
            if messages is not None:
                chunks = await client.chat.completions.create(messages=messages, **common)
            else:
                chunks = await client.completions.create(prompt=prompt, **common)
            async for chunk in chunks:
                usage = chunk.usage or usage
                spec = ((chunk.model_extra or {}).get("specstack") or {}).get("speculative") or spec
                timings = (chunk.model_extra or {}).get("timings") or timings
                text = chunk_text(chunk)
                if text:
                    now = time.perf_counter()
                    first = first or now
                    gap = max(gap, now - last) if last is not None else gap
                    last = now
                    parts.append(text)
        except openai.RateLimitError as exc:
            stats.rate_limited += 1
            await asyncio.sleep(float(exc.response.headers.get("retry-after", "1")))
            continue
        except openai.APIConnectionError as exc:
            if first is None and stale < STALE_RETRIES and "without sending a response" in str(exc.__cause__):
                stale += 1
                stats.reconnects += 1
                continue
            stats.failures.append(f"{exc!r} ({exc.__cause__!r})"[:200])
            return None
        except Exception as exc:  # a real failure: counted, the run goes on
            stats.failures.append(repr(exc)[:200])
            return None
        end = time.perf_counter()
        reply = Reply("".join(parts), usage.prompt_tokens if usage else None,
                      usage.completion_tokens if usage else len(parts),  # no stream usage: one token per chunk
                      end - t0, None if first is None else first - t0, gap, spec, timings)
        stats.add(reply)
        return reply


async def closed_loop(client: "openai.AsyncOpenAI", clients: int, stop: float, prompts: Sequence[str], n: int,
                      stats: Stats, seen: Callable[[str, Reply], None] | None = None) -> None:
    """``clients`` users, each streaming the prompts in turn (user i from prompt i) until ``stop`` (a
    ``time.perf_counter`` time; a request under way then runs to its end); ``seen(prompt, reply)`` after each."""

    async def user(i: int) -> None:
        j = i
        while time.perf_counter() < stop:
            p = prompts[j % len(prompts)]
            j += clients
            reply = await stream(client, stats, n, prompt=p)
            if reply is not None and seen is not None:
                seen(p, reply)

    await asyncio.gather(*(user(i) for i in range(clients)))


# -- output -------------------------------------------------------------------------------------------------------

Column = tuple[str, str, Callable[[Any], str]]  # a row's key, the column's title, how a value is written


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """Rows of named values as a Markdown table (``ui.markdown_table``); a missing value is '-'."""
    return markdown_table([title for _, title, _ in columns],
                          [[fmt(r[key]) if r.get(key) is not None else "-" for key, _, fmt in columns] for r in rows])


def write_json(path: str | Path | None, data: Any) -> None:
    """``data`` as JSON at ``path`` (nothing if None); values JSON has no type for (paths) are written as text."""
    if path:
        Path(path).write_text(json.dumps(data, indent=1, default=str))
