"""Tables from a bench results dict (results.json): aggregation, Markdown and CSV (plots: plots.py).

Everything here is a pure function of the results, so ``specstack bench report
results.json`` re-renders exactly what the run wrote.

Aggregation: for each request and configuration the run with the median decode
time over repeats is kept (the lower middle one for an even count).  Per
category, tok/s = sum of generated tokens / sum of decode time (prefill
excluded); speedup = tok/s / plain tok/s in the same category and temperature;
acceptance = accepted / drafted tokens; mean accepted length = tokens committed
per verification step, the bonus/recovered token included (1.0 for plain).
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..errors import SpecstackError
from ..ui import markdown_table
from .costcurve import cost_at

ALL = "all"
PLAIN = "none"
CSV_FIELDS = (
    "method", "k", "temperature", "category", "requests", "tokens", "decode_s", "tokens_per_second",
    "speedup", "median_speedup", "n_drafted", "n_accepted", "acceptance_rate", "n_steps", "mean_accepted_length",
    "draft_s", "verify_s", "other_s", "draft_share", "verify_share", "other_share", "identical", "compared",
)


class ResultsError(SpecstackError):
    """A results file is missing or not a specstack bench results file."""


def load_results(path: str | Path) -> dict[str, Any]:
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


# -- aggregation -----------------------------------------------------------------------------


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median decode time (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r["stats"]["decode_s"])
    return ordered[(len(ordered) - 1) // 2]


def _config_key(r: dict[str, Any]) -> tuple[str, int, float]:
    return (r["method"], int(r["k"]), float(r["temperature"]))


def representative_runs(results: dict[str, Any]) -> dict[tuple[str, int, float, str], dict[str, Any]]:
    """(method, k, temperature, request) -> its median run."""
    groups: dict[tuple[str, int, float, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results["runs"]:
        groups[(*_config_key(r), r["request"])].append(r)
    return {key: median_run(runs) for key, runs in groups.items()}


def aggregate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method x k x temperature x category (plus category 'all'), in run order."""
    reps = representative_runs(results)
    compared: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])  # key -> [identical, compared]
    for r in results["runs"]:
        if r.get("identical") is not None:
            for cat in (r["category"], ALL):
                c = compared[(*_config_key(r), cat)]
                c[0] += bool(r["identical"])
                c[1] += 1
    cells: dict[tuple[str, int, float, str], list[dict[str, Any]]] = defaultdict(list)
    order: list[tuple[str, int, float]] = []
    for (method, k, temp, _req), run in reps.items():
        if (method, k, temp) not in order:
            order.append((method, k, temp))
        cells[(method, k, temp, run["category"])].append(run)
        cells[(method, k, temp, ALL)].append(run)
    categories = _categories(results)
    rows = []
    for method, k, temp in order:
        for cat in categories:
            runs = cells.get((method, k, temp, cat))
            if runs:
                rows.append(_row(method, k, temp, cat, runs, compared.get((method, k, temp, cat))))
    base = {(r["temperature"], r["category"]): r["tokens_per_second"] for r in rows if r["method"] == PLAIN}
    plain_tps = {(temp, req): _tps(run) for (m, _k, temp, req), run in reps.items() if m == PLAIN}
    for r in rows:
        b = base.get((r["temperature"], r["category"]))
        r["speedup"] = round(r["tokens_per_second"] / b, 4) if b else None
        ratios = [_tps(run) / plain_tps[(t, req)] for (m, k, t, req), run in reps.items()
                  if (m, k, t) == (r["method"], r["k"], r["temperature"]) and r["category"] in (ALL, run["category"])
                  and plain_tps.get((t, req))]
        r["median_speedup"] = round(statistics.median(ratios), 4) if ratios else None
    return rows


def _tps(run: dict[str, Any]) -> float:
    s = run["stats"]
    return s["n_tokens"] / s["decode_s"] if s["decode_s"] > 0 else 0.0


def _categories(results: dict[str, Any]) -> list[str]:
    cats = list(dict.fromkeys(q["category"] for q in results["workload"]["requests"]))
    return [ALL] + cats if len(cats) > 1 else [ALL]


def _row(method: str, k: int, temp: float, cat: str, runs: list[dict[str, Any]], compared) -> dict[str, Any]:
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
    share = lambda t: round(t / decode, 4) if decode > 0 else 0.0  # noqa: E731
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


