"""``specstack bench``: run / report / replay / make-standin.

``specstack bench --workload X ...`` (no subcommand) means ``bench run``:
``preprocess_argv`` inserts ``run`` when the word after ``bench`` is an option.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any, Iterator, Sequence

from ..drafters import draft_model, none, prompt_lookup
from ..errors import InvalidParameterError
from ..ui import fmt_bytes
from .common import (add_drafter_flags, add_model_args, at_least, flag_given, target_from_args, methods_with_draft,
                     options_from_args)


def preprocess_argv(argv: Sequence[str] | None) -> list[str]:
    """``bench --workload X`` -> ``bench run --workload X``; anything else is left alone."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench" and len(argv) > 1 and argv[1].startswith("-") and argv[1] not in ("-h", "--help"):
        argv.insert(1, "run")
    return argv


def _csv(kind: type, what: str):
    def parse(text: str) -> list[Any]:
        try:
            items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: expected a comma-separated list like 2,4,8 (got {text!r})") from None
        if not items:
            raise argparse.ArgumentTypeError(f"{what}: empty list")
        return items

    return parse


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (got {text!r})")
    for conv in (int, float):
        try:
            return key.replace("-", "_"), conv(value)
        except ValueError:
            pass
    if value.lower() in ("true", "false"):
        return key.replace("-", "_"), value.lower() == "true"
    return key.replace("-", "_"), value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark drafters against plain decoding on a workload (tables, CSV, JSON, plots)",
        description="Benchmark speculative decoding. `specstack bench --workload X ...` is short for `bench run`.",
    )
    bsub = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    _register_run(bsub)
    _register_report(bsub)
    _register_replay(bsub)
    register_make_standin(bsub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def add_ks_arg(p: argparse.ArgumentParser, default: list[int] | None, help: str) -> None:
    """-k/--draft-max as in generate, taking a comma-separated list; --k is a hidden old spelling
    (it must stay defined: argparse would otherwise read --k as an abbreviation of --k-max)."""
    p.add_argument("-k", "--draft-max", dest="k", type=_csv(int, "-k"), default=default, help=help)
    p.add_argument("--k", dest="k", type=_csv(int, "-k"), default=default, help=argparse.SUPPRESS)


def _register_run(bsub: argparse._SubParsersAction) -> None:
    from ..bench.workloads import bundled

    r = bsub.add_parser(
        "run",
        help="run a workload with plain decoding and each method x k x temperature",
        description="Run every request of a workload with plain decoding and each speculative method, interleaved "
        "per request, and write results.json/.csv/.md and plots to OUTDIR. Greedy speculative outputs are checked "
        "token for token against plain decoding.",
    )
    r.add_argument("--workload", required=True, help=f"bundled workload ({', '.join(bundled())}) or a .jsonl file")
    r.add_argument("--methods", type=_csv(str, "--methods"), default=[none.NAME, prompt_lookup.NAME, draft_model.NAME],
                   help="comma-separated drafters; plain decoding (none) always runs (default: none,prompt-lookup,draft-model)")
    add_ks_arg(r, [2, 4, 8, 16], "comma-separated draft lengths (default 2,4,8,16)")
    r.add_argument("--k-max", type=int, default=None,
                   help="upper bound on k for METHOD@POLICY methods (default: the largest -k)")
    r.add_argument("--temp", dest="temps", type=_csv(float, "--temp"), default=[0.0],
                   help="comma-separated temperatures (default 0); > 0 uses a fixed seed per request")
    r.add_argument("--repeat", type=int, default=1, help="passes over the workload; the median run is kept (default 1)")
    r.add_argument("--limit", type=int, default=None, help="run only the first N requests")
    r.add_argument("-n", "--max-tokens", dest="max_tokens", type=at_least(1), default=None, metavar="N",
                   help="new tokens per request, for every request (default: each request's max_tokens in the "
                   "workload)")
    r.add_argument("-s", "--seed", type=int, default=0, help="base of the per-request seeds (default 0)")
    r.add_argument("--top-k", type=int, default=0, help="sampling top-k; 0 = off")
    r.add_argument("--top-p", type=float, default=1.0, help="sampling top-p; 1 = off")
    r.add_argument("--min-p", type=float, default=0.0, help="sampling min-p; 0 = off")
    r.add_argument("-o", "--output", type=Path, default=None,
                   help="output folder (default: bench-results/WORKLOAD-YYYYmmdd-HHMMSS)")
    add_model_args(r)
    g = r.add_argument_group("drafter options")
    # No --suffix-cache: a tree saved by one configuration would feed the next one's drafts.
    add_drafter_flags(g, skip=("--suffix-cache",))
    g.add_argument("--drafter-option", dest="extra_options", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="any other drafter config field, e.g. max_depth=32 (repeatable)")
    c = r.add_argument_group("verification cost curve")
    c.add_argument("--no-cost-curve", dest="cost_curve", action="store_false", help="skip measuring t(n)")
    c.add_argument("--cost-max-n", type=int, default=32, help="largest batch measured (default 32)")
    c.add_argument("--cost-depth", type=int, default=200, help="context depth for t(n) (default 200)")
    c.add_argument("--cost-reps", type=int, default=7, help="repetitions per n, median kept (default 7)")
    r.add_argument("--llama-cpp-bin", type=Path, default=None,
                   help="folder of llama.cpp binaries (printed by scripts/build_llama_bins.sh): also run llama.cpp's "
                   "own binaries on the same models, prompts, threads and k (greedy runs only)")
    r.add_argument("--peers", type=_csv(str, "--peers"), default=["auto"],
                   help="llama.cpp peers for --llama-cpp-bin: auto (llama-plain plus the peers of --methods: "
                   "draft-model -> llama-draft-simple, mtp -> llama-draft-mtp, prompt-lookup -> llama-ngram-simple,llama-lookup, "
                   "suffix -> llama-ngram-cache), all, or a comma-separated list")
    r.add_argument("--peer-kernels", default=None, metavar="stock|specstack|both",
                   help="which CPU kernels the llama.cpp peers run on: stock (the default; --llama-cpp-bin), "
                   "specstack (the same binaries built with specstack's verification kernels by "
                   "KERNELS=specstack scripts/build_llama_bins.sh, found in $SPECSTACK_LLAMA_BINS_SPECSTACK or "
                   "~/.cache/specstack/llama-bins-specstack/bin) or both, back to back; each peer row says which, "
                   "so the kernels' gain reads apart from the drafting's. Runs the peers even without --llama-cpp-bin")
    r.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the short unrecorded warm-up generation per configuration")
    r.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no table on stdout")
    r.set_defaults(func=cmd_run)


def _register_report(bsub: argparse._SubParsersAction) -> None:
    r = bsub.add_parser("report", help="re-render tables and plots from a results.json",
                        description="Re-render results.md, results.csv and the plots from RESULTS (a results.json or "
                        "its folder), and print the Markdown.")
    r.add_argument("results", type=Path, help="results.json (or the folder holding it)")
    r.add_argument("-o", "--output", type=Path, default=None, help="where to write (default: the results' folder)")
    r.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    r.set_defaults(func=cmd_report)


def _register_replay(bsub: argparse._SubParsersAction) -> None:
    from ..bench.replay import DEFAULT_METHODS

    r = bsub.add_parser("replay", help="replay recorded outputs on the engine: drafters' acceptance and predicted "
                        "tok/s, with no target model",
                        description="Replay the recorded plain (temperature 0) outputs in RESULTS on the engine, with "
                        "plain decoding and each drafter (METHOD@POLICY too): the target's rows are the recorded "
                        "tokens and each of its calls is priced at t(n) of the run's cost curve, so the table gives "
                        "acceptance and predicted tok/s beside the run's measured ones, in seconds, with no target "
                        "model loaded.")
    r.add_argument("results", type=Path, help="results.json (or the folder holding it)")
    r.add_argument("--methods", type=_csv(str, "--methods"), default=list(DEFAULT_METHODS),
                   help=f"comma-separated drafters (default {','.join(DEFAULT_METHODS)})")
    add_ks_arg(r, None, "comma-separated draft lengths (default: the run's)")
    r.add_argument("--drafter-option", dest="extra_options", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="drafter config field, e.g. max_spec_factor=2 (repeatable)")
    r.add_argument("--reference", action="store_true",
                   help="replay over the requests' reference answers (a workload's 'reference' field, such as the "
                   "grounded-edit workload's edits made as asked) instead of the recorded outputs: how the drafters "
                   "would do on the answer an instruction-tuned model writes, where the model at hand answers "
                   "otherwise")
    r.add_argument("-o", "--output", type=Path, default=None, help="also write the replay as JSON to this file")
    r.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    r.set_defaults(func=cmd_replay)


def register_make_standin(bsub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``make-standin`` to ``specstack bench``'s subparsers."""
    from ..modelfile.standin import FTYPES
    from ..paths import DEFAULT_TARGET

    p = bsub.add_parser(
        "make-standin",
        help="write a big zero-padded copy of a model that computes exactly the same function",
        description="Write a cost-faithful stand-in target: the source model (llama, lfm2 or gemma3) "
        "zero-padded to a wider hidden size, FFN and head count, plus layers that add nothing. Its "
        "greedy output equals the source's; its decode cost is that of the big shape. Example (about "
        "1.05B parameters): --width 2048 --layers 22 --ffn 5632. LFM2-1.2B-like from the bundled "
        "hybrid: --from specstack/models/pycoder-lfm2.gguf --width 2048 --layers 16 --attn-layers 6 "
        "--ffn 8192 --kv-heads 16. Gemma 3 1B-shaped from Gemma 3 270M Q4_K_M (keeps its quant blocks): "
        "--from gemma-3-270m-q4_k_m.gguf --width 1152 --layers 26 --ffn 6912 --ftype q4_k_m; gemma3 is "
        "bit-exact only at widths of 4^k times the source's (1152 is close, not exact: see docs/standin.md); "
        "a bit-exact 1B-parameter one keeps the width: --width 640 --layers 26 --ffn 15872 --ftype q4_k_m. "
        "Qwen 2.5 1.5B-shaped, with its 151936-row output layer (--vocab cuts Gemma's 262144; not exact): "
        "--from gemma-3-270m-q4_k_m.gguf --width 1536 --layers 28 --ffn 8960 --heads 6 --kv-heads 1 "
        "--vocab 151936 --ftype q4_k_m. "
        "--mtp LAYOUT instead writes a RANDOM-WEIGHT model with a NextN (MTP) block in a real model's layout "
        f"({_mtp_layouts()}) at --layers trunk layers: for cost and losslessness only, never for acceptance "
        "(random weights draft tokens that are almost never accepted). Example, Qwen3.5-35B-A3B at 4 of its 40 "
        "layers: --mtp qwen35moe --layers 4 --ftype q4_k_m.",
    )
    p.add_argument("--from", dest="src", type=Path, default=DEFAULT_TARGET,
                   help="source GGUF (llama, dense or MoE, or lfm2: F16/F32/BF16; gemma3: also quantized, "
                   "then --ftype f16 dequantizes and its own ftype copies its quant blocks); "
                   "default: the bundled target")
    p.add_argument("--width", type=int, default=None,
                   help="hidden size of the stand-in (required, except with --mtp: the layout's real width)")
    p.add_argument("--layers", type=int, required=True,
                   help="number of layers of the stand-in (with --mtp: trunk layers; the NextN block comes on top)")
    p.add_argument("--ffn", type=int, default=None,
                   help="FFN width (default: the source's FFN/hidden ratio times --width)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="KV heads per attention layer (default: keep the source's query heads per KV head); "
                   "fewer KV heads match a real model's KV cache but are not bit-exact in q4_k_m")
    p.add_argument("--heads", type=int, default=None,
                   help="gemma3 only: query heads (default: the source's; head_dim stays the source's)")
    p.add_argument("--vocab", type=int, default=None, metavar="N",
                   help="gemma3 only: keep N of the source's tokens (other scripts' pieces go first, then the rarest "
                   "English and code ones), so the "
                   "output layer has a real model's rows, e.g. 151936 (Qwen 2.5) or 128256 (Llama 3) instead of "
                   "Gemma 3's 262144. NOT exact: the stand-in never emits a dropped piece and reads text that held "
                   "one as smaller pieces (docs/standin.md says how often outputs differ)")
    p.add_argument("--attn-layers", type=int, default=None,
                   help="lfm2 only: how many of --layers are attention layers (default: the source's share)")
    p.add_argument("--head", metavar="HEAD", type=Path, default=None,
                   help="also pad HEAD, a trained EAGLE-3 or DFlash head GGUF for --from (the bundled "
                   "specstack/models/pycoder-6m-eagle3.gguf, pycoder-6m-dflash.gguf), for the stand-in: it drafts "
                   "what it drafts for the source, at the cost of a head of the stand-in's shape (layers as wide, FFN "
                   "--ffn). Written beside -o as NAME-eagle3.gguf or NAME-dflash.gguf; draft with --drafter eagle3 or "
                   "dflash -md that file")
    m = p.add_argument_group("random-weight MTP stand-ins (for cost and losslessness only, never acceptance)")
    m.add_argument("--mtp", metavar="LAYOUT", default=None,
                   help=f"write a random-weight model with one NextN (MTP) block in LAYOUT ({_mtp_layouts()}) "
                   "instead of padding --from, which then only gives the vocabulary. Its cost per token and per MTP "
                   "draft is the real layout's at --layers depth (recurrent state and rollback included), and "
                   "speculation on it must stay lossless; its drafts are random, so it says nothing about "
                   "acceptance. --width narrows it (head counts and FFN widths scale, head sizes stay)")
    m.add_argument("--experts", type=int, default=None,
                   help="with --mtp: routed experts per MoE layer (default: the layout's; fewer make a smaller file)")
    p.add_argument("--ftype", choices=FTYPES, default="f16", help="weight format (default f16)")
    p.add_argument("--threads", type=int, default=2, help="quantization threads (default 2)")
    p.add_argument("-o", "--output", type=Path, required=True, help="where to write the stand-in GGUF")
    p.set_defaults(func=cmd_make_standin)
    return p


# -- commands --------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from ..bench import plots, report
    from ..bench.config import BenchConfig
    from ..bench.outputs import check_output_dir
    from ..bench.peer_runs import peer_folders
    from ..bench.runner import run_bench
    from ..bench.workloads import Workload, load
    from ..llama import kernel_status

    if args.plots:
        plots.require_plotting()  # before the measurements, not after them
    wl = load(args.workload)
    if args.limit is not None:
        if args.limit < 1:
            raise InvalidParameterError(f"--limit must be >= 1 (got {args.limit})")
        wl = wl.head(args.limit)
    if args.max_tokens is not None:
        wl = Workload(wl.name, wl.path, tuple(replace(r, max_tokens=args.max_tokens) for r in wl.requests))
    if args.llama_cpp_bin is not None and not Path(args.llama_cpp_bin).is_dir():
        raise InvalidParameterError(f"--llama-cpp-bin {args.llama_cpp_bin} is not a folder; build the binaries with "
                                    "scripts/build_llama_bins.sh, which prints the folder")
    args.methods = methods_with_draft(args, args.methods, flag_given(args, "--methods"), "bench")
    options = {**options_from_args(args), **dict(args.extra_options)}
    config = BenchConfig(
        workload=wl, methods=args.methods, ks=args.k, k_max=args.k_max, temperatures=args.temps, repeat=args.repeat, seed=args.seed,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, drafter_options=options, cost_curve=args.cost_curve,
        cost_max_n=args.cost_max_n, cost_depth=args.cost_depth, cost_reps=args.cost_reps,
        warmup=args.warmup, llama_cpp_bin=args.llama_cpp_bin, peers=args.peers, peer_kernels=args.peer_kernels,
    )
    outdir = args.output or Path("bench-results") / f"{wl.name}-{datetime.now():%Y%m%d-%H%M%S}"
    check_output_dir(outdir)  # before measuring: a bad -o found after the run would lose all of it
    if config.runs_peers:
        peer_folders(config)  # a missing or stale bin folder, before the model loads and calibrates
    target = target_from_args(args)
    n_cfg = len(config.configurations())
    print(f"bench: {wl.name} ({len(wl.requests)} requests) x {n_cfg} configurations x {len(config.temperatures)} "
          f"temperature(s) x {config.repeat} repeat(s) on {target.path.name}, {target.n_threads} threads, "
          f"{kernel_status().short()} -> {outdir}", file=sys.stderr)
    results = run_bench(config, target, progress=not args.quiet)
    # Write the JSON first: whatever fails after it, the run is not lost.
    paths = report.write_outputs(results, outdir, plots=False)
    if args.plots:
        paths += plots.plot(results, outdir)
    if not args.quiet:
        sys.stdout.write(report.render_markdown(results))
    print("bench: wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    message, code = mismatch_outcome(len(results["mismatches"]), target.shapes)
    if message:
        print(message, file=sys.stderr)
    return code or (130 if results["interrupted"] else 0)


def mismatch_outcome(n: int, shapes: Any) -> tuple[str, int]:
    """What greedy mismatches mean for the exit status: a bug (1) in exact mode, expected (0, a note) when
    calls ran unpadded and unsplit (``--exact off``, or ``auto`` where exactness costs too much)."""
    if not n:
        return "", 0
    if shapes.exact:
        return (f"bench: {n} speculative output(s) at temperature 0 differ from plain decoding (see MISMATCH above "
                "and in results.md): lossless speculation is broken", 1)
    return (f"bench: note: {n} speculative output(s) at temperature 0 differ from plain decoding at near-ties, as "
            f"expected with exact shapes off ({shapes.why}); run with --exact on for bit-identical output", 0)


def cmd_report(args: argparse.Namespace) -> int:
    from ..bench import plots, report
    from ..bench.results import load_results

    if args.plots:
        plots.require_plotting()
    results = load_results(args.results)
    src = Path(args.results)
    outdir = args.output or (src if src.is_dir() else src.parent)
    paths = report.write_outputs(results, outdir, write_json=False, plots=False)
    if args.plots:
        paths += plots.plot(results, outdir)
    sys.stdout.write(report.render_markdown(results))
    print("bench report: wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    import json

    from ..bench import replay
    from ..bench.results import load_results

    results = load_results(args.results)
    out = replay.replay(results, args.methods, args.k, dict(args.extra_options), reference=args.reference)
    if args.output:
        replay.write_json(out, args.output)
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "requests"}, indent=1))
    else:
        sys.stdout.write(replay.render_markdown(out))
    return 0


def _mtp_layouts() -> str:
    """``name: real model`` for each MTP layout, for the help text."""
    from ..modelfile.standin.mtp_layouts import LAYOUTS

    return ", ".join(f"{name}: {lay.model}" for name, lay in LAYOUTS.items())


TERMINATED = 128 + signal.SIGTERM  # the exit status shells report for a command ended by SIGTERM


@contextlib.contextmanager
def _sigterm_cleans_up() -> Iterator[None]:
    """SIGTERM (``kill``, a job scheduler, a container stopping) as ``SystemExit(143)`` while a stand-in is
    written, so that the writers' cleanup runs: by default SIGTERM ends Python at once and left a 6 GB
    ``.partial`` behind.  A second SIGTERM is ignored while the first one cleans up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(TERMINATED)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except SystemExit as exc:
        if exc.code == TERMINATED:
            print("make-standin: terminated; the partial files are removed", file=sys.stderr, flush=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_make_standin(args: argparse.Namespace) -> int:
    """``make-standin``: a padded stand-in of ``--from``, or with ``--mtp`` a random-weight MTP one."""
    with _sigterm_cleans_up():
        if getattr(args, "mtp", None) is not None:
            return cmd_make_mtp_standin(args)
        return _make_padded_standin(args)


def _make_padded_standin(args: argparse.Namespace) -> int:
    from ..modelfile.standin import make_standin, plan_standin, read_source_shape

    if getattr(args, "experts", None) is not None:
        raise InvalidParameterError("--experts is for --mtp stand-ins (a padded stand-in keeps its source's experts)")
    if args.width is None:
        raise InvalidParameterError("--width is required: the stand-in's hidden size (only --mtp has a default, "
                                    "its layout's real width)")
    src = Path(args.src)
    kv_heads, attn_layers = getattr(args, "kv_heads", None), getattr(args, "attn_layers", None)
    heads, vocab = getattr(args, "heads", None), getattr(args, "vocab", None)
    plan = plan_standin(read_source_shape(src), args.width, args.layers, args.ffn, args.ftype,
                        kv_heads=kv_heads, attn_layers=attn_layers, heads=heads, vocab=vocab)
    make_standin(src, args.output, args.width, args.layers, args.ftype, ffn=args.ffn, threads=args.threads,
                 kv_heads=kv_heads, attn_layers=attn_layers, heads=heads, vocab=vocab)
    o, s = plan.out, plan.src
    size = Path(args.output).stat().st_size
    if o.arch == "lfm2":
        n_attn = o.n_attention_layers
        mix = (f"{n_attn} attention + {o.n_layer - n_attn} short-conv layers (source {s.n_attention_layers} + "
               f"{s.n_layer - s.n_attention_layers}), ")
    else:
        mix = f"{o.n_layer} layers, "
    if plan.exact_for(args.ftype):
        verdict = "bit-exact"
    elif o.n_vocab != s.n_vocab:
        verdict = (f"NOT exact: {o.n_vocab} of the source's {s.n_vocab} tokens (--vocab), so it never emits the "
                   f"{s.n_vocab - o.n_vocab} dropped pieces and tokenizes without them")
    elif not plan.bit_exact:
        verdict = ("not bit-exact (width is not a " + {"lfm2": "multiple", "gemma3": "power-of-4 multiple"}.get(
                   o.arch, "power-of-2 multiple") + " of the source's)")
    elif plan.regrouped_heads:
        verdict = f"not bit-exact in {args.ftype} (--kv-heads regroups query heads; exact in f16)"
    else:
        verdict = f"not bit-exact in {args.ftype} (no layer layout keeps the source's Q4_K_M tensor types)"
    print(f"wrote {args.output}: {o.arch} {args.ftype}, {o.n_params / 1e6:.1f}M parameters "
          f"(source {s.n_params / 1e6:.2f}M), {fmt_bytes(size)}; width {o.n_embd}, {mix}"
          f"{o.n_head} heads ({o.n_head_kv} KV), FFN {o.n_ff}; source layers at "
          f"{[i for i, live in enumerate(plan.layer_live) if live]}; {verdict}")
    if getattr(args, "head", None) is not None:
        _pad_head(args.head, Path(args.output), args.ffn)
    return 0


def _pad_head(head: Path, standin: Path, ffn: int | None) -> None:
    """``--head``: the head padded for the stand-in just written, beside it (``modelfile.standin.head``)."""
    from ..modelfile.standin.head import pad_head
    from ..modelfile.standin.source import open_source, read_field

    out = head_beside(standin, str(read_field(open_source(head), "general.architecture")))
    pad = pad_head(head, standin, out, ffn)
    print(f"wrote {out}: {pad.arch} head {head.name} padded to width {pad.width} ({pad.n_head} heads, "
          f"{pad.n_head_kv} KV, FFN {pad.n_ff}), layer ids {list(pad.target_layers)}, "
          f"{fmt_bytes(out.stat().st_size)}; draft with --drafter {pad.arch} -m {standin} -md {out}")


def head_beside(standin: Path, arch: str) -> Path:
    """Where ``--head`` writes the padded head: NAME-ARCH.gguf beside the stand-in NAME.gguf."""
    return standin.with_name(f"{standin.stem}-{arch}.gguf")


def cmd_make_mtp_standin(args: argparse.Namespace) -> int:
    """``make-standin --mtp LAYOUT``: a random-weight model with a NextN block (``modelfile.standin.mtp``)."""
    from ..modelfile.standin.mtp import make_mtp_standin, n_params, vocab_size

    flags = (("--ffn", "ffn"), ("--kv-heads", "kv_heads"), ("--heads", "heads"), ("--attn-layers", "attn_layers"),
             ("--vocab", "vocab"), ("--head", "head"))
    unused = [flag for flag, dest in flags if getattr(args, dest, None) is not None]
    if unused:
        raise InvalidParameterError(f"{', '.join(unused)}: not used with --mtp (the layout fixes them; --width "
                                    "and --experts narrow it)")
    if flag_given(args, "--from"):
        n_vocab = vocab_size(Path(args.src))  # also refuses a --from that is no GGUF, before anything is written
        print(f"make-standin: --mtp: --from {args.src} gives only the vocabulary ({n_vocab} tokens); the weights "
              f"are random in {args.mtp}'s layout", file=sys.stderr, flush=True)
    shape = make_mtp_standin(args.mtp, args.output, args.layers, args.ftype, width=args.width, experts=args.experts,
                             tokenizer=args.src, threads=args.threads)
    n_vocab = vocab_size(Path(args.src))
    total, active = n_params(shape, n_vocab)
    size = Path(args.output).stat().st_size
    print(f"wrote {args.output}: {shape.arch} {args.ftype}, RANDOM weights in {shape.layout.model}'s layout (for cost "
          f"and losslessness only, never acceptance), {total / 1e6:.1f}M parameters ({active / 1e6:.1f}M read per "
          f"token by the trunk), {fmt_bytes(size)}; {shape.describe()}; vocabulary {n_vocab} from {Path(args.src).name}")
    return 0
