"""Model-free replay: a drafter's acceptance on recorded target outputs, with no target loaded.

The idea is ArcticInference's suffix-decoding simulator.  A bench run stores
each prompt's token ids and the plain (temperature 0) output's token ids.  At
temperature 0 the target's next token at every position *is* the recorded
one, so the engine's greedy bookkeeping can be replayed exactly: each step
``propose(context, k)``, accept the longest prefix matching the recorded
continuation, commit it plus one target token, ``observe``.  The draft budget
per step is the engine's: min(k, tokens left - 1, context room).  Groups
replay in order on one drafter, as they ran.

Example: recorded output ``[5, 6, 7, 8]`` and a draft ``[5, 6, 9]`` at the
first step: 2 accepted, ``[5, 6, 7]`` committed (7 is the target's token).

Exact for deterministic drafters (prompt-lookup, suffix, rest; draft-model at
temperature 0, which loads only the draft GGUF).  One case can differ: when an
output ended at EOS and a draft ran past it, the engine may count tokens
accepted after EOS, which replay cannot know.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..drafters import BuildContext, create
from ..drafters.base import propose_one
from ..errors import InvalidParameterError
from ..metrics import GenerationStats
from ..types import Draft
from ..verify import matched_length
from ..ui import markdown_table
from .costcurve import cost_at
from .report import pct
from .results import ALL, PLAIN, categories

DEFAULT_METHODS = ("prompt-lookup", "suffix")


@dataclass
class ReplayTarget:
    """What drafter factories may read from a target, taken from results.json (no model loaded)."""

    path: Path | None
    n_ctx: int
    n_threads: int
    n_vocab: int
    capacity: int
    n_slots: int = 1


def replay_request(drafter: Any, prompt_ids: Sequence[int], output_ids: Sequence[int], k: int,
                   max_tokens: int, capacity: int) -> GenerationStats:
    """Replay one request's greedy steps against its recorded output; the stats the engine would record."""
    stats = GenerationStats(drafter=getattr(drafter, "name", "?"), k=k, n_prompt=len(prompt_ids))
    context = [int(t) for t in prompt_ids]
    recorded = [int(t) for t in output_ids]
    done = 0
    drafter.begin(context)
    try:
        while done < len(recorded):
            room = capacity - len(context)  # = capacity - n_past - 1 (the KV holds all but the pending token)
            if room < 0:
                break
            # as ``Engine._budgets``: the first token comes from a plain step
            kk = max(0, min(k, max_tokens - done - 1, room)) if done else 0
            t0 = time.perf_counter()
            draft = propose_one(drafter, context, kk) if kk > 0 else Draft.empty(stats.drafter)
            t1 = time.perf_counter()
            tokens = tuple(draft.token_ids[:kk])
            truth = recorded[done : done + len(tokens) + 1]  # the target's tokens at these positions
            n_acc = matched_length(tokens, truth)
            committed = truth[: n_acc + 1]
            stats.record_step(draft.source, len(tokens), n_acc, t1 - t0, 0.0)
            context.extend(committed)
            done += len(committed)
            drafter.advance(committed, n_acc)
    finally:
        drafter.end()
    stats.n_tokens = done
    return stats


