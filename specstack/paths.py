"""Where bundled files live: the default pycoder pair, prompts and workloads."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
MODELS_DIR = PACKAGE_DIR / "models"
DATA_DIR = PACKAGE_DIR / "data"

DEFAULT_TARGET = MODELS_DIR / "pycoder-6m.gguf"
DEFAULT_DRAFT = MODELS_DIR / "pycoder-1m.gguf"
