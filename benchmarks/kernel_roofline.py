"""ggml's CPU matmul kernels against this machine's roofline, and whether their rows are bit-identical.

    python benchmarks/kernel_roofline.py bench [-t 1] [--rounds 3] [--lib NAME=PATH]... [--models gemma,1b,7b]
                                               [--n 1,2,4] [--json OUT.json] [--markdown OUT.md]
    python benchmarks/kernel_roofline.py identity --type q8_0 --k 640 --m 256 --n 4 [--lib PATH] [--threads 1,2,3]
                                                  [--buft plain|extra]
    python benchmarks/kernel_roofline.py sweep [--lib NAME=PATH]... [--models gemma] [--n 2,4,8]   # identity table
    python benchmarks/kernel_roofline.py build     # compiles the C harness, prints its path

bench times MUL_MAT (``benchmarks/kernels/mul_mat_bench.c``) for the weight shapes and types of the models we run,
at n = 1..32 activation rows, on each CPU path: stock ggml with the weights in a plain CPU buffer, the same with
``GGML_CPU_TILED_MM_FORCE=1``, stock with repacked weights (the CPU extra buffer types, llama.cpp's default),
specstack's own build with its verification kernels (``specstack.llama``'s, built first where not cached;
``--no-specstack`` leaves it out), and every ``--lib NAME=PATH`` (another libggml-cpu.so built from the same tree).
The libraries other than stock run as llama.cpp loads them, extra buffer types offered. It prints ms per call, GMAC/s and weight GB/s beside the roofline probe's
bandwidth and int8 peak (``specstack.host.roofline``). The machine may be shared: the paths are interleaved per
shape, every figure is the fastest of ``--rounds`` subprocesses (each the fastest of its own calls), and the
report says how busy other processes kept the CPUs.

identity runs one library's MUL_MAT once with n rows and once per row (n = 1), at each thread count, and
compares both with ``ggml_get_type_traits_cpu(type)->vec_dot`` applied row by row (activations quantized alone):
a lossless verifier needs a row's logits to be the same bits whatever else the call carries. ``identity()`` is the
function tests call.

Which libggml-cpu runs is decided by LD_LIBRARY_PATH: each library gets a folder of links (libggml-base.so.0 ->
llama-cpp-python's own, libggml-cpu.so.0 -> the library), and the harness reports the path it actually loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from specstack import paths
from specstack.host import roofline, sysinfo

SOURCE = Path(__file__).resolve().parent / "kernels" / "mul_mat_bench.c"
ATTN_SOURCE = Path(__file__).resolve().parent / "kernels" / "flash_attn_check.c"
LLAMA_CPP_PYTHON = "0.3.36"
VENDORED_INCLUDE = (Path.home() / ".cache/specstack/llama-bins/src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
                    / "vendor/llama.cpp/ggml/include")
NS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
RUN_TIMEOUT_S = 900


@dataclass(frozen=True)
class Shape:
    """One weight matrix: K inputs to M output rows, in ggml type ``type`` (ggml's name, e.g. ``q4_K``)."""

    model: str
    role: str
    type: str
    k: int
    m: int

    @property
    def label(self) -> str:
        return f"{self.model} {self.role} {self.type} {self.k}x{self.m}"


# Gemma 3 270M Q4_K_M (width 640, 4 heads of 256, 1 KV head, FFN 2048, 262,144-token vocabulary; 640 is no
# multiple of 256, so the matrices reading it fall back to Q5_0/Q8_0); the 1B stand-in of docs/standin.md
# (width 2048, FFN 5632, Q4_K_M); a 7B's FFN (width 4096, FFN 14336).
SHAPES = {
    "gemma": (Shape("gemma3-270m", "attn_output", "q4_K", 1024, 640),
              Shape("gemma3-270m", "ffn_down", "q4_K", 2048, 640),
              Shape("gemma3-270m", "ffn_down", "q6_K", 2048, 640),
              Shape("gemma3-270m", "attn_k/v", "q5_0", 640, 256),
              Shape("gemma3-270m", "attn_q", "q5_0", 640, 1024),
              Shape("gemma3-270m", "ffn_gate/up", "q5_0", 640, 2048),
              Shape("gemma3-270m", "attn_v", "q8_0", 640, 256),
              Shape("gemma3-270m", "output", "q8_0", 640, 262144)),
    "1b": (Shape("standin-1b", "attn_q/o", "q4_K", 2048, 2048),
           Shape("standin-1b", "ffn_gate/up", "q4_K", 2048, 5632),
           Shape("standin-1b", "ffn_down", "q6_K", 5632, 2048)),
    "7b": (Shape("7b", "ffn_gate/up", "q4_K", 4096, 14336),
           Shape("7b", "ffn_gate/up", "q6_K", 4096, 14336),
           Shape("7b", "ffn_down", "q4_K", 14336, 4096),
           Shape("7b", "ffn_down", "q6_K", 14336, 4096)),
    # weights a Q4_K_M GGUF keeps in float (MoE routers in F32) or a whole F16/BF16 GGUF holds
    "float": (Shape("1b-f16", "attn_q/o", "f16", 2048, 2048),
              Shape("1b-f16", "ffn_gate/up", "f16", 2048, 8192),
              Shape("1b-bf16", "attn_q/o", "bf16", 2048, 2048),
              Shape("moe", "ffn_gate_inp", "f32", 2048, 64)),
}


class HarnessError(RuntimeError):
    """The harness cannot be built or a run failed; the message says why."""


# ---- the C harness ------------------------------------------------------------------------------------------
def stock_lib_dir() -> Path:
    """llama-cpp-python's own libraries (found without importing it: importing loads them)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise HarnessError("llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)")
    return Path(spec.origin).parent / "lib"


def include_dir() -> Path:
    """ggml's headers: $SPECSTACK_GGML_INCLUDE, the tree scripts/build_llama_bins.sh unpacks, or the copy
    llama-cpp-python's install leaves in site-packages/include."""
    candidates = [Path(p) for p in [os.environ.get("SPECSTACK_GGML_INCLUDE")] if p]
    candidates += [VENDORED_INCLUDE, Path(sysconfig.get_paths()["purelib"]) / "include"]
    for c in candidates:
        if (c / "ggml-cpu.h").exists() and (c / "ggml-backend.h").exists():
            return c
    raise HarnessError("no ggml headers found: run scripts/build_llama_bins.sh (it unpacks llama.cpp's tree) or "
                       "set SPECSTACK_GGML_INCLUDE to a ggml/include folder")


def build(source: Path = SOURCE) -> Path:
    """A harness's binary (``SOURCE``, or ``ATTN_SOURCE``), compiled on first use into the cache (linked by soname
    only: no rpath, so LD_LIBRARY_PATH picks the libraries at run time)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise HarnessError("no C compiler on PATH (install gcc, or set CC)")
    inc, libs = include_dir(), stock_lib_dir()
    key = hashlib.sha256(source.read_bytes() + str(inc).encode() + cc.encode()).hexdigest()[:16]
    out = paths.cache_dir() / "kernel-bench" / f"{source.stem}-{key}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}")
    cmd = [cc, "-O2", "-std=gnu11", f"-I{inc}", str(source), "-o", str(tmp), f"-L{libs}", "-Wl,--no-as-needed",
           "-l:libggml-base.so.0", "-l:libggml-cpu.so.0", "-ldl", "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise HarnessError(f"building {source.name} failed:\n{done.stderr.strip()}")
    os.replace(tmp, out)
    return out


@dataclass(frozen=True)
class Lib:
    """A libggml-cpu.so to run, beside llama-cpp-python's libggml-base.so (as llama-cpp-python loads one)."""

    name: str
    cpu: Path
    base: Path

    def folder(self) -> Path:
        """A folder of links that, as LD_LIBRARY_PATH, makes the harness load this library."""
        cpu, base = self.cpu.resolve(), self.base.resolve()
        if not cpu.is_file():
            raise HarnessError(f"{self.name}: no library at {self.cpu}")
        key = hashlib.sha256(f"{cpu}\0{base}".encode()).hexdigest()[:16]
        d = paths.cache_dir() / "kernel-bench" / "libs" / key
        d.mkdir(parents=True, exist_ok=True)
        for soname, target in (("libggml-cpu.so.0", cpu), ("libggml-base.so.0", base)):
            link = d / soname
            if not (link.is_symlink() and Path(os.readlink(link)) == target):
                tmp = d / f"{soname}.{os.getpid()}"
                tmp.unlink(missing_ok=True)
                tmp.symlink_to(target)
                os.replace(tmp, link)
        return d


def stock_lib() -> Lib:
    d = stock_lib_dir()
    return Lib("stock", d / "libggml-cpu.so.0", d / "libggml-base.so.0")


def specstack_lib() -> Lib:
    """specstack's own build of libggml-cpu, the one ``specstack.llama`` loads (``docs/kernels.md``): found in its
    cache by key, or built there first (about a minute, once). Nothing is loaded into this process."""
    from specstack.llama.kernel_build import ensure_built
    from specstack.llama.kernel_key import KernelSetupError, find_install, make_plan

    try:
        install = find_install()
        plan = make_plan(install)
        result = ensure_built(plan, install)
    except KernelSetupError as exc:
        raise HarnessError(f"specstack's kernels cannot be built here: {exc}") from exc
    if result.library is None:
        raise HarnessError(f"specstack's kernel build {plan.key} failed: {result.reason} (log: {result.log})")
    return Lib("specstack", Path(result.library), stock_lib().base)


def lib_from(spec: str) -> Lib:
    """``NAME=PATH`` (or a bare PATH, named after its folder) as a ``Lib`` beside the stock libggml-base;
    ``specstack`` alone is specstack's own build (``specstack_lib``)."""
    if spec == "specstack":
        return specstack_lib()
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = Path(spec).parent.name or "lib", spec
    return Lib(name, Path(path).expanduser(), stock_lib().base)


def run(lib: Lib, args: Sequence[str], env: dict[str, str] | None = None, source: Path = SOURCE) -> dict[str, Any]:
    """One harness run with ``lib``'s libggml-cpu; its JSON, after checking it ran that library."""
    exe = build(source)
    full = {**os.environ, **(env or {}), "LD_LIBRARY_PATH": str(lib.folder())}
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, env=full, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise HarnessError(f"{lib.name}: {source.stem} {' '.join(args)} failed ({done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    out = json.loads(done.stdout)
    if Path(out["lib"]).resolve() != lib.cpu.resolve():
        raise HarnessError(f"{lib.name}: the harness loaded {out['lib']}, not {lib.cpu}")
    return out


# ---- bit identity -----------------------------------------------------------------------------------------
COMPARISONS = ("batch_vs_single", "batch_vs_vec_dot", "single_vs_vec_dot", "batch_vs_first_threads")


def identity(lib: Lib | None, qtype: str, k: int, m: int, n: int, threads: Iterable[int] = (1, 2, 3),
             buft: str = "plain", env: dict[str, str] | None = None, seed: int = 1234) -> dict[str, Any]:
    """MUL_MAT of n rows against n calls of one row and against vec_dot row by row, at each thread count.

    The result's ``checks`` hold, per thread count, ``batch_vs_single``, ``batch_vs_vec_dot``,
    ``single_vs_vec_dot`` and ``batch_vs_first_threads`` (the n-row result against the first thread count's), each
    ``{"identical", "rows_differing", "max_abs_diff"}``; ``identical`` (top level) is whether every row was the same
    bits every way at every thread count."""
    args = ["identity", "--type", qtype, "--k", str(k), "--m", str(m), "--n", str(n),
            "--threads", ",".join(map(str, threads)), "--buft", buft, "--seed", str(seed)]
    out = run(lib or stock_lib(), args, env)
    out["identical"] = all(c[kind]["identical"] for c in out["checks"]
                           for kind in COMPARISONS)
    return out


def attention_identity(lib: Lib | None, dk: int, heads: int, kv_heads: int, depth: int, n: int,
                       threads: Iterable[int] = (1, 2, 3), window: int = 0, seed: int = 1) -> dict[str, Any]:
    """FLASH_ATTN_EXT of n query rows at ``depth`` against each row computed alone over its own call's KV length,
    at each thread count (``benchmarks/kernels/flash_attn_check.c``): ``checks`` hold ``batch_vs_single`` and
    ``batch_vs_first_threads`` per thread count, ``identical`` (top level) whether every row was the same bits
    every way, and ``ref_max_abs_diff`` how far the output is from a double-precision softmax attention."""
    args = ["identity", "--dk", str(dk), "--heads", str(heads), "--kv-heads", str(kv_heads), "--depth", str(depth),
            "--n", str(n), "--threads", ",".join(map(str, threads)), "--window", str(window), "--seed", str(seed)]
    out = run(lib or stock_lib(), args, source=ATTN_SOURCE)
    out["identical"] = all(c[kind]["identical"] for c in out["checks"] for kind in ("batch_vs_single",
                                                                                   "batch_vs_first_threads"))
    return out


def attention_bench(lib: Lib | None, dk: int, heads: int, kv_heads: int, depth: int, ns: Sequence[int],
                    threads: int = 1, min_time: float = 0.2) -> dict[int, float]:
    """ms of one FLASH_ATTN_EXT call of n rows at ``depth`` (one layer's attention), the fastest in ``min_time``."""
    args = ["bench", "--dk", str(dk), "--heads", str(heads), "--kv-heads", str(kv_heads), "--depth", str(depth),
            "--n", ",".join(map(str, ns)), "--threads", str(threads), "--min-time", str(min_time)]
    return {int(n): ms for n, ms in run(lib or stock_lib(), args, source=ATTN_SOURCE)["ms"].items()}


def identity_sweep(paths_: Sequence[KernelPath], shapes: Sequence[Shape], ns: Sequence[int],
                   threads: Iterable[int] = (1, 2, 3), max_m: int | None = 4096,
                   log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> list[dict[str, Any]]:
    """``identity`` for every path, shape and n: what a kernel author checks a library against. ``max_m`` cuts
    the output rows of a shape (the 262,144-row output matrix would take a while); None keeps them."""
    rows = []
    for shape in shapes:
        m = shape.m if max_m is None else min(shape.m, max_m)
        for p in paths_:
            cells = {}
            for n in ns:
                out = identity(p.lib, shape.type, shape.k, m, n, threads, p.buft, p.env)
                cells[str(n)] = {"identical": out["identical"], "repacked": out["repacked"],
                                 "checks": out["checks"]}
            rows.append({"label": shape.label, "m": m, "path": p.name, "buft": p.buft,
                         "repacked": any(c["repacked"] for c in cells.values()), "n": cells})
        log(f"{shape.label}: checked")
    return rows


def identity_cell(cell: dict[str, Any]) -> str:
    """same: every row the same bits with n rows, alone and by vec_dot, at every thread count; rows agree: n rows
    and one row agree, but not with vec_dot; otherwise the largest difference between n rows and one row. A
    result that changes with the thread count says so first."""
    if cell["identical"]:
        return "same"
    threads = "" if all(c["batch_vs_first_threads"]["identical"] for c in cell["checks"]) else "threads differ; "
    if all(c["batch_vs_single"]["identical"] for c in cell["checks"]):
        return threads + "rows agree, not vec_dot"
    return threads + f"differs ({max(c['batch_vs_single']['max_abs_diff'] for c in cell['checks']):.1e})"


def identity_markdown(rows: Sequence[dict[str, Any]], ns: Sequence[int]) -> str:
    lines = ["| shape | path | " + " | ".join(f"n={n}" for n in ns) + " |", "|---|---|" + "---|" * len(ns)]
    for label, group in itertools.groupby(rows, key=lambda r: r["label"]):
        for j, row in enumerate(group):
            lines.append(f"| {label if j == 0 else ''} | {_path_name(row)} | "
                         + " | ".join(identity_cell(row["n"][str(n)]) for n in ns) + " |")
    return "\n".join(lines) + "\n"


# ---- timing -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelPath:
    """A way ggml runs MUL_MAT: which library, where the weights sit (plain CPU buffer, or the extra buffer
    types offered first), and the environment."""

    name: str
    lib: Lib
    buft: str = "plain"
    env: dict[str, str] = field(default_factory=dict)


def default_paths(extra: Sequence[Lib] = ()) -> list[KernelPath]:
    stock = stock_lib()
    return ([KernelPath("stock", stock), KernelPath("stock, tiled forced", stock, env={"GGML_CPU_TILED_MM_FORCE": "1"}),
             KernelPath("stock, repacked", stock, "extra")]
            + [KernelPath(lib.name, lib, "extra") for lib in extra])


class LoadMeter:
    """Other processes' CPU use while the bench runs: the CPUs' busy time less this process's and its children's
    (the harness runs as children), as CPUs' worth of time."""

    def __init__(self) -> None:
        self.cpus = sysinfo.allowed_cpus()
        self.t0, self.ticks0, self.own0 = time.perf_counter(), sysinfo.cpu_ticks(self.cpus), self._own()

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def read(self) -> float | None:
        ticks, seconds = sysinfo.cpu_ticks(self.cpus), time.perf_counter() - self.t0
        if ticks is None or self.ticks0 is None or seconds <= 0:
            return None
        spent = (ticks - self.ticks0) / os.sysconf("SC_CLK_TCK") - (self._own() - self.own0)
        return min(float(len(self.cpus)), max(0.0, spent / seconds))


def bench_shape(path: KernelPath, shape: Shape, ns: Sequence[int], threads: int, min_time: float,
                working_set_mib: float) -> dict[str, Any]:
    args = ["bench", "--type", shape.type, "--k", str(shape.k), "--m", str(shape.m), "--n", ",".join(map(str, ns)),
            "--threads", str(threads), "--buft", path.buft, "--min-time", str(min_time),
            "--working-set-mib", str(working_set_mib)]
    return run(path.lib, args, path.env)


def bench(paths_: Sequence[KernelPath], shapes: Sequence[Shape], ns: Sequence[int], threads: int = 1,
          rounds: int = 3, min_time: float = 0.1, working_set_mib: float = 256,
          log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    """Every path on every shape, the paths interleaved per shape, ``rounds`` times; the fastest of each."""
    rows, loads = [], []
    for shape in shapes:
        meter, best = LoadMeter(), {}
        for _ in range(rounds):
            for p in paths_:
                out = bench_shape(p, shape, ns, threads, min_time, working_set_mib)
                best[p.name] = _fastest(best.get(p.name), out)
        loads.append(meter.read())
        rows += [_row(shape, p, best[p.name]) for p in paths_]
        log(f"{shape.label}: done" + ("" if loads[-1] is None else f" (others used {loads[-1]:.2f} CPUs)"))
    return {"rows": rows, "others_cpus": loads}


def _fastest(prev: dict[str, Any] | None, out: dict[str, Any]) -> dict[str, Any]:
    """``out`` with each n's time the lower of its own and ``prev``'s (a busy machine only adds time)."""
    if prev is not None:
        for a, b in zip(out["results"], prev["results"]):
            a["ms"] = min(a["ms"], b["ms"])
    return out


def _row(shape: Shape, p: KernelPath, out: dict[str, Any]) -> dict[str, Any]:
    return {"shape": asdict(shape), "label": shape.label, "path": p.name, "lib": out["lib"], "buft": p.buft,
            "weight_buft": out["weight_buft"], "repacked": out["repacked"], "weight_bytes": out["weight_bytes"],
            "copies": out["copies"], "ms": {str(x["n"]): x["ms"] for x in out["results"]}}


# ---- the report ---------------------------------------------------------------------------------------------
def derived(row: dict[str, Any], n: int, roof: roofline.RooflinePoint | None) -> dict[str, float]:
    """ms, GMAC/s, weight GB/s and the roofline floor's share of the time for one row at n."""
    ms = row["ms"][str(n)]
    s = row["shape"]
    macs, wbytes = n * s["k"] * s["m"], row["weight_bytes"]
    out = {"ms": ms, "gmacs": macs / ms / 1e6, "gbps": wbytes / ms / 1e6}
    if roof is not None and roof.int8_gmacs > 0:
        floor_ms = max(wbytes / roof.read_gbps / 1e6, macs / roof.int8_gmacs / 1e6)
        out["floor_ms"], out["roofline_pct"] = floor_ms, 100 * floor_ms / ms
    return out


def markdown(result: dict[str, Any]) -> str:
    """The header (roofline, how busy the machine was) and one table per measure, a row per shape and path; the ms
    table ends each shape with the roofline's floor, max(weight bytes / bandwidth, multiply-adds / int8 peak)."""
    ns, roof = result["n"], result["roofline"]
    point = None if roof is None else roofline.RooflinePoint(**roof["point"])
    lines = []
    if point is not None:
        lines.append(f"Roofline at -t {result['threads']}: {point.read_gbps:.1f} GB/s streaming read, "
                     f"{point.int8_gmacs:.0f} GMAC/s int8 ({roof['instruction']}, {roof['isa']}).")
    loads = [x for x in result["others_cpus"] if x is not None]
    if loads:
        lines.append(f"Other processes used {sum(loads) / len(loads):.2f} of the {result['cpus']} CPUs on average "
                     f"while it ran (per shape: {min(loads):.2f}-{max(loads):.2f}).")
    measures = [("ms per call", "ms", "{:.3f}"), ("GMAC/s", "gmacs", "{:.1f}"), ("weight GB/s", "gbps", "{:.1f}")]
    if point is not None:
        measures.append(("roofline floor / time, %", "roofline_pct", "{:.0f}"))
    for title, key, fmt in measures:
        lines += ["", f"**{title}**", "", "| shape | path | " + " | ".join(f"n={n}" for n in ns) + " |",
                  "|---|---|" + "---|" * len(ns)]
        for label, group in itertools.groupby(result["rows"], key=lambda r: r["label"]):
            group = list(group)
            for j, row in enumerate(group):
                cells = [fmt.format(derived(row, n, point)[key]) for n in ns]
                lines.append(f"| {label if j == 0 else ''} | {_path_name(row)} | " + " | ".join(cells) + " |")
            if key == "ms" and point is not None:
                floors = [fmt.format(derived(group[0], n, point)["floor_ms"]) for n in ns]
                lines.append("| | roofline floor | " + " | ".join(floors) + " |")
    return "\n".join(lines + _speedup_table(result["rows"], ns)) + "\n"


STOCK_PATHS = ("stock", "stock, repacked")  # what llama.cpp runs with and without use_extra_bufts


def _speedup_table(rows: Sequence[dict[str, Any]], ns: Sequence[int]) -> list[str]:
    """Each other library's time against the faster of stock's plain and repacked paths: above 1, it is faster."""
    lines = ["", "**the faster of stock and stock repacked / this path's time (above 1: faster than stock)**", "",
             "| shape | path | " + " | ".join(f"n={n}" for n in ns) + " |", "|---|---|" + "---|" * len(ns)]
    found = False
    for label, group in itertools.groupby(rows, key=lambda r: r["label"]):
        group = list(group)
        stock = [r for r in group if r["path"] in STOCK_PATHS]
        others = [r for r in group if r["path"] not in STOCK_PATHS and r["path"] != "stock, tiled forced"]
        for j, row in enumerate(others if stock else []):
            best = [min(r["ms"][str(n)] for r in stock) / row["ms"][str(n)] for n in ns]
            lines.append(f"| {label if j == 0 else ''} | {_path_name(row)} | " + " | ".join(f"{b:.2f}" for b in best)
                         + " |")
            found = True
    return lines if found else []


def _path_name(row: dict[str, Any]) -> str:
    """The path's name, saying where extra buffer types were offered the weights and none took them."""
    return row["path"] + (" (not repacked)" if row["buft"] == "extra" and not row["repacked"] else "")


# ---- command line -------------------------------------------------------------------------------------------
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="time MUL_MAT on every path for the models' shapes")
    b.add_argument("-t", "--threads", type=int, default=1, choices=(1, 2), help="threads (default 1)")
    b.add_argument("--lib", action="append", default=[], metavar="NAME=PATH",
                   help="another libggml-cpu.so to time (repeatable), run as llama.cpp loads it")
    b.add_argument("--models", default="gemma,1b,7b", help=f"shape sets, of {','.join(SHAPES)}")
    b.add_argument("--n", type=_ints, default=list(NS), help="activation rows (default 1,2,3,4,6,8,12,16,24,32)")
    b.add_argument("--rounds", type=int, default=3, help="subprocesses per path and shape, interleaved (fastest)")
    b.add_argument("--min-time", type=float, default=0.1, help="seconds of calls per n in each subprocess")
    b.add_argument("--working-set-mib", type=float, default=256,
                   help="copies of each matrix to cycle through, so that weights come from memory (default 256)")
    b.add_argument("--no-stock", action="store_true", help="time only the --lib libraries")
    b.add_argument("--no-specstack", action="store_true",
                   help="leave out specstack's own build (timed by default, built first where not cached)")
    b.add_argument("--json", type=Path, help="write the results here")
    b.add_argument("--markdown", type=Path, help="write the tables here too")
    i = sub.add_parser("identity", help="are a library's rows bit-identical at n rows, one row, and vec_dot?")
    i.add_argument("--lib", default=None, metavar="[NAME=]PATH",
                   help="libggml-cpu.so (default: stock; 'specstack': specstack's own build)")
    i.add_argument("--type", required=True, help="ggml type name, e.g. q8_0, q4_K")
    i.add_argument("--k", type=int, required=True)
    i.add_argument("--m", type=int, required=True)
    i.add_argument("--n", type=int, required=True)
    i.add_argument("--threads", type=_ints, default=[1, 2, 3])
    i.add_argument("--buft", choices=("plain", "extra"), default="plain")
    w = sub.add_parser("sweep", help="the identity check for every path, shape and n, as a table")
    w.add_argument("--lib", action="append", default=[], metavar="NAME=PATH", help="another libggml-cpu.so (repeatable)")
    w.add_argument("--models", default="gemma,1b,7b", help=f"shape sets, of {','.join(SHAPES)}")
    w.add_argument("--n", type=_ints, default=[2, 3, 4, 8, 16, 32])
    w.add_argument("--threads", type=_ints, default=[1, 2, 3])
    w.add_argument("--max-m", type=int, default=4096, help="cut each shape's output rows to this (0: keep all)")
    w.add_argument("--no-stock", action="store_true", help="check only the --lib libraries")
    w.add_argument("--no-specstack", action="store_true", help="leave out specstack's own build")
    w.add_argument("--json", type=Path, help="write the results here")
    sub.add_parser("build", help="compile the C harness and print its path")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            print(build())
            return 0
        if args.cmd == "identity":
            out = identity(lib_from(args.lib) if args.lib else None, args.type, args.k, args.m, args.n,
                           args.threads, args.buft)
            print(json.dumps(out, indent=2))
            return 0 if out["identical"] else 1
        if args.cmd == "sweep":
            return _sweep_cli(args)
        return _bench_cli(args)
    except HarnessError as exc:
        print(f"kernel_roofline: {exc}", file=sys.stderr)
        return 2


def _paths_and_shapes(args: argparse.Namespace) -> tuple[list[KernelPath], list[Shape]]:
    extra = [lib_from(s) for s in args.lib]
    if not args.no_specstack and not any(lib.name == "specstack" for lib in extra):
        extra.insert(0, specstack_lib())
    paths_ = default_paths(extra)
    if args.no_stock:
        paths_ = [p for p in paths_ if p.lib.name != "stock"]
    return paths_, [s for name in args.models.split(",") for s in SHAPES[name.strip()]]


def _probe(threads: int) -> dict[str, Any] | None:
    """The roofline at ``threads`` as the report keeps it; None (and a line on stderr) where it cannot run."""
    try:
        probed = roofline.measure((threads,))
    except roofline.RooflineUnavailable as exc:
        print(f"kernel_roofline: no roofline: {exc}", file=sys.stderr)
        return None
    return {"isa": probed.isa, "instruction": probed.instruction, "point": asdict(probed.points[0])}


def _best_roof(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The probe taken before and after the bench, each figure the higher: another process only lowers them."""
    if a is None or b is None:
        return a or b
    point = {k: max(a["point"][k], b["point"][k]) for k in a["point"]}
    return {**a, "point": point}


def _sweep_cli(args: argparse.Namespace) -> int:
    paths_, shapes = _paths_and_shapes(args)
    rows = identity_sweep(paths_, shapes, args.n, args.threads, args.max_m or None)
    print(identity_markdown(rows, args.n))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def _bench_cli(args: argparse.Namespace) -> int:
    paths_, shapes = _paths_and_shapes(args)
    roof = _probe(args.threads)
    result = {"command": " ".join(["python", "benchmarks/kernel_roofline.py", *sys.argv[1:]]),
              "threads": args.threads, "n": args.n, "rounds": args.rounds, "cpus": len(sysinfo.allowed_cpus()),
              "cpu_model": sysinfo.cpu_model(), "roofline": roof,
              "paths": [{"name": p.name, "lib": str(p.lib.cpu), "buft": p.buft, "env": p.env} for p in paths_]}
    result.update(bench(paths_, shapes, args.n, args.threads, args.rounds, args.min_time, args.working_set_mib))
    result["roofline"] = _best_roof(roof, _probe(args.threads))
    text = markdown(result)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
