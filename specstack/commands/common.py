"""Flags shared by the commands that run models (generate, demo, bench, tune, serve).

Flag names follow llama.cpp where one exists (-m, -md, -n, -t, -c, --temp,
--top-k, --top-p, --min-p, --seed) and mirror config field names otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..costs import calibrate, ensure_shapes
from ..draft_length import POLICIES, DraftLengthPolicy, make_policy
from ..drafters import BuildContext, available, create
from ..drafters.base import Drafter
from ..paths import DEFAULT_DRAFT, DEFAULT_TARGET
from ..sampling import SamplingParams
from ..recurrent import DEFAULT_DEPTH, STRATEGIES
from ..target import LlamaModel, ModelConfig, set_verbose


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("-m", "--model", type=Path, default=DEFAULT_TARGET, help="target GGUF (default: bundled pycoder-6m)")
    g.add_argument("-md", "--model-draft", type=Path, default=DEFAULT_DRAFT, help="draft GGUF for --drafter draft-model (default: bundled pycoder-1m)")
    g.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: number of physical cores)")
    g.add_argument("-c", "--ctx-size", type=int, default=0, help="context size in tokens (default: the model's trained context)")
    g.add_argument("--exact", choices=("on", "off"), default="on",
                   help="on (default): keep every target call in the batch shapes measured to compute exactly as plain "
                   "decoding (pad one-token steps where a one-row call differs, as on F16; split verification where a larger "
                   "call differs, as on some Q4_K_M models), so greedy speculative output is identical to plain output. "
                   "off: never pad or split: faster plain steps on such models, but speculative output may then differ from "
                   "plain decoding at near-ties (see README, Exactness)")
    g.add_argument("--experts", type=int, default=None,
                   help="LOSSY: run an MoE target with this many active experts (llama.cpp's expert_used_count "
                   "override). Faster, but the output is no longer the model's; it is labelled lossy everywhere. "
                   "For a lossless speed-up use --drafter moe-self")
    g.add_argument("--rollback", choices=STRATEGIES, default="auto",
                   help="recurrent and hybrid targets (Mamba, RWKV, LFM2, Jamba, Qwen3.5, ...): how rejected draft tokens "
                   "leave the model's state. auto (default): llama.cpp's rollback where the architecture supports it, else "
                   "checkpoint; rollback: insist on it (error where unsupported); checkpoint: save the state before each "
                   "draft and restore it after a rejection (any architecture; costs a copy per drafted step). "
                   "Ignored for attention-only models")
    g.add_argument("--rollback-depth", type=int, default=DEFAULT_DEPTH,
                   help=f"rollback: recurrent-state snapshots per sequence (llama.cpp's n_rs_seq); drafts are capped at this "
                   f"minus one (default {DEFAULT_DEPTH}); memory for the recurrent state grows with it")
    g.add_argument("--verbose", action="store_true", help="show llama.cpp's own log")


def add_drafter_args(p: argparse.ArgumentParser, default: str = "prompt-lookup") -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--drafter", default=default,
                   help=f"draft source: {', '.join(n for n in available() if n not in ('cascade', 'fusion'))}, or an ordered fallback list "
                   f"cascade:SRC,SRC,... such as cascade:suffix,prompt-lookup,draft-model, or a fused tree fusion:suffix,draft-model "
                   f"(default: {default})")
    g.add_argument("--cascade-min-len", dest="cascade_min_len", type=int, default=None,
                   help="cascade: tokens a source must offer before later sources are skipped (default 3)")
    g.add_argument("--k-policy", choices=POLICIES, default="cost",
                   help="how k is chosen each step: cost (default: maximise expected tokens/s from measured costs and acceptance), "
                   "fixed (always -k), window (research controller), heuristic (+2/-1, as in transformers)")
    g.add_argument("-k", "--draft-max", dest="k", type=int, default=4,
                   help="draft tokens per step for --k-policy fixed, the starting k for window and heuristic; the cost "
                   "policy chooses k itself up to --k-max (default 4, at most 62)")
    g.add_argument("--k-max", type=int, default=None, help="upper bound on k for adaptive policies (default: 16 for cost, 24 window, 32 heuristic)")
    g.add_argument("--ngram-min", dest="n_min", type=int, default=None, help="prompt-lookup: shortest n-gram to match (default 1)")
    g.add_argument("--ngram-max", dest="n_max", type=int, default=None, help="prompt-lookup: longest n-gram to match (default 4)")
    g.add_argument("--draft-temp", dest="draft_temp", type=float, default=None, help="draft-model: sampling temperature of the draft (default: the target's); output stays the target's distribution")
    g.add_argument("--draft-p-min", dest="p_min", type=float, default=None, help="draft-model: stop drafting when the draft's confidence is below this (default 0)")
    g.add_argument("--suffix-factor", dest="max_spec_factor", type=float, default=None, help="suffix: cap a draft at this factor x the match length (default 1.0)")
    g.add_argument("--suffix-cache", dest="cache_path", type=Path, default=None, help="suffix: file to load the global tree from and save it to, so it survives restarts")
    g.add_argument("--min-token-prob", dest="min_token_prob", type=float, default=None, help="suffix/rest: stop a draft when its path probability falls below this")
    g.add_argument("--datastore", type=Path, default=None, help="rest: datastore folder from `specstack datastore build`")
    g.add_argument("--tree", action="store_true", default=None,
                   help="suffix/rest: draft token trees and verify all branches in one batch (greedy only; "
                   "with sampling the best branch is verified)")
    g.add_argument("--tree-branches", type=int, default=8, help="most branches a tree draft may have (default 8)")
    g.add_argument("--draft-experts", dest="draft_experts", type=int, default=None,
                   help="moe-self: active experts in the self-draft (default 1); output stays the full model's")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (identical in plain and speculative decoding)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default 0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability; 0 = off")
    g.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)


def load_target(args: argparse.Namespace, slots: int = 1) -> LlamaModel:
    """The target with its exact batch shapes settled (measured once per model and cached)."""
    set_verbose(getattr(args, "verbose", False))
    # A one-slot target can verify tree drafts (fusion, --tree): several llama.cpp sequences in a
    # unified KV cache gave bit-identical chain logits, so plain decoding is unaffected.
    branches = max(1, getattr(args, "tree_branches", 8))
    overrides: tuple[tuple[str, int], ...] = ()
    if getattr(args, "experts", None) is not None:
        from ..drafters.moe_self import expert_override

        overrides = (expert_override(args.model, args.experts, "--experts"),)
    target = LlamaModel(ModelConfig(path=args.model, n_ctx=args.ctx_size, n_threads=args.threads,
                                    n_seq_max=branches, n_slots=slots, kv_overrides=overrides,
                                    rollback=getattr(args, "rollback", "auto"),
                                    rollback_depth=getattr(args, "rollback_depth", DEFAULT_DEPTH)), role="target")
    ensure_shapes(target, exact=getattr(args, "exact", "on") == "on")
    return target


def experts(args: argparse.Namespace) -> dict[str, Any] | None:
    """An MoE target's experts: how many it has, uses by default, and runs with; ``lossy`` if fewer.

    None for a dense target.  Every output of a reduced-expert run carries this label.
    """
    from ..gguf_meta import read_gguf

    meta = read_gguf(args.model, tensors=False)
    if not meta.expert_count:
        return None
    used = meta.expert_used_count
    running = getattr(args, "experts", None) or used
    return {"count": meta.expert_count, "model_used": used, "used": running, "lossy": running != used}


def lossy_label(info: dict[str, Any] | None) -> str | None:
    if not info or not info["lossy"]:
        return None
    return (f"LOSSY: the target runs {info['used']} of {info['count']} experts (the model uses {info['model_used']}); "
            "output is not the model's own")


def build_policy(args: argparse.Namespace, target: LlamaModel) -> DraftLengthPolicy:
    """The --k-policy object; the cost policy calibrates t(n) first (cached on disk)."""
    name = getattr(args, "k_policy", "fixed")
    costs = None
    if name == "cost":
        k_max = args.k_max or 16
        costs = calibrate(target, n_max=k_max + 1)  # load_target settled the shapes (--exact)
    return make_policy(name, args.k, costs=costs, k_max=args.k_max)


def drafter_options(args: argparse.Namespace) -> dict[str, Any]:
    """Drafter config fields by name; None values mean 'use the config default'."""
    return {
        "draft_model": getattr(args, "model_draft", None),
        "n_min": getattr(args, "n_min", None),
        "n_max": getattr(args, "n_max", None),
        "draft_temp": getattr(args, "draft_temp", None),
        "p_min": getattr(args, "p_min", None),
        "seed": getattr(args, "seed", None),
        "max_spec_factor": getattr(args, "max_spec_factor", None),
        "cache_path": getattr(args, "cache_path", None),
        "min_token_prob": getattr(args, "min_token_prob", None),
        "datastore": getattr(args, "datastore", None),
        "cascade_min_len": getattr(args, "cascade_min_len", None),
        "tree": getattr(args, "tree", None),
        "draft_experts": getattr(args, "draft_experts", None),
    }


def build_drafter(name: str, target: LlamaModel, args: argparse.Namespace) -> Drafter:
    return create(name, BuildContext(target=target, options=drafter_options(args), temperature=getattr(args, "temp", 0.0)))
