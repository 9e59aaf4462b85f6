"""llama.cpp's own binaries beside specstack's runs (``bench run --llama-cpp-bin DIR``, ``--peer-kernels``).

Which peers stand beside which method, and running them on a request right after
specstack's runs of it, on llama.cpp's stock CPU kernels, on specstack's, or on both back to
back (each record says which: the kernels' gain apart from the drafting's).  The binaries
themselves are driven by ``peers.py`` (``run_peer``), imported only when peers are asked for.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

from ..drafters.base import llama_peers
from ..errors import InvalidParameterError
from .config import BenchConfig, split_method
from .records import Tokenized
from .results import PLAIN

PeerConfiguration = tuple[str, int, str]  # (peer method, k, kernels)

# Which llama.cpp peers stand beside each specstack method when --peers is "auto": as each drafter declares them
# (``drafters.base.LlamaCpp``; plain decoding, ``PLAIN``, is the ``none`` drafter's)
PEERS_FOR: dict[str, tuple[str, ...]] = llama_peers()
_EOS_MARKS = (" [end of text]", "[end of text]", "<|endoftext|>")


def peer_methods(config: BenchConfig, known: Sequence[str]) -> list[str]:
    """The peer methods to run: config.peers ("auto", "all" or names) checked against ``known``."""
    if config.peers in (["auto"], []):
        methods = [PLAIN, *(split_method(m)[0] for m in config.methods)]  # prompt-lookup@cost -> prompt-lookup
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


def load_peers(config: BenchConfig, target: Any) -> PeerRunner:
    """The peer runner, failing now (not after the first request) on a missing module or binary folder."""
    peers, folders = peer_folders(config)
    return PeerRunner(peers, config, target, folders)


def peer_folders(config: BenchConfig) -> tuple[Any, dict[str, Path]]:
    """The peers module and the checked bin folder of each kernel set the config asks for (``bench run`` asks
    before loading the model): a missing specstack-kernel folder is one line naming the command that builds it."""
    try:
        from . import peers  # llama.cpp binaries; imported only when asked for
    except ImportError as exc:
        raise InvalidParameterError(
            f"--llama-cpp-bin needs specstack.bench.peers, which is not available ({exc}); run without --llama-cpp-bin"
        ) from None
    return peers, peers.kernel_folders(config.peer_kernel_sets, config.llama_cpp_bin)


def peer_label(method: str, kernels: str | None) -> str:
    """A peer row's name, saying which kernels its binary ran (a record from before --peer-kernels: stock)."""
    return f"{method} [{kernels or 'stock'} kernels]"


class PeerRunner:
    """Runs llama.cpp's binaries on each request right after specstack's runs of it (greedy only).

    ``target`` needs only ``path``, ``n_threads`` and ``n_ctx``: the binaries load the model themselves.
    ``folders`` maps each kernel set to its bin folder (``peers.kernel_folders``, checked); without it, the
    config's kernel sets with --llama-cpp-bin for stock, left to ``run_peer`` to find and check.
    """

    def __init__(self, module: Any, config: BenchConfig, target: Any,
                 folders: dict[str, Path | None] | None = None) -> None:
        self.module, self.config = module, config
        self.folders: dict[str, Path | None] = dict(folders) if folders is not None else {
            k: (config.llama_cpp_bin if k == "stock" else None) for k in config.peer_kernel_sets}
        self.methods = peer_methods(config, module.PEER_METHODS)
        self.model: Path = target.path
        self.threads: int = target.n_threads
        self.ctx: int = target.n_ctx
        self.draft = config.drafter_options.get("draft_model")

    def configurations(self) -> list[PeerConfiguration]:
        """(peer, k, kernels) per request: each k of the run, except peers whose draft length is fixed, on each
        kernel set back to back (a noisy moment slows both alike, as specstack's configurations interleave)."""
        fixed = {"llama-plain": 0, "llama-ngram-cache": getattr(self.module, "NGRAM_CACHE_DRAFT", 8)}
        out: list[PeerConfiguration] = []
        for m in self.methods:
            for k in ([fixed[m]] if m in fixed else self.config.ks):
                out.extend((m, k, kernels) for kernels in self.folders)
        return out

    def run_request(self, tok: Tokenized, temp: float, rep: int, plain_text: str) -> list[dict[str, Any]]:
        """One record per peer configuration; a failing peer is recorded with its error, never raised."""
        if temp != 0.0:
            return []  # the peer runners are greedy (--temp 0 --top-k 1)
        return [self._run_one(cfg, tok, temp, rep, plain_text) for cfg in self.configurations()]

    def _run_one(self, cfg: PeerConfiguration, tok: Tokenized, temp: float, rep: int, plain_text: str) -> dict[str, Any]:
        method, k, kernels = cfg
        req = tok.request
        rec: dict[str, Any] = {"request": req.id, "category": req.category, "method": method, "k": k,
                               "kernels": kernels, "temperature": temp, "repeat": rep}
        try:
            res = self.module.run_peer(method, self.model, req.prompt, draft=self.draft, n_predict=req.max_tokens,
                                       threads=self.threads, k=max(k, 1), ctx=self.ctx, seed=tok.seed,
                                       bins=self.folders[kernels], kernels=kernels)
            rec.update(_peer_fields(res, k, plain_text))
        except Exception as exc:  # noqa: BLE001 - a failing peer must not lose specstack's runs
            rec["error"] = f"{type(exc).__name__}: {exc}"
            print(f"\nbench: llama.cpp peer {peer_label(method, kernels)} k={k} failed on {req.id!r}: {rec['error']}",
                  file=sys.stderr)
        return rec


def _peer_fields(res: dict[str, Any], k: int, plain_text: str) -> dict[str, Any]:
    """A peer record's measured fields, from what ``peers.run_peer`` parsed out of the binary's output."""
    return {
        "k": res.get("k", k),
        "tokens_per_second": res.get("tok_per_s"),
        "n_tokens": res.get("n_predicted"),
        "n_drafted": res.get("n_drafted"),
        "n_accepted": res.get("n_accepted"),
        "acceptance_rate": res.get("acceptance"),
        "decode_s": res.get("decode_s"),
        "same_text_as_plain": agrees(plain_text, res.get("text")),
        "command": [str(c) for c in res.get("command", [])],
    }


def agrees(ours: str, theirs: str | None) -> bool | None:
    """Whether a peer's text matches ours up to the shorter one (the speculative binaries overshoot
    n_predict by up to k tokens, and print an end-of-text marker)."""
    if theirs is None:
        return None
    a, b = ours.rstrip(), theirs.rstrip()
    for mark in _EOS_MARKS:
        b = b.removesuffix(mark).rstrip()
    return a.startswith(b) or b.startswith(a)
