"""llama-server's flags, read from llama.cpp's ``common/arg.cpp``: the list ``tests/fixtures/llama_server_flags.txt``
holds, which ``specstack serve`` must accept, honour or refuse in one line (tests/test_llama_server_flags.py).

    python scripts/llama_server_flags.py [ARG_CPP] > tests/fixtures/llama_server_flags.txt

ARG_CPP defaults to the vendored llama.cpp of the llama-cpp-python sdist (``$LLAMA_CPP_SRC``, else
/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp).  Reading the source, not ``llama-server --help``, needs no
built binary.  An option is llama-server's when ``common_params_parser_init`` adds it for LLAMA_EXAMPLE_SERVER:
its ``set_examples`` names LLAMA_EXAMPLE_SERVER or LLAMA_EXAMPLE_COMMON (none given is COMMON) and its
``set_excludes`` does not name LLAMA_EXAMPLE_SERVER.  Each line is ``FLAGS<TAB>VALUE``: the option's spellings
(comma-separated) and its value hint, ``-`` for a switch; an option's negated spellings (``--no-mmap``) get a line
of their own, switches all.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

SDIST = Path("/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
ARG_CPP = Path("common") / "arg.cpp"
STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
CHAR = re.compile(r"'(?:[^'\\]|\\.)'")


def strip_comments(text: str) -> str:
    """C++ source without its comments (strings and char literals kept whole), so that a quoted flag in a comment
    (``// note: "-mmdev" must sort after "--rpc"``) is not read as one of the option's spellings."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = len(text) if i < 0 else i
        elif text.startswith("/*", i):
            i = text.index("*/", i) + 2
        elif text[i] in "\"'":
            end = (STRING if text[i] == '"' else CHAR).match(text, i).end()
            out.append(text[i:end])
            i = end
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def top_level_args(text: str, start: int) -> tuple[list[str], int]:
    """The comma-separated arguments of the call whose ``(`` is just before ``start`` (nested calls, lambdas and
    brace lists kept whole; strings skipped, so a comma or parenthesis in them counts for nothing), and the index
    just past its ``)``."""
    args, depth, i = [], 1, start
    while i < len(text):
        c = text[i]
        if c in "\"'":
            i = (STRING if c == '"' else CHAR).match(text, i).end()
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                args.append(text[start:i].strip())
                return args, i + 1
        elif c == "," and depth == 1:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1
    raise ValueError("unbalanced parentheses")


def hint_text(arg: str) -> str:
    """A value hint as ``--help`` shows it: a literal's text, or for one computed at run time (``--spec-type``'s
    list of types) ``VALUE``."""
    literal = STRING.fullmatch(arg)
    return literal.group(1) if literal else "VALUE"


def example_list(chain: str, method: str, lists: dict[str, str]) -> set[str]:
    """The examples an option's ``.set_examples(...)`` or ``.set_excludes(...)`` names (``SERVER`` for
    LLAMA_EXAMPLE_SERVER), a brace list or a named one; empty when the chain has none."""
    call = re.search(rf"{method}\(\s*(\{{[^}}]*\}}|\w+)\s*\)", chain)
    if call is None:
        return set()
    text = call.group(1)
    return set(re.findall(r"LLAMA_EXAMPLE_(\w+)", lists.get(text, text)))


def server_options(source: str) -> list[tuple[list[str], str]]:
    """(spellings, value hint) of every option llama-server parses, in ``arg.cpp``'s order; the value hint is
    ``-`` for a switch, and negated spellings come as switches of their own."""
    lists = {m.group(1): m.group(2) for m in re.finditer(  # named lists of examples (``mmproj_examples``)
        r"std::initializer_list<enum llama_example>\s+(\w+)\s*=\s*\{([^}]*)\}", source)}
    body = strip_comments(source[source.index("common_params_parser_init("):])
    body = body[:body.index("return ctx_arg;")]
    out: list[tuple[list[str], str]] = []
    seen: set[str] = set()
    for match in re.finditer(r"add_opt\(\s*common_arg\(", body):
        args, end = top_level_args(body, match.end())
        chain = body[end:top_level_args(body, match.start() + len("add_opt("))[1]]  # .set_examples(...) and such
        examples, excludes = example_list(chain, "set_examples", lists), example_list(chain, "set_excludes", lists)
        if (examples and not {"SERVER", "COMMON"} & examples) or "SERVER" in excludes:
            continue
        flags = STRING.findall(args[0])
        lambda_at = next(i for i, a in enumerate(args) if a.startswith("["))
        negated: list[str] = []
        if args[1].startswith("{"):  # {"--mmap"}, {"--no-mmap"}: a switch each way
            negated, hint = STRING.findall(args[1]), "-"
        else:
            hints = [hint_text(a) for a in args[1:lambda_at - 1]]  # before the help text
            hint = " ".join(hints) if hints else "-"
        for names, value in ((flags, hint), (negated, "-")):
            names = [n for n in names if n not in seen]
            if names:
                seen.update(names)
                out.append((names, value))
    return out


def main(argv: list[str]) -> int:
    root = Path(os.environ.get("LLAMA_CPP_SRC", SDIST))
    path = Path(argv[0]) if argv else root / ARG_CPP
    print(f"# llama-server's flags, from llama.cpp's {ARG_CPP} (llama-cpp-python 0.3.36's vendored llama.cpp);")
    print("# made by scripts/llama_server_flags.py: FLAGS<TAB>VALUE (- for a switch)")
    for names, hint in server_options(path.read_text(encoding="utf-8")):
        print(f"{','.join(names)}\t{hint}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
