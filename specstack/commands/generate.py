"""``specstack generate``: stream one completion, then print its statistics."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..calibration import Calibration
from ..constraints import dead_end_message
from ..draft_length import check_k
from ..generation import GenerationConfig
from ..errors import InvalidParameterError
from ..metrics import GenerationStats
from ..llama import BatchShapes
from ..loading import RunSpec, build_run, experts_of, lossy_label
from ..ui import table
from .common import add_drafter_args, add_model_args, add_sampling_args, constraints_from_args, load_from_args, sampling_from_args


UNTIL_THE_END = 1 << 40  # -n -1: the generation ends at its end-of-generation token or a full context


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description="Generate a completion of PROMPT with the target model, speculating with --drafter. "
        "Output is identical to plain decoding at --temp 0 and follows the same distribution otherwise.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file", type=Path, help="read the prompt from a file")
    p.add_argument("-n", "--max-tokens", "--n-predict", "--predict", dest="max_tokens", type=int, default=128,
                   help="maximum new tokens (default 128; -1: until the end of generation or a full context, as "
                   "llama.cpp's -n -1)")
    p.add_argument("--ignore-eos", action="store_true", help="never end at the end-of-generation token (llama.cpp's "
                   "--ignore-eos): generate all -n tokens")
    p.add_argument("--no-grammar-drafts", dest="grammar_drafts", action="store_false",
                   help="under a grammar or JSON schema, do not draft the tokens it forces (the 'grammar' source, on by "
                   "default with every drafter but none); for comparing, the output is the same either way")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text + statistics) instead of streaming")
    p.add_argument("--profile", type=Path, default=None, help="apply a profile from `specstack tune` (explicit flags still win)")
    p.add_argument("--category", default=None, help="profile category to use (default: the profile's [default])")
    add_model_args(p)
    add_drafter_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def read_prompt(args: argparse.Namespace) -> str:
    if args.file is None:
        return args.prompt
    try:
        data = args.file.read_bytes()
    except OSError as exc:
        raise InvalidParameterError(f"cannot read prompt file {args.file}: {exc.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:  # llama.cpp reads bytes; keep going, but say what was replaced
        print(f"specstack: warning: prompt file {args.file} is not valid UTF-8 (byte {exc.start}); invalid bytes are "
              "read as U+FFFD", file=sys.stderr)
        return data.decode("utf-8", errors="replace")


def apply_profile(args: argparse.Namespace, argv_flags: set[str]) -> None:
    """Fill drafter / k policy / k from a profile unless given on the command line."""
    from ..profiles import load_profile

    flags = {"drafter": ("--drafter",), "k_policy": ("--k-policy",), "k": ("-k", "--draft-max")}
    for key, value in load_profile(args.profile, args.category).items():
        if not any(f in argv_flags for f in flags[key]):
            setattr(args, key, value)


def run(args: argparse.Namespace) -> int:
    if args.category is not None and args.profile is None:  # it picks a profile's table; alone it would do nothing
        raise InvalidParameterError(f"--category {args.category} picks a category of a --profile, and no --profile "
                                    "was given; add --profile FILE (from `specstack tune`) or leave --category out")
    prompt = read_prompt(args)
    if args.profile is not None:
        apply_profile(args, {a.split("=")[0] for a in getattr(args, "argv", [])})
    controls = dataclasses.replace(constraints_from_args(args), ignore_eos=args.ignore_eos)
    max_tokens = UNTIL_THE_END if args.max_tokens == -1 else args.max_tokens
    config = GenerationConfig(max_tokens=max_tokens, stop=tuple(args.stop), sampling=sampling_from_args(args),
                              constraints=controls, grammar_drafts=args.grammar_drafts)
    check_k(args.k)  # the policy's own check of -k and --k-max, before the load rather than after it
    if args.k_max is not None:
        check_k(args.k_max, "k_max")
    # A model never measured here gets its first token at once: shapes and costs are measured beside it.
    # (a grammar that does not parse fails before the load: ``loading.preflight``, with every other check)
    spec, calibration = load_from_args(args, background=True, grammar=controls.grammar)
    try:
        return generate(spec, calibration, prompt, config, args.json)
    except BaseException:  # Ctrl-C or an error: its thread stops at its next turn and frees its context first
        if calibration.background is not None:
            calibration.background.abandon()
        raise


def generate(spec: RunSpec, calibration: Calibration, prompt: str, config: GenerationConfig, as_json: bool) -> int:
    """Stream (or print as JSON) one generation, then finish the one-time background measurement, if any."""
    target = calibration.target
    moe = experts_of(target.meta, spec.target.experts)  # the metadata the load read
    lossy = lossy_label(moe)
    if lossy:
        print(f"specstack generate: {lossy}", file=sys.stderr)
    engine = build_run(calibration, spec)
    gen = engine.generate(prompt, config)
    if as_json:
        gen.run()
        out = {"text": gen.text, **gen.stats.to_dict(), "exact_shapes": exactness(target.shapes),
               "lossy": bool(moe and moe["lossy"])}
        if moe:
            out["experts"] = moe
        print(json.dumps(out))
    else:
        for piece in gen:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        experts = None if moe is None else lossy or f"{moe['used']} of {moe['count']} active (the model's own setting)"
        print(format_stats(gen.stats, target.shapes, experts), file=sys.stderr)
    engine.finish_calibration()  # measured to the end, so that the next run starts from the cache
    if gen.stats.stop_reason == "constraint":
        print(f"specstack generate: {dead_end_message(len(gen.output_ids))}", file=sys.stderr)
        return 1
    return 0


def exactness(shapes: BatchShapes) -> dict:
    """How the target's calls were kept exact (``--exact``), for the JSON output."""
    return shapes.to_dict()


