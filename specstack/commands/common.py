"""Flags shared by the commands that run models (generate, demo, bench, tune, serve).

Flag names follow llama.cpp where one exists (-m, -md, -n, -t, -c, --temp,
--top-k, --top-p, --min-p, --seed) and mirror config field names otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

from ..bench.config import split_method
from ..calibration import EXACT_MODES, Calibration
from ..draft_length import DEFAULT_K, DEFAULT_K_MAX, POLICIES
from ..drafters import DEFAULT_DRAFTER, draft_model
from ..drafters.base import check_name, plain_drafters, reads_draft_model, reads_head
from ..drafters.options import (DRAFTER_FLAGS, REQUEST_OPTIONS, SHARED_OPTIONS, DrafterFlag, check_drafter_options,
                                inapplicable)
from .. import loading
from ..loading import DEFAULT_TREE_BRANCHES, RunSpec, SpeculationSpec, TargetSpec, resolve_draft
from ..paths import DEFAULT_TARGET
from ..constraints import Constraints
from ..sampling import SamplingParams
from ..llama.recurrent import DEFAULT_DEPTH, STRATEGIES
from ..llama.kv import DEFAULT_KV_TYPE, KV_TYPES, is_quantized
from ..llama import LlamaModel, flash_attention_is_exact, set_numa, set_verbose
from ..llama.target import DEFAULT_CTX
from ..gbnf import check_gbnf
from ..modelfile.meta import read_gguf
from ..errors import InvalidParameterError

__all__ = ["DRAFTER_FLAGS", "REQUEST_OPTIONS", "SHARED_OPTIONS", "DrafterFlag", "check_drafter_options", "inapplicable"]


def at_least(minimum: float, kind: Callable[[str], Any] = int) -> Callable[[str], Any]:
    """An argparse type: a finite ``kind`` (int or float) >= ``minimum``; otherwise argparse's own error naming the
    flag, exit status 2 (``--max-queue -1`` used to start a server that answered every request 429)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'} (got {text!r})")
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"must be a finite number (got {text!r})")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g} (got {text})")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("-m", "--model", type=Path, default=DEFAULT_TARGET, help="target GGUF (default: bundled pycoder-6m)")
    g.add_argument("-md", "--model-draft", type=Path, default=None,
                   help="draft GGUF for --drafter draft-model (default: the bundled pycoder-1m with the bundled target; "
                   "with your own -m, only if `specstack check` finds its vocabulary identical or compatible); for "
                   "eagle3 and dflash the trained head, for mtp on gemma4 its assistant")
    g.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: number of physical cores)")
    g.add_argument("-c", "--ctx-size", type=int, default=None,
                   help=f"context size in tokens per sequence (default {DEFAULT_CTX}, as llama.cpp, or the model's trained "
                   "context if shorter; 0 = the model's trained context). The KV cache's size is printed at load, and a "
                   "context whose cache cannot fit in memory is refused")
    g.add_argument("--exact", choices=EXACT_MODES, default="auto",
                   help="auto (default): measure, once per model and thread count (cached), what exact call shapes cost "
                   "here and keep them only where that is at most 3%% of a step, else run as off; every output says which "
                   "mode is in force and why. on: keep every target call in the batch shapes measured to compute exactly "
                   "as plain decoding (pad one-token steps where a one-row call differs, as on F16; split verification "
                   "where a larger call differs, as on Q4_K_M), so greedy speculative output is identical to plain "
                   "output at any price. off: never pad or split: faster, but speculative output may then differ from "
                   "plain decoding at near-ties, as every peer's does (see README, Exactness)")
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
    add_loading_args(g)


