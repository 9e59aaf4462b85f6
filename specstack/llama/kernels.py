"""Which llama.cpp CPU backend this process runs: specstack's build (with its verification kernels) or the stock one.

``preload()`` runs once, before llama_cpp is first imported (``backend.llama_cpp_module``): it loads the installed
``libggml-base.so.0`` and then our ``libggml-cpu.so.0`` with RTLD_GLOBAL, so that when llama_cpp loads
``libggml.so``, glibc finds a library of soname ``libggml-cpu.so.0`` already in the process and reuses ours for it.
Building it where it is not cached yet happens here too (``kernel_build``).  Anything that goes wrong leaves the
stock library to run, said once on stderr, never an import that fails because of our kernels.

``kernel_status()`` says which library runs, from /proc/self/maps where it can, so it never claims ours where
llama_cpp had been imported (and the stock library loaded) before we could preload.

SPECSTACK_KERNELS: unset or ``auto`` (build once, load), ``stock`` (never load ours), ``rebuild`` (build again,
also after a remembered failure).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .kernel_build import ensure_built
from .kernel_key import KernelSetupError, find_install, make_plan

MODES = ("auto", "stock", "rebuild")
MAPS = Path("/proc/self/maps")

_lock = threading.Lock()
_decided: "KernelStatus | None" = None


@dataclass(frozen=True)
class KernelStatus:
    """Whether specstack's kernels run in this process, and if not, why."""

    active: bool
    why_not: str | None  # None where active
    key: str | None  # the build's cache key (None: no build was planned)
    library: str | None  # the libggml-cpu this process runs (or would run once llama_cpp loads)
    isa: str | None  # what the build is for: "native" or "avx2" (AVX2 without AVX-512, as the installed library)
    log: str | None = None  # the build log

    def line(self) -> str:
        """One line for doctor, bench and logs."""
        if self.active:
            return f"specstack's verification kernels ({_isa_words(self.isa)}; build {self.key}): {self.library}"
        return f"llama-cpp-python's stock CPU backend ({self.why_not}): {self.library or 'not loaded'}"

    def short(self) -> str:
        """A few words, for a header that says much else."""
        return f"specstack's kernels (build {self.key})" if self.active else f"stock CPU backend ({self.why_not})"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KernelStatus":
        """A status read back (doctor's facts, a results.json): fields it does not know are left out."""
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})


def _isa_words(isa: str | None) -> str:
    return {"native": "built for this CPU", "avx2": "built for AVX2 without AVX-512, as the installed llama.cpp"}.get(
        isa or "", f"built for {isa}")


def mode() -> str:
    """SPECSTACK_KERNELS, where it is one of ``MODES`` (anything else: ``auto``, said once)."""
    value = os.environ.get("SPECSTACK_KERNELS", "").strip().lower() or "auto"
    if value in MODES:
        return value
    _say_once(f"SPECSTACK_KERNELS={value!r} is not one of {', '.join(MODES)}; using auto")
    return "auto"


def preload() -> "KernelStatus":
    """Load specstack's CPU backend before llama_cpp is imported (building it first where needed); once a process."""
    global _decided
    with _lock:
        if _decided is None:
            _decided = _decide()
        return _decided


def kernel_status() -> KernelStatus:
    """Which CPU backend this process runs.  Where nothing has loaded llama.cpp yet, this loads specstack's (a
    build, where it is not cached: about a minute, once per machine and llama-cpp-python).  The library named is
    the one mapped (/proc/self/maps) where llama.cpp is loaded: what runs, not what was meant to."""
    status = preload()
    mapped = _mapped_cpu_backends()
    if not mapped:  # no /proc, or llama.cpp not loaded yet
        return status
    if status.active and mapped != [status.library]:
        return replace(status, active=False, library=", ".join(mapped),
                     why_not=f"another libggml-cpu is mapped beside specstack's: {', '.join(mapped)}")
    return replace(status, library=", ".join(mapped))


def flash_attention_is_exact() -> bool:
    """Whether flash attention computes a row the same in every call shape: where specstack's CPU backend runs
    (its edit computes each query row alone, never a one-row call split over the KV), so exact modes run with it.
    The stock backend splits a one-row call over the threads once the KV holds 512 cells, so there exact call
    shapes are measured without flash attention."""
    return kernel_status().active


