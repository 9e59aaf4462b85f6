"""Building llama.cpp's CPU backend (the ``ggml-cpu`` target alone) with specstack's kernels, once per key.

Layout under ``kernels_dir()``: ``<key>/`` holds either ``libggml-cpu.so.0`` (built) or ``failed.json`` (why the
build failed), beside ``inputs.json`` (what the key hashes) and ``build.log``.  A build runs in
``.build-<key>-<pid>/`` and is renamed into place whole, so a reader never sees half a library; ``<key>.lock``
(fcntl) lets one process build while another waits and then loads.  A failure is remembered under its key, so a
machine without a compiler pays the failed attempt once, not at every import (``rebuild`` tries again).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..paths import cache_dir
from .kernel_edits import EditError, apply_edits
from .kernel_key import Install, Plan, find_cmake, kernels_dir

LIBRARY = "libggml-cpu.so.0"
BUILDING_LINE = ("specstack: building llama.cpp's CPU backend with specstack's verification kernels for this CPU "
                 "(once, about a minute)")
LOG_TAIL = 12  # lines of the build log kept in the failure record
ERROR_LINE = re.compile(r"CMake Error|\berror:|\bfatal error\b|\bERROR\b")
BUILD_TIMEOUT_S = 3600


@dataclass(frozen=True)
class BuildResult:
    """A build's outcome: the library, or why there is none (and the log that says more)."""

    library: Path | None
    reason: str | None
    log: Path | None
    log_tail: tuple[str, ...] = ()
    error: str | None = None  # the log's first error, in a line
    built_now: bool = False


class BuildFailed(RuntimeError):
    """One step of the build failed; ``str`` says which and why."""


def sdist_paths(version: str) -> tuple[Path, Path]:
    """Where the llama-cpp-python sdist is looked for: the cache's ``llama-bins/`` (where it is downloaded), then
    ``~/.cache/specstack/llama-bins/``, where ``scripts/build_llama_bins.sh`` keeps it whatever the cache dir."""
    name = f"llama_cpp_python-{version}.tar.gz"
    return cache_dir() / "llama-bins" / name, Path.home() / ".cache" / "specstack" / "llama-bins" / name


def ensure_built(plan: Plan, install: Install, rebuild: bool = False) -> BuildResult:
    """The library for ``plan``: cached, built now, or the failure remembered under its key."""
    if not rebuild:
        cached = read_result(plan)
        if cached is not None:
            return cached
    with _locked(plan):
        cached = None if rebuild else read_result(plan)  # another process may have built it while we waited
        if cached is not None:
            return cached
        return _build(plan, install)


