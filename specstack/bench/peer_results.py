"""The llama.cpp peers' table rows, from the peer records of a results dict (runs: peer_runs.py).

Apart from results.py because the peers are measured differently: each binary
reports its own tok/s, so rows pool decode time from those rates, and failures
are counted beside the numbers.  A row is one peer, k, temperature and kernel set
(``--peer-kernels``): its speedup is over llama-plain on the same kernels (the
drafting's gain), and a specstack-kernel row's ``vs_stock_kernels`` is over the same
peer on stock kernels (the kernels' gain).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .peer_runs import peer_label
from .results import ALL, PLAIN, aggregate, lower_median

PeerKey = tuple[str, int, float, str]  # (peer method, k, temperature, kernels)


def peer_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per peer method x k x temperature x kernels, over the median run of each request.

    tok/s = sum of tokens / sum of (tokens / the binary's own tok/s), i.e. total decode time.
    A record without ``kernels`` (a run from before --peer-kernels) ran on stock kernels.
    """
    groups: dict[PeerKey, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for p in results.get("peers") or []:
        key = (p["method"], int(p.get("k") or 0), float(p["temperature"]), p.get("kernels") or "stock")
        groups[key][p["request"]].append(p)
    plain = {r["temperature"]: r["tokens_per_second"] for r in aggregate(results)
             if r["method"] == PLAIN and r["category"] == ALL}
    rows = [_peer_row(key, by_req, plain) for key, by_req in groups.items()]
    tps = {(r["method"], r["k"], r["temperature"], r["kernels"]): r["tokens_per_second"] for r in rows}
    base = {(r["temperature"], r["kernels"]): r["tokens_per_second"] for r in rows
            if r["method"] == "llama-plain" and r["tokens_per_second"]}
    for r in rows:
        r["speedup"] = _ratio(r["tokens_per_second"], base.get((r["temperature"], r["kernels"])))
        if r["kernels"] != "stock":
            r["vs_stock_kernels"] = _ratio(r["tokens_per_second"],
                                           tps.get((r["method"], r["k"], r["temperature"], "stock")))
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _peer_row(key: PeerKey, by_req: dict[str, list[dict[str, Any]]], plain: dict[float, float]) -> dict[str, Any]:
    """One peer configuration's row; failed runs are counted, never averaged in."""
    method, k, temp, kernels = key
    ps = [p for runs in by_req.values() for p in runs]
    ok_runs = {q: [p for p in runs if not p.get("error") and p.get("tokens_per_second")] for q, runs in by_req.items()}
    ok = [lower_median(runs, key=lambda p: p["tokens_per_second"]) for runs in ok_runs.values() if runs]
    tps = None
    if ok:
        toks = [p.get("n_tokens") or 1 for p in ok]
        tps = sum(toks) / sum(t / p["tokens_per_second"] for t, p in zip(toks, ok))
    drafted = sum(p.get("n_drafted") or 0 for p in ok)
    accepted = sum(p.get("n_accepted") or 0 for p in ok)
    same = [p["same_text_as_plain"] for p in ok if p.get("same_text_as_plain") is not None]
    return {"method": method, "kernels": kernels, "label": peer_label(method, kernels), "k": k,
            "temperature": temp, "tokens_per_second": tps, "vs_stock_kernels": None,
            "acceptance_rate": accepted / drafted if drafted else None, "runs": len(ps),
            "errors": sum(1 for p in ps if p.get("error")), "speedup": None,
            "vs_specstack_plain": tps / plain[temp] if tps and plain.get(temp) else None,
            "same_text": (sum(same), len(same)) if same else None}
