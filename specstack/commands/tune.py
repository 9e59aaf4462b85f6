"""``specstack tune``: sweep draft sources, k policies and k on a workload sample; write a profile.

A preset of ``specstack bench``: the bench runner runs plain decoding interleaved with every
configuration on each prompt, so the speedups compare runs made moments apart on the same
machine, and they are the bench's own speedups (tok/s over plain tok/s, per category).
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..bench.results import ALL, PLAIN, aggregate
from ..bench.config import DEFAULT_K_MAX, BenchConfig, adaptive_start, split_method
from ..bench.outputs import check_output_file
from ..bench.runner import run_bench
from ..bench.workloads import Workload, load
from ..draft_length import POLICIES
from ..drafters import draft_model, prompt_lookup
from ..errors import InvalidParameterError
from ..profiles import write_profile
from ..ui import table
from .bench import add_ks_arg
from .common import add_model_args, flag_given, target_from_args, methods_with_draft, options_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="find the best drafter / k policy / k per content type and write a profile",
        description="Sweep --sources x --policies (x -k for the fixed policy) on a workload sample, "
        "measure tok/s against plain decoding run interleaved, and write the best setting per category as a TOML profile "
        "for `specstack generate --profile`.",
    )
    p.add_argument("--workload", default="code-complete", help="bundled workload name or JSONL file (default code-complete)")
    p.add_argument("--prompts", type=int, default=4, help="requests per category to use (default 4)")
    p.add_argument("--sources", default=None, help="comma-separated drafters to try (default "
                   f"{','.join(DEFAULT_SOURCES)}, and mtp where the model has a multi-token-prediction head)")
    p.add_argument("--policies", default="cost,fixed", help=f"comma-separated k policies ({', '.join(POLICIES)})")
    add_ks_arg(p, [2, 4, 8], "comma-separated k values for the fixed policy (default 2,4,8)")
    p.add_argument("-n", "--max-tokens", type=int, default=None, help="override each request's max_tokens")
    p.add_argument("-o", "--output", type=Path, default=Path("specstack-profile.toml"), help="profile to write")
    add_model_args(p)
    p.add_argument("--k-max", type=int, default=None,
                   help=f"upper bound on k for adaptive policies (default {DEFAULT_K_MAX}); they start at k=min(k-max, 4)")
    p.set_defaults(func=run)


DEFAULT_SOURCES = (prompt_lookup.NAME, draft_model.NAME)


def sources_for(args: argparse.Namespace) -> list[str]:
    """--sources, checked before any load; by default ``DEFAULT_SOURCES``, and the drafters the model offers itself
    (``Needs.offered``: mtp where its NextN head is one this llama.cpp drafts from, as generate names it there: a
    tuned profile should weigh the drafter that needs no second model).  A source the model cannot have (mtp on a
    model without a head, ``Needs.check``) is refused in one line from its metadata."""
    from ..drafters.base import Asked, check_name, check_target, offered_by
    from ..modelfile.meta import read_gguf

    if args.sources is None:
        return [*DEFAULT_SOURCES, *offered_by(read_gguf(args.model, tensors=False))]
    sources = [s for s in args.sources.split(",") if s]
    for source in sources:
        check_name(source, "--sources")
        check_target(source, Path(args.model), Asked(f"--sources {source}"))
    return sources


@dataclass(frozen=True)
class Setting:
    drafter: str
    k_policy: str
    k: int | None  # the fixed k, an adaptive policy's starting k; None for cost, which picks every step's k

    def label(self) -> str:
        if self == PLAIN_SETTING:
            return "none (plain decoding)"
        return f"{self.drafter} / {self.k_policy}" + (f" k={self.k}" if self.k_policy == "fixed" else "")

    @classmethod
    def of(cls, method: str, k: int) -> Setting:
        """The setting a bench configuration measured: METHOD is DRAFTER or DRAFTER@POLICY, and an
        adaptive configuration's k is its cap, so the profile records the k it started from (none for
        ``cost``: it does not use one)."""
        drafter, policy = split_method(method)
        if not policy:
            return cls(drafter, "fixed", k)
        return cls(drafter, policy, None if policy == "cost" else adaptive_start(k))


# Plain decoding, a candidate of every category at 1.00x: a setting that measured slower never makes the profile
# (`tune` wrote one at 0.98x as "best" on Gemma 3 270M, where plain decoding was the fastest choice).
PLAIN_SETTING = Setting("none", "fixed", None)


def methods(args: argparse.Namespace) -> list[str]:
    """--sources x --policies as bench methods: DRAFTER for fixed k (run at each -k), else DRAFTER@POLICY."""
    policies = [p for p in args.policies.split(",") if p]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise InvalidParameterError(f"unknown k policy {bad[0]!r}; choose from {', '.join(POLICIES)}")
    out = [s if p == "fixed" else f"{s}@{p}" for s in args.sources.split(",") if s for p in policies]
    if not out:
        raise InvalidParameterError("--sources and --policies must each name at least one")
    return out


def sample(workload: Workload, per_category: int, max_tokens: int | None) -> Workload:
    """The first `per_category` requests of each category, with max_tokens overridden if given."""
    if per_category < 1:
        raise InvalidParameterError(f"--prompts must be >= 1 (got {per_category})")
    seen: Counter[str] = Counter()
    picked = []
    for r in workload.requests:
        seen[r.category] += 1
        if seen[r.category] <= per_category:
            picked.append(replace(r, max_tokens=max_tokens or r.max_tokens))
    return Workload(workload.name, workload.path, tuple(picked))


def run(args: argparse.Namespace) -> int:
    check_output_file(args.output)  # before the sweep: a bad -o found after it would lose minutes of measurement
    sources = sources_for(args)
    args.sources = ",".join(methods_with_draft(args, sources, flag_given(args, "--sources"), "tune"))
    wl = sample(load(args.workload), args.prompts, args.max_tokens)
    config = BenchConfig(workload=wl, methods=methods(args), ks=args.k, k_max=args.k_max or DEFAULT_K_MAX,
                         drafter_options=options_from_args(args), cost_curve=False)
    target = target_from_args(args)
    results = run_bench(config, target, label="tune")
    if results["interrupted"]:
        return 130  # a profile from part of the sample would be chosen on too little
    best, overall, text = choose(aggregate(results), wl.categories)
    print(text)
    if overall == PLAIN_SETTING:
        print("tune: plain decoding is best here: no setting measured faster than plain over the sample, so the "
              "profile's default is drafter none")
    header = (f"specstack profile written by `specstack tune --workload {args.workload}`\n"
              f"target {target.path.name}, draft {args.model_draft.name if args.model_draft else 'none'}, "
              f"{target.n_threads} threads\n{text}")
    write_profile(args.output, {c: vars_of(s) for c, s in best.items()}, vars_of(overall), header)
    print(f"wrote {args.output}; use it with `specstack generate --profile {args.output} [--category NAME]`")
    return 0


def choose(rows: list[dict[str, Any]], categories: list[str]) -> tuple[dict[str, Setting], Setting, str]:
    """Best setting per category and over all requests, by the bench's speedup, plain decoding among them at
    1.00x (it wins ties: a drafter must be faster to be chosen); and the table the per-category choice was made
    from (best first, marked *)."""

    def ranked(cat: str) -> list[tuple[Setting, float]]:
        # with one category the report has only its "all" rows
        want = ALL if len(categories) == 1 else cat
        measured = {Setting.of(r["method"], r["k"]): r["speedup"] or 0.0
                    for r in rows if r["category"] == want and r["method"] != PLAIN}
        return sorted([(PLAIN_SETTING, 1.0), *measured.items()], key=lambda kv: -kv[1])  # stable: plain first on ties

    best, body = {}, []
    for cat in categories:
        order = ranked(cat)
        best[cat] = order[0][0]
        body += [[cat, s.label(), f"{x:.2f}x", "*" if i == 0 else ""] for i, (s, x) in enumerate(order)]
    overall = ranked(ALL)[0][0]
    return best, overall, table(["category", "setting", "speedup", ""], body, align="llrl", rule=True)


def vars_of(s: Setting) -> dict:
    """A profile table: a cost setting has no k (``generate`` would only say it is unused)."""
    return {"drafter": s.drafter, "k_policy": s.k_policy} | ({} if s.k is None else {"k": s.k})
