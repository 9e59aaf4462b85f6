"""``specstack`` command line: one subcommand module per command under ``specstack.commands``.

Each module exposes ``register(subparsers)``, which adds its parser and sets
``func`` to a callable taking the parsed args and returning an exit status.
User errors (``SpecstackError``) print one clear line, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from .errors import SpecstackError

# Order here is the order in --help.
COMMAND_MODULES = [
    "generate",
    "demo",
    "bench",
    "check",
    "models",
    "doctor",
    "datastore",
    "tune",
    "serve",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specstack",
        description="Lossless speculative decoding on llama.cpp for CPUs. "
        "Every command defaults to the bundled pycoder pair, so none needs a model argument.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f".commands.{name}", __package__).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # `specstack bench --workload X` means `specstack bench run --workload X`
        argv = importlib.import_module(".commands.bench", __package__).preprocess_argv(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # lets a command tell explicit flags from defaults (profiles)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    warnings.formatwarning = _one_line
    try:
        return int(args.func(args) or 0)
    except SpecstackError as exc:
        print(f"specstack {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def _one_line(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> str:
    """A library warning (e.g. a context larger than the model was trained on) as one plain line."""
    return f"specstack: warning: {message}\n"


if __name__ == "__main__":
    sys.exit(main())
