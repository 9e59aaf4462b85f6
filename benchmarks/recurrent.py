"""Recurrent and hybrid targets: plain against prompt-lookup, suffix and draft-model (cost policy), per strategy.

For each rewind strategy (``rollback`` where the architecture has it, and ``checkpoint``) the
target is loaded once and every method runs on every prompt, interleaved, greedy.  Reported:
decode tokens/s, the median per-prompt speedup over plain decoding *of the same target load*,
acceptance, what a drafted step paid to take rejected tokens back (ms), and whether the output
equals plain decoding.  With --peers, llama.cpp's own llama-completion and
llama-speculative-simple run on the same prompts (needs scripts/build_llama_bins.sh).

    python benchmarks/recurrent.py [-m pycoder-lfm2.gguf] [-md pycoder-1m.gguf] [--prompts 6] [-n 128] [--exact off] [--peers]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.loading import Calibration, TargetSpec, build_engine, load_calibrated
from specstack.paths import DEFAULT_DRAFT, MODELS_DIR
from specstack.prompts import held_out_prompts

METHODS = ("none", "prompt-lookup", "suffix", "draft-model")


@dataclass
class Row:
    tps: list[float] = field(default_factory=list)
    speedup: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    rewind_s: float = 0.0
    drafted_steps: int = 0
    identical: int = 0


def engines_for(loaded: Calibration, draft: str) -> dict[str, Engine]:
    """Each method's engine; every drafting one with the cost policy, all pricing with the load's cost model."""
    return {m: build_engine(loaded, m, None if m == "none" else "cost", drafter_options={"draft_model": draft})
            for m in METHODS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(MODELS_DIR / "pycoder-lfm2.gguf"))
    ap.add_argument("-md", "--model-draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--strategies", default="auto,checkpoint", help="comma list of --rollback values")
    ap.add_argument("--exact", choices=("on", "off"), default="on", help="exact call shapes (README, Exactness)")
    ap.add_argument("--peers", action="store_true", help="also run llama.cpp's llama-completion and llama-speculative-simple")
    args = ap.parse_args()

    loads = {}
    for s in args.strategies.split(","):
        loaded = load_calibrated(TargetSpec(Path(args.model), threads=args.threads, exact=args.exact, rollback=s,
                                            tree_branches=1), n_max=17)
        loads[loaded.target.strategy] = (loaded.target, engines_for(loaded, args.model_draft))
    prompts = held_out_prompts(args.prompts)
    rows = {(s, m): Row() for s in loads for m in METHODS}
    peers: dict[str, list[float]] = {}
    for _, engines in loads.values():  # warm-up: first calls build graphs
        for e in engines.values():
            e.generate(prompts[0], GenerationConfig(max_tokens=8)).run()
    for p in prompts:
        for s, (_, engines) in loads.items():
            plain = None
            for m, e in engines.items():
                g = e.generate(p, GenerationConfig(max_tokens=args.n)).run()
                st, r = g.stats, rows[(s, m)]
                if m == "none":
                    plain = g
                r.tps.append(st.tokens_per_second)
                r.speedup.append(st.tokens_per_second / plain.stats.tokens_per_second)
                r.drafted += st.n_drafted
                r.accepted += st.n_accepted
                r.rewind_s += st.rewound.seconds
                r.drafted_steps += sum(1 for _, d, _ in st.steps if d)
                r.identical += g.output_ids == plain.output_ids
        if args.peers:
            run_peers(args, p, peers)
    report(args, loads, rows, peers, len(prompts))


def run_peers(args: argparse.Namespace, prompt: str, peers: dict[str, list[float]]) -> None:
    from specstack.bench.peers import PeerError, run_peer

    for method, draft in (("llama-plain", None), ("llama-draft-simple", args.model_draft), ("llama-ngram-simple", None)):
        try:
            r = run_peer(method, args.model, prompt, draft=draft, n_predict=args.n, threads=args.threads, k=8)
        except PeerError as exc:
            print(f"{method}: {str(exc).splitlines()[0]}")
            peers.setdefault(method, [])
            continue
        peers.setdefault(method, []).append(r["tok_per_s"])


def report(args, loads, rows, peers, n_prompts: int) -> None:
    first = next(iter(loads.values()))[0]
    print(f"{args.model} ({first.memory}), draft {args.model_draft}: {n_prompts} held-out prompts x {args.n} tokens, "
          f"{args.threads} threads, greedy, cost policy, --exact {args.exact}")
    print(f"{'strategy':11s} {'method':14s} {'tok/s':>7} {'speedup':>8} {'accept':>7} {'rewind ms/step':>15} {'identical':>9}")
    for (s, m), r in rows.items():
        acc = f"{r.accepted / r.drafted:.0%}" if r.drafted else "-"
        rw = f"{1000 * r.rewind_s / r.drafted_steps:.3f}" if r.drafted_steps else "-"
        print(f"{s:11s} {m:14s} {statistics.mean(r.tps):7.0f} {statistics.median(r.speedup):7.2f}x {acc:>7} "
              f"{rw:>15} {r.identical:>6}/{len(r.tps)}")
    for method, tps in peers.items():
        print(f"{'llama.cpp':11s} {method:26s} " + (f"{statistics.mean(tps):7.0f} tok/s (its own report)" if tps else "did not run"))


if __name__ == "__main__":
    main()