def acceptance_by_position(results: dict[str, Any]) -> dict[tuple[str, int, float], list[float]]:
    """(method, k, temperature) -> acceptance at draft positions 1..k over all requests (median runs).

    Position i's rate = steps whose draft's first i tokens were all accepted / steps that drafted
    at least i tokens (the metrics' convention).
    """
    acc: dict[tuple[str, int, float], list[list[int]]] = {}
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
    curves = []
    configs = list(dict.fromkeys((m, k, t) for (m, k, t, _r) in reps if m != PLAIN))
    for group, ids in order.items():
        if len(ids) < 2:
            continue
        for m, k, t in configs:
            speedups, acceptance = [], []
            for rid in ids:
                run, plain = reps.get((m, k, t, rid)), reps.get((PLAIN, 0, t, rid))
                if run is None or plain is None or _tps(plain) <= 0:
                    break
                speedups.append(round(_tps(run) / _tps(plain), 3))
                st = run["stats"]
                acceptance.append(round(st["n_accepted"] / st["n_drafted"], 3) if st["n_drafted"] else None)
            if len(speedups) == len(ids):
                tail = speedups[-max(1, len(ids) // 4):]
                curves.append({"group": group, "method": m, "k": k, "temperature": t, "speedups": speedups,
                               "acceptance": acceptance, "last_quarter": round(statistics.mean(tail), 3)})
    return curves


def by_group(curves: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
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
    plain = [run for (m, _k, t, _q), run in representative_runs(results).items() if m == PLAIN and t == (temps[0] if temps else 0.0)]
    rows = []
    for cat in _categories(results):
        qs = [q for q in reqs.values() if cat in (ALL, q["category"])]
        outs = [r for r in plain if cat in (ALL, r["category"])]
        shares = [s for s in (repeated_line_share(reqs[r["request"]]["prompt"], r.get("text", "")) for r in outs) if s is not None]
        rows.append({
            "category": cat,
            "requests": len(qs),
            "groups": len({q["group"] for q in qs if q.get("group")}),
            "prompt_tokens": sum(len(q["prompt_ids"]) for q in qs) / len(qs) if qs else 0.0,
            "output_tokens": sum(r["stats"]["n_tokens"] for r in outs) / len(outs) if outs else None,
            "repeated_lines": sum(shares) / len(shares) if shares else None,
        })
    return rows


# -- Markdown --------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _best_speedups(rows: list[dict[str, Any]]) -> set[int]:
    """ids of the rows with the best speedup per (temperature, category), for bold."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        if r["method"] == PLAIN or r["speedup"] is None:
            continue
        key = (r["temperature"], r["category"])
        if key not in best or r["speedup"] > best[key]["speedup"]:
            best[key] = r
    return {id(r) for r in best.values()}


def _summary_rows(rows: list[dict[str, Any]], with_category: bool) -> list[list[str]]:
    bold = _best_speedups(rows)
    out = []
    for r in rows:
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        if id(r) in bold:
            speed = f"**{speed}**"
        ident = "-" if r["compared"] is None else f"{r['identical']}/{r['compared']}"
        if r["compared"] and r["identical"] != r["compared"]:
            ident = f"**{ident} MISMATCH**"
        cells = [r["method"], "-" if r["method"] == PLAIN else str(r["k"]), f"{r['temperature']:g}"]
        if with_category:
            cells.append(r["category"])
        med = "-" if r["median_speedup"] is None else f"{r['median_speedup']:.2f}x"
        cells += [
            _num(r["tokens_per_second"]), speed, med, _pct(r["acceptance_rate"]), _num(r["mean_accepted_length"], ".2f"),
            _pct(r["draft_share"]), _pct(r["verify_share"]), _pct(r["other_share"]), ident,
        ]
        out.append(cells)
    return out


def render_markdown(results: dict[str, Any]) -> str:
    cfg, mach = results["config"], results.get("machine", {})
    rows = aggregate(results)
    n_req = len(results["workload"]["requests"])
    cats = _categories(results)
    parts = [f"# specstack bench: {results['workload']['name']}", ""]
    draft = (cfg.get("draft") or {}).get("name", "-")
    temps = ", ".join(f"{t:g}" for t in cfg.get("temperatures", []))
    parts.append(
        f"Target `{cfg['target']['name']}`, draft `{draft}`, {cfg['target']['threads']} threads, "
        f"context {cfg['target']['n_ctx']}; workload `{results['workload']['name']}` ({n_req} requests); "
        f"k = {', '.join(map(str, cfg['ks']))}; temperature {temps}; {cfg['repeat']} repeat(s), median run kept; "
        f"seed {cfg['seed']}. {results.get('created', '')}."
    )
    load0, load1 = mach.get("load_average"), mach.get("load_average_end")
    parts.append("")
    parts.append(
        f"Machine: {mach.get('cpu_model') or 'unknown CPU'}, {mach.get('physical_cores')} physical cores "
        f"({mach.get('logical_cpus')} logical), llama-cpp-python {mach.get('llama_cpp_python')}"
        + (f"; load average {load0[0]:.2f} at start, {load1[0]:.2f} at end" if load0 and load1 else "")
        + ". Methods ran interleaved per request, so only ratios from one run are comparable."
    )
    if cfg["target"].get("lossy"):
        parts += ["", f"**LOSSY: the target ran with {cfg['target']['experts_used']} active expert(s) (`--experts`), "
                      "not its own setting: every output here is the reduced model's, not the model's.**"]
    if results.get("interrupted"):
        parts += ["", "**Interrupted: partial results.**"]
    parts += ["", "## Summary (all requests)", ""]
    head = ["method", "k", "temp", "tok/s", "speedup", "median speedup", "acceptance", "mean accepted length",
            "draft", "verify", "other", "identical"]
    parts.append(markdown_table(head, _summary_rows([r for r in rows if r["category"] == ALL], False)))
    parts.append("")
    parts.append("tok/s: generated tokens / decode time (prefill excluded); speedup: tok/s over plain tok/s; median "
                 "speedup: median over requests of each request's speedup (robust to one slow run on a noisy machine). "
                 "draft / verify / other: shares of decode time. identical: speculative outputs equal to plain decoding, token for token (temperature 0 only).")
    if len(cats) > 1:
        parts += ["", "## By category", ""]
        by_cat = [r for r in rows if r["category"] != ALL]
        parts.append(markdown_table(head[:3] + ["category"] + head[3:], _summary_rows(by_cat, True)))
    pos = acceptance_by_position(results)
    for group_curves in by_group(sequence_curves(results)):
        group, n = group_curves[0]["group"], len(group_curves[0]["speedups"])
        parts += ["", f"## Sequence: group `{group}` ({n} requests in order, one drafter)", ""]
        parts.append(markdown_table(["method", "k", "temp"] + [str(i + 1) for i in range(n)] + ["last quarter"],
                            [[c["method"], str(c["k"]), f"{c['temperature']:g}"] + [f"{x:.2f}x" for x in c["speedups"]]
                             + [f"**{c['last_quarter']:.2f}x**"] for c in group_curves]))
        parts.append("")
        parts.append("Each request's speedup over plain decoding, in the order the group ran. Drafters that learn across "
                     "requests (the suffix drafter's global tree) should rise along the row.")
    if pos:
        n = max(len(v) for v in pos.values())
        parts += ["", "## Acceptance by draft position", ""]
        parts.append(markdown_table(["method", "k", "temp"] + [str(i + 1) for i in range(n)],
                            [[m, str(k), f"{t:g}"] + [_pct(v[i]) if i < len(v) else "" for i in range(n)]
                             for (m, k, t), v in pos.items()]))
        parts.append("")
        parts.append("Position i: steps whose first i draft tokens were all accepted / steps that drafted at least i.")
    curve = results.get("cost_curve")
    if curve:
        parts += ["", f"## Verification cost t(n) at context depth {curve['depth']}", ""]
        t1 = cost_at(curve, 1)
        ns = sorted({n for n in curve["n"] if n <= 8 or n in (12, 16, 17, 24, 32)} |
                    {k + 1 for k in cfg["ks"] if k + 1 in curve["n"]})
        mins = dict(zip(curve["n"], curve["min_s"]))
        parts.append(markdown_table(["n", "t(n) ms", "t(n) / t(1)", "ms per token", "fastest rep ms"],
                            [[str(n), f"{1000 * cost_at(curve, n):.2f}", f"{cost_at(curve, n) / t1:.2f}",
                              f"{1000 * cost_at(curve, n) / n:.2f}", f"{1000 * mins[n]:.2f}"] for n in ns]))
        parts.append("")
        parts.append(f"Median of {curve['reps']} reps, {curve['threads']} threads, one batch of n tokens with logits "
                     "for every row. t(1) is a true one-token batch; specstack pads one-token steps to two "
                     "(batch-invariant logits), so a plain step costs t(2).")
    parts += ["", "## Workload", ""]
    parts.append(markdown_table(["category", "requests", "groups", "prompt tokens (mean)", "plain output tokens (mean)",
                         "repeated lines in plain output"],
                        [[w["category"], str(w["requests"]), str(w["groups"]), f"{w['prompt_tokens']:.0f}",
                          _num(w["output_tokens"], ".0f"), _pct(w["repeated_lines"])] for w in workload_summary(results)]))
    parts.append("")
    parts.append("Repeated lines: non-blank output lines already seen in the prompt or earlier output. Small models "
                 "loop, and loops flatter lookup drafters.")
    peers = peer_rows(results)
    if peers:
        parts += ["", "## llama.cpp peers (same models, prompts, threads and k)", ""]
        x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        parts.append(markdown_table(["peer", "k", "temp", "tok/s", "speedup vs llama-plain", "vs specstack plain", "acceptance",
                             "text agrees with specstack plain", "runs", "errors"],
                            [[p["method"], "-" if not p["k"] else str(p["k"]), f"{p['temperature']:g}",
                              _num(p["tokens_per_second"]), x(p["speedup"]), x(p["vs_specstack_plain"]),
                              _pct(p["acceptance_rate"]), "-" if p["same_text"] is None else "%d/%d" % p["same_text"],
                              str(p["runs"]), str(p["errors"])] for p in peers]))
        parts.append("")
        parts.append("tok/s as each binary reports it (decode only; llama-plain: llama.cpp's eval rate). The peers run "
                     "greedy only, right after specstack's runs of each request. Text can differ where llama.cpp "
                     "evaluates one-token batches (see README: exactness); agreement is checked up to the shorter text, since the "
                     "speculative binaries overshoot n_predict by up to k tokens.")
    parts += ["", "## Exactness", ""]
    mism = results.get("mismatches", [])
    n_cmp = sum(1 for r in results["runs"] if r.get("identical") is not None)
    if mism:
        parts.append(f"**{len(mism)} of {n_cmp} speculative outputs at temperature 0 differ from plain decoding: a bug.**")
        parts.append("")
        parts += [f"- {m['message']}" for m in mism]
    elif n_cmp:
        parts.append(f"All {n_cmp} speculative outputs at temperature 0 are identical to plain decoding.")
    else:
        parts.append("No temperature-0 speculative runs to compare.")
    return "\n".join(parts) + "\n"


def peer_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per peer method x k x temperature, over the median run of each request.

    tok/s = sum of tokens / sum of (tokens / the binary's own tok/s), i.e. total decode time.
    """
    groups: dict[tuple, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for p in results.get("peers") or []:
        groups[(p["method"], int(p.get("k") or 0), float(p["temperature"]))][p["request"]].append(p)
    plain = {r["temperature"]: r["tokens_per_second"] for r in aggregate(results)
             if r["method"] == PLAIN and r["category"] == ALL}
    rows = []
    for (method, k, temp), by_req in groups.items():
        ps = [p for runs in by_req.values() for p in runs]
        ok_runs = {q: [p for p in runs if not p.get("error") and p.get("tokens_per_second")] for q, runs in by_req.items()}
        ok = [sorted(runs, key=lambda p: p["tokens_per_second"])[(len(runs) - 1) // 2]  # median run per request
              for runs in ok_runs.values() if runs]
        tps = None
        if ok:
            toks = [p.get("n_tokens") or 1 for p in ok]
            tps = sum(toks) / sum(t / p["tokens_per_second"] for t, p in zip(toks, ok))
        drafted = sum(p.get("n_drafted") or 0 for p in ok)
        accepted = sum(p.get("n_accepted") or 0 for p in ok)
        same = [p["same_text_as_plain"] for p in ok if p.get("same_text_as_plain") is not None]
        rows.append({"method": method, "k": k, "temperature": temp, "tokens_per_second": tps,
                     "acceptance_rate": accepted / drafted if drafted else None, "runs": len(ps),
                     "errors": sum(1 for p in ps if p.get("error")), "speedup": None,
                     "vs_specstack_plain": tps / plain[temp] if tps and plain.get(temp) else None,
                     "same_text": (sum(same), len(same)) if same else None})
    base = {r["temperature"]: r["tokens_per_second"] for r in rows if r["method"] == "llama-plain" and r["tokens_per_second"]}
    for r in rows:
        if r["tokens_per_second"] and base.get(r["temperature"]):
            r["speedup"] = r["tokens_per_second"] / base[r["temperature"]]
    return rows


# -- CSV and plots ---------------------------------------------------------------------------


def render_csv(results: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for r in aggregate(results):
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
    return buf.getvalue()


def write_outputs(results: dict[str, Any], outdir: str | Path, *, write_json: bool = True,
                  plots: bool = True) -> list[Path]:
    """results.json (optionally), results.csv, results.md, then the plots; returns the paths written."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if write_json:
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        written.append(out / "results.json")
    (out / "results.csv").write_text(render_csv(results), encoding="utf-8")
    (out / "results.md").write_text(render_markdown(results), encoding="utf-8")
    written += [out / "results.csv", out / "results.md"]
    if plots:
        from .plots import plot

        written += plot(results, out)
    return written
