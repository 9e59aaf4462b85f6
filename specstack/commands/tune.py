"""``specstack tune``: sweep draft sources, k policies and k on a workload sample; write a profile.

Plain decoding runs interleaved with every configuration on each prompt, so
the speedups compare runs made moments apart on the same machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..draft_length import POLICIES
from ..engine import Engine, GenerationConfig
from ..errors import InvalidParameterError
from ..profile import write_profile
from .common import add_model_args, build_drafter, build_policy, load_target


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="find the best drafter / k policy / k per content type and write a profile",
        description="Sweep --sources x --policies (x --k for the fixed policy) on a workload sample, "
        "measure tok/s against plain decoding run interleaved, and write the best setting per category as a TOML profile "
        "for `specstack generate --profile`.",
    )
    p.add_argument("--workload", default="code-complete", help="bundled workload name or JSONL file (default code-complete)")
    p.add_argument("--prompts", type=int, default=4, help="requests per category to use (default 4)")
    p.add_argument("--sources", default="prompt-lookup,draft-model", help="comma-separated drafters to try")
    p.add_argument("--policies", default="cost,fixed", help=f"comma-separated k policies ({', '.join(POLICIES)})")
    p.add_argument("--k", default="2,4,8", help="k values for the fixed policy (and initial k for the others)")
    p.add_argument("-n", "--max-tokens", type=int, default=None, help="override each request's max_tokens")
    p.add_argument("-o", "--output", type=Path, default=Path("specstack-profile.toml"), help="profile to write")
    add_model_args(p)
    p.add_argument("--k-max", type=int, default=None, help="upper bound on k for adaptive policies")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Setting:
    drafter: str
    k_policy: str
    k: int

    def label(self) -> str:
        return f"{self.drafter} / {self.k_policy}" + (f" k={self.k}" if self.k_policy == "fixed" else "")


def settings(args: argparse.Namespace) -> list[Setting]:
    sources = [s for s in args.sources.split(",") if s]
    policies = [p for p in args.policies.split(",") if p]
    try:
        ks = [int(k) for k in args.k.split(",") if k]
    except ValueError:
        raise InvalidParameterError(f"--k must be comma-separated integers (got {args.k!r})") from None
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise InvalidParameterError(f"unknown k policy {bad[0]!r}; choose from {', '.join(POLICIES)}")
    out = []
    for s in sources:
        for p in policies:
            out += [Setting(s, p, k) for k in (ks if p == "fixed" else ks[:1])]
    return out


def run(args: argparse.Namespace) -> int:
    from ..bench.workloads import load

    workload = load(args.workload)
    target = load_target(args)
    grid = settings(args)
    plain = Engine(target, build_drafter("none", target, args))
    engines = {}
    for s in grid:
        ns = argparse.Namespace(**{**vars(args), "k_policy": s.k_policy, "k": s.k})
        engines[s] = Engine(target, build_drafter(s.drafter, target, ns), build_policy(ns, target))
    by_cat: dict[str, list] = {}
    for r in workload.requests:
        if len(by_cat.setdefault(r.category, [])) < args.prompts:
            by_cat[r.category].append(r)
    total = sum(len(v) for v in by_cat.values())
    warm = GenerationConfig(max_tokens=8)
    for engine in [plain, *engines.values()]:  # first-call costs (allocations, graph builds) off the clock
        engine.generate(workload.requests[0].prompt, warm).run()
    tps: dict[tuple[str, Setting | None], list[float]] = {}
    done, t0 = 0, time.perf_counter()
    for cat, reqs in by_cat.items():
        for r in reqs:
            config = GenerationConfig(max_tokens=args.max_tokens or r.max_tokens)
            runs = [(None, plain)] + list(engines.items())
            for s, engine in runs:
                gen = engine.generate(r.prompt, config).run()
                tps.setdefault((cat, s), []).append(gen.stats.n_tokens / max(gen.stats.decode_s, 1e-9))
            done += 1
            eta = (time.perf_counter() - t0) / done * (total - done)
            print(f"\rtune: {done}/{total} prompts, ETA {eta:.0f}s ", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    best, table = choose(by_cat, grid, tps)
    print(table)
    overall = max(grid, key=lambda s: sum(_speedup(tps, c, s) for c in by_cat))
    header = (f"specstack profile written by `specstack tune --workload {args.workload}`\n"
              f"target {target.path.name}, draft {args.model_draft.name}, {target.n_threads} threads\n{table}")
    write_profile(args.output, {c: vars_of(s) for c, s in best.items()}, vars_of(overall), header)
    print(f"wrote {args.output}; use it with `specstack generate --profile {args.output} [--category NAME]`")
    return 0


def _speedup(tps, cat: str, s: Setting) -> float:
    import statistics

    return statistics.mean(a / b for a, b in zip(tps[(cat, s)], tps[(cat, None)]))


def choose(by_cat, grid, tps) -> tuple[dict[str, Setting], str]:
    """Best setting per category by mean per-prompt speedup, and the table it was chosen from."""
    lines = [f"{'category':<16}{'setting':<40}{'speedup':>9}", "-" * 65]
    best = {}
    for cat in by_cat:
        ranked = sorted(grid, key=lambda s: -_speedup(tps, cat, s))
        best[cat] = ranked[0]
        for s in ranked:
            mark = " *" if s == ranked[0] else ""
            lines.append(f"{cat:<16}{s.label():<40}{_speedup(tps, cat, s):>8.2f}x{mark}")
    return best, "\n".join(lines)


def vars_of(s: Setting) -> dict:
    return {"drafter": s.drafter, "k_policy": s.k_policy, "k": s.k}
