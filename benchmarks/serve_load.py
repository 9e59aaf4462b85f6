"""Load test for OpenAI-compatible servers: specstack serve, or llama-server on the same GGUFs.

N concurrent clients (the official async `openai` client) stream greedy completions of held-out
prompts for a fixed time; each reports time to first token and inter-token latency (p50/p99). Every output is checked against the same server's answer to that prompt
when it ran alone. A 429 is counted and retried after its Retry-After; anything else is a failure.
The server's memory (RSS) is sampled throughout.

    python benchmarks/serve_load.py --spawn specstack --clients 16 --seconds 120
    python benchmarks/serve_load.py --spawn specstack --sweep 1,2,4,8 --seconds 60 -m STANDIN -md DRAFT
    python benchmarks/serve_load.py --spawn llama-server --sweep 1,2,4,8 --seconds 60 -m STANDIN -md DRAFT
    python benchmarks/serve_load.py --url http://127.0.0.1:8080 --clients 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from specstack.paths import DEFAULT_DRAFT, DEFAULT_TARGET
from specstack.prompts import held_out_prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args, parallel: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if args.spawn == "specstack":
        cmd = [sys.executable, "-m", "specstack", "serve", "--port", str(port), "-np", str(parallel), "-m", args.model,
               "-md", args.model_draft, "-t", str(args.threads), "--drafter", args.drafter, "--max-queue", "64"]
    else:
        from specstack.bench.peers import DEFAULT_BIN_DIR

        binary = Path(os.environ.get("SPECSTACK_LLAMA_BINS", DEFAULT_BIN_DIR)) / "llama-server"
        cmd = [str(binary), "-m", args.model, "--port", str(port), "--host", "127.0.0.1", "-np", str(parallel),
               "-t", str(args.threads), "-c", str(512 * parallel), "--temp", "0", *args.llama_args.split()]
        if args.model_draft and args.llama_draft:
            cmd += ["-md", args.model_draft]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"{args.spawn} did not become healthy: {' '.join(cmd)}")


def rss_mb(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def one(client: openai.AsyncOpenAI, prompt: str, n: int, stats: dict) -> str | None:
    """One streamed greedy completion: its text, with latency, time to first token and inter-token latency
    (the mean gap between its tokens after the first, as specstack's /metrics defines it) in ``stats``."""
    while True:
        t0 = time.perf_counter()
        first = None
        parts: list[str] = []
        tokens = 0
        try:
            stream = await client.completions.create(model="default", prompt=prompt, max_tokens=n, temperature=0,
                                                     stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.text:
                        first = first or time.perf_counter()
                        parts.append(choice.text)
        except openai.RateLimitError as exc:
            stats["429"] += 1
            await asyncio.sleep(float(exc.response.headers.get("retry-after", "1")))
            continue
        except Exception as exc:  # a real failure
            stats["failures"].append(repr(exc)[:200])
            return None
        end = time.perf_counter()
        tokens = tokens or len(parts)  # a server without stream usage: one token per chunk
        stats["latency"].append(end - t0)
        stats["tokens"] += tokens
        if first is not None:
            stats["ttft"].append(first - t0)
            if tokens > 1:
                stats["itl"].append((end - first) / (tokens - 1))
        return "".join(parts)


async def load(url: str, clients: int, seconds: float, n: int, prompts: list[str], reference: dict[str, str],
               pid: int | None) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=os.environ.get("SPECSTACK_API_KEY", "none"), max_retries=0,
                                timeout=600)
    stats = {"429": 0, "failures": [], "latency": [], "ttft": [], "itl": [], "tokens": 0, "identical": 0, "checked": 0,
             "rss": []}
    stop = time.perf_counter() + seconds

    async def user(i: int) -> None:
        j = i
        while time.perf_counter() < stop:
            p = prompts[j % len(prompts)]
            j += clients
            text = await one(client, p, n, stats)
            if text is not None:
                stats["checked"] += 1
                stats["identical"] += text == reference[p]

    async def sample() -> None:
        while time.perf_counter() < stop:
            stats["rss"].append(rss_mb(pid))
            await asyncio.sleep(2)

    t0 = time.perf_counter()
    await asyncio.gather(sample(), *(user(i) for i in range(clients)))
    stats["wall"] = time.perf_counter() - t0
    return stats


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by rank; 0 for no values."""
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0


def report(name: str, clients: int, s: dict) -> str:
    rss = s["rss"] or [0.0]
    return (f"{name:14s} clients {clients:3d}: {len(s['latency'])} ok, {s['429']} x 429 (retried), "
            f"{len(s['failures'])} failures; {s['tokens'] / s['wall']:.1f} tok/s aggregate; latency p50 "
            f"{pct(s['latency'], 0.5):.2f} s p95 {pct(s['latency'], 0.95):.2f} s; TTFT p50 {1000 * pct(s['ttft'], 0.5):.0f} "
            f"ms p99 {1000 * pct(s['ttft'], 0.99):.0f} ms; ITL p50 {1000 * pct(s['itl'], 0.5):.1f} ms p99 "
            f"{1000 * pct(s['itl'], 0.99):.1f} ms; identical to solo {s['identical']}/{s['checked']}; "
            f"RSS {rss[0]:.0f} -> max {max(rss):.0f} -> {rss[-1]:.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an already running server")
    ap.add_argument("--spawn", choices=("specstack", "llama-server"), help="start this server for the run")
    ap.add_argument("-m", "--model", default=str(DEFAULT_TARGET))
    ap.add_argument("-md", "--model-draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--drafter", default="prompt-lookup", help="specstack's default drafter")
    ap.add_argument("--llama-args", default="", help="extra llama-server flags, e.g. '--spec-draft-n-max 8'")
    ap.add_argument("--llama-draft", action="store_true", help="give llama-server the draft model (-md)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--sweep", default=None, help="comma-separated client counts; slots = clients")
    ap.add_argument("--parallel", type=int, default=4, help="server slots without --sweep")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=12)
    args = ap.parse_args()
    prompts = held_out_prompts(args.prompts)
    runs = [int(c) for c in args.sweep.split(",")] if args.sweep else [args.clients]
    for clients in runs:
        proc = None
        url = args.url
        if args.spawn:
            proc, url = spawn(args, clients if args.sweep else args.parallel)
        try:
            ref_client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("SPECSTACK_API_KEY", "none"), timeout=600)
            reference = {p: ref_client.completions.create(model="default", prompt=p, max_tokens=args.n, temperature=0)
                         .choices[0].text for p in prompts}
            stats = asyncio.run(load(url, clients, args.seconds, args.n, prompts, reference, proc.pid if proc else None))
            print(report(args.spawn or url, clients, stats), flush=True)
            for f in stats["failures"][:5]:
                print("  failure:", f)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)


if __name__ == "__main__":
    main()
