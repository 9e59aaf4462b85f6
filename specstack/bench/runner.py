"""``specstack bench run``: plain decoding vs each drafter over a workload, interleaved per prompt.

For every request the configurations run back to back (plain, then each
method x k), so a noisy machine slows all of them alike (A B A B, never all
of A then all of B).  A group of requests runs in order on one engine per
configuration, so state a drafter keeps across requests (the suffix drafter's
global tree) learns from the group's earlier outputs only; drafters are built
afresh for each group (and for each ungrouped request).  At temperature 0
every speculative output must equal the plain output token for token; a
difference is reported loudly.  At temperature > 0 every configuration uses
the same seed for a given request.

This module is the run loop; what runs is config.py, what is written is
records.py, llama.cpp's binaries beside it are peer_runs.py.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ..loading import build_drafter, build_engine, build_policy
from ..draft_length import DraftLengthPolicy
from ..drafters import Drafter
from ..engine import Engine
from ..errors import ContextOverflowError
from ..generation import Generation, GenerationConfig
from ..sampling import SamplingParams
from ..llama import LlamaModel
from ..ui import Progress
from .config import BenchConfig, adaptive_start, request_seed, split_method
from .peer_runs import PeerRunner, load_peers
from .records import Tokenized, load_average, mismatch_record, new_results, run_record
from .results import PLAIN
from .workloads import Request

__all__ = ["run_bench"]

Configuration = tuple[str, int]  # (method, k)


def run_bench(config: BenchConfig, target: LlamaModel, progress: bool = True, label: str = "bench") -> dict[str, Any]:
    """Run the whole benchmark; returns the results dict (see docs/bench.md for its fields).

    ``demo`` and ``tune`` are presets of this run: what they print is computed from this dict
    (``results.aggregate``), so all three measure and compare in one way.
    """
    reqs = _tokenize(config, target)
    peers = load_peers(config, target) if config.runs_peers else None
    configs = config.configurations()
    _check_and_warm_up(config, target, configs, reqs[0])
    results = new_results(config, target, reqs)
    bar = Progress(f"{label} {config.workload.name}", _total_work(config, reqs, configs, peers), unit="tokens",
                   quiet=not progress)
    try:
        _Session(config, target, configs, peers, results, bar).run(reqs)
    except KeyboardInterrupt:
        results["interrupted"] = True
        print(f"\n{label}: interrupted; keeping the runs finished so far", file=sys.stderr)
    finally:
        bar.close()
    if config.cost_curve and not results["interrupted"]:
        results["cost_curve"] = _cost_curve(config, target, reqs[0].prompt_ids, progress)
    results["machine"]["load_average_end"] = load_average()
    # What is written is what a re-render reads: round-trip through JSON once.
    return json.loads(json.dumps(results))


def _tokenize(config: BenchConfig, target: LlamaModel) -> list[Tokenized]:
    """Every request tokenized with its seed; refuses, before anything runs, one that cannot fit the context."""
    wl = config.workload
    reqs = [Tokenized(r, target.tokenize(r.prompt), request_seed(config.seed, r.id)) for r in wl.requests]
    for t in reqs:
        need = len(t.prompt_ids) + t.request.max_tokens
        if need > target.capacity:
            raise ContextOverflowError(
                f"{wl.path}:{t.request.line}: request {t.request.id!r} needs {len(t.prompt_ids)} prompt tokens + "
                f"max_tokens {t.request.max_tokens} = {need} > context {target.capacity}; shorten the prompt, "
                "lower max_tokens or raise --ctx-size"
            )
    return reqs


def _check_and_warm_up(config: BenchConfig, target: LlamaModel, configs: list[Configuration], first: Tokenized) -> None:
    """Fail on a bad method name or draft model before anything runs, and warm up: the first
    evaluations allocate buffers and fault in weights, which would count against the first method."""
    temp = config.temperatures[0]
    drafters = {(m, k): _build(m, target, config, temp, first.seed) for m, k in configs}
    if config.warmup:
        for (method, k), drafter in drafters.items():
            _generate(build_engine(target, drafter, _policy(method, k, target)), first, temp, config, max_tokens=8)


def _total_work(config: BenchConfig, reqs: list[Tokenized], configs: list[Configuration],
                peers: PeerRunner | None) -> int:
    """Progress units: max_tokens of every generation, peers included (they run at temperature 0 only)."""
    n_peer = len(peers.configurations()) * config.temperatures.count(0.0) if peers else 0
    per_pass = sum(t.request.max_tokens for t in reqs) * (len(configs) * len(config.temperatures) + n_peer)
    return per_pass * config.repeat


class _Session:
    """One benchmark's loop: repeats x temperatures x units x requests x configurations, into ``results``."""

    def __init__(self, config: BenchConfig, target: LlamaModel, configs: list[Configuration],
                 peers: PeerRunner | None, results: dict[str, Any], bar: Progress) -> None:
        self.config, self.target, self.configs, self.peers = config, target, configs, peers
        self.results, self.bar = results, bar
        self.done = 0  # progress units finished

    def run(self, reqs: list[Tokenized]) -> None:
        by_id = {t.request.id: t for t in reqs}
        for rep in range(self.config.repeat):
            for temp in self.config.temperatures:
                for unit in self.config.workload.units():
                    self._run_unit([by_id[r.id] for r in unit], temp, rep)
        self.bar.update(self.done)  # the last line a log shows is the finished one

    def _run_unit(self, unit: list[Tokenized], temp: float, rep: int) -> None:
        """Fresh drafters per unit (seeded by its first request): cross-request state learns from this group only."""
        seed = unit[0].seed
        engines = {(m, k): build_engine(self.target, _build(m, self.target, self.config, temp, seed),
                                        _policy(m, k, self.target))
                   for m, k in self.configs}
        for tok in unit:
            self._run_request(tok, engines, temp, rep)

    def _run_request(self, tok: Tokenized, engines: dict[Configuration, Engine], temp: float, rep: int) -> None:
        """Every configuration on one request, plain first, then the peers; greedy outputs checked against plain."""
        req = tok.request
        plain_ids: list[int] = []
        plain_text = ""
        for method, k in self.configs:  # interleaved: every configuration, then the next request
            self.bar.update(self.done, f"{req.id[:40]} {method}{f' k={k}' if k else ''} T={temp:g} rep {rep + 1}")
            gen = _generate(engines[(method, k)], tok, temp, self.config)
            identical = None
            if method == PLAIN:
                plain_ids, plain_text = gen.output_ids, gen.text
            elif temp == 0.0:
                identical = gen.output_ids == plain_ids
                if not identical:
                    self._mismatch(req, method, k, rep, plain_ids, gen.output_ids)
            self.results["runs"].append(run_record(req, method, k, temp, rep, tok.seed, gen, identical))
            self.done += req.max_tokens
        if self.peers is not None and temp == 0.0:
            self.bar.update(self.done, f"{req.id[:40]} llama.cpp peers rep {rep + 1}")
            self.results["peers"].extend(self.peers.run_request(tok, temp, rep, plain_text))
            self.done += req.max_tokens * len(self.peers.configurations())

    def _mismatch(self, req: Request, method: str, k: int, rep: int, plain: list[int], got: list[int]) -> None:
        """Record a greedy output that differs from plain decoding: loudly under --exact on (a bug),
        as a note under --exact off (near-ties may flip there by design)."""
        rec = mismatch_record(self.target, req, method, k, rep, plain, got)
        bar = "!" * 100 if self.target.shapes.exact else "-" * 100
        print("\n" + bar + "\n" + rec["message"] + "\n" + bar, file=sys.stderr)
        self.results["mismatches"].append(rec)


