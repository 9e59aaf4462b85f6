"""llama.cpp's process-wide side: importing llama_cpp, its backend and log, file checks, quantizing.

This package is the only place that imports llama_cpp; every other module
reaches llama.cpp through ``specstack.target``.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from ..errors import ModelLoadError, UnsupportedModelError

_GGUF_MAGIC = b"GGUF"
_backend_lock = threading.Lock()
_backend_ready = False
recent_log: list[str] = []  # last llama.cpp log lines, quoted in load errors
_log_state = {"verbose": False}
_log_callback = None  # keep the ctypes callback alive for the process lifetime


def llama_cpp_module():
    """Import llama_cpp lazily, so commands that only read metadata stay fast."""
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - install problem
        raise ModelLoadError(
            f"llama-cpp-python is not importable ({exc}); install it with `pip install llama-cpp-python==0.3.36`"
        ) from None
    return llama_cpp


def set_verbose(verbose: bool) -> None:
    """Show llama.cpp's own log on stderr (off by default: it is very chatty)."""
    _log_state["verbose"] = verbose


def init_backend() -> None:
    """Initialise llama.cpp once and route its log through a quiet callback."""
    global _backend_ready, _log_callback
    with _backend_lock:
        if _backend_ready:
            return
        lc = llama_cpp_module()

        def on_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            line = text.decode("utf-8", errors="replace") if text else ""
            recent_log.append(line)
            del recent_log[:-40]
            if _log_state["verbose"]:
                import sys

                sys.stderr.write(line)

        _log_callback = lc.llama_log_callback(on_log)
        lc.llama_log_set(_log_callback, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _backend_ready = True


def check_gguf_file(path: str | Path, role: str = "model") -> Path:
    """Fail early, clearly, on a missing or non-GGUF file (llama.cpp would only say 'failed')."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"{role} file not found: {p}; pass an existing .gguf file (see `specstack models scan DIR`)")
    if p.is_dir():
        raise ModelLoadError(f"{role} path is a directory, not a GGUF file: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(
            f"{role} file is not GGUF (starts with {magic!r}, expected b'GGUF'): {p}; "
            "convert it with llama.cpp's convert_hf_to_gguf.py or pick a .gguf file"
        )
    return p


def default_threads() -> int:
    """Physical cores: llama.cpp decoding gains nothing from SMT siblings."""
    try:
        from ..machine.sysinfo import physical_cores

        return max(1, physical_cores())
    except Exception:  # sysinfo missing or unreadable /proc: fall back
        import os

        return max(1, os.cpu_count() or 1)


def quantize(src: Path, out: Path, ftype: str, *, threads: int = 2) -> int:
    """llama.cpp's own quantizer (``llama_model_quantize``); ftype "q8_0" or "q4_k_m". Returns its code."""
    lc = llama_cpp_module()
    init_backend()
    ftypes = {"q8_0": lc.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_k_m": lc.LLAMA_FTYPE_MOSTLY_Q4_K_M}
    if ftype not in ftypes:
        raise UnsupportedModelError(f"cannot quantize to {ftype!r}; choose one of {', '.join(ftypes)}")
    params = lc.llama_model_quantize_default_params()
    params.ftype = ftypes[ftype]
    params.nthread = threads
    return int(lc.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)))


def llama_version() -> str | None:
    """llama-cpp-python's version, or None when it cannot be imported (never raises)."""
    try:
        return getattr(llama_cpp_module(), "__version__", None)
    except Exception:  # noqa: BLE001 - doctor and bench report it, they must not fail on it
        return None


def llama_system_info() -> tuple[str | None, str | None]:
    """(llama.cpp's system info line, error): never raises, for doctor and bench."""
    try:
        return system_info().strip(), None
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"


def system_info() -> str:
    """llama.cpp's build and CPU feature line (AVX2, AVX512, ...)."""
    init_backend()
    return llama_cpp_module().llama_print_system_info().decode(errors="replace")


def builtin_chat_templates() -> list[str]:
    """The chat templates llama.cpp knows by name (``llama_chat_builtin_templates``: gemma, chatml, llama3, ...)."""
    lc = llama_cpp_module()
    n = int(lc.llama_chat_builtin_templates(None, 0))
    names = (ctypes.c_char_p * n)()
    lc.llama_chat_builtin_templates(names, n)
    return sorted(name.decode() for name in names if name)


def apply_builtin_chat_template(name: str, messages: list[tuple[str, str]]) -> str:
    """``messages`` (role, text) through llama.cpp's built-in template ``name``, ending with the assistant's turn.

    Raises ``ValueError`` when llama.cpp refuses (an unknown name, or messages the format cannot hold).
    """
    lc = llama_cpp_module()
    keep = [(role.encode(), text.encode()) for role, text in messages]  # alive while llama.cpp reads them
    chat = (lc.llama_chat_message * len(keep))(*[lc.llama_chat_message(r, t) for r, t in keep])
    size = 2 * sum(len(r) + len(t) for r, t in keep) + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = int(lc.llama_chat_apply_template(name.encode(), chat, len(keep), True, buf, size))
        if n < 0:
            raise ValueError(f"llama.cpp's chat template {name!r} could not format these messages")
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n
    raise ValueError(f"llama.cpp's chat template {name!r} returned an inconsistent size")
