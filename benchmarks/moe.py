"""MoE target: full experts, fewer experts (lossy), the moe-self draft, and llama.cpp's --override-kv run.

Interleaved per prompt in one run; greedy; identity is checked against full-expert plain decoding.

    python benchmarks/moe.py [-m MOE.gguf] [--prompts 6] [-n 96]
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace
from pathlib import Path

from specstack.bench.serving import rss_mb
from specstack.generation import GenerationConfig
from specstack.loading import TargetSpec, build_drafter, build_engine, load_calibrated
from specstack.paths import MODELS_DIR
from specstack.prompts import held_out_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(MODELS_DIR / "pycoder-moe.gguf"))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--llama", action="store_true", help="also run llama-completion with --override-kv (needs the peer binaries)")
    args = ap.parse_args()

    spec = TargetSpec(Path(args.model), threads=args.threads, exact="on", tree_branches=1)  # chains, as measured
    full = load_calibrated(spec, n_max=17)  # one cost model, which the cost policies below share
    reduced = load_calibrated(replace(spec, experts=1))
    pid = os.getpid()
    before = rss_mb(pid)
    moe_self = build_drafter("moe-self", full.target)
    after = rss_mb(pid)
    engines = {
        "none": build_engine(full),
        "--experts 1 (LOSSY)": build_engine(reduced),
        "moe-self@fixed4": build_engine(full, moe_self, "fixed"),
        "moe-self@cost": build_engine(full, moe_self, "cost"),
        "cascade:prompt-lookup,moe-self@cost": build_engine(full, "cascade:prompt-lookup,moe-self", "cost"),
        "draft-model(1m)@cost": build_engine(full, "draft-model", "cost"),
    }
    prompts = held_out_prompts(args.prompts)
    rows: dict[str, list] = {k: [] for k in engines}
    peer: list[float] = []
    for e in engines.values():
        e.generate(prompts[0], GenerationConfig(max_tokens=8)).run()
    for p in prompts:
        ref = None
        for name, e in engines.items():
            g = e.generate(p, GenerationConfig(max_tokens=args.n)).run()
            if name == "none":
                ref = g.output_ids
            rows[name].append((g.stats.tokens_per_second, g.stats.n_accepted, g.stats.n_drafted, g.output_ids == ref))
        if args.llama:
            from specstack.bench.peers import run_peer

            r = run_peer("llama-plain", args.model, p, n_predict=args.n, threads=args.threads,
                         extra_args=("--override-kv", "llama.expert_used_count=int:1"))
            peer.append(r["tok_per_s"])
    base = [r[0] for r in rows["none"]]
    print(f"{args.model}: {len(prompts)} held-out prompts x {args.n} tokens; moe-self draft context adds "
          f"{after - before:.1f} MB RSS (weights shared through mmap)")
    print(f"{'method':38s} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'identical':>9}")
    for name, r in rows.items():
        tps = statistics.mean(x[0] for x in r)
        speed = statistics.median(x[0] / b for x, b in zip(r, base))
        drafted = sum(x[2] for x in r)
        acc = f"{sum(x[1] for x in r) / drafted:.0%}" if drafted else "-"
        print(f"{name:38s} {tps:8.0f} {speed:7.2f}x {acc:>7} {sum(x[3] for x in r):>6}/{len(r)}")
    if peer:
        print(f"{'llama-completion --override-kv 1 expert':38s} {statistics.mean(peer):8.0f}  (LOSSY; llama.cpp's own rate)")


if __name__ == "__main__":
    main()
