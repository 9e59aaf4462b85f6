"""``specstack models scan DIR...``: inventory of GGUF models and a draft/target matrix."""

from __future__ import annotations

import json
import sys

from ..models_scan import render, scan
from ..paths import MODELS_DIR

PROGRESS_MIN_FILES = 20  # without a terminal, show progress only for folders this big


def register(subparsers) -> None:
    p = subparsers.add_parser("models", help="inventory of GGUF models (models scan)",
                              description="Work with collections of GGUF models.")
    sub = p.add_subparsers(dest="models_command", metavar="SUBCOMMAND")
    s = sub.add_parser(
        "scan",
        help="list every GGUF under folders and which models can draft for which",
        description="Read the metadata of every .gguf under the given folders (no weights are "
        "loaded): architecture, parameters, quantization, size, context, vocabulary fingerprint, "
        "MoE experts, recurrent/hybrid. Then list, for each model, the smaller models with an "
        "identical or compatible vocabulary that can draft for it. Results are cached by path, "
        "size and mtime (SPECSTACK_CACHE_DIR, else $XDG_CACHE_HOME/specstack or ~/.cache/specstack).",
    )
    s.add_argument("dirs", nargs="*", default=[str(MODELS_DIR)], metavar="DIR",
                   help="folders (or files) to scan (default: the bundled models)")
    s.add_argument("--json", action="store_true", help="print the full inventory as JSON")
    s.add_argument("--no-cache", action="store_true", help="read every file again; do not use or update the cache")
    s.set_defaults(func=run_scan)

    def _help(args) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=_help)


class _Progress:
    def __init__(self, stream=None):
        self.stream = stream = stream if stream is not None else sys.stderr
        try:
            self.tty = stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.shown = False

    def __call__(self, i: int, n: int, path) -> None:
        if self.tty:
            msg = f"scanning {i}/{n} {path.name}"[:78]
            self.stream.write("\r" + msg.ljust(78))
            self.stream.flush()
            self.shown = True
        elif n >= PROGRESS_MIN_FILES and (i == 1 or i == n or i % max(1, n // 10) == 0):
            self.stream.write(f"scanning {i}/{n} {path.name}\n")
            self.stream.flush()

    def done(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\r" + " " * 78 + "\r")
            self.stream.flush()


def run_scan(args) -> int:
    progress = _Progress()
    try:
        result = scan(args.dirs, use_cache=not args.no_cache, progress=progress)
    finally:
        progress.done()
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(render(result))
    return 0
