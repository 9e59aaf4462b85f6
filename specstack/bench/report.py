"""Rendering a bench results dict (results.json): Markdown, CSV and the files of a run (plots: plots.py).

The numbers come from results.py (which runs count, per-category statistics);
this module only formats them, so ``specstack bench report results.json``
re-renders exactly what the run wrote.  The aggregation names are re-exported
here because the commands (demo, tune, bench report) read them as ``report.*``.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from ..errors import SpecstackError
from ..ui import markdown_table
from ..calibration.curve import cost_at
from .peer_results import peer_rows
from .results import (
    ALL,
    PLAIN,
    acceptance_by_position,
    aggregate,
    by_group,
    categories,
    paired_speedups,
    sequence_curves,
    workload_summary,
)

__all__ = ["CSV_FIELDS", "num", "pct", "render_csv", "render_markdown", "write_outputs"]

CSV_FIELDS = (
    "method", "k", "temperature", "category", "requests", "tokens", "decode_s", "tokens_per_second",
    "speedup", "median_speedup", "n_drafted", "n_accepted", "acceptance_rate", "n_steps", "mean_accepted_length",
    "draft_s", "verify_s", "other_s", "draft_share", "verify_share", "other_share", "identical", "compared",
)
SUMMARY_HEAD = ["method", "k", "temp", "tok/s", "speedup", "median speedup", "acceptance", "mean accepted length",
                "draft", "verify", "other", "identical"]
COST_CURVE_NS = (12, 16, 17, 24, 32)  # listed beyond n <= 8 (17: k = 16 plus the bonus token)


def pct(x: float | None) -> str:
    """A share as a whole percentage; '-' where there is nothing to divide (no draft, no run)."""
    return "-" if x is None else f"{100 * x:.0f}%"


def num(x: float | None, fmt: str = ".1f") -> str:
    """A number in ``fmt``; '-' for a missing one."""
    return "-" if x is None else format(x, fmt)


def _speedup(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


# -- Markdown ------------------------------------------------------------------------------------


def render_markdown(results: dict[str, Any]) -> str:
    """results.md: run description, summary and category tables, sequences, positions, cost curve,
    workload, peers, exactness; each section is left out when the run has nothing for it."""
    sections = (_header, _summary, _by_category, _per_request, _sequences, _positions, _cost_curve, _workload, _peers,
                _exactness)
    parts: list[str] = []
    for section in sections:
        parts += section(results)
    return "\n".join(parts) + "\n"


def _header(results: dict[str, Any]) -> list[str]:
    """Title, what ran (models, workload, k, temperatures), the machine, and the loud flags (lossy, interrupted)."""
    cfg, mach = results["config"], results.get("machine", {})
    n_req = len(results["workload"]["requests"])
    draft = (cfg.get("draft") or {}).get("name", "-")
    temps = ", ".join(f"{t:g}" for t in cfg.get("temperatures", []))
    load0, load1 = mach.get("load_average"), mach.get("load_average_end")
    parts = [
        f"# specstack bench: {results['workload']['name']}",
        "",
        f"Target `{cfg['target']['name']}`, draft `{draft}`, {cfg['target']['threads']} threads, "
        f"context {cfg['target']['n_ctx']}; workload `{results['workload']['name']}` ({n_req} requests); "
        f"k = {', '.join(map(str, cfg['ks']))}; temperature {temps}; {cfg['repeat']} repeat(s), median run kept; "
        f"seed {cfg['seed']}. {results.get('created', '')}.",
        "",
        f"Machine: {mach.get('cpu_model') or 'unknown CPU'}, {mach.get('physical_cores')} physical cores "
        f"({mach.get('logical_cpus')} logical), llama-cpp-python {mach.get('llama_cpp_python')}"
        + (f"; load average {load0[0]:.2f} at start, {load1[0]:.2f} at end" if load0 and load1 else "")
        + ". Methods ran interleaved per request, so only ratios from one run are comparable.",
    ]
    if mach.get("kernels"):
        parts += ["", f"CPU backend: {_kernels_line(mach['kernels'])}."]
    parts += ["", _exact_line(cfg["target"])]
    if cfg["target"].get("lossy"):
        parts += ["", f"**LOSSY: the target ran with {cfg['target']['experts_used']} active expert(s) (`--experts`), "
                      "not its own setting: every output here is the reduced model's, not the model's.**"]
    if results.get("interrupted"):
        parts += ["", "**Interrupted: partial results.**"]
    return parts


def _kernels_line(kernels: dict[str, Any]) -> str:
    """Which llama.cpp CPU backend the run had (results.json from before it was recorded: none said)."""
    from ..llama import KernelStatus

    return KernelStatus.from_dict(kernels).line()


def _exact_line(target: dict[str, Any]) -> str:
    """The exact mode the run had, and why (results.json from before it was recorded: on/off only)."""
    exact = target.get("exact", True)
    why = target.get("exact_why")
    held = ("greedy speculative outputs must equal plain decoding token for token" if exact else
            "calls ran unpadded and unsplit, so greedy outputs may differ from plain decoding at near-ties")
    return f"Exact mode: {'on' if exact else 'off'}" + (f" ({why})" if why else "") + f": {held}."


def _summary(results: dict[str, Any]) -> list[str]:
    rows = [r for r in aggregate(results) if r["category"] == ALL]
    return ["", "## Summary (all requests)", "", markdown_table(SUMMARY_HEAD, _summary_rows(rows, False)), "",
            "tok/s: generated tokens / decode time (prefill excluded); speedup: tok/s over plain tok/s; median "
            "speedup: median over requests of each request's speedup (robust to one slow run on a noisy machine). "
            "draft / verify / other: shares of decode time. identical: speculative outputs equal to plain decoding, "
            "token for token (temperature 0 only)."]


def _by_category(results: dict[str, Any]) -> list[str]:
    if len(categories(results)) <= 1:
        return []
    rows = [r for r in aggregate(results) if r["category"] != ALL]
    head = SUMMARY_HEAD[:3] + ["category"] + SUMMARY_HEAD[3:]
    return ["", "## By category", "", markdown_table(head, _summary_rows(rows, True))]


def _best_speedups(rows: list[dict[str, Any]]) -> set[int]:
    """ids of the rows with the best speedup per (temperature, category), for bold."""
    best: dict[tuple[float, str], dict[str, Any]] = {}
    for r in rows:
        if r["method"] == PLAIN or r["speedup"] is None:
            continue
        key = (r["temperature"], r["category"])
        if key not in best or r["speedup"] > best[key]["speedup"]:
            best[key] = r
    return {id(r) for r in best.values()}


def _summary_rows(rows: list[dict[str, Any]], with_category: bool) -> list[list[str]]:
    """Table cells of aggregate rows: the best speedup bold, any mismatch bold and named."""
    bold = _best_speedups(rows)
    out = []
    for r in rows:
        speed = _speedup(r["speedup"])
        if id(r) in bold:
            speed = f"**{speed}**"
        ident = "-" if r["compared"] is None else f"{r['identical']}/{r['compared']}"
        if r["compared"] and r["identical"] != r["compared"]:
            ident = f"**{ident} MISMATCH**"
        cells = [r["method"], "-" if r["method"] == PLAIN else str(r["k"]), f"{r['temperature']:g}"]
        if with_category:
            cells.append(r["category"])
        cells += [
            num(r["tokens_per_second"]), speed, _speedup(r["median_speedup"]), pct(r["acceptance_rate"]),
            num(r["mean_accepted_length"], ".2f"), pct(r["draft_share"]), pct(r["verify_share"]),
            pct(r["other_share"]), ident,
        ]
        out.append(cells)
    return out


def _sequences(results: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    for group_curves in by_group(sequence_curves(results)):
        group, n = group_curves[0]["group"], len(group_curves[0]["speedups"])
        head = ["method", "k", "temp"] + [str(i + 1) for i in range(n)] + ["last quarter"]
        rows = [[c["method"], str(c["k"]), f"{c['temperature']:g}"] + [f"{x:.2f}x" for x in c["speedups"]]
                + [f"**{c['last_quarter']:.2f}x**"] for c in group_curves]
        parts += ["", f"## Sequence: group `{group}` ({n} requests in order, one drafter)", "",
                  markdown_table(head, rows), "",
                  "Each request's speedup over plain decoding, in the order the group ran. Drafters that learn across "
                  "requests (the suffix drafter's global tree) should rise along the row."]
    return parts


def _per_request(results: dict[str, Any]) -> list[str]:
    """Each request's paired speedup per method (``paired_speedups``), and each method's lowest: a per-request floor."""
    paired = paired_speedups(results)
    if not paired:
        return []
    configs = list(paired)
    requests = list(dict.fromkeys(req for reqs in paired.values() for req in reqs))
    head = ["request"] + [f"{m} k{k}" + (f" t{t:g}" if t else "") for m, k, t in configs]

    def cell(config: tuple[str, int, float], req: str) -> str:
        got = paired[config].get(req)
        return "-" if got is None else f"{got[0]:.2f}x ({got[1]}/{got[2]})"

    rows = [[req] + [cell(c, req) for c in configs] for req in requests]
    lowest = [min(paired[c].items(), key=lambda kv: kv[1][0]) for c in configs]
    rows.append(["**lowest**"] + [f"**{v[0]:.2f}x** ({req})" for req, v in lowest])
    reps = len({r.get("repeat", 0) for r in results["runs"]})
    return ["", "## Per request (paired with plain decoding)", "", markdown_table(head, rows), "",
            f"Each request's tok/s over plain decoding's in the same repeat, the median over {reps} repeat(s) "
            "(methods run back to back per request, so a pair sees one machine state), with accepted/drafted "
            "tokens over all repeats. Read a per-request floor here, from several repeats (--repeat)."]


def _positions(results: dict[str, Any]) -> list[str]:
    pos = acceptance_by_position(results)
    if not pos:
        return []
    n = max(len(v) for v in pos.values())
    rows = [[m, str(k), f"{t:g}"] + [pct(v[i]) if i < len(v) else "" for i in range(n)] for (m, k, t), v in pos.items()]
    return ["", "## Acceptance by draft position", "",
            markdown_table(["method", "k", "temp"] + [str(i + 1) for i in range(n)], rows), "",
            "Position i: steps whose first i draft tokens were all accepted / steps that drafted at least i."]


def _cost_curve(results: dict[str, Any]) -> list[str]:
    """t(n) as the cost policy reads it (the fastest rep, ``cost_at``), with the median rep beside it."""
    curve = results.get("cost_curve")
    if not curve:
        return []
    t1 = cost_at(curve, 1)
    ns = sorted({n for n in curve["n"] if n <= 8 or n in COST_CURVE_NS} |
                {k + 1 for k in results["config"]["ks"] if k + 1 in curve["n"]})
    medians = dict(zip(curve["n"], curve["median_s"]))
    rows = [[str(n), f"{1000 * cost_at(curve, n):.2f}", f"{cost_at(curve, n) / t1:.2f}",
             f"{1000 * cost_at(curve, n) / n:.2f}", f"{1000 * medians[n]:.2f}"] for n in ns]
    return ["", f"## Verification cost t(n) at context depth {curve['depth']}", "",
            markdown_table(["n", "t(n) ms", "t(n) / t(1)", "ms per token", "median rep ms"], rows), "",
            f"Fastest of {curve['reps']} reps (as the cost policy keeps it: interference only adds time), "
            f"{curve['threads']} threads, one batch of n tokens with logits for every row. t(1) is a true one-token "
            f"batch. {_plain_step(results['config']['target'])}", "", _build_advice(results, curve)]


def _build_advice(results: dict[str, Any], curve: dict[str, Any]) -> str:
    """Which llama.cpp build suits this curve (``host.doctor.row_cost_check``), with the command to try."""
    from ..host.doctor import llamafile_in, row_cost_check

    check = row_cost_check(lambda n: cost_at(curve, n), llamafile_in(results.get("machine", {}).get("llama_system_info")),
                           "On this curve")
    return check.message + (f". To try it: `{check.fix}`" if check.fix else "")


def _plain_step(target: dict[str, Any]) -> str:
    """What one plain decoding step cost in this run, from the shapes it ran with (``records.config_dict``)."""
    rows = target.get("min_rows")
    if rows is None:  # results.json from before the run's shapes were recorded
        return "This run did not record whether its one-token steps were padded."
    if rows > 1:
        return (f"In this run exact mode padded one-token steps to {rows} rows (batch-invariant logits), so a plain "
                f"step cost t({rows}).")
    return "In this run one-token steps ran unpadded, so a plain step cost t(1)."


def _workload(results: dict[str, Any]) -> list[str]:
    head = ["category", "requests", "groups", "prompt tokens (mean)", "plain output tokens (mean)",
            "repeated lines in plain output"]
    rows = [[w["category"], str(w["requests"]), str(w["groups"]), f"{w['prompt_tokens']:.0f}",
             num(w["output_tokens"], ".0f"), pct(w["repeated_lines"])] for w in workload_summary(results)]
    return ["", "## Workload", "", markdown_table(head, rows), "",
            "Repeated lines: non-blank output lines already seen in the prompt or earlier output. Small models "
            "loop, and loops flatter lookup drafters."]


def _peers(results: dict[str, Any]) -> list[str]:
    peers = peer_rows(results)
    if not peers:
        return []
    ours = any(p["kernels"] != "stock" for p in peers)  # --peer-kernels specstack or both
    head = ["peer", "k", "temp", "tok/s", "speedup vs llama-plain", *(["vs stock kernels"] if ours else []),
            "vs specstack plain", "acceptance", "text agrees with specstack plain", "runs", "errors"]
    rows = [[p["label"], "-" if not p["k"] else str(p["k"]), f"{p['temperature']:g}", num(p["tokens_per_second"]),
             _speedup(p["speedup"]), *([_speedup(p["vs_stock_kernels"])] if ours else []),
             _speedup(p["vs_specstack_plain"]), pct(p["acceptance_rate"]),
             "-" if p["same_text"] is None else "%d/%d" % p["same_text"], str(p["runs"]), str(p["errors"])]
            for p in peers]
    return ["", "## llama.cpp peers (same models, prompts, threads and k)", "", markdown_table(head, rows), "",
            "tok/s as each binary reports it (its decode loop; llama-plain: llama.cpp's eval plus sampling time, "
            "the loop specstack's plain rate times). The peers run "
            "greedy only, right after specstack's runs of each request. Text can differ where llama.cpp "
            "evaluates one-token batches (see README: exactness); agreement is checked up to the shorter text, since "
            "the speculative binaries overshoot n_predict by up to k tokens. [stock kernels]: llama.cpp's binaries "
            "as llama.cpp ships them; [specstack kernels]: the same binaries built with specstack's verification "
            "kernels in ggml-cpu (--peer-kernels). Speedup is over llama-plain on the same kernels: the drafting's "
            "gain" + (", and vs stock kernels is over the same peer and k on stock kernels: the kernels' gain."
                       if ours else ".")]


def _exactness(results: dict[str, Any]) -> list[str]:
    parts = ["", "## Exactness", ""]
    mism = results.get("mismatches", [])
    n_cmp = sum(1 for r in results["runs"] if r.get("identical") is not None)
    if mism:
        exact = results["config"].get("target", {}).get("exact", True)
        what = "a bug" if exact else "expected under --exact off (near-ties may flip; --exact on keeps them identical)"
        parts.append(f"**{len(mism)} of {n_cmp} speculative outputs at temperature 0 differ from plain decoding: {what}.**")
        parts.append("")
        parts += [f"- {m['message']}" for m in mism]
    elif n_cmp:
        parts.append(f"All {n_cmp} speculative outputs at temperature 0 are identical to plain decoding.")
    else:
        parts.append("No temperature-0 speculative runs to compare.")
    return parts


# -- CSV and the files of a run --------------------------------------------------------------------


def render_csv(results: dict[str, Any]) -> str:
    """results.csv: the aggregate rows, raw numbers, '' for a missing one."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for r in aggregate(results):
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
    return buf.getvalue()


def write_outputs(results: dict[str, Any], outdir: str | Path, *, write_json: bool = True,
                  plots: bool = True) -> list[Path]:
    """results.json (optionally), results.csv, results.md, then the plots; returns the paths written.  A folder
    that cannot be written is a SpecstackError naming it (``bench run`` checks its folder before measuring,
    ``outputs.check_output_dir``; ``bench report -o`` meets it here)."""
    out = Path(outdir)
    try:
        return _write_outputs(results, out, write_json, plots)
    except OSError as exc:
        raise SpecstackError(f"cannot write the results to {out} ({exc.strerror or exc}); give -o a folder you can "
                             "write to") from None


def _write_outputs(results: dict[str, Any], out: Path, write_json: bool, plots: bool) -> list[Path]:
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
