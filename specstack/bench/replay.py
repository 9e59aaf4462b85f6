"""Replay: the real engine, drafters and k policies over a run's recorded outputs, priced by its measured t(n).

The idea is ArcticInference's suffix-decoding simulator, run on the engine itself.  A bench run
stores each prompt's token ids and the plain (temperature 0) output's token ids; at temperature 0
the target's token after every recorded context *is* the recorded one.  ``bench.recorded``'s
``RecordedTarget`` answers the engine's calls from those outputs, so replay is ``Engine.generate``
with the drafter and policy of each configuration: the budgets (the first token from a plain step,
the caps, trees, a policy's cut), the drafts, verification and commits are the live engine's, and
there is no second loop to keep in step with it.  Each target call is priced at t(rows) of the
run's cost curve for the rows the engine put in it (split and padded as the run's target did), so
the replayed decode time, and tok/s, is a prediction of the live one.  Groups and configurations
run in the order the bench ran them (runner.py), one engine per configuration and group.

Example: recorded output ``[5, 6, 7, 8]`` and a draft ``[6, 7, 9]`` after the first (plain) step:
2 accepted, ``[6, 7, 8]`` committed (8 is the target's token).

With ``--reference`` the recorded output of each request that has a reference answer (a workload's ``reference``:
the answer asked for, as an instruction-tuned model writes it) is replaced by that answer, so drafters are measured on
it where the model at hand answers otherwise: a pretrained model asked to rename a parameter mostly copies the
function unchanged, an instruction-tuned one renames it everywhere.

Exact counts for deterministic drafters (prompt-lookup, suffix, rest; draft-model at temperature 0,
which loads only the draft GGUF), and for k policies up to what they learn from time (``cost``
sees priced calls and real drafting).  One case can differ: when an output ended at EOS and a draft
ran past it, the engine may count tokens accepted after EOS, which replay cannot know.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from ..draft_length import DraftLengthPolicy
from ..draft_length.costs import CostModel
from ..drafters import Drafter, prompt_lookup, suffix
from ..errors import InvalidParameterError, SpecstackError
from ..generation import GenerationConfig
from ..loading import build_drafter, build_engine, build_policy
from ..sampling import SamplingParams
from ..ui import markdown_table
from .config import adaptive_start, configurations as bench_configurations, split_method
from .recorded import RecordedTarget, recorded_outputs
from .report import pct
from .results import ALL, PLAIN, categories, representative_runs

DEFAULT_METHODS = (prompt_lookup.NAME, suffix.NAME)
# A request replayed below this share of its own plain decoding rate counts as a loss (``aggregate``): the floor
# issue 38 asks of every drafter under the cost policy, per prompt. Live single runs vary by 5-8% per request on a
# 2-core machine, so the replay, priced by one cost curve, is where a per-prompt floor can be read.
LOSS_BELOW = 0.97


class ReplayError(SpecstackError):
    """A replay did not reproduce its recording: the recorded target or the engine is wrong."""


def _units(requests: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    units: list[list[dict[str, Any]]] = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for q in requests:
        g = q.get("group")
        if g is None:
            units.append([q])
        elif g in groups:
            groups[g].append(q)
        else:
            groups[g] = [q]
            units.append(groups[g])
    return units


def configurations(methods: Sequence[str], ks: Sequence[int], k_max: int | None = None) -> list[tuple[str, int]]:
    """(method, k) as ``BenchConfig.configurations`` orders them: plain first, ``METHOD@POLICY`` once at k_max."""
    return bench_configurations([m for m in dict.fromkeys(methods) if m != PLAIN], ks, k_max)


def _policy(method: str, k: int, target: RecordedTarget, curve: list[float] | None) -> DraftLengthPolicy:
    """As the bench's: a fixed k or the policy after '@', capped at k; ``cost`` prices with the run's curve."""
    name = split_method(method)[1]
    if name is None:
        return build_policy("fixed", max(k, 1))
    costs = None
    if name == "cost":
        if not curve:
            raise InvalidParameterError(f"{method}: replaying the cost policy needs the run's cost curve "
                                        "(the run had --no-cost-curve)")
        costs = CostModel(list(curve), shapes=target.shapes)
    return build_policy(name, adaptive_start(k), k_max=k, costs=costs)


def _drafter(method: str, target: RecordedTarget, options: dict[str, Any], seed: int) -> Drafter:
    return build_drafter(split_method(method)[0], target, {**options, "seed": seed})


def _config(request: dict[str, Any], max_tokens: int | None = None) -> GenerationConfig:
    """A request's generation as the bench runs it at temperature 0."""
    n = request["max_tokens"] if max_tokens is None else min(max_tokens, request["max_tokens"])
    return GenerationConfig(max_tokens=n, sampling=SamplingParams(temperature=0.0, seed=request.get("seed")))


