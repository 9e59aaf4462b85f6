"""Numbers from a bench results dict (results.json): which runs count, and per-category statistics.

Everything here is a pure function of the results, so ``specstack bench report
results.json`` re-renders exactly what the run wrote (rendering: report.py, plots: plots.py,
the llama.cpp peers' rows: peer_results.py).

Aggregation: for each request and configuration the run with the median decode
time over repeats is kept (the lower middle one for an even count).  Per
category, tok/s = sum of generated tokens / sum of decode time (prefill
excluded); speedup = tok/s / plain tok/s in the same category and temperature;
acceptance = accepted / drafted tokens; mean accepted length = tokens committed
per verification step, the bonus/recovered token included (1.0 for plain).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from ..errors import SpecstackError

ALL = "all"  # the category row over every request
PLAIN = "none"  # the plain-decoding method: the reference of every speedup

T = TypeVar("T")
Config = tuple[str, int, float]  # (method, k, temperature)


class ResultsError(SpecstackError):
    """A results file is missing or not a specstack bench results file."""


def load_results(path: str | Path) -> dict[str, Any]:
    """A results dict from results.json (or a directory holding one), refused early if it is not one."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "results.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResultsError(f"results file not found: {p} (written by `specstack bench run -o DIR` as DIR/results.json)") from None
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{p} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or "runs" not in data or "config" not in data:
        raise ResultsError(f"{p} is not a specstack bench results file (no 'runs' and 'config')")
    return data


# -- which runs count --------------------------------------------------------------------------


