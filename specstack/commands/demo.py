"""``specstack demo``: plain decoding vs each drafter on held-out code prompts, side by side.

Methods run interleaved per prompt (plain, lookup, draft, plain, ...) so a
noisy machine slows all of them alike; the table shows ratios from one run.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from ..engine import Engine, GenerationConfig
from ..prompts import held_out_prompts
from .common import add_model_args, build_drafter, build_policy, load_target

# (row label, drafter, k policy); plain decoding first: speedups are relative to it.
METHODS = (
    ("none", "none", "fixed"),
    ("prompt-lookup", "prompt-lookup", "fixed"),
    ("prompt-lookup+cost", "prompt-lookup", "cost"),
    ("draft-model", "draft-model", "fixed"),
    ("draft-model+cost", "draft-model", "cost"),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="compare plain decoding with each drafter on the bundled pair",
        description="Run held-out code prompts with plain decoding and with each drafter, "
        "and print tok/s, speedup, acceptance and whether each output is identical to plain decoding (greedy).",
    )
    p.add_argument("--prompts", type=int, default=6, help="number of held-out prompts (default 6)")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("-k", "--draft-max", dest="k", type=int, default=4, help="draft tokens per step for the fixed-k rows (default 4)")
    p.add_argument("--k-max", type=int, default=None, help="upper bound on k for the cost-policy rows (default 16)")
    p.add_argument("--show", action="store_true", help="print each prompt's plain output")
    add_model_args(p)
    p.set_defaults(func=run)


@dataclass
class _Totals:
    tokens: int = 0
    decode_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    committed: int = 0
    identical: int = 0
    runs: int = 0
    per_prompt_tps: list[float] = field(default_factory=list)


def run(args: argparse.Namespace) -> int:
    target = load_target(args)
    engines = {}
    for label, drafter, policy in METHODS:
        ns = argparse.Namespace(**{**vars(args), "k_policy": policy})
        engines[label] = Engine(target, build_drafter(drafter, target, ns), build_policy(ns, target))
    prompts = held_out_prompts(args.prompts)
    totals = {label: _Totals() for label in engines}
    config = GenerationConfig(max_tokens=args.max_tokens, k=args.k)
    print(f"target {target.path.name}, draft {args.model_draft.name}, {target.n_threads} threads, greedy; "
          f"fixed rows k={args.k}, '+cost' rows choose k per step from measured costs", file=sys.stderr)
    for engine in engines.values():  # first-call costs (allocations, graph builds) off the clock
        engine.generate(prompts[0], GenerationConfig(max_tokens=8)).run()
    for i, prompt in enumerate(prompts, 1):
        reference = None
        for m, engine in engines.items():
            print(f"\r[{i}/{len(prompts)}] {m:<14}", end="", file=sys.stderr, flush=True)
            gen = engine.generate(prompt, config).run()
            reference = gen.output_ids if reference is None else reference
            _accumulate(totals[m], gen, gen.output_ids == reference)
            if args.show and m == "none":
                print(f"\n--- prompt {i} ---\n{gen.text}", file=sys.stderr)
    print("\r" + " " * 40 + "\r", end="", file=sys.stderr)
    print(format_table(totals, len(prompts)))
    return 0


def _accumulate(t: _Totals, gen, identical: bool) -> None:
    s = gen.stats
    t.tokens += s.n_tokens
    t.decode_s += s.decode_s
    t.drafted += s.n_drafted
    t.accepted += s.n_accepted
    t.steps += s.n_steps
    t.committed += s.n_committed
    t.identical += identical
    t.runs += 1


def format_table(totals: dict[str, _Totals], n_prompts: int) -> str:
    base = totals["none"]
    base_tps = base.tokens / base.decode_s if base.decode_s else 0.0
    head = f"{'method':<20}{'tok/s':>9}{'speedup':>9}{'accept':>9}{'mean len':>10}{'identical':>11}"
    lines = [head, "-" * len(head)]
    for m, t in totals.items():
        tps = t.tokens / t.decode_s if t.decode_s else 0.0
        acc = f"{100 * t.accepted / t.drafted:.0f}%" if t.drafted else "-"
        mean_len = t.committed / t.steps if t.steps else 0.0
        lines.append(
            f"{m:<20}{tps:>9.1f}{tps / base_tps if base_tps else 0:>8.2f}x{acc:>9}{mean_len:>10.2f}{f'{t.identical}/{t.runs}':>11}"
        )
    lines.append(f"({n_prompts} held-out prompts; tok/s = generated tokens / decode time; 'identical' = token-for-token equal to plain decoding)")
    return "\n".join(lines)
