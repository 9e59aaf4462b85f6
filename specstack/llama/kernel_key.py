"""What specstack's CPU backend is built for here, and the cache key of that build.

The library we build replaces the installed ``libggml-cpu.so.0`` in the process, so it must be what that library
is, plus our kernels: the same llama.cpp sources (llama-cpp-python's own sdist, of the installed version), the
same instruction sets and the same ggml-cpu options.  Those are read from the installed library's system info
(``llama_print_system_info``), taken in a subprocess because importing llama_cpp here would load the stock
library before ours could be.  The probe is cached by the installed files' identity: it costs 0.2 s a process.

The key hashes every input of the build (our C sources, the edit list, the llama-cpp-python version, the system
info, the compilers and the cmake flags), so changing any of them builds anew and never loads a stale library.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..paths import cache_dir
from .kernel_edits import edits_digest, sources_digest

# CI's second job installs a wheel built with exactly these (.ci/run): AVX2 without AVX-512 on an AVX-512 CPU
AVX2_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
              "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF")
NATIVE_FLAGS = ("-DGGML_NATIVE=ON",)
# as llama-cpp-python's build configures llama.cpp (its CMakeLists.txt forces LLAMA_CURL OFF and shared libraries),
# minus everything but ggml; RPATH skipped: the library is loaded by path, its libggml-base already in the process
BASE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF",
              "-DCMAKE_SKIP_RPATH=ON")
# ggml-cpu options the system info shows, each kept as the installed library has it (llama.cpp's defaults: ON)
FEATURE_OPTIONS = {"OPENMP": "GGML_OPENMP", "LLAMAFILE": "GGML_LLAMAFILE", "REPACK": "GGML_CPU_REPACK"}
PROBE = "import llama_cpp, sys; sys.stdout.write(llama_cpp.llama_print_system_info().decode(errors='replace'))"


class KernelSetupError(RuntimeError):
    """What the build needs is not there (llama_cpp's files, its system info): the stock library runs."""


@dataclass(frozen=True)
class Install:
    """The installed llama-cpp-python: its version and the folder holding its shared libraries."""

    version: str
    lib_dir: Path

    @property
    def base_library(self) -> Path:
        return self.lib_dir / "libggml-base.so.0"

    @property
    def cpu_library(self) -> Path:
        return self.lib_dir / "libggml-cpu.so.0"


@dataclass(frozen=True)
class Plan:
    """One build: its key, the inputs the key hashes, and the cmake flags it configures with."""

    key: str
    isa: str  # "native" or "avx2" (AVX2 without AVX-512, as the installed library)
    flags: tuple[str, ...]
    inputs: dict = field(hash=False, compare=False)

    @property
    def dir(self) -> Path:
        return kernels_dir() / self.key


def kernels_dir() -> Path:
    """Where builds are kept: $SPECSTACK_KERNELS_DIR, else the cache's ``kernels/``.  Its own variable, so that a
    run with a fresh cache (a test's, a first measurement's) can still find the library built before."""
    env = os.environ.get("SPECSTACK_KERNELS_DIR")
    return Path(env) if env else cache_dir() / "kernels"


def find_install() -> Install:
    """llama-cpp-python's version and lib folder, found without importing llama_cpp (which would load its library)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        raise KernelSetupError("llama-cpp-python is not installed")
    lib_dir = Path(spec.origin).parent / "lib"
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise KernelSetupError("llama-cpp-python's version is unknown (no package metadata)") from None
    install = Install(version, lib_dir)
    for lib in (install.base_library, install.cpu_library):
        if not lib.exists():
            raise KernelSetupError(f"{lib} does not exist: this llama-cpp-python is not laid out as a Linux wheel")
    return install


def make_plan(install: Install) -> Plan:
    """The build for ``install`` on this CPU and compiler."""
    info = system_info(install)
    isa, isa_flags = choose_isa(info, cpu_flags())
    flags = BASE_FLAGS + isa_flags + feature_flags(info)
    inputs = {"sources": sources_digest(), "edits": edits_digest(), "llama_cpp_python": install.version,
              "system_info": info, "compilers": compiler_versions(), "cmake_flags": list(flags)}
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]
    return Plan(key, isa, flags, inputs)


def choose_isa(system_info: str, flags: set[str]) -> tuple[str, tuple[str, ...]]:
    """Native, unless the installed library was built for AVX2 without AVX-512 on a CPU that has AVX-512 (CI's
    AVX2 wheel): then the same AVX2 flags, so our kernels run beside the kernels that library would run."""
    feats = parse_system_info(system_info)
    if feats.get("AVX512") == "1":
        return "native", NATIVE_FLAGS
    if feats.get("AVX2") == "1" and "avx512f" in flags:
        return "avx2", AVX2_FLAGS
    return "native", NATIVE_FLAGS


def feature_flags(system_info: str) -> tuple[str, ...]:
    """OpenMP, llamafile and repack as the installed library has them: each changes which kernel runs a call."""
    feats = parse_system_info(system_info)
    return tuple(f"-D{opt}={'ON' if feats.get(name) == '1' else 'OFF'}" for name, opt in FEATURE_OPTIONS.items())


def parse_system_info(text: str) -> dict[str, str]:
    """``"CPU : AVX2 = 1 | REPACK = 1 |"`` -> {"AVX2": "1", "REPACK": "1"}; a feature not listed is off."""
    from ..host.sysinfo import parse_llama_system_info

    return parse_llama_system_info(text)


def cpu_flags() -> set[str]:
    from ..host.sysinfo import cpu_flags as read_flags

    return read_flags()


def compiler_versions() -> dict[str, str]:
    """The first line of ``--version`` of the C and C++ compilers cmake will pick ($CC, $CXX, else cc and c++)."""
    return {name: _version_line(os.environ.get(var) or default)
            for name, var, default in (("cc", "CC", "cc"), ("cxx", "CXX", "c++"))}


def _version_line(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{compiler}: unavailable ({type(exc).__name__})"
    first = (out.stdout or out.stderr).strip().splitlines()
    return f"{compiler}: {first[0] if first else 'no version'}" + (f" (exit {out.returncode})" if out.returncode else "")


def system_info(install: Install) -> str:
    """The installed library's system info, probed in a subprocess once per install (cached by its files)."""
    path = kernels_dir() / f"probe-{_install_fingerprint(install)}.json"
    try:
        return str(json.loads(path.read_text())["system_info"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    info = _probe()
    _write_json(path, {"system_info": info, "lib_dir": str(install.lib_dir)})
    return info


def _probe() -> str:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    try:
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelSetupError(f"could not read llama.cpp's system info ({exc})") from None
    if out.returncode != 0 or "=" not in out.stdout:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise KernelSetupError(f"could not read llama.cpp's system info: {tail}")
    return out.stdout.strip()


def _install_fingerprint(install: Install) -> str:
    """The installed libraries' identity and this CPU's flags: a reinstall or another machine probes again."""
    parts: list[object] = [str(install.lib_dir), sorted(cpu_flags())]
    for name in ("libggml-cpu.so.0", "libggml-base.so.0", "libllama.so.0"):
        path = (install.lib_dir / name).resolve()
        st = path.stat() if path.exists() else None
        parts.append([str(path), st.st_size if st else None, st.st_mtime_ns if st else None])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def _write_json(path: Path, data: dict) -> None:
    """Write ``data`` whole or not at all (another process may read it meanwhile); a read-only cache is no error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass


def find_cmake() -> str | None:
    """cmake on PATH, else the ``cmake`` PyPI package's binary (a dependency of specstack: a fresh machine may have
    no cmake of its own, and a virtualenv's bin folder need not be on PATH)."""
    found = shutil.which("cmake")
    if found:
        return found
    try:
        import cmake  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = Path(cmake.CMAKE_BIN_DIR) / "cmake"
    return str(path) if path.exists() else None
