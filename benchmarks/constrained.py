"""Time per constrained token against unconstrained, for specstack serve and llama-server, on one GGUF.

Both servers decode plainly (no speculation: the grammar's own cost is what is measured), one slot,
greedy, and get the same requests: a prompt, and the same prompt with a JSON grammar (one GBNF text,
llama.cpp's converter, in both servers' ``grammar`` field). Requests alternate between the servers and
between the two kinds (A B B A ...), so machine noise hits all four alike. Reported: the mean time
between tokens after the first (ITL) of each, and constrained over unconstrained.

    python benchmarks/constrained.py -m GGUF [-t 1] [--rounds 6] [-n 64] [--chat-template gemma]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from specstack.bench.serving import Server, Stats, llama_server, specstack_serve, stream, table, with_client
from specstack.llama.schema_gbnf import schema_to_gbnf
from specstack.paths import DEFAULT_TARGET

SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "count": {"type": "integer"}}, "required": ["name", "count"]},
        "maxItems": 30}}, "required": ["items"]}
PROMPT = "Inventory of the storeroom, as JSON records:\n"


def itl(server: Server, n: int, grammar: str | None) -> float:
    """One request's mean time between tokens after the first, in ms."""
    stats = Stats()
    body = {"grammar": grammar} if grammar else None
    reply = with_client(server.url, lambda c: stream(c, stats, n, prompt=PROMPT, body=body))
    if reply is None or reply.ttft is None or reply.tokens < 2:
        raise SystemExit(f"{server.name}: request failed: {stats.failures[:1]}")
    return 1000 * (reply.latency - reply.ttft) / (reply.tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(DEFAULT_TARGET))
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-n", type=int, default=64, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=6, help="requests of each kind on each server")
    args = ap.parse_args()
    grammar = schema_to_gbnf(SCHEMA)
    common = ["-m", args.model, "-t", str(args.threads), "-np", "1"]
    servers = [specstack_serve([*common, "--drafter", "none"], name="specstack", timeout=600),
               llama_server([*common, "-c", "4096", "--temp", "0"], name="llama-server", timeout=600)]
    times: dict[tuple[str, bool], list[float]] = {}
    try:
        for s in servers:
            s.start()
            itl(s, 8, grammar)  # warm-up (specstack measures a model it has not seen first)
        for r in range(args.rounds):
            order = [(s, g) for s in servers for g in (False, True)]
            for s, g in (order if r % 2 == 0 else order[::-1]):
                times.setdefault((s.name, g), []).append(itl(s, args.n, grammar if g else None))
    finally:
        for s in servers:
            s.stop()
    rows = []
    for s in servers:
        free, bound = statistics.median(times[(s.name, False)]), statistics.median(times[(s.name, True)])
        rows.append({"server": s.name, "free": free, "bound": bound, "ratio": bound / free})
    print(f"\n{args.model}, {args.threads} thread(s), {args.n} tokens a request, median of {args.rounds} each:\n")
    print(table(rows, [("server", "server", str), ("free", "ms/token unconstrained", "{:.2f}".format),
                       ("bound", "ms/token JSON grammar", "{:.2f}".format), ("ratio", "constrained / free", "{:.2f}x".format)]))


if __name__ == "__main__":
    main()
