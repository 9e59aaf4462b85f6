"""``specstack demo``: plain decoding vs each drafter on held-out code prompts, side by side.

A preset of ``specstack bench``: the bench runner interleaves the methods per prompt (plain,
lookup, draft, plain, ...) so a noisy machine slows all of them alike, and the table shows
ratios from one run.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..bench.results import aggregate
from ..bench.config import DEFAULT_K_MAX, BenchConfig
from ..bench.runner import run_bench
from ..bench.workloads import Request, Workload
from ..drafters import draft_model, prompt_lookup
from ..paths import DATA_DIR
from ..prompts import held_out_prompts
from ..ui import table
from .common import add_model_args, target_from_args, methods_with_draft, options_from_args
from .generate import describe_shapes

# Rows after plain decoding (which always runs first: speedups are relative to it).
# METHOD@cost is the bench's spelling of "this drafter under the cost policy"; shown as +cost.
METHODS = tuple(method for drafter in (prompt_lookup.NAME, draft_model.NAME) for method in (drafter, f"{drafter}@cost"))


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
    p.add_argument("--k-max", type=int, default=None, help=f"upper bound on k for the cost-policy rows (default {DEFAULT_K_MAX})")
    p.add_argument("--show", action="store_true", help="print each prompt's plain output")
    add_model_args(p)
    p.set_defaults(func=run)


def workload(n_prompts: int, max_tokens: int) -> Workload:
    """The held-out prompts as a bench workload, all in one group.

    One group means one engine per configuration for the whole run, as a user's session has: a
    k policy then carries what it learnt (e.g. that the draft model does not pay on this pair)
    from one prompt to the next instead of probing afresh on each.
    """
    prompts = held_out_prompts(n_prompts)
    reqs = tuple(Request(id=f"prompt {i}", prompt=p, category="code", max_tokens=max_tokens, group="held-out", line=i)
                 for i, p in enumerate(prompts, 1))
    return Workload("held-out", DATA_DIR / "prompts" / "code-complete.jsonl", reqs)


def run(args: argparse.Namespace) -> int:
    wl = workload(args.prompts, args.max_tokens)
    methods = methods_with_draft(args, list(METHODS), False, "demo")
    config = BenchConfig(workload=wl, methods=methods, ks=[args.k], k_max=args.k_max or DEFAULT_K_MAX,
                         drafter_options=options_from_args(args), cost_curve=False)
    target = target_from_args(args)
    draft = args.model_draft.name if args.model_draft else "none"
    print(f"target {target.path.name}, draft {draft}, {target.n_threads} threads, greedy; "
          f"fixed rows k={args.k}, '+cost' rows choose k per step from measured costs", file=sys.stderr)
    results = run_bench(config, target, label="demo")
    if args.show:
        for r in results["runs"]:
            if r["method"] == "none":
                print(f"--- {r['request']} ---\n{r['text']}", file=sys.stderr)
    print(format_table(aggregate(results), len(wl.requests)))
    print(f"exact shapes: {describe_shapes(target.shapes)}")  # which guarantee the 'identical' column rests on
    return 130 if results["interrupted"] else 0


def format_table(rows: list[dict[str, Any]], n_prompts: int) -> str:
    """One line per method from the bench's aggregate rows (category 'all')."""
    body = []
    for r in rows:
        if r["category"] != "all":
            continue
        acc = r["acceptance_rate"]
        body.append([r["method"].replace("@", "+"), f"{r['tokens_per_second']:.1f}", f"{r['speedup'] or 0:.2f}x",
                     "-" if acc is None else f"{100 * acc:.0f}%", f"{r['mean_accepted_length'] or 0:.2f}",
                     "-" if r["compared"] is None else f"{r['identical']}/{r['compared']}"])
    head = ["method", "tok/s", "speedup", "accept", "mean len", "identical"]
    return (table(head, body, rule=True) + f"\n({n_prompts} held-out prompts; tok/s = generated tokens / decode time; "
            "'identical' = token-for-token equal to plain decoding)")
