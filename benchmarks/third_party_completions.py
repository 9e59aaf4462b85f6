"""Write a bench workload of code completions from third-party modules installed here (models never trained on them).

For each module, the function in the middle of its functions (500-4,000 characters of source, sorted by name) is cut
after its third line, and the prompt is the 2,400 characters of the module before that point; the completion asks
for 96 tokens. Modules not installed are skipped with a note, so the set depends on the machine: the figures in
docs/drafters.md ("A floor under every generation") came from 25 of them.

    python benchmarks/third_party_completions.py -o comp.jsonl
    specstack bench run -m MODEL.gguf --workload comp.jsonl -t 1 --methods prompt-lookup@cost -k 16

With ``--sequence MODULE:CLASS`` it writes a repetitive sequence instead: the class's methods in source order, each
cut after its def line with the 2,400 characters before, as one ``group`` (run in order, so drafters that learn
across requests keep what earlier answers taught them), as a user writing one class method after method.

    python benchmarks/third_party_completions.py -o seq.jsonl --sequence yaml.constructor:FullConstructor
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from types import ModuleType

MODULES = ("requests.models", "requests.utils", "urllib3.util.retry", "urllib3.response", "idna.core", "certifi.core",
           "packaging.version", "packaging.specifiers", "pydantic.fields", "yaml.constructor", "pygments.lexer",
           "attr._make", "anyio._core._sockets", "h11._connection", "charset_normalizer.api", "tqdm.std",
           "numpy.lib._function_base_impl", "jinja2.lexer", "click.core", "httpx._client", "starlette.routing",
           "pluggy._manager", "iniconfig", "sniffio._impl", "typing_extensions")


def _functions(m: ModuleType, src: str) -> list[tuple[str, str]]:
    """(qualified name, source) of the module's own functions and methods whose source sits in the module's text."""
    found = []
    for _, obj in sorted(vars(m).items()):
        members = [obj] + ([v for _, v in sorted(vars(obj).items())] if inspect.isclass(obj) else [])
        for f in members:
            if not inspect.isfunction(f) or getattr(f, "__module__", None) != m.__name__:
                continue
            try:
                fs = inspect.getsource(f)
            except (OSError, TypeError):
                continue
            if 500 <= len(fs) <= 4000 and fs in src:
                found.append((f.__qualname__, fs))
    return found


def completion(module: str, chars: int, max_tokens: int) -> dict | None:
    """One workload line for ``module``, or None (with a note) where it is not installed or has no function to cut."""
    try:
        m = importlib.import_module(module)
        src = inspect.getsource(m)
    except Exception as e:  # noqa: BLE001 (any import failure means: not here)
        print(f"skipped {module}: {e}", file=sys.stderr)
        return None
    funcs = _functions(m, src)
    if not funcs:
        print(f"skipped {module}: no function of 500-4,000 characters", file=sys.stderr)
        return None
    qual, fs = funcs[len(funcs) // 2]
    lines = fs.splitlines(keepends=True)
    j = 0
    while j < len(lines) - 1 and not lines[j].rstrip().endswith(":"):  # the end of the def line(s)
        j += 1
    cut = src.index(fs) + len("".join(lines[: j + 3]))
    return {"id": f"{module}:{qual}", "category": "code", "max_tokens": max_tokens, "prompt": src[max(0, cut - chars):cut]}


def sequence(spec: str, chars: int, max_tokens: int, count: int) -> list[dict]:
    """Workload lines for the first ``count`` methods of ``MODULE:CLASS`` in source order (see the module's doc)."""
    module, _, cls_name = spec.partition(":")
    m = importlib.import_module(module)
    src = inspect.getsource(m)
    cls = getattr(m, cls_name)
    methods = sorted((inspect.getsourcelines(f)[1], name, inspect.getsource(f))
                     for name, f in vars(cls).items() if inspect.isfunction(f))
    rows = []
    for _, name, fs in methods[:count]:
        lines = fs.splitlines(keepends=True)
        j = 0
        while j < len(lines) - 1 and not lines[j].rstrip().endswith(":"):
            j += 1
        cut = src.index(fs) + len("".join(lines[: j + 1]))
        rows.append({"id": f"{module}:{cls_name}.{name}", "category": "repetitive", "max_tokens": max_tokens,
                     "group": spec, "prompt": src[max(0, cut - chars):cut]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", required=True, help="the workload file to write (JSON lines)")
    ap.add_argument("--chars", type=int, default=2400, help="characters of the module before the cut (default 2400)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens each completion asks for (default 96)")
    ap.add_argument("--modules", default=",".join(MODULES), help="comma-separated modules (default: 25 common ones)")
    ap.add_argument("--sequence", metavar="MODULE:CLASS", help="a repetitive sequence: the class's methods in order")
    ap.add_argument("--count", type=int, default=14, help="methods in a --sequence (default 14)")
    args = ap.parse_args()
    if args.sequence:
        rows = sequence(args.sequence, args.chars, args.max_tokens, args.count)
    else:
        rows = [r for r in (completion(m, args.chars, args.max_tokens) for m in args.modules.split(",")) if r]
    with open(args.output, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(rows)} {'requests' if args.sequence else 'completions'} to {args.output}")


if __name__ == "__main__":
    main()
