"""Build the bundled held-out prompt sets from CPython 3.11's standard library.

The pycoder models never saw the files in specstack/models/held_out.txt, so
prompts cut from them measure real drafting.  The output is committed, so
nothing at run time depends on the local stdlib.  Run:

    python scripts/make_prompts.py

code-complete: up to MAX_CHARS of a file ending right after a ``def`` line
and the first line of its body; the model writes the rest of the body.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ROOT / "specstack" / "models" / "held_out.txt"
OUT = ROOT / "specstack" / "data" / "prompts"
MAX_CHARS = 900
DEF = re.compile(r"^(\s*)def \w+\(.*\):\s*$")


def completion_prompt(text: str) -> str | None:
    """The last def (with a one-line signature) whose body's first line ends the prompt."""
    lines = text.splitlines(keepends=True)
    best = None
    offset = 0
    for i, line in enumerate(lines[:-1]):
        if DEF.match(line) and lines[i + 1].strip() and offset > 200:
            end = offset + len(line) + len(lines[i + 1])
            best = text[max(0, end - MAX_CHARS) : end]
            if end > 1500:
                break
        offset += len(line)
    return best


def main() -> None:
    lib = Path(os.path.dirname(os.__file__))
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for rel in HELD_OUT.read_text().split():
        path = lib / rel
        if not path.exists():
            continue
        prompt = completion_prompt(path.read_text(encoding="utf-8", errors="replace"))
        if prompt:
            # Start at a line boundary so the prompt reads naturally.
            nl = prompt.find("\n")
            rows.append({"id": rel, "prompt": prompt[nl + 1 :] if 0 <= nl < 200 else prompt})
    with open(OUT / "code-complete.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} prompts to {OUT / 'code-complete.jsonl'}")


if __name__ == "__main__":
    main()