def lower_median(items: Sequence[T], key: Callable[[T], float]) -> T:
    """The median item by ``key``, the lower middle one for an even count: always a real run, never an average."""
    ordered = sorted(items, key=key)
    return ordered[(len(ordered) - 1) // 2]


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median decode time (the lower middle one for an even count)."""
    return lower_median(runs, key=lambda r: r["stats"]["decode_s"])


def _config_key(r: dict[str, Any]) -> Config:
    return (r["method"], int(r["k"]), float(r["temperature"]))


def representative_runs(results: dict[str, Any]) -> dict[tuple[str, int, float, str], dict[str, Any]]:
    """(method, k, temperature, request) -> its median run."""
    groups: dict[tuple[str, int, float, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results["runs"]:
        groups[(*_config_key(r), r["request"])].append(r)
    return {key: median_run(runs) for key, runs in groups.items()}


def categories(results: dict[str, Any]) -> list[str]:
    """'all' plus each category in workload order; just 'all' when there is one (its row would repeat 'all')."""
    cats = list(dict.fromkeys(q["category"] for q in results["workload"]["requests"]))
    return [ALL] + cats if len(cats) > 1 else [ALL]


def tokens_per_second(run: dict[str, Any]) -> float:
    """Decode tok/s of one run (prefill excluded); 0 for a run with no decode time."""
    s = run["stats"]
    return s["n_tokens"] / s["decode_s"] if s["decode_s"] > 0 else 0.0


# -- the summary rows ----------------------------------------------------------------------------


def aggregate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method x k x temperature x category (plus category 'all'), in run order."""
    reps = representative_runs(results)
    compared = _identical_counts(results["runs"])
    cells: dict[tuple[str, int, float, str], list[dict[str, Any]]] = defaultdict(list)
    for (method, k, temp, _req), run in reps.items():  # dicts keep run order: the configs' order
        cells[(method, k, temp, run["category"])].append(run)
        cells[(method, k, temp, ALL)].append(run)
    order = list(dict.fromkeys((m, k, t) for m, k, t, _req in reps))
    rows = [_row(*config, cat, cells[(*config, cat)], compared.get((*config, cat)))
            for config in order for cat in categories(results) if cells.get((*config, cat))]
    _add_speedups(rows, reps)
    return rows


def _identical_counts(runs: list[dict[str, Any]]) -> dict[tuple[str, int, float, str], list[int]]:
    """(method, k, temperature, category) -> [identical, compared] over every run (all repeats, not medians)."""
    compared: dict[tuple[str, int, float, str], list[int]] = defaultdict(lambda: [0, 0])
    for r in runs:
        if r.get("identical") is not None:
            for cat in (r["category"], ALL):
                c = compared[(*_config_key(r), cat)]
                c[0] += bool(r["identical"])
                c[1] += 1
    return compared


def _add_speedups(rows: list[dict[str, Any]], reps: dict[tuple[str, int, float, str], dict[str, Any]]) -> None:
    """Fill speedup (pooled tok/s over plain's) and median speedup (median of per-request ratios).

    Both: the pooled one weighs long requests more; the median one shrugs off one run slowed by
    another process, which on a shared machine moves the pooled one a lot.
    """
    base = {(r["temperature"], r["category"]): r["tokens_per_second"] for r in rows if r["method"] == PLAIN}
    plain_tps = {(temp, req): tokens_per_second(run) for (m, _k, temp, req), run in reps.items() if m == PLAIN}
    for r in rows:
        b = base.get((r["temperature"], r["category"]))
        r["speedup"] = round(r["tokens_per_second"] / b, 4) if b else None
        ratios = [tokens_per_second(run) / plain_tps[(t, req)] for (m, k, t, req), run in reps.items()
                  if (m, k, t) == (r["method"], r["k"], r["temperature"]) and r["category"] in (ALL, run["category"])
                  and plain_tps.get((t, req))]
        r["median_speedup"] = round(statistics.median(ratios), 4) if ratios else None


def paired_speedups(results: dict[str, Any]) -> dict[Config, dict[str, tuple[float, int, int]]]:
    """(method, k, temperature) -> request -> (the median over repeats of its tok/s over plain decoding's in the
    same repeat, accepted and drafted tokens over all repeats).

    The runner runs every method of a request back to back (interleaved per request), so one repeat's ratio
    compares runs made in the same machine state.  On this project's 2-core EPYC, whose speed swung within a
    minute (plain decoding of one prompt: 356-795 tok/s in 12 runs in a row), the ratio of the independent
    median runs of one request swung from 1.23x to 0.71x between two runs of the same command; a per-request
    floor ("never below 0.97x plain") can only be read from paired ratios, over several repeats.
    """
    plain = {(float(r["temperature"]), r["request"], r.get("repeat", 0)): tokens_per_second(r)
             for r in results["runs"] if r["method"] == PLAIN}
    cells: dict[Config, dict[str, tuple[list[float], list[int]]]] = defaultdict(dict)
    for r in results["runs"]:
        base = plain.get((float(r["temperature"]), r["request"], r.get("repeat", 0)))
        if r["method"] == PLAIN or not base:
            continue
        ratios, counts = cells[_config_key(r)].setdefault(r["request"], ([], [0, 0]))
        ratios.append(tokens_per_second(r) / base)
        counts[0] += r["stats"]["n_accepted"]
        counts[1] += r["stats"]["n_drafted"]
    return {config: {req: (statistics.median(ratios), *counts) for req, (ratios, counts) in reqs.items()}
            for config, reqs in cells.items()}


def _row(method: str, k: int, temp: float, cat: str, runs: list[dict[str, Any]],
         compared: list[int] | None) -> dict[str, Any]:
    """One summary row: sums over the kept runs, then the ratios (speedups are added by the caller)."""
    s = [r["stats"] for r in runs]
    tokens = sum(x["n_tokens"] for x in s)
    decode = sum(x["decode_s"] for x in s)
    draft = sum(x["time_s"]["draft"] for x in s)
    verify = sum(x["time_s"]["verify"] for x in s)
    other = max(decode - draft - verify, 0.0)
    drafted = sum(x["n_drafted"] for x in s)
    accepted = sum(x["n_accepted"] for x in s)
    steps = sum(x["n_steps"] for x in s)
    committed = sum(x.get("n_committed", x["n_accepted"] + x["n_steps"]) for x in s)

    def share(t: float) -> float:
        return round(t / decode, 4) if decode > 0 else 0.0

    return {
        "method": method, "k": k, "temperature": temp, "category": cat, "requests": len(runs),
        "tokens": tokens, "decode_s": round(decode, 6),
        "tokens_per_second": round(tokens / decode, 3) if decode > 0 else 0.0, "speedup": None,
        "median_speedup": None,
        "n_drafted": drafted, "n_accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "n_steps": steps, "mean_accepted_length": round(committed / steps, 4) if steps else None,
        "draft_s": round(draft, 6), "verify_s": round(verify, 6), "other_s": round(other, 6),
        "draft_share": share(draft), "verify_share": share(verify), "other_share": share(other),
        "identical": compared[0] if compared else None, "compared": compared[1] if compared else None,
    }


# -- per position, per sequence, per workload ------------------------------------------------------


def acceptance_by_position(results: dict[str, Any]) -> dict[Config, list[float]]:
    """(method, k, temperature) -> acceptance at draft positions 1..k over all requests (median runs).

    Position i's rate = steps whose draft's first i tokens were all accepted / steps that drafted
    at least i tokens (the metrics' convention).
    """
    acc: dict[Config, list[list[int]]] = {}
    for (method, k, temp, _req), run in representative_runs(results).items():
        if method == PLAIN:
            continue
        s = run["stats"]
        drafted = s.get("drafted_by_position", [])
        accepted = s.get("accepted_by_position") or [round(a * d) for a, d in zip(s["acceptance_by_position"], drafted)]
        d_tot, a_tot = acc.setdefault((method, k, temp), [[0] * k, [0] * k])
        for i, (d, a) in enumerate(zip(drafted, accepted)):
            if i < k:
                d_tot[i] += d
                a_tot[i] += a
    return {key: [a / d if d else 0.0 for a, d in zip(at, dt)] for key, (dt, at) in acc.items()}


def sequence_curves(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per group of requests (a sequence run in order on one drafter): each request's speedup, in order.

    This is where cross-request learning shows (the suffix drafter's global
    tree): one row per (method, k, temperature), with the speedup and
    acceptance of request 1, 2, ... of the group, plus the mean of the last
    quarter of the sequence.
    """
    reps = representative_runs(results)
    order: dict[str, list[str]] = defaultdict(list)
    for q in results["workload"]["requests"]:
        if q.get("group"):
            order[q["group"]].append(q["id"])
    configs = list(dict.fromkeys((m, k, t) for (m, k, t, _r) in reps if m != PLAIN))
    curves = []
    for group, ids in order.items():
        if len(ids) < 2:
            continue
        for config in configs:
            curve = _sequence_curve(reps, group, ids, config)
            if curve is not None:
                curves.append(curve)
    return curves


def _sequence_curve(reps: dict[tuple[str, int, float, str], dict[str, Any]], group: str, ids: list[str],
                    config: Config) -> dict[str, Any] | None:
    """One configuration's curve over a group; None unless every request has it and a plain run to compare."""
    m, k, t = config
    speedups: list[float] = []
    acceptance: list[float | None] = []
    for rid in ids:
        run, plain = reps.get((m, k, t, rid)), reps.get((PLAIN, 0, t, rid))
        if run is None or plain is None or tokens_per_second(plain) <= 0:
            return None
        speedups.append(round(tokens_per_second(run) / tokens_per_second(plain), 3))
        st = run["stats"]
        acceptance.append(round(st["n_accepted"] / st["n_drafted"], 3) if st["n_drafted"] else None)
    tail = speedups[-max(1, len(ids) // 4):]
    return {"group": group, "method": m, "k": k, "temperature": t, "speedups": speedups,
            "acceptance": acceptance, "last_quarter": round(statistics.mean(tail), 3)}


def by_group(curves: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Sequence curves bundled per group, in first-seen order: one table or plot each."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in curves:
        groups.setdefault(c["group"], []).append(c)
    return list(groups.values())


def repeated_line_share(prompt: str, text: str) -> float | None:
    """Share of the output's non-blank lines that already appeared (stripped) earlier in prompt or output.

    Small models fall into loops, which flatter lookup drafters; this says how much of a workload's
    plain output is such repetition.
    """
    seen = {ln.strip() for ln in prompt.splitlines() if ln.strip()}
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    repeated = 0
    for ln in lines:
        repeated += ln in seen
        seen.add(ln)
    return repeated / len(lines)


def workload_summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per category: requests, mean prompt and plain output tokens, repeated-line share (temperature 0 if run)."""
    reqs = {q["id"]: q for q in results["workload"]["requests"]}
    temps = sorted({float(r["temperature"]) for r in results["runs"]})
    first_temp = temps[0] if temps else 0.0
    plain = [run for (m, _k, t, _q), run in representative_runs(results).items() if m == PLAIN and t == first_temp]
    rows = []
    for cat in categories(results):
        qs = [q for q in reqs.values() if cat in (ALL, q["category"])]
        outs = [r for r in plain if cat in (ALL, r["category"])]
        shares = [s for s in (repeated_line_share(reqs[r["request"]]["prompt"], r.get("text", "")) for r in outs)
                  if s is not None]
        rows.append({
            "category": cat,
            "requests": len(qs),
            "groups": len({q["group"] for q in qs if q.get("group")}),
            "prompt_tokens": sum(len(q["prompt_ids"]) for q in qs) / len(qs) if qs else 0.0,
            "output_tokens": sum(r["stats"]["n_tokens"] for r in outs) / len(outs) if outs else None,
            "repeated_lines": sum(shares) / len(shares) if shares else None,
        })
    return rows