class _NoteGiven(argparse.Action):
    """Store the value and mark it as given on the command line (``<dest>_given``), not defaulted."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_given", True)


def add_drafter_args(p: argparse.ArgumentParser, default: str = DEFAULT_DRAFTER) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--drafter", default=default,
                   help=f"draft source: {', '.join(plain_drafters())}, or an ordered fallback list "
                   f"cascade:SRC,SRC,... such as cascade:suffix,prompt-lookup,draft-model, or a fused tree fusion:suffix,draft-model "
                   f"(default: {default})")
    g.add_argument("--k-policy", choices=POLICIES, default="cost",
                   help="how k is chosen each step: cost (default: maximise expected tokens/s from measured costs and "
                   "acceptance, up to --k-max; -k is not used), fixed (always -k), window (research controller, from -k), "
                   "heuristic (+2/-1 as in transformers, from -k)")
    g.add_argument("-k", "--draft-max", dest="k", type=int, default=4, action=_NoteGiven,
                   help="draft tokens per step under --k-policy fixed, and the starting k of window and heuristic "
                   "(default 4, at most 62). Not used by the default cost policy, which chooses k each step up to --k-max")
    g.add_argument("--k-max", type=int, default=None, help=f"upper bound on k for adaptive policies (default: {DEFAULT_K_MAX} for cost, 24 window, 32 heuristic)")
    g.add_argument("--tree-branches", type=int, default=8, help="most branches a tree draft may have (default 8)")
    add_drafter_flags(g)


def add_drafter_flags(g: argparse._ActionsContainer, skip: tuple[str, ...] = ()) -> None:
    """The flags of ``DRAFTER_FLAGS`` (less those named in ``skip``), unset (None) unless given,
    so each config's default applies."""
    for f in DRAFTER_FLAGS:
        if f.flag in skip:
            continue
        kind = {"action": "store_true"} if f.type is None else {"type": f.type}
        g.add_argument(f.flag, dest=f.dest, default=None, help=f.help_text(), **kind)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (identical in plain and speculative decoding)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default 0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability; 0 = off")
    g.add_argument("-s", "--seed", type=int, default=None, help="random seed for reproducible sampling (-1: random, as llama.cpp)")
    add_constraint_args(p)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)


def run_spec(args: argparse.Namespace, slots: int = 1, grammar: str | None = None) -> RunSpec:
    """The run a command's flags describe (``loading.RunSpec``), read here once and checked as flags, in the words
    typed: -fa against --exact, the drafter's name, drafter flags it would ignore, their values. What needs the
    model files (the grammar on its vocabulary, the MTP head, the draft's fit) is ``loading.preflight``'s."""
    settle_flash_attn(args)
    name = getattr(args, "drafter", None)
    speculation = None if name is None else speculation_spec(args, name)
    return RunSpec(target=target_spec(args, slots), speculation=speculation, temperature=getattr(args, "temp", 0.0),
                   grammar=grammar, note_mtp=name is not None and not flag_given(args, "--drafter"),
                   command=getattr(args, "command", "specstack"))


def speculation_spec(args: argparse.Namespace, name: str) -> SpeculationSpec:
    """How the command's flags speculate (``loading.SpeculationSpec``): the drafter ``name`` and its flags, checked
    (``check_drafter_flags``), and the k policy, k and k_max."""
    options = drafter_options(args)
    check_drafter_flags(name, options)
    policy = getattr(args, "k_policy", "fixed")
    if policy == "cost" and getattr(args, "k_given", False):  # the cost policy chooses every step's k itself
        print(f"specstack: note: -k {args.k} is not used by --k-policy cost, which chooses k each step up to --k-max "
              f"({args.k_max or DEFAULT_K_MAX}); use --k-policy fixed to draft {args.k} tokens per step", file=sys.stderr)
    return SpeculationSpec(drafter=name, k_policy=policy, k=getattr(args, "k", DEFAULT_K),
                           k_max=getattr(args, "k_max", None), options=options)


def check_drafter_flags(name: str, options: dict[str, Any]) -> None:
    """The drafter's name, drafter flags that the chosen drafters would ignore, and the flags' values, each
    refused naming its flag."""
    check_name(name)  # unknown names first
    unused = inapplicable(name, {f.dest for f in DRAFTER_FLAGS if options.get(f.dest) is not None})
    if unused is not None:
        raise InvalidParameterError(f"{unused.flag} applies to --drafter {' or '.join(sorted(unused.configs))}, which "
                                    f"{name!r} does not use; leave it out or choose one of those")
    try:
        check_drafter_options({k: v for k, v in options.items() if v is not None})
    except InvalidParameterError as exc:
        raise InvalidParameterError(_by_flag(str(exc))) from None


