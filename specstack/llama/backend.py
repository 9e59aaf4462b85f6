"""llama.cpp's process-wide side: importing llama_cpp, its backend and log, file checks, quantizing.

This package is the only place that imports llama_cpp; every other module
reaches llama.cpp through ``specstack.llama``.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, NamedTuple

from ..errors import ModelLoadError, UnsupportedModelError
from ..modelfile.read import check_gguf_file  # the one check of a model file, with the reader

_backend_lock = threading.Lock()
_backend_ready = False
recent_log: list[str] = []  # last llama.cpp log lines, quoted in load errors
_log_state: dict[str, object] = {"verbose": False, "verbosity": None, "numa": 0}
_log_callback = None  # keep the ctypes callback alive for the process lifetime
_progress_callback = None  # likewise, passed to every model load
_interrupt = {"pending": False}  # a Ctrl-C that arrived inside a llama.cpp callback, raised once the call returns
_threads_warned: set[int] = set()


def llama_cpp_module():
    """Import llama_cpp lazily, so commands that only read metadata stay fast.  specstack's CPU backend is loaded
    first (``kernels.preload``): once llama_cpp is imported, its stock library is in the process for good."""
    from .kernels import preload

    preload()
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - install problem
        raise ModelLoadError(
            f"llama-cpp-python is not importable ({exc}); install it with `pip install llama-cpp-python==0.3.36`"
        ) from None
    return llama_cpp


def ext_module():
    """``llama_cpp.llama_cpp_ext``: llama.cpp's staging API (``src/llama-ext.h``) as llama-cpp-python wraps it.
    Here, beside ``llama_cpp_module``, because both the target's hidden rows (``hidden``) and the MTP context
    (``mtp``) call it, and ``mtp`` imports the model that ``hidden`` is part of."""
    llama_cpp_module()  # our CPU backend first
    import llama_cpp.llama_cpp_ext as ext

    return ext


class HeadApi(NamedTuple):
    """The part of ``llama-ext.h`` that trained draft heads (EAGLE-3, DFlash) need and llama-cpp-python does not
    bind: a target's layer inputs, a head's target layer ids, the token embedding matrix.  The header is C++ with
    no ``extern "C"``, so these are exported under mangled names (docs/design-eagle3-dflash.md, blocker 2)."""

    set_embeddings_layer_inp: Any  # (ctx, uint32 layer id, bool) -> None; forces a scheduler re-reserve
    get_embeddings_layer_inp: Any  # (ctx, uint32 layer id) -> address (int, None for NULL) of n_embd floats per row
    #                              of the last call: an address, since staging copies it with one memmove a layer
    model_target_layer_ids: Any  # (model) -> const int32*: a head's ``{arch}.target_layers``
    model_target_layer_ids_n: Any  # (model) -> uint32: how many
    model_dflash_selector_top_k: Any  # (model) -> int32: DFlash2's selector top-k
    model_get_tok_embd: Any  # (model, float* or NULL) -> uint32: the n_vocab*n_embd F32 token embeddings


# (names tried in order: a plain C export, then the Itanium C++ mangling that the Linux library exports;
# each mangled name read with ``nm -D --defined-only llama_cpp/lib/libllama.so``), argtypes, restype.
_HEAD_SYMBOLS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "set_embeddings_layer_inp": (("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"), "ctx,u32,bool", "void"),
    "get_embeddings_layer_inp": (("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj"), "ctx,u32", "void*"),
    "model_target_layer_ids": (("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model"), "model", "int32*"),
    "model_target_layer_ids_n": (("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model"), "model", "u32"),
    "model_dflash_selector_top_k": (("llama_model_dflash_selector_top_k", "_Z33llama_model_dflash_selector_top_kPK11llama_model"), "model", "i32"),
    "model_get_tok_embd": (("llama_model_get_tok_embd", "_Z24llama_model_get_tok_embdPK11llama_modelPf"), "model,float*", "u32"),
}
_head_api: HeadApi | None = None


def head_api() -> HeadApi:
    """The six ``llama-ext.h`` functions of ``HeadApi``, bound once on llama-cpp-python's loaded library
    (``llama_cpp.llama_cpp._lib``), as ``llama_cpp_ext._ctypes_function_from_names`` binds the ones it has.
    Raises ``ModelLoadError`` naming the symbols when the library lacks one (another llama.cpp build)."""
    global _head_api
    if _head_api is None:
        lc = llama_cpp_module()
        ctypes_of = {"ctx": lc.llama_context_p_ctypes, "model": lc.llama_model_p_ctypes, "u32": ctypes.c_uint32,
                     "i32": ctypes.c_int32, "bool": ctypes.c_bool, "float*": ctypes.POINTER(ctypes.c_float),
                     "int32*": ctypes.POINTER(ctypes.c_int32), "void*": ctypes.c_void_p, "void": None}
        bound = {field: _bind(lc.llama_cpp._lib, names, [ctypes_of[a] for a in args.split(",")], ctypes_of[res])
                 for field, (names, args, res) in _HEAD_SYMBOLS.items()}
        _head_api = HeadApi(**bound)
    return _head_api


def _bind(lib: ctypes.CDLL, names: tuple[str, ...], argtypes: list[Any], restype: Any) -> Any:
    """The first of ``names`` that ``lib`` exports, typed; a ``ModelLoadError`` naming them all when none is."""
    for name in names:
        try:
            func = getattr(lib, name)
        except AttributeError:
            continue
        func.argtypes = argtypes
        func.restype = restype
        return func
    raise ModelLoadError(f"this llama.cpp library exports none of {', '.join(names)}; specstack needs "
                         "llama-cpp-python 0.3.36's build (pip install llama-cpp-python==0.3.36)")


def set_verbose(verbose: bool, verbosity: int | None = None) -> None:
    """Show llama.cpp's own log on stderr (off by default: it is very chatty); ``verbosity`` (llama.cpp's -lv:
    1 errors, 2 warnings too, 3 information, 4 debug) shows only the lines up to that level."""
    _log_state["verbose"] = verbose or verbosity is not None
    _log_state["verbosity"] = verbosity


def set_numa(strategy: int) -> None:
    """llama.cpp's NUMA strategy (--numa: ``enum ggml_numa_strategy``, 0 off), for the process: llama_numa_init runs
    once the backend is up, before any model loads (now, if it is up already)."""
    _log_state["numa"] = strategy
    if _backend_ready and strategy:
        llama_cpp_module().llama_numa_init(strategy)


def init_backend() -> None:
    """Initialise llama.cpp once and route its log through a quiet callback."""
    global _backend_ready, _log_callback, _progress_callback
    with _backend_lock:
        if _backend_ready:
            return
        lc = llama_cpp_module()
        _log_callback = lc.llama_log_callback(_on_log)
        _progress_callback = lc.llama_progress_callback(_on_progress)
        lc.llama_log_set(_log_callback, ctypes.c_void_p(0))
        lc.llama_backend_init()
        if _log_state["numa"]:
            lc.llama_numa_init(_log_state["numa"])
        _backend_ready = True
    raise_if_interrupted()


def _on_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log, kept for load errors (and shown with --verbose).

    An exception cannot leave a ctypes callback (ctypes prints "Exception ignored on calling ctypes
    callback" and llama.cpp goes on), so a Ctrl-C raised here is noted and raised after the call returns."""
    try:
        line = text.decode("utf-8", errors="replace") if text else ""
        recent_log.append(line)
        del recent_log[:-40]
        if _log_state["verbose"] and _shown(level):
            sys.stderr.write(line)
    except KeyboardInterrupt:
        _interrupt["pending"] = True


