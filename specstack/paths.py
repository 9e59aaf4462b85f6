"""Where bundled files live: the default pycoder pair, prompts and workloads."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
MODELS_DIR = PACKAGE_DIR / "models"
DATA_DIR = PACKAGE_DIR / "data"

DEFAULT_TARGET = MODELS_DIR / "pycoder-6m.gguf"
DEFAULT_DRAFT = MODELS_DIR / "pycoder-1m.gguf"


def cache_dir() -> Path:
    """Where specstack caches scans and cost curves: $SPECSTACK_CACHE_DIR, else $XDG_CACHE_HOME/specstack, else ~/.cache/specstack."""
    env = os.environ.get("SPECSTACK_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specstack"