def describe_shapes(shapes: BatchShapes) -> str:
    if shapes.pending:
        return f"on ({shapes.why}): every call one row, as plain decoding, so no draft changed the output"
    if not shapes.exact:
        return f"off ({shapes.why or '--exact off'}): calls are never padded or split"
    top = "any size" if shapes.max_rows >= 512 else f"at most {shapes.max_rows} rows (longer verifications are split)"
    pad = "no padding"
    if shapes.min_rows > 1:
        pad = "one-token steps padded to 2 rows" + ("" if shapes.pad_logits else " (no logits asked of the pad)")
    trees = {True: "; trees verified as trees", False: "; trees verified as chains (tree calls measured inexact here)",
             None: ""}[shapes.tree_exact]
    return f"on ({shapes.why or '--exact on'}): {pad}; calls of {top}{trees}"


def format_stats(s: GenerationStats, shapes: BatchShapes | None = None, experts: str | None = None) -> str:
    """The statistics table ``generate`` prints after its output (``experts``: an MoE target's row, if any)."""
    t = s.to_dict()["time_s"]
    by_pos = " ".join(f"{x:.2f}" for x in s.acceptance_by_position[:16]) or "-"
    rows = [
        ("drafter", f"{s.drafter} (k policy {s.k_policy}, max k used {len(s.drafted_at)})"),
        ("tokens", f"{s.n_tokens} generated, {s.n_prompt} prompt, stop: {s.stop_reason}"),
        ("drafted / accepted", f"{s.n_drafted} / {s.n_accepted} ({100 * s.acceptance_rate:.1f}%)"),
        ("mean accepted length", f"{s.mean_accepted_length:.2f} tokens per step ({s.n_steps} steps)"),
        ("acceptance by position", by_pos),
        ("time (s)", f"prefill {t['prefill']:.3f}  draft {t['draft']:.3f}  verify {t['verify']:.3f}  other {t['other']:.3f}"),
        ("decode speed", f"{s.tokens_per_second:.1f} tok/s"),
    ]
    if s.idle_why:
        rows.append(("no drafts", s.idle_why))
    if shapes is not None:
        rows.append(("exact shapes", describe_shapes(shapes)))
    if s.rewind != "truncate":
        r = s.rewound
        rows.append(("recurrent state", f"{s.rewind}: {r.rollbacks} rollbacks, {r.checkpoints} checkpoints, "
                     f"{r.restores} restores ({r.redecoded} tokens re-decoded), {1000 * r.seconds:.1f} ms"))
    if s.trees:
        rows.append(("trees", s.trees))
    if experts is not None:
        rows.append(("experts", experts))
    return "-" * 60 + "\n" + table([], rows, align="ll")