def uses_draft_model(names: list[str] | tuple[str, ...], where: str = "--methods") -> bool:
    """Whether any of these drafter names (plain, cascade or fusion; a bench method's ``@policy`` ignored) runs a
    drafter that reads -md (``Needs.draft_model``: draft-model)."""
    return any(reads_draft_model(split_method(n)[0], where) for n in names)


def flag_given(args: argparse.Namespace, *flags: str) -> bool:
    """Whether one of ``flags`` was typed on the command line (``main`` keeps it as ``args.argv``), as opposed to
    left at its default."""
    typed = {a.split("=", 1)[0] for a in getattr(args, "argv", ()) if a.startswith("-")}
    return any(f in typed for f in flags)


def methods_with_draft(args: argparse.Namespace, methods: list[str], explicit: bool, command: str) -> list[str]:
    """``methods`` (bench methods or drafter names) with -md settled: refused where none of them reads it, resolved
    (``resolve_draft``) where one does.  Without a usable draft, a default method list loses its draft-model
    entries (with a note) and a list the user typed is refused: the bundled draft is never a silent stand-in."""
    if not uses_draft_model(methods):
        if args.model_draft is not None and not any(reads_head(split_method(m)[0], "--methods") for m in methods):
            readers = [n for n in plain_drafters() if reads_draft_model(n) or reads_head(n)]
            raise InvalidParameterError(f"-md {args.model_draft} is read by {', '.join(readers)} only (a draft "
                                        f"model or a head), which none of {','.join(methods)} runs; leave -md out or "
                                        "add one of them")
        return methods  # a head's own check settles it
    try:
        args.model_draft = resolve_draft(read_gguf(args.model, tensors=False), args.model_draft, where=draft_model.NAME)
    except InvalidParameterError as exc:
        if explicit:
            raise
        print(f"specstack {command}: note: draft-model is left out of the default methods. {exc}", file=sys.stderr,
              flush=True)
        return [m for m in methods if not uses_draft_model([m])]
    return methods


def _by_flag(message: str) -> str:
    """A config error in the words the user typed: field names (n_min, p_min) become their flags.  Only names
    with an underscore: "tree" or "datastore" are also ordinary words of the messages."""
    for f in DRAFTER_FLAGS:
        if "_" in f.field:
            message = re.sub(rf"\b{re.escape(f.field)}\b", f.flag, message)
    return message


def target_spec(args: argparse.Namespace, slots: int = 1) -> TargetSpec:
    """The ``TargetSpec`` that a command's model flags describe (``loading`` builds from it)."""
    return TargetSpec(model=args.model, ctx=args.ctx_size, threads=args.threads, slots=slots,
                      exact=getattr(args, "exact", "on"), experts=getattr(args, "experts", None),
                      rollback=getattr(args, "rollback", "auto"),
                      rollback_depth=getattr(args, "rollback_depth", DEFAULT_DEPTH),
                      tree_branches=max(1, getattr(args, "tree_branches", DEFAULT_TREE_BRANCHES)),
                      **loading_options(args))


def target_from_args(args: argparse.Namespace, slots: int = 1) -> LlamaModel:
    """The target of the command's flags (``load_from_args``'s)."""
    return load_from_args(args, slots)[1].target


def load_from_args(args: argparse.Namespace, slots: int = 1, background: bool = False,
                   grammar: str | None = None) -> tuple[RunSpec, Calibration]:
    """The run of the command's flags (``run_spec``, ``grammar`` among them), its target loaded and calibrated by
    ``loading.load_run`` after every check that needs no load: the run with its draft settled, and the
    calibration (a cost curve where the policy prices; with ``background``, what the cache lacks measured beside
    the first generations)."""
    run = run_spec(args, slots, grammar)
    apply_process_flags(args)
    return loading.load_run(run, background=background)


def apply_process_flags(args: argparse.Namespace) -> None:
    """llama.cpp's flags for the whole process, set before any model loads: its log (-v, and serve's -lv N) and
    its NUMA strategy (--numa)."""
    verbose = bool(getattr(args, "verbose", False))
    set_verbose(verbose, None if verbose else getattr(args, "verbosity", None))
    if getattr(args, "numa", None) is not None:
        set_numa(NUMA[args.numa])


