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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import zlib
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from ..commands.common import build_policy, drafter_options
from ..drafters import BuildContext, create
from ..engine import Engine, GenerationConfig
from ..errors import ContextOverflowError, InvalidParameterError
from ..sampling import SamplingParams
from ..target import LlamaModel
from ..ui import Progress
from .workloads import Request, Workload

RESULTS_VERSION = 1
PLAIN = "none"
DEFAULT_K_MAX = 16  # the cost policy's own cap (draft_length.make_policy); demo and tune cap adaptive k here


@dataclass
class BenchConfig:
    """Everything that decides what runs; stored verbatim in results.json."""

    workload: Workload
    methods: list[str]  # speculative methods; plain ("none") always runs too
    ks: list[int]
    k_max: int | None = None  # cap for METHOD@POLICY; None: the largest of ks
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    repeat: int = 1
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    drafter_options: dict[str, Any] = field(default_factory=dict)
    cost_curve: bool = True
    cost_max_n: int = 32
    cost_depth: int = 200
    cost_reps: int = 7
    warmup: bool = True
    llama_cpp_bin: Path | None = None
    peers: list[str] = field(default_factory=lambda: ["auto"])

    def __post_init__(self) -> None:
        self.methods = [m for m in dict.fromkeys(self.methods) if m != PLAIN]
        if not self.ks or any(k < 1 for k in self.ks):
            raise InvalidParameterError(f"-k needs draft lengths >= 1 (got {self.ks})")
        if any(k > 62 for k in [*self.ks, self.k_max or 1]):
            raise InvalidParameterError("k must be <= 62: verification batches stay under 64 tokens (see README)")
        if self.k_max is not None and self.k_max < 1:
            raise InvalidParameterError(f"--k-max must be >= 1 (got {self.k_max})")
        if self.drafter_options.get("cache_path") is not None:
            raise InvalidParameterError("cache_path is not allowed in a benchmark: a suffix tree saved across runs "
                                        "would already hold the outputs being measured (drafters are built fresh "
                                        "per group)")
        if self.repeat < 1:
            raise InvalidParameterError(f"--repeat must be >= 1 (got {self.repeat})")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise InvalidParameterError(f"--temp needs temperatures >= 0 (got {self.temperatures})")
        if self.cost_max_n < 1 or self.cost_reps < 1:
            raise InvalidParameterError("--cost-max-n and --cost-reps must be >= 1")

    def configurations(self) -> list[tuple[str, int]]:
        """(method, k) in run order for each request: plain first (the reference), then the rest.

        ``METHOD@POLICY`` (e.g. ``prompt-lookup@cost``) runs once with an
        adaptive k policy up to k_max (default: the largest --k); its k is that cap.
        """
        out: list[tuple[str, int]] = [(PLAIN, 0)]
        for m in self.methods:
            out += [(m, self.k_max or max(self.ks))] if "@" in m else [(m, k) for k in self.ks]
        return out


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Drafter options given on the command line (the shared flags of commands/common.py).

    Unset flags are left out so each drafter's config default applies; the seed is left out
    because the runner gives each request its own.
    """
    return {k: v for k, v in drafter_options(args).items() if v is not None and k != "seed"}


def adaptive_start(k_max: int) -> int:
    """The starting k of an adaptive policy capped at k_max (window and heuristic grow from it)."""
    return min(k_max, 4)


def request_seed(base: int, request_id: str) -> int:
    """A fixed seed per request: the same for every method, repeat and k."""
    return (base * 1_000_003 + zlib.crc32(request_id.encode())) % (2**31 - 1)


def machine_info(target: LlamaModel | None = None) -> dict[str, Any]:
    """Facts that explain a number: CPU, cores, load, versions."""
    from ..machine import sysinfo

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": sysinfo.cpu_model(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": sysinfo.physical_cores(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    from ..target import llama_version

    info["llama_cpp_python"] = llama_version()
    raw, _err = sysinfo.llama_system_info()
    info["llama_system_info"] = raw
    if target is not None:
        info["threads"] = target.n_threads
    return info


@dataclass
class _Tokenized:
    request: Request
    prompt_ids: list[int]
    seed: int


def run_bench(config: BenchConfig, target: LlamaModel, progress: bool = True, label: str = "bench") -> dict[str, Any]:
    """Run the whole benchmark; returns the results dict (see docs/bench.md for its fields).

    ``demo`` and ``tune`` are presets of this run: what they print is computed from this dict
    (``report.aggregate``), so all three measure and compare in one way.
    """
    wl = config.workload
    reqs = [_Tokenized(r, target.tokenize(r.prompt), request_seed(config.seed, r.id)) for r in wl.requests]
    by_id = {t.request.id: t for t in reqs}
    for t in reqs:
        need = len(t.prompt_ids) + t.request.max_tokens
        if need > target.capacity:
            raise ContextOverflowError(
                f"{wl.path}:{t.request.line}: request {t.request.id!r} needs {len(t.prompt_ids)} prompt tokens + "
                f"max_tokens {t.request.max_tokens} = {need} > context {target.capacity}; shorten the prompt, "
                "lower max_tokens or raise --ctx-size"
            )
    peers = _load_peers(config, target) if config.llama_cpp_bin else None
    configs = config.configurations()
    # Fail on a bad method name or draft model before anything runs, and warm up: the first
    # evaluations allocate buffers and fault in weights, which would count against the first method.
    first = reqs[0]
    drafters = {(m, k): _build(m, target, config, config.temperatures[0], first.seed) for m, k in configs}
    if config.warmup:
        for (method, k), drafter in drafters.items():
            _generate(Engine(target, drafter, _policy(method, k, target)), first, k, config.temperatures[0], config, max_tokens=8)
    del drafters

    results: dict[str, Any] = {
        "version": RESULTS_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": _config_dict(config, target),
        "machine": machine_info(target),
        "workload": {
            "name": wl.name,
            "path": str(wl.path),
            "requests": [{**t.request.to_dict(), "line": t.request.line, "prompt_ids": t.prompt_ids,
                          "seed": t.seed} for t in reqs],
        },
        "runs": [],
        "peers": [],
        "mismatches": [],
        "cost_curve": None,
        "interrupted": False,
    }
    runs, mismatches = results["runs"], results["mismatches"]
    n_peer = len(peers.configurations()) * config.temperatures.count(0.0) if peers else 0
    work_per_pass = sum(t.request.max_tokens for t in reqs) * (len(configs) * len(config.temperatures) + n_peer)
    bar = Progress(f"{label} {wl.name}", work_per_pass * config.repeat, unit="tokens", quiet=not progress)
    done = 0
    try:
        for rep in range(config.repeat):
            for temp in config.temperatures:
                for unit in wl.units():
                    # Fresh drafters per unit: cross-request state learns from this group only.
                    seed = by_id[unit[0].id].seed
                    engines = {(m, k): Engine(target, _build(m, target, config, temp, seed), _policy(m, k, target))
                               for m, k in configs}
                    for req in unit:
                        tok = by_id[req.id]
                        plain_ids: list[int] = []
                        plain_text = ""
                        for method, k in configs:  # interleaved: every configuration, then the next request
                            bar.update(done, f"{req.id[:40]} {method}{f' k={k}' if k else ''} T={temp:g} rep {rep + 1}")
                            gen = _generate(engines[(method, k)], tok, k, temp, config)
                            identical = None
                            if method == PLAIN:
                                plain_ids, plain_text = gen.output_ids, gen.text
                            elif temp == 0.0:
                                identical = gen.output_ids == plain_ids
                                if not identical:
                                    mismatches.append(_report_mismatch(target, req, method, k, rep, plain_ids, gen.output_ids))
                            runs.append(_run_record(req, method, k, temp, rep, tok.seed, gen, identical))
                            done += req.max_tokens
                        if peers is not None and temp == 0.0:
                            bar.update(done, f"{req.id[:40]} llama.cpp peers rep {rep + 1}")
                            results["peers"].extend(peers.run_request(tok, temp, rep, plain_text))
                            done += req.max_tokens * len(peers.configurations())
        bar.update(done)  # the last line a log shows is the finished one
    except KeyboardInterrupt:
        results["interrupted"] = True
        print(f"\n{label}: interrupted; keeping the runs finished so far", file=sys.stderr)
    finally:
        bar.close()
    if config.cost_curve and not results["interrupted"]:
        from .costcurve import measure

        print(f"bench: measuring the verification cost curve t(n), n = 1..{config.cost_max_n} "
              f"({config.cost_reps} reps)", file=sys.stderr)
        results["cost_curve"] = measure(
            target.path, reqs[0].prompt_ids, n_max=config.cost_max_n, depth=config.cost_depth,
            reps=config.cost_reps, n_threads=target.n_threads, n_ctx=target.n_ctx,
        )
    results["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    # What is written is what a re-render reads: round-trip through JSON once.
    return json.loads(json.dumps(results))


def _generate(engine: Engine, tok: _Tokenized, k: int, temp: float, config: BenchConfig,
              max_tokens: int | None = None):
    """One generation of one request; k=0 (plain) still needs a valid config value."""
    sampling = SamplingParams(temperature=temp, top_k=config.top_k, top_p=config.top_p, min_p=config.min_p,
                              seed=tok.seed)
    n = tok.request.max_tokens if max_tokens is None else min(max_tokens, tok.request.max_tokens)
    return engine.generate(tok.prompt_ids, GenerationConfig(max_tokens=n, k=max(k, 1), sampling=sampling)).run()


def _build(method: str, target: LlamaModel, config: BenchConfig, temp: float, seed: int):
    options = {**config.drafter_options, "seed": seed}
    return create(method.split("@")[0], BuildContext(target=target, options=options, temperature=temp))


def _policy(method: str, k: int, target: LlamaModel):
    """None (fixed k from the config) or the adaptive policy named after '@', capped at k and
    built exactly as ``generate --k-policy NAME --k-max k`` builds it."""
    if "@" not in method:
        return None
    name = method.split("@", 1)[1]
    return build_policy(argparse.Namespace(k_policy=name, k=adaptive_start(k), k_max=k), target)


def _run_record(req: Request, method: str, k: int, temp: float, rep: int, seed: int, gen, identical) -> dict[str, Any]:
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


def _report_mismatch(target: LlamaModel, req: Request, method: str, k: int, rep: int,
                     plain: list[int], got: list[int]) -> dict[str, Any]:
    i = next((j for j, (a, b) in enumerate(zip(plain, got)) if a != b), min(len(plain), len(got)))
    show = lambda ids: repr(target.detokenize(ids[i : i + 1])) if i < len(ids) else "<end>"  # noqa: E731
    msg = (f"MISMATCH: {method} k={k} on request {req.id!r} (repeat {rep + 1}, temperature 0) differs from plain "
           f"decoding at output token {i}: plain {plain[i] if i < len(plain) else None} {show(plain)}, "
           f"{method} {got[i] if i < len(got) else None} {show(got)}. Greedy speculation must be lossless: this is a bug.")
    print("\n" + "!" * 100 + "\n" + msg + "\n" + "!" * 100, file=sys.stderr)
    return {"request": req.id, "method": method, "k": k, "repeat": rep, "first_difference": i,
            "plain_len": len(plain), "len": len(got), "message": msg}


def _config_dict(config: BenchConfig, target: LlamaModel) -> dict[str, Any]:
    d = asdict(config)
    d.pop("workload")
    d["workload"] = config.workload.name
    d["llama_cpp_bin"] = str(config.llama_cpp_bin) if config.llama_cpp_bin else None
    d["drafter_options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in config.drafter_options.items()}
    d["methods"] = [PLAIN] + config.methods
    d["target"] = {
        "path": str(target.path),
        "name": target.path.name,
        "n_ctx": target.n_ctx,
        "capacity": target.capacity,
        "n_vocab": target.n_vocab,
        "threads": target.n_threads,
        # --experts N: every result of this run comes from a reduced model and is labelled lossy
        "experts_used": next((v for k, v in target.config.kv_overrides if k.endswith("expert_used_count")), None),
        "lossy": any(k.endswith("expert_used_count") for k, _ in target.config.kv_overrides),
    }
    draft = config.drafter_options.get("draft_model")
    d["draft"] = {"path": str(draft), "name": Path(draft).name} if draft else None
    return d


# -- peers (llama.cpp's own binaries) ---------------------------------------------------------

# Which llama.cpp peers stand beside each specstack method when --peers is "auto".
PEERS_FOR: dict[str, tuple[str, ...]] = {
    PLAIN: ("llama-plain",),
    "draft-model": ("llama-draft-simple",),
    "prompt-lookup": ("llama-ngram-simple", "llama-lookup"),
    "suffix": ("llama-ngram-cache",),
}


def peer_methods(config: BenchConfig, known: Sequence[str]) -> list[str]:
    """The peer methods to run: config.peers ("auto", "all" or names) checked against ``known``."""
    if config.peers in (["auto"], []):
        methods = [PLAIN, *(m.split("@")[0] for m in config.methods)]  # prompt-lookup@cost -> prompt-lookup
        names = list(dict.fromkeys(p for m in methods for p in PEERS_FOR.get(m, ())))
    elif config.peers == ["all"]:
        names = list(known)
    else:
        names = list(config.peers)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InvalidParameterError(f"unknown llama.cpp peer {unknown[0]!r}; choose from: {', '.join(known)}, or auto / all")
    if "llama-plain" not in names:
        names.insert(0, "llama-plain")  # the peers' own baseline
    return list(dict.fromkeys(names))


def _load_peers(config: BenchConfig, target: LlamaModel) -> "_Peers":
    try:
        from . import peers  # llama.cpp binaries; imported only when asked for
    except ImportError as exc:
        raise InvalidParameterError(
            f"--llama-cpp-bin needs specstack.bench.peers, which is not available ({exc}); run without --llama-cpp-bin"
        ) from None
    peers.bin_dir(config.llama_cpp_bin)  # a clear error now, not after the first request
    return _Peers(peers, config, target)


class _Peers:
    """Runs llama.cpp's binaries on each request right after specstack's runs of it (greedy only)."""

    def __init__(self, module: Any, config: BenchConfig, target: LlamaModel) -> None:
        self.module, self.config = module, config
        self.methods = peer_methods(config, module.PEER_METHODS)
        self.model, self.threads, self.ctx = target.path, target.n_threads, target.n_ctx
        self.draft = config.drafter_options.get("draft_model")

    def configurations(self) -> list[tuple[str, int]]:
        fixed = {"llama-plain": 0, "llama-ngram-cache": getattr(self.module, "NGRAM_CACHE_DRAFT", 8)}
        out: list[tuple[str, int]] = []
        for m in self.methods:
            out.extend([(m, fixed[m])] if m in fixed else [(m, k) for k in self.config.ks])
        return out

    def run_request(self, tok: _Tokenized, temp: float, rep: int, plain_text: str) -> list[dict[str, Any]]:
        if temp != 0.0:
            return []  # the peer runners are greedy (--temp 0 --top-k 1)
        out = []
        req = tok.request
        for method, k in self.configurations():
            rec: dict[str, Any] = {"request": req.id, "category": req.category, "method": method, "k": k,
                                   "temperature": temp, "repeat": rep}
            try:
                res = self.module.run_peer(method, self.model, req.prompt, draft=self.draft, n_predict=req.max_tokens,
                                           threads=self.threads, k=max(k, 1), ctx=self.ctx, seed=tok.seed,
                                           bins=self.config.llama_cpp_bin)
                rec.update({
                    "k": res.get("k", k),
                    "tokens_per_second": res.get("tok_per_s"),
                    "n_tokens": res.get("n_predicted"),
                    "n_drafted": res.get("n_drafted"),
                    "n_accepted": res.get("n_accepted"),
                    "acceptance_rate": res.get("acceptance"),
                    "decode_s": res.get("decode_s"),
                    "same_text_as_plain": _agrees(plain_text, res.get("text")),
                    "command": [str(c) for c in res.get("command", [])],
                })
            except Exception as exc:  # noqa: BLE001 - a failing peer must not lose specstack's runs
                rec["error"] = f"{type(exc).__name__}: {exc}"
                print(f"\nbench: llama.cpp peer {method} k={k} failed on {req.id!r}: {rec['error']}", file=sys.stderr)
            out.append(rec)
        return out


_EOS_MARKS = (" [end of text]", "[end of text]", "<|endoftext|>")


def _agrees(ours: str, theirs: str | None) -> bool | None:
    """Whether a peer's text matches ours up to the shorter one (the speculative binaries overshoot
    n_predict by up to k tokens, and print an end-of-text marker)."""
    if theirs is None:
        return None
    a, b = ours.rstrip(), theirs.rstrip()
    for mark in _EOS_MARKS:
        b = b.removesuffix(mark).rstrip()
    return a.startswith(b) or b.startswith(a)
