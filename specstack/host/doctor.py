"""``specstack doctor``: what matters for CPU inference on this machine.

``gather_facts()`` reads the machine (read-only); ``evaluate(facts)`` turns the
facts into checks, each with a status (ok / warn / fail / info), a message and,
where something could be better, the command that would fix it. Doctor never
runs those commands.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from . import roofline, sysinfo
from ..errors import ModelLoadError
from ..modelfile.meta import read_gguf
from ..ui import fmt_bytes, table

STATUSES = ("ok", "info", "warn", "fail")
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# CPU features worth having llama.cpp compiled for, in the names llama.cpp's system info uses
LLAMA_FEATURES = ("AVX2", "FMA", "F16C", "AVX_VNNI", "AVX512", "AVX512_VNNI", "AVX512_BF16",
                  "AMX_INT8")
REBUILD_FIX = ('CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --force-reinstall --no-cache-dir '
               'llama-cpp-python==0.3.36')
MEMORY_HEADROOM = 1.2  # weights plus KV cache, compute buffers and Python
ROW_COST_NS = (2, 4, 8, 16)  # the verification sizes a row-cost check reports: short model drafts to copied lines
LLAMAFILE_OFF_FIX = ('CMAKE_ARGS="-DGGML_LLAMAFILE=OFF" pip install --force-reinstall --no-deps --no-cache-dir '
                     'llama-cpp-python==0.3.36')
LLAMAFILE_ON_FIX = "pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36"


@dataclass
class Check:
    name: str
    status: str
    message: str
    fix: str | None = None

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status


def gather_facts() -> dict[str, Any]:
    from ..llama import llama_system_info

    raw, err = llama_system_info()
    mem = sysinfo.meminfo()
    lim, use = sysinfo.cgroup_memory()
    return {
        "cpu_model": sysinfo.cpu_model(),
        "os_cpu_count": os.cpu_count(),
        "allowed_cpus": sysinfo.allowed_cpus(),
        "logical_cpus": sysinfo.logical_cpus(),
        "physical_cores": sysinfo.physical_cores_topology(),
        "cpu_quota": sysinfo.cpu_quota(),
        "threads": sysinfo.physical_cores(),
        "numa_nodes": sysinfo.numa_nodes(),
        "numactl": sysinfo.numactl_path(),
        "env": {k: os.environ.get(k) for k in THREAD_ENV_VARS},
        "thp": sysinfo.thp_setting(),
        "cpu_features": sysinfo.cpu_features(),
        "llama_system_info": raw,
        "llama_features": sysinfo.parse_llama_system_info(raw) if raw else None,
        "llama_error": err,
        "llama_version": _llama_version() if raw else None,
        "kernels": _kernels() if raw else None,
        "mem_total": mem.get("MemTotal"),
        "mem_available": sysinfo.available_memory(),
        "cgroup_memory_limit": lim,
        "cgroup_memory_usage": use,
        "governor": sysinfo.cpu_governor(),
        "cpu_load": _cpu_load(),
    }


def _cpu_load() -> dict[str, Any] | None:
    """Other processes' CPU use over a moment (``sysinfo.cpu_load``), as a dict of ``CpuLoad``'s fields."""
    load = sysinfo.cpu_load()
    return None if load is None else asdict(load)


def _kernels() -> dict[str, Any]:
    """Which CPU backend runs (``specstack.llama.kernel_status``), as a dict of ``KernelStatus``'s fields."""
    from ..llama import kernel_status

    return kernel_status().to_dict()


def _llama_version() -> str | None:
    from ..llama import llama_version

    return llama_version()


def _gib(n: int | None) -> str:
    """A size inside a sentence, where an unknown one reads "?" rather than a table's "-"."""
    return fmt_bytes(n, missing="?")


def evaluate(f: dict[str, Any], model: str | Path | None = None) -> list[Check]:
    """The checks the facts ``f`` (``gather_facts``) call for, and ``model``'s where given: one function a part."""
    checks = [*_threads(f), *_numa(f), *_thread_env(f), _huge_pages(f), *_cpu_features(f), *_kernel_check(f),
              _governor(f)]
    checks += [] if f.get("roofline") is None else [_roofline(f["roofline"])]
    return checks + (_memory(f) if model is None else _model(f, model))