def drafter_options(args: argparse.Namespace) -> dict[str, Any]:
    """Drafter config fields by option name (``DRAFTER_FLAGS``); None values mean 'use the config default'."""
    options = {option: getattr(args, attr, None) for option, attr in SHARED_OPTIONS.items()}
    return options | {f.dest: getattr(args, f.dest, None) for f in DRAFTER_FLAGS}


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Drafter options given on the command line, for the bench runner (``BenchConfig.drafter_options``).

    Unset flags are left out so each drafter's config default applies; the seed is left out
    because the runner gives each request its own.
    """
    return {k: v for k, v in drafter_options(args).items() if v is not None and k != "seed"}


# -- llama.cpp's flags, where specstack means the same ------------------------------------------------------------

FLASH_ATTN = {"auto": None, "on": True, "off": False}
ON_CPU = "specstack runs models on the CPU (its exact call shapes are measured there)"


def gpu_layers(text: str) -> int:
    """-ngl: 0 is what specstack does anyway; any other value (99, all, auto) is refused, never ignored."""
    if text.strip() == "0":
        return 0
    raise argparse.ArgumentTypeError(f"{ON_CPU}, so -ngl 0 is the only value it takes (got {text!r}); leave -ngl "
                                     "out or pass 0")


def add_loading_args(g: argparse._ActionsContainer, unset: bool = False) -> None:
    """llama.cpp's loading flags, under its names and with its meanings (``loading.TargetSpec``).  ``unset``:
    every default None, so that a command can tell a flag given from one left out (``serve`` beside --config)."""

    def default(value: Any) -> Any:
        return None if unset else value

    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", type=gpu_layers, default=default(0),
                   metavar="N", help=f"layers offloaded to a GPU: {ON_CPU}, so 0 is accepted (as in llama.cpp command "
                   "lines) and any other value refused")
    g.add_argument("-fa", "--flash-attn", dest="flash_attn", choices=tuple(FLASH_ATTN), default=default("auto"),
                   nargs="?", const="on",  # a bare -fa is on, as older llama.cpp command lines write it
                   help="flash attention: bare -fa is on; auto (default: on exactly where --exact is off, since exact call shapes are "
                   "measured without it), on (needs exactness off: with --exact auto it runs as --exact off, with "
                   "--exact on it is refused) or off")
    g.add_argument("-b", "--batch-size", dest="batch_size", type=at_least(1), default=default(2048), metavar="N",
                   help="llama.cpp's logical batch; with -ub, one call decodes at most min(-b, -ub) rows (default 2048)")
    g.add_argument("-ub", "--ubatch-size", dest="ubatch_size", type=at_least(1), default=default(512), metavar="N",
                   help="llama.cpp's physical batch: the most rows one call decodes (default 512, as llama.cpp). "
                   "specstack's calls are a prefill chunk (128) or a verification batch, so it rarely matters")
    g.add_argument("-ctk", "--cache-type-k", dest="cache_type_k", type=cache_type, default=default(DEFAULT_KV_TYPE),
                   metavar="TYPE", help=f"the target's K cache type: {', '.join(KV_TYPES)} (default f16, as "
                   "llama.cpp). A quantized K cache (q8_0: 34 bytes per 32 values, 53%% of f16's) keeps --exact on: "
                   "exact call shapes are measured for each pair of types")
    g.add_argument("-ctv", "--cache-type-v", dest="cache_type_v", type=cache_type, default=default(DEFAULT_KV_TYPE),
                   metavar="TYPE", help="the target's V cache type, as -ctk (default f16). A quantized V cache needs "
                   "flash attention in llama.cpp, so it turns -fa on, as llama-server does, and with it --exact off "
                   "(refused with --exact on or -fa off)")
    g.add_argument("--mlock", action="store_true", default=default(False), help="keep the weights in RAM (llama.cpp's "
                   "--mlock: never swapped out)")
    g.add_argument("--no-mmap", dest="mmap", action="store_false", default=default(True),
                   help="read the weights into memory instead of mapping the file (llama.cpp's --no-mmap)")
    g.add_argument("-lm", "--load-mode", dest="load_mode", choices=LOAD_MODES, default=None, metavar="MODE",
                   help="how llama.cpp reads the weights: auto (default: mmap on a CPU), none (read into memory, as "
                   "--no-mmap), mmap, mlock (read and locked in RAM), mmap+mlock (as --mlock), dio (direct I/O where "
                   "the OS has it)")
    g.add_argument("-dio", "--direct-io", dest="load_mode", action="store_const", const="dio",
                   help="older llama.cpp's spelling of --load-mode dio")
    g.add_argument("-ndio", "--no-direct-io", dest="no_direct_io", action="store_true",
                   help="older llama.cpp's spelling for no direct I/O: the default")
    g.add_argument("-lzm", "--lazy-mode", dest="lazy_mode", choices=tuple(LAZY_MODES), default=None, metavar="MODE",
                   help="llama.cpp's on-demand reading of large tensors (per-layer embeddings): on, auto (default: "
                   "tensors over 4 GiB) or off")
    g.add_argument("--check-tensors", dest="check_tensors", action="store_true", default=None,
                   help="llama.cpp validates the weights' data as it loads them")
    g.add_argument("--repack", dest="repack", action="store_true", default=None,
                   help="llama.cpp repacks the weights for this CPU's kernels (the default)")
    g.add_argument("-nr", "--no-repack", dest="repack", action="store_false", default=None,
                   help="keep the weights as the file lays them out (slower; exact shapes are measured apart)")
    g.add_argument("-tb", "--threads-batch", dest="threads_batch", type=at_least(-1), default=None, metavar="N",
                   help="threads of llama.cpp calls of more than one row (prompt chunks, verification batches; "
                   "llama.cpp's n_threads_batch); default, 0 or -1: as -t")
    g.add_argument("--numa", dest="numa", choices=tuple(NUMA), default=None, metavar="TYPE",
                   help="llama.cpp's NUMA optimisations for this process (llama_numa_init): distribute, isolate or "
                   "numactl")
    g.add_argument("--override-kv", dest="override_kv", type=override_kv, action="append", default=None,
                   metavar="KEY=TYPE:VALUE,...", help="read these model metadata values in place of the GGUF's "
                   "(llama.cpp's kv_overrides; TYPE int, float, bool or str), e.g. "
                   "tokenizer.ggml.add_bos_token=bool:false")
    g.add_argument("-sp", "--special", dest="special", action="store_true", default=None,
                   help="output text spells special tokens out (<|im_end|>, <end_of_turn>), as llama.cpp's --special")
    g.add_argument("--rope-scaling", dest="rope_scaling", choices=tuple(ROPE_SCALING), default=None,
                   help="RoPE frequency scaling method: none, linear or yarn (default: the model's)")
    g.add_argument("--rope-scale", dest="rope_scale", type=positive_float, default=None, metavar="N",
                   help="RoPE context scaling factor: the context is stretched N times (--rope-freq-scale 1/N)")
    for flag, field, text in ROPE_FLAGS:
        g.add_argument(flag, dest=field, type=int if field == "yarn_orig_ctx" else float, default=None,
                       metavar="N", help=f"{text} (llama.cpp's {field}; default: the model's)")


def cache_type(text: str) -> str:
    """-ctk/-ctv: one of llama.cpp's KV cache types (``llama.kv.KV_TYPES``, common/arg.cpp's list)."""
    if text not in KV_TYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(KV_TYPES)} (got {text!r})")
    return text


def loading_options(args: argparse.Namespace) -> dict[str, Any]:
    """``TargetSpec``'s fields for llama.cpp's loading flags (defaults where a command has none of them)."""
    batch = min(getattr(args, "batch_size", None) or 2048, getattr(args, "ubatch_size", None) or 512)
    return {"flash_attn": FLASH_ATTN[getattr(args, "flash_attn", None) or "auto"], "batch": batch,
            "mmap": getattr(args, "mmap", None) is not False, "mlock": bool(getattr(args, "mlock", False)),
            "cache_type_k": getattr(args, "cache_type_k", None) or DEFAULT_KV_TYPE,
            "cache_type_v": getattr(args, "cache_type_v", None) or DEFAULT_KV_TYPE,
            **llama_load_values(args)}


def settle_quantized_v(args: argparse.Namespace, exact_flag: str = "--exact") -> None:
    """A quantized V cache (-ctv q8_0) needs flash attention: llama.cpp refuses one without it, and llama-server's
    -fa auto turns it on (llama_init_from_model).  So here -fa auto becomes on, which needs exactness off: -fa off
    and --exact on are refused (``loading.check_quantized_v``, in words naming -ctv, not a -fa never typed), and
    auto runs as off, with a note."""
    kind = getattr(args, "cache_type_v", None) or DEFAULT_KV_TYPE
    if not is_quantized(kind):
        return
    exact = getattr(args, "exact", None) or "auto"
    loading.check_quantized_v(kind, FLASH_ATTN[getattr(args, "flash_attn", None) or "auto"],
                              "off" if exact == "auto" else exact, exact_flag)
    if exact == "auto":
        print(f"specstack: note: -ctv {kind} turns flash attention on (-fa on, which llama.cpp needs for a quantized V "
              f"cache), so it runs with {exact_flag} off: greedy speculative output may differ from plain decoding at "
              f"near-ties; -ctk {kind} alone keeps exactness", file=sys.stderr)
    args.flash_attn, args.exact = "on", "off"


# llama.cpp's values of --load-mode (mmap, mlock) and --lazy-mode, --numa and --rope-scaling (their enums)
LOAD_MODES = ("auto", "none", "mmap", "mlock", "mmap+mlock", "dio")
LAZY_MODES = {"off": 0, "auto": 1, "on": 2}
NUMA = {"distribute": 1, "isolate": 2, "numactl": 3}
ROPE_SCALING = {"none": 0, "linear": 1, "yarn": 2}
# The RoPE/YaRN flags that set a llama_context_params field as given: (flag, field, help)
ROPE_FLAGS = (("--rope-freq-base", "rope_freq_base", "RoPE base frequency, used by NTK-aware scaling"),
              ("--rope-freq-scale", "rope_freq_scale", "RoPE frequency scaling factor: the context is stretched "
               "1/N times"),
              ("--yarn-orig-ctx", "yarn_orig_ctx", "YaRN: the model's original context size"),
              ("--yarn-ext-factor", "yarn_ext_factor", "YaRN: extrapolation mix factor (0.0 = full interpolation)"),
              ("--yarn-attn-factor", "yarn_attn_factor", "YaRN: scale sqrt(t) or attention magnitude"),
              ("--yarn-beta-slow", "yarn_beta_slow", "YaRN: high correction dim or alpha"),
              ("--yarn-beta-fast", "yarn_beta_fast", "YaRN: low correction dim or beta"))


def positive_float(text: str) -> float:
    """A finite number > 0 (--rope-scale N divides by it)."""
    value = at_least(0, float)(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def override_kv(text: str) -> list[tuple[str, int | float | bool | str]]:
    """--override-kv KEY=TYPE:VALUE,...: llama.cpp's model metadata overrides, each value of its TYPE (int, float,
    bool true/false, str of at most 127 bytes), as llama.cpp's ``string_parse_kv_override`` reads them."""
    out: list[tuple[str, int | float | bool | str]] = []
    for item in (part for part in text.split(",") if part):
        key, eq, rest = item.partition("=")
        kind, colon, value = rest.partition(":")
        if not (key and eq and colon) or len(key) > 127:
            raise argparse.ArgumentTypeError(f"{item!r} is not KEY=TYPE:VALUE (e.g. "
                                             "tokenizer.ggml.add_bos_token=bool:false)")
        try:
            typed: int | float | bool | str = {"int": int, "float": float, "str": str,
                                               "bool": lambda v: {"true": True, "false": False}[v]}[kind](value)
        except (KeyError, ValueError):
            raise argparse.ArgumentTypeError(f"{item!r}: TYPE must be int, float, bool (true/false) or str, and "
                                             "VALUE one of it") from None
        if isinstance(typed, str) and len(typed.encode()) > 127:
            raise argparse.ArgumentTypeError(f"{key}: a str value holds at most 127 bytes")
        out.append((key, typed))
    return out


