"""Engine benchmarks: plain speed against llama.cpp, speculation that never pays, batching, prefix reuse.

Every comparison runs interleaved in one process run (A B A B ...), so
machine noise hits both sides alike; only the ratios mean anything.

    python benchmarks/engine_speed.py plain   -m MODEL [--exact on|off]   # P1: --drafter none vs llama-completion
    python benchmarks/engine_speed.py nopay   -m MODEL                    # P2: always-wrong drafter @cost vs llama plain
    python benchmarks/engine_speed.py draft   [-m MODEL -md DRAFT]        # P2: draft-model @cost vs none (bundled pair)
    python benchmarks/engine_speed.py batch   -m MODEL [--conc 1,2,4,8]   # aggregate tok/s by concurrency, k chosen
    python benchmarks/engine_speed.py prefix  -m MODEL                    # time to first token, cold vs warm

P1 and "nopay" need llama.cpp's binaries (scripts/build_llama_bins.sh).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Sequence

from specstack.bench.config import split_method
from specstack.drafters.base import DraftRequest
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.llama import LlamaModel
from specstack.loading import TargetSpec, build_engine, load_target
from specstack.paths import DEFAULT_DRAFT, DEFAULT_TARGET
from specstack.prompts import held_out_prompts
from specstack.types import Draft


class AlwaysWrong:
    """Drafts tokens the target (almost) never picks: the cost of speculation that does not pay."""

    name = "always-wrong"

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab

    def begin(self, prompt_ids: Sequence[int], seq: int = 0) -> None:
        pass

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [Draft(tuple((int(r.context[-1]) * 7 + 11 + i) % self.n_vocab for i in range(r.budget.max_tokens)), self.name)
                for r in requests]

    def advance(self, new_ids: Sequence[int], n_accepted: int, seq: int = 0) -> None:
        pass

    def end(self, seq: int = 0, complete: bool = True) -> None:
        pass


def load(args, slots: int = 1, exact: str = "on") -> LlamaModel:
    """The target as `generate` and `serve` load it, with 512 positions per slot, verifying chains (no trees)."""
    return load_target(TargetSpec(Path(args.model), ctx=512, threads=args.threads, slots=slots, exact=exact,
                                  tree_branches=1))


def engine_for(target: LlamaModel, method: str, args) -> Engine:
    """METHOD or METHOD@POLICY, as in `specstack bench --methods`; each cost policy has its own cost model."""
    name, policy = split_method(method)
    drafter = AlwaysWrong(target.n_vocab) if name == "always-wrong" else name
    return build_engine(target, drafter, policy or None, drafter_options={"draft_model": args.model_draft})


def llama_plain(args, prompt: str) -> float:
    from specstack.bench.peers import run_peer

    return run_peer("llama-plain", args.model, prompt, n_predict=args.n, threads=args.threads, ctx=512)["tok_per_s"]


def ours(engine: Engine, prompt: str, n: int):
    return engine.generate(prompt, GenerationConfig(max_tokens=n)).run().stats


def cmd_versus_llama(args, method: str) -> None:
    target = load(args, exact=args.exact)
    engine = engine_for(target, method, args)
    prompts = held_out_prompts(args.prompts)
    ours(engine, prompts[0], 8)  # warm-up
    mine, theirs, acc = [], [], []
    for rep in range(args.repeat):
        for p in prompts:
            s = ours(engine, p, args.n)
            t = llama_plain(args, p)
            mine.append(s.tokens_per_second)
            theirs.append(t)
            acc.append(s.acceptance_rate)
            print(f"  rep {rep} prompt {len(target.tokenize(p))} tok: specstack {s.tokens_per_second:.2f} tok/s, "
                  f"llama-completion {t:.2f} tok/s, ratio {s.tokens_per_second / t:.3f}, drafted {s.n_drafted}, "
                  f"accepted {s.n_accepted}", flush=True)
    ratios = [a / b for a, b in zip(mine, theirs)]
    print(f"{method} ({args.model}, shapes {target.shapes.to_dict()}, exact {args.exact}): "
          f"mean {statistics.mean(mine):.2f} vs {statistics.mean(theirs):.2f} tok/s; "
          f"ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}), "
          f"ratio of means {statistics.mean(mine) / statistics.mean(theirs):.3f}; acceptance {statistics.mean(acc):.2%}")


def cmd_draft(args) -> None:
    methods = ["none", "draft-model@cost", "draft-model@fixed"]
    target = load(args)
    engines = {m: engine_for(target, m, args) for m in methods}
    prompts = held_out_prompts(args.prompts)
    rates: dict[str, list[float]] = {m: [] for m in methods}
    for e in engines.values():
        ours(e, prompts[0], 8)
    for rep in range(args.repeat):
        for p in prompts:
            for m, e in engines.items():
                rates[m].append(ours(e, p, args.n).tokens_per_second)
    base = rates["none"]
    for m in methods:
        r = [a / b for a, b in zip(rates[m], base)]
        print(f"{m:20s} {statistics.mean(rates[m]):9.1f} tok/s  per-request speedup median {statistics.median(r):.3f}x "
              f"(min {min(r):.3f}, max {max(r):.3f})")


def cmd_batch(args) -> None:
    conc = [int(c) for c in args.conc.split(",")]
    methods = args.methods.split(",")
    target = load(args, slots=max(conc), exact=args.exact)
    engines = {m: engine_for(target, m, args) for m in methods}
    prompts = held_out_prompts(max(conc) * 2)
    print(f"{args.model}: shapes {target.shapes.to_dict()}, {target.n_slots} slots, {args.n} tokens per generation")
    print(f"{'conc':>4} {'method':22s} {'agg tok/s':>10} {'vs none':>8} {'mean k':>7} {'accept':>7}")
    for c in conc:
        rows: dict[str, list[tuple[float, float, float]]] = {m: [] for m in methods}
        for rep in range(args.repeat):
            for m, e in engines.items():
                batch = prompts[rep * c % len(prompts):][:c] or prompts[:c]
                gens = [e.generate(p, GenerationConfig(max_tokens=args.n)) for p in batch]
                while e.busy and not all(g.output_ids for g in gens):
                    e.step()  # admit and prefill all of them first (prompts go in chunks): the clock measures decoding
                start = sum(len(g.output_ids) for g in gens)
                t0 = time.perf_counter()
                while e.busy:
                    e.step()
                wall = time.perf_counter() - t0
                tokens = sum(len(g.output_ids) for g in gens) - start
                steps = sum(g.stats.n_steps for g in gens)
                drafted = sum(g.stats.n_drafted for g in gens)
                accepted = sum(g.stats.n_accepted for g in gens)
                rows[m].append((tokens / wall, drafted / max(steps, 1), accepted / max(drafted, 1)))
        base = statistics.mean(r[0] for r in rows["none"]) if "none" in rows else None
        for m in methods:
            agg = statistics.mean(r[0] for r in rows[m])
            vs = f"{agg / base:7.2f}x" if base else "      -"
            print(f"{c:4d} {m:22s} {agg:10.1f} {vs} {statistics.mean(r[1] for r in rows[m]):7.2f} "
                  f"{statistics.mean(r[2] for r in rows[m]):6.0%}", flush=True)


def cmd_prefix(args) -> None:
    target = load(args)
    engine = engine_for(target, "none", args)
    base = " ".join(held_out_prompts(8))
    ids = target.tokenize(base)[: args.prompt_tokens]
    cold, warm, reused = [], [], []
    for rep in range(args.repeat):
        target.reset()
        fresh = build_engine(target, engine.drafter)  # a new engine knows no cached prefix
        a = fresh.generate(ids, GenerationConfig(max_tokens=4)).run()
        b = fresh.generate(ids, GenerationConfig(max_tokens=4)).run()
        assert a.output_ids == b.output_ids
        cold.append(a.stats.ttft_s)
        warm.append(b.stats.ttft_s)
        reused.append(b.stats.n_reused)
    print(f"{args.model}: {len(ids)}-token prompt, shapes {target.shapes.to_dict()}: time to first token "
          f"cold {statistics.median(cold) * 1e3:.1f} ms, warm {statistics.median(warm) * 1e3:.1f} ms "
          f"({statistics.median(cold) / statistics.median(warm):.1f}x), reused {reused[0]} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("plain", "nopay", "draft", "batch", "prefix"))
    ap.add_argument("-m", "--model", default=str(DEFAULT_TARGET))
    ap.add_argument("-md", "--model-draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--exact", choices=("on", "off"), default="on")
    ap.add_argument("--conc", default="1,2,4,8")
    ap.add_argument("--methods", default="none,prompt-lookup@cost,draft-model@cost")
    ap.add_argument("--prompt-tokens", type=int, default=400)
    args = ap.parse_args()
    if args.what == "plain":
        cmd_versus_llama(args, "none")
    elif args.what == "nopay":
        cmd_versus_llama(args, "always-wrong@cost")
    elif args.what == "draft":
        cmd_draft(args)
    elif args.what == "batch":
        cmd_batch(args)
    else:
        cmd_prefix(args)


if __name__ == "__main__":
    main()
