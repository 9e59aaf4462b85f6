"""The roofline of this machine's cores: streaming read bandwidth and int8 multiply-add peak.

A quantized matmul reads its weights once a call and does n multiply-adds a weight for n activation rows, so
one call of n rows costs at least max(weight bytes / bandwidth, n x weights / int8 peak). Those two numbers
come from a probe, ``roofline.c`` beside this file, compiled with ``cc -O3 -march=native`` on first use (so it
times the best int8 instruction this CPU has, as llama.cpp's native build would) and cached in
``paths.cache_dir()``; a run takes about a second. ``specstack doctor`` reports it, and
``benchmarks/kernel_roofline.py`` sets the kernels' measured speeds beside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from . import sysinfo
from .. import paths

SOURCE = Path(__file__).with_name("roofline.c")
CFLAGS = ("-O3", "-march=native", "-pthread")
# ISA names the probe may be told to time instead of the best one (a -D flag of roofline.c)
FORCED_ISAS = {"avx2": "-DROOFLINE_ISA_AVX2"}
COMPILE_TIMEOUT_S = 120
RUN_TIMEOUT_S = 60


class RooflineUnavailable(RuntimeError):
    """The probe cannot be built or run here; the message says why in one line."""


@dataclass(frozen=True)
class RooflinePoint:
    threads: int
    read_gbps: float
    int8_gmacs: float


@dataclass(frozen=True)
class Roofline:
    isa: str  # "AVX-512 VNNI", "AVX-VNNI", "AVX2", "NEON dotprod" or "none"
    instruction: str  # e.g. "vpdpbusd zmm"; "" where no int8 SIMD instruction was timed
    points: tuple[RooflinePoint, ...]

    def at(self, threads: int) -> RooflinePoint | None:
        return next((p for p in self.points if p.threads == threads), None)

    def describe(self) -> str:
        """One line: per thread count the bandwidth and the peak, then which instruction made the peak."""
        parts = [f"{'one core' if p.threads == 1 else f'{p.threads} threads'}: {p.read_gbps:.1f} GB/s streaming "
                 f"read, {p.int8_gmacs:.0f} GMAC/s int8" for p in self.points]
        how = (f"{self.instruction}, {self.isa}" if self.instruction else "no int8 SIMD instruction known here")
        return "; ".join(parts) + f" ({how})"


def _compiler() -> str:
    """The C compiler: $CC, else cc; RooflineUnavailable where there is none."""
    cc = os.environ.get("CC", "cc")
    found = shutil.which(cc)
    if found is None:
        raise RooflineUnavailable(f"no C compiler ({cc}) on PATH to build the roofline probe "
                                  "(install gcc, or set CC)")
    return found


def _key(cc: str, flags: Sequence[str]) -> str:
    """What the binary depends on: the source, the flags, the compiler and the CPU -march=native targets (a
    cache dir shared between machines must not hand one CPU's binary to another)."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join([cc, *flags]).encode())
    h.update(repr((sysinfo.cpu_model(), sorted(sysinfo.cpu_flags()))).encode())
    return h.hexdigest()[:16]


def binary(isa: str | None = None) -> Path:
    """The probe's binary, compiled on first use (to a temporary name, then renamed: two processes may race)."""
    cc = _compiler()
    flags = (*CFLAGS, *([FORCED_ISAS[isa]] if isa else []))
    out = paths.cache_dir() / f"roofline-{_key(cc, flags)}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise RooflineUnavailable(f"{cc} could not build the roofline probe: {last}")
        os.replace(tmp, out)
    except subprocess.TimeoutExpired as exc:
        raise RooflineUnavailable(f"{cc} took over {COMPILE_TIMEOUT_S} s to build the roofline probe") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def parse(text: str) -> Roofline:
    """The probe's JSON line as a ``Roofline``."""
    d = json.loads(text)
    points = tuple(RooflinePoint(int(p["threads"]), float(p["read_gbps"]), float(p["int8_gmacs"]))
                   for p in d["results"])
    return Roofline(d["isa"], d["instruction"], points)


def measure(threads: Sequence[int] = (1,), isa: str | None = None, buffer_mib: int = 256) -> Roofline:
    """Runs the probe once for each thread count (deduplicated, in order); about half a second each."""
    counts = list(dict.fromkeys(int(t) for t in threads))
    exe = binary(isa)
    try:
        done = subprocess.run([str(exe), "-m", str(buffer_mib), *map(str, counts)], capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise RooflineUnavailable(f"the roofline probe ran over {RUN_TIMEOUT_S} s") from exc
    if done.returncode != 0:
        raise RooflineUnavailable(f"the roofline probe failed (exit {done.returncode}): "
                                  f"{done.stderr.strip() or 'no message'}")
    return parse(done.stdout)


def probe(threads: int) -> dict[str, Any]:
    """For doctor's facts: one core and ``threads`` threads as a dict, or ``{"error": why}`` where the probe
    cannot run (no compiler, say): doctor says that in one line rather than failing."""
    try:
        return asdict(measure((1, max(1, threads))))
    except (RooflineUnavailable, OSError, ValueError, KeyError) as exc:
        return {"error": str(exc)}


def from_dict(d: dict[str, Any]) -> Roofline:
    """``probe``'s dict back as a ``Roofline`` (not an error dict)."""
    return Roofline(d["isa"], d["instruction"], tuple(RooflinePoint(**p) for p in d["points"]))
