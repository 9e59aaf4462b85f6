"""Bundled held-out prompts (cut from stdlib files the pycoder models never saw)."""

from __future__ import annotations

import json

from .paths import DATA_DIR


def held_out_prompts(n: int | None = None, name: str = "code-complete") -> list[str]:
    """The first n prompts of a bundled prompt set (see scripts/make_prompts.py)."""
    with open(DATA_DIR / "prompts" / f"{name}.jsonl", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts if n is None else prompts[:n]