def llama_load_values(args: argparse.Namespace) -> dict[str, Any]:
    """The ``TargetSpec`` (and a serve role's) fields of llama.cpp's further loading flags, only those given: -tb,
    --override-kv, --load-mode, --lazy-mode, --check-tensors, -nr, --special and RoPE/YaRN.  --load-mode says
    what --mlock and --no-mmap say (llama.cpp now has it in their place), so it goes with neither."""
    values: dict[str, Any] = {}
    if getattr(args, "threads_batch", None) is not None:
        values["threads_batch"] = max(0, args.threads_batch)
    overrides = [kv for group in getattr(args, "override_kv", None) or () for kv in group]
    if overrides:
        values["kv_overrides"] = tuple(overrides)
    mode = getattr(args, "load_mode", None)
    if mode is not None:
        given = [f for f, a, v in (("--mlock", "mlock", True), ("--no-mmap", "mmap", False)) if getattr(args, a) == v]
        if given:
            raise InvalidParameterError(f"--load-mode {mode} and {' and '.join(given)} each say how the weights are "
                                        "read; pass one of them (--load-mode mlock = --mlock --no-mmap)")
        if mode != "auto":
            values.update(mmap="mmap" in mode, mlock="mlock" in mode, direct_io=mode == "dio")
    model = [("lazy_mode", LAZY_MODES[args.lazy_mode])] if getattr(args, "lazy_mode", None) else []
    model += [("check_tensors", True)] if getattr(args, "check_tensors", None) else []
    if model:
        values["model_params"] = tuple(model)
    for key in ("repack", "special"):
        if getattr(args, key, None) is not None:
            values[key] = getattr(args, key)
    context = rope_params(args)
    if context:
        values["context_params"] = context
    return values


