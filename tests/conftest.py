"""Shared fixtures: the bundled target, held-out prompts, and ../shared next to the repo."""

from __future__ import annotations

from pathlib import Path

import pytest

from specstack.paths import DEFAULT_TARGET

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session", autouse=True)
def hermetic_cache(tmp_path_factory):
    """Cost curves, shapes and scans go to a temporary cache, never the user's ~/.cache/specstack.

    Except two folders, linked in from the user's cache: specstack's build of llama.cpp's CPU backend (kernels/)
    and llama-cpp-python's sdist it is built from (llama-bins/).  Each is keyed by everything that goes into it, so
    sharing them is safe, and a cache of its own would cost every session a minute's build (and a 76 MB download).
    The backend is loaded here, before any test: a CLI test's subprocess then finds it built and says nothing."""
    import os

    from specstack.llama import kernel_status
    from specstack.paths import cache_dir

    old = os.environ.get("SPECSTACK_CACHE_DIR")
    users, cache = cache_dir(), tmp_path_factory.mktemp("specstack-cache")
    for shared in ("kernels", "llama-bins"):
        try:
            (users / shared).mkdir(parents=True, exist_ok=True)
            (cache / shared).symlink_to(users / shared, target_is_directory=True)
        except OSError:  # a read-only home: the session builds in its own cache
            pass
    os.environ["SPECSTACK_CACHE_DIR"] = str(cache)
    kernel_status()
    yield
    if old is None:
        os.environ.pop("SPECSTACK_CACHE_DIR", None)
    else:
        os.environ["SPECSTACK_CACHE_DIR"] = old


@pytest.fixture(scope="session", autouse=True)
def steady_timings():
    """Timings are never judged too noisy to cache, except by the tests of that judgement: a test that expects a
    first measurement to be cached must not fail because another process loaded the machine (``timing.steady``).
    ``real_noise_limit`` gives those tests the limit users get."""
    import math

    from specstack.calibration import timing

    real = timing.NOISE_LIMIT
    timing.NOISE_LIMIT = math.inf
    yield real
    timing.NOISE_LIMIT = real


@pytest.fixture()
def real_noise_limit(steady_timings, monkeypatch):
    from specstack.calibration import timing

    monkeypatch.setattr(timing, "NOISE_LIMIT", steady_timings)


@pytest.fixture(scope="session")
def target():
    from specstack.llama import LlamaModel, ModelConfig

    model = LlamaModel(ModelConfig(DEFAULT_TARGET), role="target")
    yield model
    model.close()


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} (the shared models and vocab folder) is not next to the repository")
    return SHARED




@pytest.fixture(scope="session")
def store(tmp_path_factory) -> Path:
    """A small REST datastore built from three standard-library files."""
    import os

    from specstack.cli import main

    lib = Path(os.path.dirname(os.__file__))
    files = [str(lib / f) for f in ("typing.py", "functools.py", "argparse.py") if (lib / f).exists()]
    out = tmp_path_factory.mktemp("rest") / "store"
    assert main(["datastore", "build", *files, "-o", str(out)]) == 0
    return out