def with_references(results: dict[str, Any]) -> dict[str, Any]:
    """The results cut to the requests with a reference answer, each answer in place of the recorded plain output.

    The live runs of other methods answered something else, so they are left out (the table then has no live
    columns), and so is plain decoding's decode time (it timed another answer)."""
    refs = {q["id"]: q for q in results["workload"]["requests"] if q.get("reference_ids")}
    if not refs:
        raise InvalidParameterError("--reference: no request in these results has a reference answer; give the "
                                    "workload a 'reference' field (the answer asked for) and run `specstack bench run` "
                                    "on it again")
    runs = []
    for r in results["runs"]:
        q = refs.get(r["request"])
        if q is not None and r["method"] == PLAIN and float(r["temperature"]) == 0.0:
            ids = list(q["reference_ids"])
            stats = {k: v for k, v in r["stats"].items() if k != "decode_s"}
            runs.append({**r, "output_ids": ids, "stats": {**stats, "stop_reason": "length", "n_tokens": len(ids)}})
    requests = [dict(q, max_tokens=len(q["reference_ids"])) for q in refs.values()]
    return {**results, "workload": {**results["workload"], "requests": requests}, "runs": runs}


def replay(results: dict[str, Any], methods: Sequence[str] = DEFAULT_METHODS, ks: Sequence[int] | None = None,
           options: dict[str, Any] | None = None, statistic: str = "min_s", reference: bool = False) -> dict[str, Any]:
    """Replay plain decoding and every (method, k) over the recorded outputs on the engine (``reference``: over the
    requests' reference answers, ``with_references``); per-request counts and predicted decode times, plus
    aggregates beside the live run's (``statistic``: the cost curve's ``min_s``, as the cost policy reads it, or
    ``median_s``)."""
    if reference:
        results = with_references(results)
    cfg = results["config"]
    ks = list(ks or cfg["ks"])
    opts = {**cfg.get("drafter_options", {}), **(options or {})}
    if opts.pop("cache_path", None) is not None:
        raise InvalidParameterError("cache_path is not allowed in a replay: a saved suffix tree would already hold "
                                    "the outputs being replayed")
    target = RecordedTarget.from_results(results, statistic)
    curve = (results.get("cost_curve") or {}).get(statistic)
    plain = recorded_outputs(results)
    configs = configurations(methods, ks, cfg.get("k_max"))
    live = {(r["method"], int(r["k"]), r["request"]): r["stats"] for r in results["runs"]
            if float(r["temperature"]) == 0.0 and r["repeat"] == 0 and r["method"] != PLAIN}
    requests = [q for q in results["workload"]["requests"] if q["id"] in plain]
    per_request = []
    t0 = time.perf_counter()
    if requests:  # as the bench warms up before it measures: first calls of each configuration's code paths
        first = requests[0]
        for m, k in configs:
            engine = build_engine(target, _drafter(m, target, opts, first.get("seed", 0)), _policy(m, k, target, curve),
                                  clock=target.clock)
            engine.generate(first["prompt_ids"], _config(first, max_tokens=8)).run()
    for unit in _units(requests):
        seed = unit[0].get("seed", 0)
        engines = {(m, k): build_engine(target, _drafter(m, target, opts, seed), _policy(m, k, target, curve),
                                        clock=target.clock)
                   for m, k in configs}
        for q in unit:  # interleaved as the bench ran them: every configuration, then the next request
            recorded = [int(t) for t in plain[q["id"]]["output_ids"]]
            for method, k in configs:
                gen = engines[(method, k)].generate(q["prompt_ids"], _config(q)).run()
                if gen.output_ids != recorded:
                    raise ReplayError(f"replaying {method} k={k} on {q['id']!r} gave another output than the recorded "
                                      f"one ({len(gen.output_ids)} against {len(recorded)} tokens): a replay bug")
                s = gen.stats
                lv = live.get((method, k, q["id"]))
                per_request.append({
                    "request": q["id"], "category": q["category"], "method": method, "k": k,
                    "n_tokens": s.n_tokens, "n_steps": s.n_steps, "n_drafted": s.n_drafted,
                    "n_accepted": s.n_accepted, "n_committed": s.n_committed, "draft_s": s.draft_s,
                    "verify_s": s.verify_s, "decode_s": s.decode_s,
                    "steps": [list(x) for x in s.steps],
                    "live": None if lv is None else {"n_drafted": lv["n_drafted"], "n_accepted": lv["n_accepted"]},
                })
    out = {"source": results.get("workload", {}).get("name"), "methods": list(dict.fromkeys(m for m, _ in configs)),
           "configurations": [list(c) for c in configs], "ks": ks, "requests": per_request,
           "cost_curve": results.get("cost_curve"), "statistic": statistic, "priced": target.costs is not None,
           "replay_s": round(time.perf_counter() - t0, 3)}
    out["rows"] = aggregate(out, categories(results), _live_rates(results, {q["id"] for q in requests}))
    return out