def read_result(plan: Plan) -> BuildResult | None:
    """What the cache holds for ``plan``: the library, a remembered failure, or None (never built)."""
    lib, failed = plan.dir / LIBRARY, plan.dir / "failed.json"
    if lib.is_file():
        return BuildResult(lib, None, plan.dir / "build.log")
    try:
        record = json.loads(failed.read_text())
        return BuildResult(None, str(record["reason"]), Path(record["log"]), tuple(record.get("log_tail", ())),
                           record.get("error"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _locked:
    """``<key>.lock`` held exclusively; says one line where another process holds it (it is building)."""

    def __init__(self, plan: Plan) -> None:
        self.path = kernels_dir() / f"{plan.key}.lock"

    def __enter__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("specstack: waiting for another process to finish building llama.cpp's CPU backend",
                  file=sys.stderr, flush=True)
            fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _build(plan: Plan, install: Install) -> BuildResult:
    """Build into a private folder, then rename it to ``plan.dir``; a failure is renamed there too, as a record."""
    print(BUILDING_LINE, file=sys.stderr, flush=True)
    _clear_stale(plan)
    work = kernels_dir() / f".build-{plan.key}-{os.getpid()}"
    out = work / "out"
    out.mkdir(parents=True)
    log = out / "build.log"
    (out / "inputs.json").write_text(json.dumps({**plan.inputs, "key": plan.key, "isa": plan.isa}, indent=1))
    try:
        started = time.monotonic()
        built = _run_steps(plan, install, work, log)
        shutil.copyfile(built, out / LIBRARY)
        _append(log, f"built in {time.monotonic() - started:.0f} s")
    except Exception as exc:  # noqa: BLE001 - any failure is recorded, and the stock library runs
        reason = str(exc) if isinstance(exc, (BuildFailed, EditError)) else f"{type(exc).__name__}: {exc}"
        lines = _lines(log)
        (out / "failed.json").write_text(json.dumps({"reason": reason, "error": first_error(lines),
                                                     "log": str(plan.dir / "build.log"),
                                                     "log_tail": lines[-LOG_TAIL:]}, indent=1))
    _publish(out, plan.dir)
    shutil.rmtree(work, ignore_errors=True)
    result = read_result(plan)
    assert result is not None
    return BuildResult(result.library, result.reason, result.log, result.log_tail, result.error, built_now=True)


def _run_steps(plan: Plan, install: Install, work: Path, log: Path) -> Path:
    """sdist, tree, edits, configure, build: the built library's path, or ``BuildFailed`` naming the step."""
    cmake = find_cmake()
    if cmake is None:
        raise BuildFailed("no cmake (neither on PATH nor the `cmake` package's): pip install cmake")
    tree = _extract_tree(obtain_sdist(install.version, log), work / "src")
    _append(log, "applied: " + "; ".join(apply_edits(tree)))
    build = work / "build"
    _run([cmake, "-S", str(tree), "-B", str(build), *plan.flags], log, "cmake configure")
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(max(1, len(os.sched_getaffinity(0))))
    _run([cmake, "--build", str(build), "--target", "ggml-cpu", "-j", jobs], log, "cmake --build (ggml-cpu)")
    built = build / "bin" / LIBRARY
    if not built.exists():
        raise BuildFailed(f"the build ran but left no {built}")
    return built.resolve()


def obtain_sdist(version: str, log: Path) -> Path:
    """llama-cpp-python's sdist of the installed version: a kept copy, else ``pip download`` (8 s here).  Only
    llama-cpp-python itself is asked for as source: ``--no-binary :all:`` would build the build dependencies pip
    prepares the sdist's metadata with (cmake among them) from source too, which takes longer than the build."""
    for path in sdist_paths(version):
        if path.is_file():
            _append(log, f"sdist: {path}")
            return path
    path = sdist_paths(version)[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
          f"llama-cpp-python=={version}", "-d", str(path.parent)], log,
         f"downloading llama-cpp-python {version}'s source (pip download)")
    if not path.is_file():
        raise BuildFailed(f"pip download left no {path}")
    return path


def _extract_tree(sdist: Path, dest: Path) -> Path:
    """The llama.cpp tree the sdist vendors (``vendor/llama.cpp``), without the parts a library build never reads."""
    skip = ("models/", "docs/", "media/", "benches/")
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        prefix = f"{top}/vendor/llama.cpp/"
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix) and not m.name[len(prefix):].startswith(skip)]
        if not members:
            raise BuildFailed(f"{sdist} holds no vendor/llama.cpp")
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **kwargs)
    return dest / prefix


def _run(cmd: list[str], log: Path, step: str) -> None:
    """Run one step with its output appended to ``log``; ``BuildFailed`` naming the step where it fails."""
    _append(log, "$ " + " ".join(cmd))
    with log.open("a") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=BUILD_TIMEOUT_S).returncode
        except FileNotFoundError as exc:
            raise BuildFailed(f"{step} failed: {exc}") from None
        except subprocess.TimeoutExpired:
            raise BuildFailed(f"{step} ran past {BUILD_TIMEOUT_S} s") from None
    if rc != 0:
        raise BuildFailed(f"{step} failed (exit {rc})")


def _append(log: Path, line: str) -> None:
    with log.open("a") as out:
        out.write(line + "\n")


def _lines(log: Path) -> list[str]:
    try:
        return log.read_text(errors="replace").splitlines()
    except OSError:
        return []


def first_error(lines: list[str], width: int = 240) -> str | None:
    """The first error the log shows (cmake's "CMake Error" and the lines of its message, a compiler's "error:"),
    in one line of at most ``width`` characters: the log's last lines are usually only "errors occurred"."""
    for i, line in enumerate(lines):
        if ERROR_LINE.search(line):
            said = " ".join(" ".join(lines[i:i + 6]).split())
            return said if len(said) <= width else said[:width - 3] + "..."
    return None


def _publish(out: Path, final: Path) -> None:
    """Rename the finished folder into place (under the lock: an older result of this key is replaced)."""
    if final.exists():
        shutil.rmtree(final)
    os.rename(out, final)


def _clear_stale(plan: Plan) -> None:
    """Work folders of this key that a killed build left (the lock is ours, so none of them is running)."""
    for stale in kernels_dir().glob(f".build-{plan.key}-*"):
        shutil.rmtree(stale, ignore_errors=True)