def _shown(level: int) -> bool:
    """Whether a llama.cpp log line of ggml ``level`` (1 debug, 2 info, 3 warn, 4 error) is shown under -lv N
    (llama.cpp's levels: 1 errors, 2 warnings too, 3 information, 4 debug); every line without -lv.  A
    continuation line (5) follows the line it continues."""
    verbosity = _log_state["verbosity"]
    if verbosity is None:
        return True
    if level != 5:
        _log_state["shown"] = level == 0 or level >= max(1, 5 - int(verbosity))
    return bool(_log_state.get("shown", True))


def _on_progress(progress: float, user_data: ctypes.c_void_p) -> bool:
    """llama.cpp's model-load progress: False aborts the load, which is how a Ctrl-C stops it (see ``_on_log``).
    Only the main thread's load: the interrupt is raised there, and a load on another thread (a server's role)
    would only fail."""
    try:
        return not (_interrupt["pending"] and threading.current_thread() is threading.main_thread())
    except KeyboardInterrupt:
        _interrupt["pending"] = True
        return False


_CALLBACK_CODES: frozenset[CodeType] = frozenset({_on_log.__code__, _on_progress.__code__})


def in_llama_callback(frame: FrameType | None) -> bool:
    """True when ``frame`` (a signal handler's) runs inside a llama.cpp callback, where an exception would be lost."""
    while frame is not None:
        if frame.f_code in _CALLBACK_CODES:
            return True
        frame = frame.f_back
    return False