def _live_rates(results: dict[str, Any], ids: set[str]) -> dict[tuple[str, int, str], tuple[int, float]]:
    """(method, k, request) -> (tokens, decode seconds) of the run the bench report keeps (median over repeats)."""
    timed = {**results, "runs": [r for r in results["runs"] if "decode_s" in r["stats"]]}
    return {(m, k, req): (run["stats"]["n_tokens"], run["stats"]["decode_s"])
            for (m, k, temp, req), run in representative_runs(timed).items() if temp == 0.0 and req in ids}


def aggregate(out: dict[str, Any], categories: list[str],
              live_rates: dict[tuple[str, int, str], tuple[int, float]] | None = None) -> list[dict[str, Any]]:
    """One row per configuration x category: replayed counts, predicted tok/s and the live run's beside them."""
    live_rates = live_rates or {}
    cells: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in out["requests"]:
        for cat in (ALL, r["category"]):
            cells[(r["method"], r["k"], cat)].append(r)
    rows = []
    for method, k in (tuple(c) for c in out["configurations"]):
        for cat in categories:
            rs = cells.get((method, k, cat))
            if not rs:
                continue
            drafted = sum(r["n_drafted"] for r in rs)
            accepted = sum(r["n_accepted"] for r in rs)
            steps = sum(r["n_steps"] for r in rs)
            tokens = sum(r["n_tokens"] for r in rs)
            draft_s = sum(r["draft_s"] for r in rs)
            decode_s = sum(r["decode_s"] for r in rs)
            lives = [r["live"] for r in rs if r["live"] is not None]
            rates = [live_rates.get((method, k, r["request"])) for r in rs]
            live_tps = None
            if rates and all(x is not None for x in rates) and sum(x[1] for x in rates) > 0:
                live_tps = sum(x[0] for x in rates) / sum(x[1] for x in rates)
            est_tps = tokens / decode_s if out.get("priced") and decode_s > 0 else None
            rows.append({
                "method": method, "k": k, "category": cat, "requests": len(rs), "n_tokens": tokens,
                "n_drafted": drafted, "n_accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
                "mean_accepted_length": sum(r["n_committed"] for r in rs) / steps if steps else None,
                "draft_us_per_step": 1e6 * draft_s / steps if steps else None,
                "est_tokens_per_second": est_tps,
                "est_speedup": None,
                "live_tokens_per_second": live_tps,
                "est_error": est_tps / live_tps - 1 if est_tps and live_tps else None,
                "live_acceptance": (sum(x["n_accepted"] for x in lives) / max(1, sum(x["n_drafted"] for x in lives)))
                if lives else None,
                "same_as_live": (all(r["live"] == {"n_drafted": r["n_drafted"], "n_accepted": r["n_accepted"]}
                                     for r in rs) if len(lives) == len(rs) and method != PLAIN else None),
            })
    base = {r["category"]: r["est_tokens_per_second"] for r in rows if r["method"] == PLAIN}
    for r in rows:
        b = base.get(r["category"])
        r["est_speedup"] = r["est_tokens_per_second"] / b if b and r["est_tokens_per_second"] else None
    _add_per_request(rows, out)
    return rows