def _threads(f: dict[str, Any]) -> list[Check]:
    """Cores, a cgroup quota, SMT, and whether other processes hold the cores the threads need."""
    phys, logical, threads = f["physical_cores"], f["logical_cpus"], f["threads"]
    msg = (f"{phys} physical core(s), {logical} logical CPU(s) usable"
           + (f" (of {f['os_cpu_count']} on the machine)" if f["os_cpu_count"] and f["os_cpu_count"] > logical else "")
           + f"; specstack uses {threads} thread(s), "
           + ("as -t says" if f.get("threads_given") else "one per physical core"))
    if f["cpu_quota"] is not None and f["cpu_quota"] < phys:
        check = Check("threads", "warn", msg + f"; a cgroup CPU quota allows only {f['cpu_quota']:g} CPU(s)",
                      f"give the container more CPUs (e.g. docker run --cpus {phys}), or accept {threads} thread(s)")
    elif logical > phys:
        check = Check("threads", "ok", msg + f"; SMT is on ({logical // max(1, phys)} threads "
                      "per core): more threads than cores usually slows llama.cpp down")
    else:
        check = Check("threads", "ok", msg)
    load = _load_check(f.get("cpu_load"), threads)
    return [check] + ([load] if load is not None else [])


def _numa(f: dict[str, Any]) -> list[Check]:
    nodes = f["numa_nodes"]
    if nodes <= 1:
        return [Check("numa", "ok", "1 NUMA node: memory is equally close to every core")]
    if not f["numactl"]:
        return [Check("numa", "warn", f"{nodes} NUMA nodes and no numactl: weights may sit on "
                      "the far node and threads wander between nodes",
                      "apt-get install numactl, then: numactl --cpunodebind=0 --membind=0 "
                      "specstack ... (one node), or numactl --interleave=all specstack ...")]
    return [Check("numa", "info", f"{nodes} NUMA nodes; numactl at {f['numactl']}",
                  "for a model that fits one node: numactl --cpunodebind=0 --membind=0 "
                  "specstack ...; otherwise numactl --interleave=all specstack ...")]


def _thread_env(f: dict[str, Any]) -> list[Check]:
    """Numerical libraries' thread variables, which would compete with llama.cpp's threads."""
    phys, checks = f["physical_cores"], []
    for var in THREAD_ENV_VARS:
        val = f["env"].get(var)
        if val is None:
            if var != "MKL_NUM_THREADS":
                checks.append(Check(var, "ok", "unset (llama.cpp's thread count comes from specstack's "
                                    "n_threads)"))
            continue
        try:
            n = int(val.split(",")[0])
        except ValueError:
            checks.append(Check(var, "warn", f"{var}={val!r} is not a number", f"unset {var}"))
            continue
        if n > phys:
            checks.append(Check(var, "warn", f"{var}={n} exceeds the {phys} physical core(s): "
                                "threads of numerical libraries will compete with llama.cpp's",
                                f"export {var}={phys}   (or: unset {var})"))
        else:
            checks.append(Check(var, "ok", f"{var}={n}"))
    return checks


def _huge_pages(f: dict[str, Any]) -> Check:
    thp = f["thp"]
    thp_fix = "echo always | sudo tee /sys/kernel/mm/transparent_hugepage/enabled"
    if thp == "always":
        return Check("huge pages", "ok", "transparent huge pages: always")
    if thp == "madvise":
        return Check("huge pages", "info", "transparent huge pages: madvise; llama.cpp does "
                     "not madvise its buffers, so weights use 4 KiB pages (a few % slower on "
                     "large models)", thp_fix)
    if thp == "never":
        return Check("huge pages", "warn", "transparent huge pages: never (more TLB misses "
                     "on large models)", thp_fix)
    return Check("huge pages", "info", "transparent huge pages setting not readable")


