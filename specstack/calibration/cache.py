"""The on-disk cache of what calibration measures (exact call shapes, what exactness costs, the cost curve).

Keys: each entry is keyed by what its measurement depends on and nothing else (``machine_key`` plus the
measurement's own scope), so a new ``-c``, ``-np`` or roles file finds the entries a run with other settings
stored.  Before, the key held the whole model config, and each new context size paid the one-time
measurement again: its first generation ran 4-5x slower.

Damage: the file is user-writable JSON.  An entry that does not validate is discarded, measured again and
rewritten, with one line saying so; it never raises and never stays wrong for later runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..paths import cache_dir

if TYPE_CHECKING:
    from ..llama import EngineTarget

CACHE_VERSION = 9  # bump when a measurement method changes: old entries are then ignored

T = TypeVar("T")
_said: set[str] = set()  # lines this process has printed (a bench builds many policies: each says once)


def cache_path() -> Path:
    return cache_dir() / "costs.json"


def machine_key(model: "EngineTarget", flash_attn: bool | None = None) -> list[object]:
    """What every measured cost depends on: the model file, the thread count, llama.cpp's build and CPU features,
    and the settings that change which kernels run or how the weights and KV cache are laid out.

    Left out on purpose: the context size, the slot count and the batch size.  The measurements run one
    sequence at a bounded depth (``shapes.probe_depths``), and a sequence of a multi-slot target keeps its
    own KV stream, laid out as in a solo run; shapes measured on the bundled target and Gemma 3 270M at
    -c 4096, -c 2048 -np 3 and -c 1024 were identical.  Where a small context bounds a measurement (its depth
    or its largest call), that bound is part of the measurement's scope (``entry_key``), not of this key.
    ``flash_attn``: the key as with flash attention set so (None: as the model has it).

    The KV cache's types (-ctk/-ctv) are in it where either is not f16: a q8_0 K cache rounds every key, so its
    calls compute other logits, with other kernels, than an f16 cache's, and its shapes and costs are its own.
    An f16 cache's key is left as it was before the types could change, so its entries stay valid.

    specstack's own CPU backend (``kernel_status``: llama.cpp's ggml-cpu with our verification kernels) is in it by
    its build key where it runs: its kernels compute other calls, at other costs, than the stock library's, so
    neither's curves and shapes may stand for the other's.  The stock library's keys stay as they were.
    """
    from ..llama import kernel_status, system_info

    cfg = model.config
    st = os.stat(model.path)
    recurrent = [cfg.rollback, cfg.rollback_depth] if model.is_recurrent else []
    # -tb (the threads of multi-row calls) and RoPE/YaRN settings change the measured calls too, as do the KV cache's
    # types; each only where set, so that the keys of every run without them stay as they were
    context = [["n_threads_batch", cfg.n_threads_batch]] if cfg.n_threads_batch else []
    context += [list(kv) for kv in cfg.context_params]
    key = [CACHE_VERSION, str(Path(model.path).resolve()), st.st_size, int(st.st_mtime), model.n_threads,
           system_info(), cfg.repack, [list(kv) for kv in cfg.kv_overrides],
           _flash_attn(model, flash_attn), cfg.exact,
           cfg.prefill_chunk, recurrent]
    kernels = kernel_status()
    key += [["kernels", kernels.key]] if kernels.active else []
    kv_types = [cfg.type_k, cfg.type_v]
    key += [kv_types] if kv_types != ["f16", "f16"] else []
    return key + ([context] if context else [])


def _flash_attn(model: "EngineTarget", flash_attn: bool | None) -> bool:
    """Flash attention as the key holds it: as asked (``flash_attn``), else as the model's context runs it."""
    if flash_attn is not None:
        return bool(flash_attn)
    fa = getattr(model, "flash_attn", None)
    return bool(model.config.flash_attn if fa is None else fa)


def entry_key(kind: str, model: "EngineTarget", scope: object, flash_attn: bool | None = None) -> str:
    """``kind`` (``shapes-``, ``exact-auto-``, ``curve-``) and a digest of ``machine_key`` and ``scope``."""
    raw = json.dumps([machine_key(model, flash_attn), scope], default=str)
    return kind + hashlib.sha256(raw.encode()).hexdigest()[:24]


def read_cache(path: Path) -> dict:
    """The cache as a dict of entries; empty (and said once) where the file is not a JSON object."""
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError, UnicodeDecodeError):
        data = None
    if isinstance(data, dict):
        return data
    say_once(f"damaged:{path}", f"the cost cache {path} is damaged (not a JSON object); discarding it and "
                                "measuring again (it is rewritten)")
    return {}


def lookup(cache: dict, key: str, parse: Callable[[object], T], path: Path) -> T | None:
    """The entry ``key`` parsed, or None where it is missing or does not validate (``parse`` raises
    ValueError); a damaged entry is said once and left to be measured again and overwritten."""
    if key not in cache:
        return None
    try:
        return parse(cache[key])
    except (ValueError, TypeError, KeyError) as exc:
        say_once(f"damaged:{path}:{key}", f"discarding a damaged entry of the cost cache {path} ({exc}); "
                                          "measuring it again")
        return None


def store(path: Path, key: str, value: object) -> None:
    """Write one entry (re-reading the file first: another process may have stored others meanwhile)."""
    cache = read_cache(path)
    cache[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache dir only costs a re-measurement


def say_once(topic: str, message: str) -> None:
    """One line on stderr per ``topic`` and process."""
    if topic in _said:
        return
    _said.add(topic)
    say(message)


def say(message: str) -> None:
    """One line of calibration's on stderr, terminal or not."""
    print(f"specstack: {message}", file=sys.stderr, flush=True)


# -- validation of entries read back ------------------------------------------------------------------


def need_dict(value: object, fields: tuple[str, ...]) -> dict:
    """``value`` as an object holding every one of ``fields``, else ValueError naming what is wrong."""
    if not isinstance(value, dict):
        raise ValueError(f"expected an object, found {type(value).__name__}")
    missing = [f for f in fields if f not in value]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    return value


def need_seconds(value: object, what: str, positive: bool = True) -> float:
    """A finite number of seconds (or a share), > 0 (or >= 0), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} is {value!r}, not a number")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{what} is {value!r}, not {'positive' if positive else 'at least 0'}")
    return float(value)


def need_int(value: object, what: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what} is {value!r}, not an integer >= {least}")
    return value