def _add_per_request(rows: list[dict[str, Any]], out: dict[str, Any]) -> None:
    """Each row's lowest per-request speedup (over that request's replayed plain decoding) and how many requests fell
    below ``LOSS_BELOW``: an aggregate can hide a prompt that a drafter slows down."""
    plain = {r["request"]: r["decode_s"] for r in out["requests"] if r["method"] == PLAIN}
    speedups: dict[tuple, list[tuple[float, str]]] = defaultdict(list)
    if out.get("priced"):
        for r in out["requests"]:
            base = plain.get(r["request"])
            if r["method"] != PLAIN and base and r["decode_s"] > 0:
                for cat in (ALL, r["category"]):
                    speedups[(r["method"], r["k"], cat)].append((base / r["decode_s"], r["request"]))
    for row in rows:
        got = speedups.get((row["method"], row["k"], row["category"]))
        low = min(got) if got else None
        row["lowest_speedup"] = None if low is None else low[0]
        row["lowest_request"] = None if low is None else low[1]
        row["requests_below"] = None if not got else sum(x < LOSS_BELOW for x, _ in got)


def render_markdown(out: dict[str, Any]) -> str:
    head = ["method", "k", "category", "drafted", "accepted", "acceptance", "mean accepted length",
            "draft µs/step", "est. speedup (cost curve)", "lowest request", f"below {LOSS_BELOW:.2f}x",
            "live acceptance", "same counts as live",
            "est. tok/s", "live tok/s", "est. error"]

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    rows = [[r["method"], str(r["k"]) if r["method"] != PLAIN else "-", r["category"], str(r["n_drafted"]),
             str(r["n_accepted"]), pct(r["acceptance_rate"]), num(r["mean_accepted_length"], ".2f"),
             num(r["draft_us_per_step"], ".0f"), num(r["est_speedup"], ".2f") + ("x" if r["est_speedup"] else ""),
             num(r.get("lowest_speedup"), ".2f") + ("x" if r.get("lowest_speedup") else ""),
             num(r.get("requests_below"), "d"),
             pct(r["live_acceptance"]), {None: "-", True: "yes", False: "**no**"}[r["same_as_live"]],
             num(r["est_tokens_per_second"], ".0f"), num(r["live_tokens_per_second"], ".0f"),
             "-" if r["est_error"] is None else f"{100 * r['est_error']:+.0f}%"]
            for r in out["rows"]]
    n_req = len({r["request"] for r in out["requests"]})
    stat = {"min_s": "fastest", "median_s": "median"}.get(out.get("statistic", "min_s"), out.get("statistic"))
    notes = (f"\nReplayed on the engine over the recorded plain outputs of `{out['source']}` ({n_req} requests, "
             "temperature 0), no target loaded: each target call priced at t(rows) of the run's cost curve "
             f"({stat} rep) for the rows the engine put in it, drafting and the loop's own time as measured here. "
             "est. tok/s: tokens over that decode time; est. speedup: over replayed plain decoding; lowest request: "
             f"the smallest of each request's own est. speedup, and below {LOSS_BELOW:.2f}x: how many requests fell "
             "under that (an aggregate can hide a prompt the drafter slows down; the lowest one's id is in the JSON); "
             "live tok/s: the run's (median over repeats); est. error: est. / live - 1.\n")
    return f"# specstack bench replay: {out['source']}\n\n" + markdown_table(head, rows) + "\n" + notes


def write_json(out: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
