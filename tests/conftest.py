"""Shared fixtures: the bundled target, held-out prompts, and ../shared next to the repo."""

from __future__ import annotations

from pathlib import Path

import pytest

from specstack.paths import DEFAULT_TARGET

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def target():
    from specstack.target import LlamaModel, ModelConfig

    model = LlamaModel(ModelConfig(DEFAULT_TARGET), role="target")
    yield model
    model.close()


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} (the shared models and vocab folder) is not next to the repository")
    return SHARED


