"""Build the bundled benchmark workloads from CPython 3.11's held-out standard library files.

Only files listed in specstack/models/held_out.txt are read (the pycoder models
never saw them), so the workloads measure real drafting, not recall.  The
output is committed; nothing at run time needs the local stdlib.  Run:

    python scripts/make_workloads.py

code-complete  a def line and the first line of its body; the model writes the
               rest (the first prompts of specstack/data/prompts/code-complete.jsonl).
code-grounded  the prompt holds code the output naturally re-uses:
               'edit'    a function, then "# Same function, refactored:" and its def line;
               'sibling' a method of a class, then the def line of the most similar
                         other method of that class.
repetitive     groups of requests with shared structure, run in order: one test
               class's header, then the def line of each of its test methods, so
               state kept across requests (the suffix drafter's global tree) can learn.
grounded-edit  third-party code (functions from packages specstack installs, none of them
               CPython's), each with a small edit to make and the instruction to return the
               whole function: the answer copies the prompt, as an agent's edits do.  For
               models other than the bundled pair (Gemma 3 270M, stand-ins), beside code-complete.

Every prompt is at most MAX_PROMPT_TOKENS tokens and prompt + max_tokens fits the
models' 512-token context (counted with the bundled target's tokenizer).
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HELD_OUT = ROOT / "specstack" / "models" / "held_out.txt"
PROMPTS = ROOT / "specstack" / "data" / "prompts" / "code-complete.jsonl"
OUT = ROOT / "specstack" / "data" / "workloads"
N_CTX = 512
MAX_PROMPT_TOKENS = 300
EDIT_MARK = "\n\n# Same function, refactored:\n"

# code-complete: every request writes this many tokens.
COMPLETE_COUNT, COMPLETE_TOKENS = 10, 128
# code-grounded: how many of each kind, and the output budget (enough to rewrite the function).
EDIT_COUNT, SIBLING_COUNT = 6, 4
GROUNDED_TOKENS = 128
# repetitive: (held-out file, class, requests); each group runs in order.
REPETITIVE_GROUPS = (
    ("test/test_timeit.py", "TestTimeit", 16),
    ("test/test_sqlite3/test_regression.py", "RegressionTests", 12),
)
REPETITIVE_TOKENS = 96


class Tokens:
    """Token counts from the bundled target's tokenizer."""

    def __init__(self) -> None:
        from specstack.paths import DEFAULT_TARGET
        from specstack.llama import LlamaModel, ModelConfig

        self.model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_threads=1), role="target")

    def __call__(self, text: str) -> int:
        return len(self.model.tokenize(text))


def held_out_files() -> list[tuple[str, Path]]:
    lib = Path(os.path.dirname(os.__file__))
    files = []
    for rel in HELD_OUT.read_text().split():
        if (lib / rel).is_file():
            files.append((rel, lib / rel))
    return files


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def source_of(text: str, node: ast.AST) -> tuple[str, str]:
    """(whole source, header) of a function, dedented; header = decorators and def line(s)."""
    lines = text.splitlines(keepends=True)
    start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno]) - 1
    src = textwrap.dedent("".join(lines[start : node.end_lineno]))
    n_header = node.body[0].lineno - 1 - start  # 0 when the body shares the def line
    header = "".join(src.splitlines(keepends=True)[:n_header])
    return src.rstrip() + "\n", header


def fits(n_prompt: int, max_tokens: int) -> bool:
    return n_prompt <= MAX_PROMPT_TOKENS and n_prompt + max_tokens <= N_CTX - 2


# -- code-complete ---------------------------------------------------------------------------


def code_complete(tok: Tokens) -> list[dict]:
    rows = []
    for line in PROMPTS.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        prompt = trim_to_tokens(row["prompt"], tok, MAX_PROMPT_TOKENS)
        if prompt and fits(tok(prompt), COMPLETE_TOKENS):
            rows.append({"id": row["id"], "category": "complete", "max_tokens": COMPLETE_TOKENS, "prompt": prompt})
        if len(rows) == COMPLETE_COUNT:
            break
    return rows


