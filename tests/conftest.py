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

    Except the user's builds of llama.cpp's CPU backend: SPECSTACK_KERNELS_DIR names the user's kernels/ for this
    session and every process it starts, whatever cache a test gives them.  A build is keyed by everything that goes
    into it, so sharing it is safe, and a folder of the session's own would cost every session (and every test with
    a fresh cache) a build.  The backend is loaded here, before any test: a CLI test's subprocess then finds it
    built and says nothing."""
    import os

    from specstack.llama import kernel_status
    from specstack.llama.kernel_key import kernels_dir

    old = os.environ.get("SPECSTACK_CACHE_DIR")
    old_kernels = os.environ.get("SPECSTACK_KERNELS_DIR")
    os.environ["SPECSTACK_KERNELS_DIR"] = str(kernels_dir())
    os.environ["SPECSTACK_CACHE_DIR"] = str(tmp_path_factory.mktemp("specstack-cache"))
    kernel_status()
    yield
    if old_kernels is None:
        os.environ.pop("SPECSTACK_KERNELS_DIR", None)
    else:
        os.environ["SPECSTACK_KERNELS_DIR"] = old_kernels
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