def rope_params(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """The llama_context_params RoPE/YaRN fields that --rope-scaling, --rope-scale and the --rope-freq-*/--yarn-*
    flags set (--rope-scale N is --rope-freq-scale 1/N; beside it --rope-freq-scale is refused: two scales)."""
    params: list[tuple[str, float]] = []
    if getattr(args, "rope_scaling", None) is not None:
        params.append(("rope_scaling_type", ROPE_SCALING[args.rope_scaling]))
    if getattr(args, "rope_scale", None) is not None:
        if getattr(args, "rope_freq_scale", None) is not None:
            raise InvalidParameterError("--rope-scale and --rope-freq-scale each give the RoPE scale (--rope-scale N "
                                        "is --rope-freq-scale 1/N); pass one of them")
        params.append(("rope_freq_scale", 1.0 / args.rope_scale))
    params += [(field, getattr(args, field)) for _, field, _ in ROPE_FLAGS if getattr(args, field, None) is not None]
    return tuple(params)


def settle_flash_attn(args: argparse.Namespace, exact_flag: str = "--exact") -> None:
    """-fa on needs exactness off on llama.cpp's stock CPU backend: under --exact on it is refused; under auto it
    runs as off, with a note.  Where specstack's backend runs, flash attention is exact and goes with every mode.
    A quantized V cache sets -fa on first (``settle_quantized_v``)."""
    settle_quantized_v(args, exact_flag)
    if getattr(args, "flash_attn", None) != "on" or flash_attention_is_exact():
        return
    exact = getattr(args, "exact", None) or "auto"
    if exact == "on":
        raise InvalidParameterError(f"-fa on cannot go with {exact_flag} on: exact call shapes are measured without "
                                    "flash attention (its one-row path depends on the KV length); use -fa auto, or "
                                    f"{exact_flag} off")
    if exact != "off":
        print(f"specstack: note: -fa on runs with {exact_flag} off (exact call shapes are measured without flash "
              "attention): greedy speculative output may differ from plain decoding at near-ties", file=sys.stderr)
        args.exact = "off"


def add_constraint_args(p: argparse.ArgumentParser, unset: bool = False) -> None:
    """llama.cpp's penalty and grammar flags (``constraints.Constraints``, exact under speculation).  ``unset``:
    every default None (``serve``: the role's defaults then apply)."""

    def default(value: Any) -> Any:
        return None if unset else value

    g = p.add_argument_group("logit controls (identical in plain and speculative decoding)")
    g.add_argument("--repeat-penalty", type=float, default=default(1.0), metavar="X",
                   help="penalize tokens seen in the last --repeat-last-n tokens of prompt and output (llama.cpp's "
                   "formula; 1 = off, the default)")
    g.add_argument("--repeat-last-n", type=at_least(-1), default=default(64), metavar="N",
                   help="tokens the penalties look back over (default 64; 0 = none, -1 = the whole context)")
    g.add_argument("--presence-penalty", type=float, default=default(0.0), metavar="X",
                   help="subtract X from tokens in that window (-2..2; default 0)")
    g.add_argument("--frequency-penalty", type=float, default=default(0.0), metavar="X",
                   help="subtract X per occurrence in that window (-2..2; default 0)")
    g.add_argument("--grammar", default=None, metavar="GBNF", help="constrain the output with a GBNF grammar "
                   "(llama.cpp's GBNF, run by llguidance; the tokens it forces are drafted; exact under speculation)")
    g.add_argument("--grammar-file", type=Path, default=None, metavar="FILE", help="read the GBNF grammar from FILE")
    g.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                   help="constrain the output to JSON matching this JSON schema (e.g. '{}' for any JSON object)")
    g.add_argument("-jf", "--json-schema-file", type=Path, default=None, metavar="FILE",
                   help="read the JSON schema from FILE")