def _cost_curve(config: BenchConfig, target: LlamaModel, prompt_ids: list[int], progress: bool) -> dict[str, Any]:
    """The verification cost curve t(n) on a separate copy of the target (``calibration.curve.bench_curve``), with a
    progress bar."""
    from ..calibration.curve import bench_curve

    return bench_curve(target.path, prompt_ids, n_max=config.cost_max_n, depth=config.cost_depth,
                   reps=config.cost_reps, n_threads=target.n_threads, n_ctx=target.n_ctx, progress=progress)


def _generate(engine: Engine, tok: Tokenized, temp: float, config: BenchConfig,
              max_tokens: int | None = None) -> Generation:
    """One generation of one request, drafting as its engine's policy says (``_policy``)."""
    sampling = SamplingParams(temperature=temp, top_k=config.top_k, top_p=config.top_p, min_p=config.min_p,
                              seed=tok.seed)
    n = tok.request.max_tokens if max_tokens is None else min(max_tokens, tok.request.max_tokens)
    return engine.generate(tok.prompt_ids, GenerationConfig(max_tokens=n, sampling=sampling)).run()


def _build(method: str, target: LlamaModel, config: BenchConfig, temp: float, seed: int) -> Drafter:
    """A fresh drafter for ``method`` (the part before '@'), seeded per request."""
    options = {**config.drafter_options, "seed": seed}
    return build_drafter(split_method(method)[0], target, options, temp)


def _policy(method: str, k: int, target: LlamaModel) -> DraftLengthPolicy:
    """A fixed k (plain: k = 0, a valid policy all the same) or the adaptive policy named after '@', capped at k
    and built exactly as ``generate --k-policy NAME --k-max k`` builds it."""
    name = split_method(method)[1]
    if name is None:
        return build_policy("fixed", max(k, 1))
    return build_policy(name, adaptive_start(k), k_max=k, target=target)