def _cpu_features(f: dict[str, Any]) -> list[Check]:
    """The llama.cpp build against the CPU: a feature it was built for that the CPU lacks, or the reverse."""
    cpu = f["cpu_features"]
    have = [k for k, v in cpu.items() if v]
    lf = f["llama_features"]
    if f["llama_error"] or lf is None:
        return [Check("llama.cpp", "fail", f"llama_cpp cannot be imported: {f['llama_error']}",
                      "pip install llama-cpp-python==0.3.36"),
                Check("cpu features", "info" if cpu.get("AVX2") else "warn",
                      "CPU: " + (", ".join(have) or "no AVX") + "; llama.cpp: unknown")]
    build = Check("llama.cpp", "ok", f"llama-cpp-python {f['llama_version'] or '?'}: {f['llama_system_info']}")
    llama_on = {k for k, v in lf.items() if v == "1"}
    missing = [k for k in LLAMA_FEATURES if cpu.get(k) and k not in llama_on]
    extra = [k for k in LLAMA_FEATURES if k in llama_on and k in cpu and not cpu[k]]
    line = ("CPU: " + (", ".join(have) or "none of AVX/AVX2/AVX-512/AMX") + "; llama.cpp uses: "
            + (", ".join(k for k in LLAMA_FEATURES if k in llama_on) or "none of them"))
    if extra:
        features = Check("cpu features", "fail", line + f"; llama.cpp was built for {', '.join(extra)}, "
                         "which this CPU lacks (illegal instruction risk)", REBUILD_FIX)
    elif missing:
        features = Check("cpu features", "warn", line + f"; the CPU has {', '.join(missing)} but "
                         "this llama.cpp build does not use it", REBUILD_FIX)
    elif not cpu.get("AVX2"):
        features = Check("cpu features", "warn", line + "; no AVX2: expect slow inference")
    else:
        features = Check("cpu features", "ok", line)
    return [build, features]


def _kernel_check(f: dict[str, Any]) -> list[Check]:
    """Whether specstack's verification kernels run (its own build of llama.cpp's CPU backend) or the stock one, and
    why: a failed build is a warning with what retries it, a chosen stock library (SPECSTACK_KERNELS=stock) is not."""
    from ..llama import KernelStatus

    if not f.get("kernels"):
        return []
    k = KernelStatus.from_dict(f["kernels"])
    if k.active:
        return [Check("kernels", "ok", k.line())]
    if k.why_not and "build failed" in k.why_not:
        return [Check("kernels", "warn", f"{k.line()}; log: {k.log}",
                      "install a C/C++ compiler (and cmake), then: SPECSTACK_KERNELS=rebuild specstack doctor")]
    return [Check("kernels", "info", k.line())]


def _governor(f: dict[str, Any]) -> Check:
    gov = f["governor"]
    if gov is None:
        return Check("cpu governor", "info", "frequency governor not exposed (virtual machine or container)")
    if gov == "performance":
        return Check("cpu governor", "ok", "frequency governor: performance")
    return Check("cpu governor", "info", f"frequency governor: {gov}; timings vary while the clock ramps up",
                 "sudo cpupower frequency-set -g performance")


def _roofline(probed: dict[str, Any]) -> Check:
    """What the cores can stream and multiply (``roofline.probe``): the ceilings a verification call's matmuls
    live under, so that a kernel's measured speed (``benchmarks/kernel_roofline.py``) reads as a share of them."""
    if "error" in probed:
        return Check("roofline", "info", f"not measured: {probed['error']}")
    return Check("roofline", "info", roofline.from_dict(probed).describe())


def _memory_line(f: dict[str, Any]) -> str:
    return (f"{_gib(f['mem_available'])} available of {_gib(f['mem_total'])}"
            + (f" (cgroup limit {_gib(f['cgroup_memory_limit'])})" if f["cgroup_memory_limit"] else ""))


def _memory(f: dict[str, Any]) -> list[Check]:
    """Without a model: what memory there is."""
    return [Check("memory", "info", _memory_line(f) + "; give -m MODEL to check that a model fits")]