def defer_interrupt() -> None:
    """Note a Ctrl-C to raise once llama.cpp's call returns (``raise_if_interrupted``); a load in progress stops."""
    _interrupt["pending"] = True


def raise_if_interrupted() -> None:
    """Raise the ``KeyboardInterrupt`` a llama.cpp callback had to hold back, on the main thread (where Python
    delivers signals), after the C call that ran the callback has returned."""
    if _interrupt["pending"] and threading.current_thread() is threading.main_thread():
        _interrupt["pending"] = False
        raise KeyboardInterrupt


def progress_callback():
    """The load-progress callback every model load passes to llama.cpp (``llama_model_params.progress_callback``)."""
    init_backend()
    return _progress_callback


def default_threads() -> int:
    """Physical cores: llama.cpp decoding gains nothing from SMT siblings."""
    try:
        from ..host.sysinfo import physical_cores

        return max(1, physical_cores())
    except Exception:  # sysinfo missing or unreadable /proc: fall back
        import os

        return max(1, os.cpu_count() or 1)


def usable_threads(requested: int) -> int:
    """``requested`` threads capped at the CPUs this process may use, with a warning once per value.

    More llama.cpp threads than CPUs only contend for them: -t 1000 started 1,001 threads and made the
    one-time measurement run for minutes.  0 (the default) means one per physical core."""
    if requested <= 0:
        return default_threads()
    from ..host.sysinfo import allowed_cpus

    cpus = max(1, len(allowed_cpus()))
    if requested <= cpus:
        return requested
    if requested not in _threads_warned:
        _threads_warned.add(requested)
        print(f"specstack: warning: -t {requested} is more than the {cpus} CPUs this process may use; using {cpus} "
              "(more threads would only contend for them)", file=sys.stderr, flush=True)
    return cpus


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
    code = int(lc.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)))
    raise_if_interrupted()
    return code


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


def apply_builtin_chat_template(name: str, messages: list[tuple[str, str]], generation_prompt: bool = True) -> str:
    """``messages`` (role, text) through llama.cpp's built-in template ``name``, ending with the assistant's turn
    opened (``generation_prompt`` False: not opened).

    Raises ``ValueError`` when llama.cpp refuses (an unknown name, or messages the format cannot hold).
    """
    lc = llama_cpp_module()
    keep = [(role.encode(), text.encode()) for role, text in messages]  # alive while llama.cpp reads them
    chat = (lc.llama_chat_message * len(keep))(*[lc.llama_chat_message(r, t) for r, t in keep])
    size = 2 * sum(len(r) + len(t) for r, t in keep) + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = int(lc.llama_chat_apply_template(name.encode(), chat, len(keep), generation_prompt, buf, size))
        if n < 0:
            raise ValueError(f"llama.cpp's chat template {name!r} could not format these messages")
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n
    raise ValueError(f"llama.cpp's chat template {name!r} returned an inconsistent size")
