"""``specstack models scan DIR...``: inventory of GGUF models and a draft/target matrix."""

from __future__ import annotations

import json
import sys

from ..modelfile.scan import render, scan
from ..paths import MODELS_DIR
from ..ui import Progress, isatty

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


def _progress():
    """A scan callback drawing one ui.Progress; sized on the first call, when the file count is known.

    Without a terminal, folders under PROGRESS_MIN_FILES files show no progress (it would be noise).
    """
    bar: Progress | None = None

    def update(i: int, n: int, path) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress("scanning", n, quiet=n < PROGRESS_MIN_FILES and not isatty(sys.stderr))
        bar.update(i, path.name)

    def close() -> None:
        if bar is not None:
            bar.close()

    return update, close


def run_scan(args) -> int:
    update, close = _progress()
    try:
        result = scan(args.dirs, use_cache=not args.no_cache, progress=update)
    finally:
        close()
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(render(result))
    if result.errors and not result.models:  # nothing usable: a script must not read this as success
        print(f"specstack models: error: none of the {len(result.errors)} GGUF file(s) found could be read "
              "(listed above); check the paths, or re-download or re-convert the models", file=sys.stderr)
        return 1
    return 0