def _model(f: dict[str, Any], model: str | Path) -> list[Check]:
    """The model's file (its recurrence, NextN head, whether trained heads can read it, or what head it is) and
    whether it fits in memory."""
    try:
        info = read_gguf(model)
    except ModelLoadError as exc:
        return [Check("model", "fail", str(exc))]
    from ..modelfile.compat import head_line, layer_input_line, mtp_line, rewind_line

    desc = (f"{Path(model).name}: {info.architecture}, {info.n_params / 1e6:.2f}M params, {info.file_type_name}, "
            f"{_gib(info.file_size)} on disk")
    checks = [Check("model", "warn" if info.rewind == "checkpoint" else "info",
                    desc + ("" if info.recurrence == "none" else f"; {rewind_line(info.recurrence, info.rewind)}"),
                    None if info.rewind != "checkpoint" else
                    "speculation pays a state copy per drafted step; `specstack bench` shows whether it pays")]
    if info.nextn_layers:
        checks.append(Check("mtp", "info", f"{Path(model).name}: "
                            f"{mtp_line(info.nextn_layers, info.mtp_mode, info.architecture)}",
                            "specstack generate --drafter mtp (or cascade:suffix,mtp on repetitive work)"
                            if info.mtp_mode == "single head" else None))
    head = info.head
    if head is not None:  # a trained draft head given as the model: say what it is and how to check it
        checks.append(Check("head", "warn", f"{Path(model).name}: {head_line(head)}; a draft head, not a model to "
                            "generate with", f"specstack check TARGET {Path(model).name} (does it fit its target?)"))
    else:
        checks.append(Check("head", "info", f"{Path(model).name}: {layer_input_line(info.architecture)}"))
    return checks + [_fits(f, int(info.file_size * MEMORY_HEADROOM))]


def _fits(f: dict[str, Any], need: int) -> Check:
    avail, mem_line = f["mem_available"], _memory_line(f)
    if avail is None:
        return Check("memory", "info", f"available memory unknown; the model needs about {_gib(need)}")
    if need > avail:
        return Check("memory", "fail", f"the model needs about {_gib(need)} but only {mem_line}: it will swap or "
                     "be killed", "use a smaller quantization (e.g. Q4_K_M) or a smaller model, or free memory")
    if need > 0.8 * avail:
        return Check("memory", "warn", f"the model needs about {_gib(need)}, close to the {mem_line}",
                     "close other programs, or use a smaller quantization")
    return Check("memory", "ok", f"the model needs about {_gib(need)}; {mem_line}")


# From this share of the weights' bytes on, the doctor says rows here cost more than on a big model (Gemma 3 270M
# Q4_K_M: 72%, 63% of its parameters; Qwen 2.5 1.5B Q4_K_M: about 19%; 7B models: 2-7%).
OUTPUT_SHARE_NOTE = 0.25


def llamafile_in(system_info: str | None) -> bool | None:
    """Whether llama.cpp was built with llamafile's tinyBLAS (``LLAMAFILE = 1`` in its system info); None: unknown."""
    if not system_info:
        return None
    return sysinfo.parse_llama_system_info(system_info).get("LLAMAFILE") == "1"