def recorded_outputs(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """request id -> its first plain temperature-0 run (the reference outputs)."""
    out: dict[str, dict[str, Any]] = {}
    for r in results["runs"]:
        if r["method"] == PLAIN and float(r["temperature"]) == 0.0 and r["request"] not in out:
            out[r["request"]] = r
    if not out:
        raise InvalidParameterError(
            "replay needs plain (none) runs at temperature 0 in the results; re-run `specstack bench` with --temp 0"
        )
    return out


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


def replay(results: dict[str, Any], methods: Sequence[str] = DEFAULT_METHODS, ks: Sequence[int] | None = None,
           options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Replay every (method, k) over the recorded outputs; per-request counts plus aggregates."""
    cfg = results["config"]
    ks = list(ks or cfg["ks"])
    tcfg = cfg["target"]
    tpath = Path(tcfg["path"])
    target = ReplayTarget(tpath if tpath.is_file() else None, tcfg["n_ctx"], tcfg["threads"],
                          tcfg["n_vocab"], tcfg["capacity"])
    opts = {**cfg.get("drafter_options", {}), **(options or {}), "seed": None}
    if opts.pop("cache_path", None) is not None:
        raise InvalidParameterError("cache_path is not allowed in a replay: a saved suffix tree would already hold "
                                    "the outputs being replayed")
    plain = recorded_outputs(results)
    live = {(r["method"], int(r["k"]), r["request"]): r["stats"] for r in results["runs"]
            if float(r["temperature"]) == 0.0 and r["repeat"] == 0 and r["method"] != PLAIN}
    requests = [q for q in results["workload"]["requests"] if q["id"] in plain]
    per_request = []
    for method in methods:
        for k in ks:
            for unit in _units(requests):
                drafter = create(method, BuildContext(target=target, options=opts, temperature=0.0))
                for q in unit:
                    rec = plain[q["id"]]
                    s = replay_request(drafter, q["prompt_ids"], rec["output_ids"], k, q["max_tokens"], target.capacity)
                    lv = live.get((method, k, q["id"]))
                    per_request.append({
                        "request": q["id"], "category": q["category"], "method": method, "k": k,
                        "n_tokens": s.n_tokens, "n_steps": s.n_steps, "n_drafted": s.n_drafted,
                        "n_accepted": s.n_accepted, "n_committed": s.n_committed, "draft_s": s.draft_s,
                        "steps": [list(x) for x in s.steps],
                        "live": None if lv is None else {"n_drafted": lv["n_drafted"], "n_accepted": lv["n_accepted"]},
                    })
    out = {"source": results.get("workload", {}).get("name"), "methods": list(methods), "ks": ks,
           "requests": per_request, "cost_curve": results.get("cost_curve")}
    out["rows"] = aggregate(out, categories(results))
    return out


def _est_time(steps: list[list[Any]], curve: dict[str, Any]) -> float | None:
    """Verification time from the cost curve; one-token batches are padded to two, as the engine does."""
    total = 0.0
    for _src, drafted, _acc in steps:
        t = cost_at(curve, max(2, int(drafted) + 1))
        if t is None:
            return None
        total += t
    return total


def aggregate(out: dict[str, Any], categories: list[str]) -> list[dict[str, Any]]:
    cells: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in out["requests"]:
        for cat in (ALL, r["category"]):
            cells[(r["method"], r["k"], cat)].append(r)
    curve = out.get("cost_curve")
    t2 = cost_at(curve, 2)
    rows = []
    for method in out["methods"]:
        for k in out["ks"]:
            for cat in categories:
                rs = cells.get((method, k, cat))
                if not rs:
                    continue
                drafted = sum(r["n_drafted"] for r in rs)
                accepted = sum(r["n_accepted"] for r in rs)
                steps = sum(r["n_steps"] for r in rs)
                tokens = sum(r["n_tokens"] for r in rs)
                draft_s = sum(r["draft_s"] for r in rs)
                lives = [r["live"] for r in rs if r["live"] is not None]
                est = None
                if curve and t2:
                    times = [_est_time(r["steps"], curve) for r in rs]
                    if all(t is not None for t in times):
                        est = tokens * t2 / (sum(times) + draft_s) if tokens else None
                rows.append({
                    "method": method, "k": k, "category": cat, "requests": len(rs), "n_tokens": tokens,
                    "n_drafted": drafted, "n_accepted": accepted,
                    "acceptance_rate": accepted / drafted if drafted else None,
                    "mean_accepted_length": sum(r["n_committed"] for r in rs) / steps if steps else None,
                    "draft_us_per_step": 1e6 * draft_s / steps if steps else None,
                    "est_speedup": est,
                    "live_acceptance": (sum(x["n_accepted"] for x in lives) / max(1, sum(x["n_drafted"] for x in lives)))
                    if lives else None,
                    "same_as_live": (all(r["live"] == {"n_drafted": r["n_drafted"], "n_accepted": r["n_accepted"]}
                                         for r in rs) if len(lives) == len(rs) else None),
                })
    return rows


def render_markdown(out: dict[str, Any]) -> str:
    head = ["method", "k", "category", "drafted", "accepted", "acceptance", "mean accepted length",
            "draft µs/step", "est. speedup (cost curve)", "live acceptance", "same counts as live"]
    rows = [[r["method"], str(r["k"]), r["category"], str(r["n_drafted"]), str(r["n_accepted"]),
             pct(r["acceptance_rate"]), "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}",
             "-" if r["draft_us_per_step"] is None else f"{r['draft_us_per_step']:.0f}",
             "-" if r["est_speedup"] is None else f"{r['est_speedup']:.2f}x",
             pct(r["live_acceptance"]), {None: "-", True: "yes", False: "**no**"}[r["same_as_live"]]]
            for r in out["rows"]]
    n_req = len({r["request"] for r in out["requests"]})
    notes = (f"\nReplayed on the recorded plain outputs of `{out['source']}` ({n_req} requests, temperature 0), no "
             "target loaded. est. speedup: plain cost n_tokens x t(2) over sum of t(drafted + 1) per step plus the "
             "measured draft time, from the run's cost curve.\n")
    return f"# specstack bench replay: {out['source']}\n\n" + markdown_table(head, rows) + "\n" + notes


def write_json(out: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
