"""The records a bench run writes into results.json: the skeleton, one per run, one per mismatch.

Their fields are what ``results.py`` and ``replay.py`` read back (docs/bench.md
lists them), so they are built in one place, apart from the run loop.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import BenchConfig
from .results import PLAIN
from .workloads import Request

if TYPE_CHECKING:
    from ..generation import Generation
    from ..llama import LlamaModel

RESULTS_VERSION = 1


@dataclass
class Tokenized:
    """A request with its prompt token ids and its fixed seed (the same for every method)."""

    request: Request
    prompt_ids: list[int]
    seed: int


def load_average() -> list[float] | None:
    """The 1/5/15-minute load average where the platform has one: a busy machine explains odd numbers."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info(target: LlamaModel | None = None) -> dict[str, Any]:
    """Facts that explain a number: CPU, cores, load, versions."""
    from ..host import sysinfo
    from ..llama import kernel_status, llama_system_info, llama_version

    raw, _err = llama_system_info()
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": sysinfo.cpu_model(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": sysinfo.physical_cores(),
        "load_average": load_average(),
        "llama_cpp_python": llama_version(),
        "llama_system_info": raw,
        "kernels": kernel_status().to_dict(),  # specstack's CPU backend or the stock one: a number depends on which
    }
    if target is not None:
        info["threads"] = target.n_threads
    return info


def new_results(config: BenchConfig, target: LlamaModel, reqs: list[Tokenized]) -> dict[str, Any]:
    """The results dict before any run: config, machine, the workload with its token ids and seeds."""
    wl = config.workload
    return {
        "version": RESULTS_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": config_dict(config, target),
        "machine": machine_info(target),
        "workload": {
            "name": wl.name,
            "path": str(wl.path),
            "requests": [{**t.request.to_dict(), "line": t.request.line, "prompt_ids": t.prompt_ids,
                          "seed": t.seed, **_reference_ids(t, target)} for t in reqs],
        },
        "runs": [],
        "peers": [],
        "mismatches": [],
        "cost_curve": None,
        "interrupted": False,
    }


def _reference_ids(t: Tokenized, target: LlamaModel) -> dict[str, Any]:
    """A request's reference answer as token ids (``bench replay --reference`` drafts over them), if it has one."""
    if t.request.reference is None:
        return {}
    return {"reference_ids": target.tokenize(t.request.reference, add_special=False)}


def config_dict(config: BenchConfig, target: LlamaModel) -> dict[str, Any]:
    """The config as JSON: paths as strings, the workload by name, plus the target's and draft's facts."""
    d = asdict(config)
    d.pop("workload")
    d["workload"] = config.workload.name
    d["llama_cpp_bin"] = str(config.llama_cpp_bin) if config.llama_cpp_bin else None
    d["drafter_options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in config.drafter_options.items()}
    d["methods"] = [PLAIN] + config.methods
    overrides = target.config.kv_overrides
    d["target"] = {
        "path": str(target.path),
        "name": target.path.name,
        "n_ctx": target.n_ctx,
        "capacity": target.capacity,
        "n_vocab": target.n_vocab,
        "threads": target.n_threads,
        # --experts N: every result of this run comes from a reduced model and is labelled lossy
        "experts_used": next((v for k, v in overrides if k.endswith("expert_used_count")), None),
        "lossy": any(k.endswith("expert_used_count") for k, _ in overrides),
        "exact": target.shapes.exact,  # --exact: False means greedy outputs may differ at near-ties, by design
        "exact_why": target.shapes.why,  # the mode as chosen (--exact, or what auto measured), for results.md
        "min_rows": target.shapes.min_rows,  # 2: one-token steps padded to two rows, so a plain step costs t(2)
        # What replay's recorded target needs to split and pad each step's calls as this run's target did
        # (``bench.recorded``), and which drafts it could verify (trees, a recurrent state's reach).
        "shapes": {**target.shapes.to_dict(), "pad_to": list(target.shapes.pad_to),
                   "even_rows": target.shapes.even_rows},
        "batch_cap": target.batch_cap,
        "prefill_chunk": target.config.prefill_chunk,
        "n_slots": target.n_slots,
        "n_seq_max": target.n_seq_max,
        "unified": target.unified,
        "memory": target.memory,
        "strategy": target.strategy,
        "max_draft": target.max_draft,
    }
    draft = config.drafter_options.get("draft_model")
    d["draft"] = {"path": str(draft), "name": Path(draft).name} if draft else None
    return d


def run_record(req: Request, method: str, k: int, temp: float, rep: int, seed: int, gen: Generation,
               identical: bool | None) -> dict[str, Any]:
    """One run: its configuration, output (ids and text) and stats with per-step detail (replay needs them)."""
    s = gen.stats
    stats = s.to_dict(with_steps=True)
    stats["n_committed"] = s.n_committed
    stats["accepted_by_position"] = list(s.accepted_at)
    stats["decode_s"] = round(s.decode_s, 6)
    return {
        "request": req.id,
        "category": req.category,
        "group": req.group,
        "method": method,
        "k": k,
        "temperature": temp,
        "repeat": rep,
        "seed": seed,
        "identical": identical,
        "output_ids": list(gen.output_ids),
        "text": gen.text,
        "stats": stats,
    }


def mismatch_verdict(exact: bool) -> str:
    """What a greedy mismatch means: a bug under ``--exact on``; expected at near-ties under ``--exact off``."""
    if exact:
        return "Greedy speculation must be lossless: this is a bug."
    return ("Expected under --exact off: calls are not kept to the exact shapes, so near-ties may flip "
            "(run with --exact on for bit-identical output).")


def mismatch_record(target: LlamaModel, req: Request, method: str, k: int, rep: int,
                    plain: list[int], got: list[int]) -> dict[str, Any]:
    """A greedy output that differs from plain decoding, located at its first differing token."""
    i = next((j for j, (a, b) in enumerate(zip(plain, got)) if a != b), min(len(plain), len(got)))

    def show(ids: list[int]) -> str:
        return repr(target.detokenize(ids[i : i + 1])) if i < len(ids) else "<end>"

    msg = (f"MISMATCH: {method} k={k} on request {req.id!r} (repeat {rep + 1}, temperature 0) differs from plain "
           f"decoding at output token {i}: plain {plain[i] if i < len(plain) else None} {show(plain)}, "
           f"{method} {got[i] if i < len(got) else None} {show(got)}. " + mismatch_verdict(target.shapes.exact))
    return {"request": req.id, "method": method, "k": k, "repeat": rep, "first_difference": i,
            "plain_len": len(plain), "len": len(got), "message": msg}