# llama_ftype values of the files whose weights specstack's kernels take (Q8_0, Q5_0, Q4_K_S/M, Q5_K_S/M, Q6_K)
KERNEL_FTYPES = frozenset({7, 8, 14, 15, 16, 17, 18})


def resolved_flash_attn(flash_attn: bool | None, file_type: int | None = None) -> bool:
    """``ModelConfig.flash_attn`` as a context gets it.  None (auto) is on where flash attention is exact here
    and the file's weights are ones specstack's kernels take (``file_type``, llama.cpp's ``general.file_type``):
    there every call of up to 32 rows is exact with it, and without it the attention's F16 products are not.
    Elsewhere (an F16 model, the stock backend) it is off until ``calibration.open_for_mode`` knows the
    --exact verdict: a prompt's calls of 64+ rows take flash attention's tiled path, so with it on a prefill
    computes KV unlike decoding, and a cached prefix is reused only up to a prefill call's edge."""
    if flash_attn is not None:
        return bool(flash_attn)
    return file_type in KERNEL_FTYPES and flash_attention_is_exact()


def _decide() -> KernelStatus:
    """Why the stock library must run, or ours loaded (never an exception: the stock library is the way out)."""
    if "llama_cpp" in sys.modules:
        return _stock("llama_cpp was imported before specstack.llama could load its kernels", None)
    chosen = mode()
    if chosen == "stock":
        return _stock("SPECSTACK_KERNELS=stock", None)
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return _stock("LLAMA_CPP_LIB_PATH names the llama.cpp library to run", None)
    if not sys.platform.startswith("linux"):
        return _stock(f"specstack builds its kernels on Linux only (this is {sys.platform})", None)
    try:
        return _load_ours(rebuild=chosen == "rebuild")
    except KernelSetupError as exc:
        return _fallback(str(exc), None)
    except Exception as exc:  # noqa: BLE001 - an unwritable cache, a broken install: run on the stock library
        return _fallback(f"{type(exc).__name__}: {exc}", None)


def _load_ours(rebuild: bool) -> KernelStatus:
    """Build (where not cached) and load specstack's library; the stock one where the build failed."""
    install = find_install()
    plan = make_plan(install)
    result = ensure_built(plan, install, rebuild=rebuild)
    if result.library is None:
        why = f"the kernel build failed: {result.reason}" + (f": {result.error}" if result.error else "")
        _say_once(f"running on llama-cpp-python's stock CPU backend: {why}; log: {result.log} "
                  "(SPECSTACK_KERNELS=rebuild tries again)")
        return KernelStatus(False, why, plan.key, _real(install.cpu_library), plan.isa, str(result.log))
    try:
        ctypes.CDLL(str(install.base_library), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(result.library), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return _fallback(f"specstack's library did not load ({exc})", plan.key)
    return KernelStatus(True, None, plan.key, _real(result.library), plan.isa, str(result.log))


def _stock(why: str, key: str | None) -> KernelStatus:
    """The stock library runs, by choice or circumstance (nothing said)."""
    try:
        library: str | None = _real(find_install().cpu_library)
    except KernelSetupError:
        library = None
    return KernelStatus(False, why, key, library, None)


def _fallback(why: str, key: str | None) -> KernelStatus:
    """The stock library runs because something went wrong: said once."""
    _say_once(f"running on llama-cpp-python's stock CPU backend: {why}")
    return _stock(why, key)


def _mapped_cpu_backends() -> list[str] | None:
    """The libggml-cpu files this process has mapped (None where /proc/self/maps cannot be read)."""
    try:
        lines = MAPS.read_text().splitlines()
    except OSError:
        return None
    paths = {line.split(None, 5)[5] for line in lines if len(line.split(None, 5)) == 6}
    return sorted(p for p in paths if Path(p).name.startswith("libggml-cpu.so"))


def _real(path: Path) -> str:
    """A path as /proc/self/maps names it (symbolic links resolved)."""
    return os.path.realpath(path)


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        print(f"specstack: {message}", file=sys.stderr, flush=True)


__all__ = ["KernelStatus", "kernel_status", "preload", "mode"]