def trim_to_tokens(text: str, tok: Tokens, limit: int) -> str | None:
    """Drop whole lines from the front until the text has at most ``limit`` tokens."""
    lines = text.splitlines(keepends=True)
    while lines and tok("".join(lines)) > limit:
        lines.pop(0)
    return "".join(lines) if len(lines) >= 3 else None


# -- code-grounded ---------------------------------------------------------------------------


def functions(text: str) -> list[tuple[ast.AST, ast.ClassDef | None]]:
    """Every function in a module with its enclosing class (None at module level)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node, None))
        elif isinstance(node, ast.ClassDef):
            out.extend((m, node) for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return out


def edit_candidates(files, tok: Tokens) -> list[dict]:
    """Functions of 60-200 tokens and 5+ lines, one per file, largest first within a file."""
    rows = []
    for rel, path in files:
        text = read(path)
        best = None
        for fn, _cls in functions(text):
            src, header = source_of(text, fn)
            if not header:
                continue
            n_lines = src.count("\n")
            n = tok(src)
            if not (60 <= n <= 200 and n_lines >= 5):
                continue
            prompt = src.rstrip("\n") + EDIT_MARK + header
            n_prompt = tok(prompt)
            if fits(n_prompt, GROUNDED_TOKENS) and (best is None or n > best[0]):
                best = (n, fn.name, prompt)
        if best:
            rows.append({"id": f"{rel}:{best[1]}:edit", "category": "edit", "max_tokens": GROUNDED_TOKENS, "prompt": best[2]})
    return rows


def _body_shape(src: str, name: str) -> str:
    return src.replace(name, "NAME")


def sibling_candidates(files, tok: Tokens) -> list[tuple[float, dict]]:
    """(similarity, row) for the most similar pair of methods in each class of each file."""
    rows = []
    for rel, path in files:
        text = read(path)
        best = None
        by_class: dict[str, list[tuple[ast.AST, tuple[str, str]]]] = {}
        classes: dict[str, ast.ClassDef] = {}
        for fn, cls in functions(text):
            if cls is None:
                continue
            by_class.setdefault(cls.name, []).append((fn, source_of(text, fn)))
            classes[cls.name] = cls
        for cname, methods in by_class.items():
            header = text.splitlines(keepends=True)[classes[cname].lineno - 1]
            header = header.lstrip() if not header.startswith(" ") else header.strip() + "\n"
            for i, (a, (a_src, _)) in enumerate(methods):
                for b, (b_src, b_header) in methods[i + 1 : i + 4]:  # nearby methods
                    if not b_header or b_src.count("\n") < 3 or a.name.startswith("__") or b.name.startswith("__"):
                        continue
                    sim = difflib.SequenceMatcher(None, _body_shape(a_src, a.name), _body_shape(b_src, b.name)).ratio()
                    if sim < 0.5 or a_src == b_src:
                        continue
                    prompt = header + textwrap.indent(a_src, "    ") + "\n" + textwrap.indent(b_header, "    ")
                    n_prompt, n_out = tok(prompt), tok(b_src)
                    if n_out < 30 or not fits(n_prompt, GROUNDED_TOKENS):
                        continue
                    if best is None or sim > best[0]:
                        best = (sim, {"id": f"{rel}:{cname}.{b.name}:sibling", "category": "sibling",
                                      "max_tokens": GROUNDED_TOKENS, "prompt": prompt})
        if best:
            rows.append(best)
    return rows


def spread(rows: list, n: int) -> list:
    """n rows spread evenly over a list (deterministic)."""
    if len(rows) <= n:
        return rows
    return [rows[round(i * (len(rows) - 1) / (n - 1))] for i in range(n)] if n > 1 else rows[:1]


def code_grounded(files, tok: Tokens) -> list[dict]:
    edits = spread(edit_candidates(files, tok), EDIT_COUNT)
    siblings = sorted(sibling_candidates(files, tok), key=lambda s: -s[0])
    used = {r["id"].split(":")[0] for r in edits}
    picked = [row for _sim, row in siblings if row["id"].split(":")[0] not in used][:SIBLING_COUNT]
    return edits + picked


# -- repetitive ------------------------------------------------------------------------------


def repetitive(tok: Tokens) -> list[dict]:
    lib = Path(os.path.dirname(os.__file__))
    held = set(HELD_OUT.read_text().split())
    rows = []
    for rel, cname, count in REPETITIVE_GROUPS:
        if rel not in held:
            raise SystemExit(f"{rel} is not in {HELD_OUT}: only held-out files may be used")
        text = read(lib / rel)
        tree = ast.parse(text)
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cname)
        lines = text.splitlines(keepends=True)
        methods = [m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        tests = [m for m in methods if m.name.startswith("test")]
        # Shared header: the module's imports, the class line and the methods before the first
        # test (setUp ...), never a test body.
        imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno < cls.lineno]
        first_test = min([d.lineno for d in tests[0].decorator_list] + [tests[0].lineno])
        header = (
            "".join(lines[imports[0].lineno - 1 : imports[-1].end_lineno]).rstrip()
            + "\n\n\n"
            + "".join(lines[cls.lineno - 1 : first_test - 1]).rstrip()
            + "\n\n"
        )
        group = f"{Path(rel).stem}.{cname}"
        n = 0
        for m in tests:
            start = min([d.lineno for d in m.decorator_list] + [m.lineno]) - 1
            def_end = m.body[0].lineno - 1
            prompt = header + "".join(lines[start:def_end])
            if not prompt.rstrip().endswith(":"):
                continue
            body = "".join(lines[def_end : m.end_lineno])
            if tok(body) < 12:
                continue
            if not fits(tok(prompt), REPETITIVE_TOKENS):
                raise SystemExit(f"{rel}: the shared header of {cname} is too long for a {MAX_PROMPT_TOKENS}-token prompt")
            rows.append({"id": f"{rel}:{cname}.{m.name}", "category": "repetitive", "max_tokens": REPETITIVE_TOKENS,
                         "group": group, "prompt": prompt})
            n += 1
            if n == count:
                break
    return rows


# grounded-edit: (module, function, the edit asked for); every answer may use this many tokens.
GROUNDED_EDITS = [
    ("jinja2.utils", "url_quote", "Rename the parameter `obj` to `value` everywhere"),
    ("httpx._urlparse", "normalize_port", "Rename `default_port` to `scheme_port` everywhere"),
    ("httpx._urlparse", "validate_path", "Replace the ValueError raised with InvalidURL (already imported)"),
    ("starlette.datastructures", "make_absolute_url", "Rename `base_url` to `root_url` everywhere"),
    ("click.utils", "get_text_stream", "Rename the parameter `name` to `stream_name` everywhere"),
    ("prometheus_client.utils", "floatToGoString", "Rename the function to `float_to_go_string`"),
]
GROUNDED_EDIT_TOKENS = 160


def grounded_edit() -> list[dict]:
    """Edits of third-party functions, the whole function to be returned (the models never saw this code)."""
    import importlib
    import inspect

    rows = []
    for module, name, task in GROUNDED_EDITS:
        src = inspect.getsource(importlib.import_module(module))
        node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == name)
        code = ast.get_source_segment(src, node)
        prompt = (f"Below is a Python function from the {module.split('.')[0]} package.\n\n```python\n{code}\n```\n\n"
                  f"Task: {task}. Return the whole function, changed, and nothing else.\n\n```python\n")
        rows.append({"id": f"{module}:{name}:edit", "category": "edit", "max_tokens": GROUNDED_EDIT_TOKENS,
                     "prompt": prompt})
    return rows


def write(name: str, rows: list[dict], tok: Tokens) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            ordered = {k: row[k] for k in ("id", "category", "max_tokens", "group", "prompt") if k in row}
            f.write(json.dumps(ordered) + "\n")
    sizes = [tok(r["prompt"]) for r in rows]
    cats = sorted({r["category"] for r in rows})
    print(f"wrote {len(rows)} requests to {path.relative_to(ROOT)} ({', '.join(cats)}; prompt tokens {min(sizes)}-{max(sizes)})")


def main() -> None:
    tok = Tokens()
    files = held_out_files()
    write("code-complete", code_complete(tok), tok)
    write("code-grounded", code_grounded(files, tok), tok)
    write("repetitive", repetitive(tok), tok)
    write("grounded-edit", grounded_edit(), tok)


if __name__ == "__main__":
    main()
