"""``specstack`` command line: one subcommand module per command under ``specstack.commands``.

Each module exposes ``register(subparsers)``, which adds its parser and sets
``func`` to a callable taking the parsed args and returning an exit status.
User errors (``SpecstackError``) print one clear line, never a traceback.
Ctrl-C, at any stage from the imports on, prints "interrupted" and exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import warnings
from types import FrameType
from typing import Iterator

from .errors import SpecstackError

INTERRUPTED = 130  # 128 + SIGINT, as shells report a command ended by Ctrl-C

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


class Parser(argparse.ArgumentParser):
    """argparse reading options as llama.cpp does: each option whole, never a prefix of it.

    Plain argparse reads an unknown single-dash option as a known one plus an attached value (``-ngl 0`` was
    ``-n gl``, ``-fa on`` was ``-f a``, ``-cnv`` was ``-c nv``) and takes abbreviations of long ones
    (``--temperature`` for ``--temp-max``).  Here an option is its exact name, or ``NAME=VALUE``; anything else
    is refused whole as unrecognized.  Every command's parser is one of these (subparsers take their parent's
    class).
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.register("action", "parsers", Subcommands)

    def _get_option_tuples(self, option_string: str) -> list:
        if option_string[:1] in self.prefix_chars and option_string[1:2] not in self.prefix_chars:
            return []  # single dash: no known option plus an attached value, no prefix of a longer one
        return super()._get_option_tuples(option_string)


class Subcommands(argparse._SubParsersAction):
    """Subcommands whose unknown options are refused by the subcommand that was given them.

    argparse hands a subcommand's unknown options up to the top-level parser, which refuses them with its own
    usage (``specstack [-h] COMMAND ...``), so ``bench make-standin -t 1`` never showed make-standin's flags.
    Here the subcommand's parser refuses them: its usage, its name in the error, exit status 2.  Nested
    subcommands (``bench make-standin``) are refused by the innermost one, which parses first.
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        extras = vars(namespace).pop(argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if extras:
            name = values[0]  # type: ignore[index]
            self._name_parser_map[name].error(f"unrecognized arguments: {' '.join(extras)}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="specstack",
        description="Lossless speculative decoding on llama.cpp for CPUs. "
        "Every command defaults to the bundled pycoder pair, so none needs a model argument.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f".commands.{name}", __package__).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    with _interrupts():
        try:
            return _run(argv)
        except KeyboardInterrupt:
            return _interrupted()
        finally:
            _forget_caught_interrupts()


def _forget_caught_interrupts() -> None:
    """Let the exit status be the one ``main`` returns, 130 after a Ctrl-C, not a death by SIGINT (-2).

    CPython (3.11) notes a ``KeyboardInterrupt`` leaving any ``exec`` or ``eval`` of a string as unhandled, even
    when an outer ``except`` catches it, and ``python -m`` then ends the process by SIGINT after ``sys.exit``.
    Imports run such strings (dataclasses build ``__init__`` so), and a Ctrl-C during them got -2 from CI.  The
    note is cleared by the next string ``exec`` that starts, so one runs here.
    """
    exec("pass")


def _run(argv: list[str] | None) -> int:
    """Parse and run one command; building the parser imports every command, so Ctrl-C may land here too."""
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
    except BrokenPipeError:
        return 0


_sigint = {"raised": False, "interrupted": False}


def _interrupted() -> int:
    """The one line a Ctrl-C prints (once, however many come), and its exit status."""
    if not _sigint["interrupted"]:
        _sigint["interrupted"] = True
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        print("interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED


@contextlib.contextmanager
def _interrupts() -> Iterator[None]:
    """SIGINT through ``_on_sigint`` while a command runs (the previous handler is put back after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _sigint.update(raised=False, interrupted=False)
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C as ``KeyboardInterrupt``, except where that would go wrong:

    - inside a llama.cpp callback, ctypes would print the exception and drop it, and the load or call would go
      on (a model loaded and 400 tokens generated after Ctrl-C): noted, and raised once the call returns;
    - on a running event loop (``serve``, once uvicorn has drained, or given up draining on a second Ctrl-C,
      and hands the signal back), the exception would cancel the open requests' tasks, each printing a
      traceback: what is left is abandoned anyway, so the process ends here;
    - a second Ctrl-C while the first unwinds (waiting for a measurement's thread, say) ends it at once.
    """
    backend = sys.modules.get(f"{__package__}.llama.backend")  # not imported: no llama.cpp call is running
    if backend is not None and backend.in_llama_callback(frame):
        backend.defer_interrupt()
        return
    if _sigint["raised"] or _event_loop_running():
        os._exit(_interrupted())
    _sigint["raised"] = True
    raise KeyboardInterrupt


def _event_loop_running() -> bool:
    asyncio = sys.modules.get("asyncio")  # never imported: no loop can be running
    if asyncio is None:
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _one_line(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> str:
    """A library warning (e.g. a context larger than the model was trained on) as one plain line."""
    return f"specstack: warning: {message}\n"


if __name__ == "__main__":
    sys.exit(main())