def json_schema_text(args: argparse.Namespace) -> str | None:
    """The JSON schema of -j or -jf, as JSON text (checked: it parses and is a schema object)."""
    given = [f for f, a in (("--grammar", "grammar"), ("--grammar-file", "grammar_file"), ("-j", "json_schema"),
                            ("-jf", "json_schema_file")) if getattr(args, a, None) is not None]
    if len(given) > 1:
        raise InvalidParameterError(f"{' and '.join(given)} each give the grammar; pass one of them")
    text = args.json_schema
    if getattr(args, "json_schema_file", None) is not None:
        text = _read(args.json_schema_file, "-jf")
    if text is None:
        return None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise InvalidParameterError(f"the JSON schema ({given[0]}) is not JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidParameterError(f"the JSON schema ({given[0]}) must be a JSON object (got {text[:40]!r})")
    return text


def grammar_from_args(args: argparse.Namespace) -> str | None:
    """The GBNF that --grammar, --grammar-file, -j or -jf give (None: no grammar)."""
    schema = json_schema_text(args)
    if schema is not None:
        from ..llama.schema_gbnf import schema_to_gbnf

        flag = "-jf" if getattr(args, "json_schema_file", None) is not None else "-j"
        try:
            return schema_to_gbnf(json.loads(schema))
        except InvalidParameterError as exc:
            raise InvalidParameterError(f"{flag}: {exc}") from None
    from_file = getattr(args, "grammar_file", None) is not None
    text = _read(args.grammar_file, "--grammar-file") if from_file else args.grammar
    if text is not None and not text.strip():
        raise InvalidParameterError("the grammar is empty; leave --grammar out for unconstrained output")
    if text is not None:
        try:
            check_gbnf(text)  # before llama.cpp's parser, which a bad bound hangs or crashes
        except InvalidParameterError as exc:
            raise InvalidParameterError(f"{'--grammar-file' if from_file else '--grammar'}: {exc}") from None
    return text


def constraints_from_args(args: argparse.Namespace) -> Constraints:
    """The ``Constraints`` of the penalty and grammar flags (their ranges checked, named by flag); a flag left
    unset (``serve``'s) counts as off."""
    values = {"repeat_penalty": 1.0, "repeat_last_n": 64, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    values.update({k: getattr(args, k) for k in values if getattr(args, k, None) is not None})
    try:
        return Constraints(**values, grammar=grammar_from_args(args))
    except InvalidParameterError as exc:  # "repeat_penalty must be > 0 ..." in the words typed: --repeat-penalty
        word, _, rest = str(exc).partition(" ")
        if word in values:
            raise InvalidParameterError(f"--{word.replace('_', '-')} {rest}") from None
        raise


def _read(path: Path, flag: str) -> str:
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(f"{flag} {path}: cannot read it ({exc})") from None
