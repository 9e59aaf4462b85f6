"""The plots of a bench run (matplotlib, imported only when a plot is drawn).

tokps_vs_k.png, acceptance_by_position.png, sequence_GROUP.png per request group and
cost_curve.png, from the aggregation in ``results``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ..errors import SpecstackError
from .results import ALL, PLAIN, acceptance_by_position, aggregate, by_group, sequence_curves


def require_plotting() -> None:
    """Fail now if plots cannot be drawn: `bench run` calls this before measuring, not after."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise SpecstackError(
            "plots need matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'specstack[bench]'); or pass --no-plots"
        ) from None


def _pyplot():
    require_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(results: dict[str, Any], outdir: Path) -> list[Path]:
    """tokps_vs_k.png, acceptance_by_position.png, sequence_GROUP.png per request group and (if measured) cost_curve.png."""
    plt = _pyplot()
    outdir = Path(outdir)
    written = []
    rows = [r for r in aggregate(results) if r["category"] == ALL]
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        here = [r for r in rows if r["temperature"] == temp]
        for method in dict.fromkeys(r["method"] for r in here if r["method"] != PLAIN):
            pts = sorted((r["k"], r["tokens_per_second"]) for r in here if r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        plain = [r["tokens_per_second"] for r in here if r["method"] == PLAIN]
        if plain:
            ax.axhline(plain[0], color="gray", linestyle="--", label="plain (none)")
        ks = sorted({r["k"] for r in here if r["method"] != PLAIN})
        if ks:
            ax.set_xscale("log", base=2)
            ax.set_xticks(ks, [str(k) for k in ks])
        _finish(ax, "k (draft tokens per step)", "decode tok/s", f"{results['workload']['name']}, temperature {temp:g}")
    fig.tight_layout()
    written.append(_save(fig, outdir / "tokps_vs_k.png", plt))

    pos = acceptance_by_position(results)
    methods = list(dict.fromkeys(m for m, _k, _t in pos))
    if methods:
        fig, axes = plt.subplots(1, len(methods), figsize=(5.5 * len(methods), 4), squeeze=False)
        styles = ["-", "--", ":", "-."]
        for ax, method in zip(axes[0], methods):
            for (m, k, t), v in pos.items():
                if m == method:
                    ax.plot(range(1, len(v) + 1), v, marker=".", linestyle=styles[temps.index(t) % 4] if t in temps else "-",
                            label=f"k={k}" + (f", T={t:g}" if len(temps) > 1 else ""))
            ax.xaxis.get_major_locator().set_params(integer=True)
            _finish(ax, "draft position", "acceptance", method, top=1.02)
        fig.tight_layout()
        written.append(_save(fig, outdir / "acceptance_by_position.png", plt))

    for group_curves in by_group(sequence_curves(results)):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for c in group_curves:
            xs = range(1, len(c["speedups"]) + 1)
            ax.plot(xs, c["speedups"], marker="o", label=f"{c['method']} k={c['k']}" + (f", T={c['temperature']:g}" if len(temps) > 1 else ""))
        ax.axhline(1.0, color="gray", linestyle="--", label="plain (none)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        _finish(ax, "request in sequence", "speedup over plain", f"sequence: {group_curves[0]['group']}")
        fig.tight_layout()
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in group_curves[0]["group"])
        written.append(_save(fig, outdir / f"sequence_{safe}.png", plt))

    curve = results.get("cost_curve")
    if curve:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        ax.plot(curve["n"], [1000 * x for x in curve["min_s"]], marker="o", label="fastest rep (t(n))")
        ax.plot(curve["n"], [1000 * x for x in curve["median_s"]], linestyle=":", label="median rep")
        _finish(ax, "tokens in one batch (n)", "t(n) ms", f"verification cost at depth {curve['depth']}")
        fig.tight_layout()
        written.append(_save(fig, outdir / "cost_curve.png", plt))
    return written


def _finish(ax, xlabel: str, ylabel: str, title: str, top: float | None = None) -> None:
    """Labels, a y axis from zero, grid and legend: the same finish on every plot."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(bottom=0, top=top)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