def row_cost_check(t: Callable[[int], float | None], llamafile: bool | None, where: str,
                   output_share: float | None = None, per_depth: tuple[int, float] | None = None) -> Check:
    """What a verified row costs (``t``: a measured t(n) in seconds, ``where``: whose curve) and which llama.cpp
    build suits it. llama.cpp hands calls of 2+ rows to llamafile's tinyBLAS where it is built in, and a build
    without it measured cheaper at 2 rows but dearer from 4 on (docs/drafters.md), so the better build depends
    on how long the drafts are that pay on this model and CPU. ``output_share``: the output layer's share of the
    model's bytes, said beside the curve, because where it is large (a small model with a big vocabulary) the
    curve is mostly that layer's, and a bigger model of the family can differ (on a 2-core AMD EPYC, 16 rows cost
    Gemma 3 270M 8.9x one row; on a 2-core Intel Xeon, 4.5x, as they did a 1.5B stand-in with a 22% share).
    ``per_depth``: the depth the curve was timed at and what a row adds per context token beyond it
    (``CostModel.row_depth_s``), said too: deeper in, every row costs more."""
    ratios = {n: t(n) / t(1) for n in ROW_COST_NS if t(n)}  # the sizes the curve measured
    said = ", ".join(f"{n} rows {r:.1f}x" for n, r in ratios.items())
    msg = f"{where}: a verification of {said} one row ({1000 * t(1):.1f} ms)"
    if per_depth is not None and per_depth[1] > 0:
        depth0, slope = per_depth
        msg += f" at a context of {depth0} tokens; each row adds {1e6 * slope:.2f} ms per 1000 tokens deeper"
    note = ""
    if output_share is not None:
        note = f". Its output layer is {100 * output_share:.0f}% of its weights' bytes"
        if output_share >= OUTPUT_SHARE_NOTE:
            note += (" (a 7B model's: 2-7%), so this curve need not be a bigger model's of its family: measure that "
                     "model, or a stand-in of its shape (specstack bench make-standin), before reading these ratios "
                     "as its")
    if ratios.get(2, 1.0) <= 1.5:
        return Check("rows", "ok", msg + ": extra rows are cheap, so even short drafts pay" + note)
    measured = ("on Gemma 3 270M Q4_K_M, 2-core AMD EPYC, -t 1, a build without it made 2 rows 20% cheaper and 8-16 "
                "rows 27-41% dearer (docs/drafters.md)")
    if llamafile:
        return Check("rows", "info", msg + "; drafts pay only when long and near-certain (the cost policy prices "
                     f"each by this curve). This build hands 2+ rows to llamafile's tinyBLAS; {measured}: try that "
                     "build for short model drafts (draft-model, mtp at k 1-3), keep this one for long retrieval "
                     "drafts (suffix, prompt lookup)" + note, LLAMAFILE_OFF_FIX)
    return Check("rows", "info", msg + f"; this build runs without llamafile's tinyBLAS ({measured}): for long "
                 "retrieval drafts (suffix, prompt lookup at k 8-16) the default build verifies cheaper" + note,
                 LLAMAFILE_ON_FIX)


def _load_check(load: dict[str, Any] | None, threads: int) -> Check | None:
    """Whether other processes keep the cores busy: every timing specstack takes then comes out slow and
    uneven (the ``--exact auto`` verdict, cost curves, bench), by the limit calibration applies to its own
    timings (``calibration.timing.NOISE_LIMIT``).  None where the CPUs' time cannot be read (not Linux)."""
    from ..calibration.timing import NOISE_LIMIT

    if load is None:
        return None
    seen = sysinfo.CpuLoad(**load)
    share = seen.contention(threads)
    said = seen.describe()
    if share > NOISE_LIMIT:
        return Check("load", "warn", f"the machine is busy: {said}: {100 * share:.0f}% of the cores specstack's "
                     f"{threads} thread(s) need; timings taken now (the --exact auto verdict, cost curves, bench) "
                     "are slowed and uneven, so specstack uses them for that run only",
                     "measure when the machine is quiet (see top), or leave other work its cores with fewer "
                     "threads (-t)")
    return Check("load", "ok", f"quiet: {said}")


def run_doctor(model: str | Path | None = None, threads: int = 0,
               probe: bool = True) -> tuple[list[Check], dict[str, Any]]:
    """The checks and the facts they read; ``threads`` (``-t``; 0: one per physical core) is what the threads and
    load checks judge, as the run being prepared will use it, and the roofline probe (``probe``: about a second,
    a compile the first time) measures at, beside one core."""
    facts = gather_facts()
    if threads:
        facts.update(threads=threads, threads_given=True)
    if probe:
        facts["roofline"] = roofline.probe(facts["threads"])
    return evaluate(facts, model), facts


def to_dict(checks: list[Check], facts: dict[str, Any]) -> dict[str, Any]:
    return {"checks": [asdict(c) for c in checks], "facts": facts,
            "summary": {s: sum(1 for c in checks if c.status == s) for s in STATUSES}}


def render(checks: list[Check]) -> str:
    rows = []
    for c in checks:  # the status is always 6 wide, so a fix lines up under its message
        rows.append([f"[{c.status:^4}] {c.name}", c.message])
        if c.fix:
            rows.append(["", f"fix: {c.fix}"])
    lines = [table([], rows, align="ll")]
    counts = {s: sum(1 for c in checks if c.status == s) for s in STATUSES}
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n)
                 + ". doctor changes nothing; the fixes are commands to run yourself.")
    return "\n".join(lines)
