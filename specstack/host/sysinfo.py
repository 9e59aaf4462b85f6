"""What the machine offers for CPU inference: cores, NUMA, memory, CPU features, and how busy it is.

Read-only: nothing here changes a system setting. ``physical_cores()`` is the
engine's default thread count (llama.cpp runs best with one thread per
physical core; SMT siblings share the core's vector units and slow it down).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")
PROC_CPUINFO = Path("/proc/cpuinfo")
PROC_MEMINFO = Path("/proc/meminfo")
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
CGROUP = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def allowed_cpus() -> list[int]:
    """Logical CPUs this process may run on (affinity mask)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def logical_cpus() -> int:
    return len(allowed_cpus()) or (os.cpu_count() or 1)


def _cores_from_sysfs(cpus: list[int], root: Path = SYS_CPU) -> int | None:
    cores = set()
    for c in cpus:
        topo = root / f"cpu{c}" / "topology"
        core = _read(topo / "core_id")
        pkg = _read(topo / "physical_package_id")
        if core is None:
            return None
        cores.add((pkg.strip() if pkg else "0", core.strip()))
    return len(cores) or None


def _cores_from_cpuinfo(cpus: list[int], text: str | None) -> int | None:
    if not text:
        return None
    allowed = set(cpus)
    cores = set()
    for block in re.split(r"\n\s*\n", text):
        fields = {}
        for line in block.splitlines():
            if ":" in line:
                k, _, v = line.partition(":")
                fields[k.strip()] = v.strip()
        if "processor" not in fields:
            continue
        try:
            proc = int(fields["processor"])
        except ValueError:
            continue
        if allowed and proc not in allowed:
            continue
        if "core id" not in fields:
            return None  # e.g. some ARM / virtual machines: no topology here
        cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores) or None


def cpu_quota() -> float | None:
    """CPUs allowed by a cgroup CPU quota (containers), or None if unlimited."""
    v2 = _read(CGROUP / "cpu.max")
    if v2:
        parts = v2.split()
        if parts and parts[0] != "max":
            try:
                return int(parts[0]) / int(parts[1] if len(parts) > 1 else 100000)
            except (ValueError, ZeroDivisionError):
                return None
        return None
    q, p = _read(CGROUP / "cpu" / "cpu.cfs_quota_us"), _read(CGROUP / "cpu" / "cpu.cfs_period_us")
    try:
        if q and p and int(q) > 0:
            return int(q) / int(p)
    except (ValueError, ZeroDivisionError):
        pass
    return None


def physical_cores_topology() -> int:
    """Physical cores among the CPUs this process may use (no quota applied)."""
    cpus = allowed_cpus()
    n = _cores_from_sysfs(cpus) or _cores_from_cpuinfo(cpus, _read(PROC_CPUINFO))
    return n or len(cpus) or os.cpu_count() or 1


def physical_cores() -> int:
    """Default thread count: physical cores we may use, capped by a cgroup CPU quota.

    Parses /sys/devices/system/cpu/cpuN/topology (then /proc/cpuinfo "physical id"/"core id"),
    for the CPUs in this process's affinity mask; falls back to os.cpu_count(). Always >= 1.
    """
    n = physical_cores_topology()
    quota = cpu_quota()
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def cpu_flags(text: str | None = None) -> set[str]:
    text = _read(PROC_CPUINFO) if text is None else text
    if not text:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.partition(":")[2].split())
    return set()


def cpu_model() -> str | None:
    text = _read(PROC_CPUINFO) or ""
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else None


# feature name -> /proc/cpuinfo flags that must all be present
CPU_FEATURES: dict[str, tuple[str, ...]] = {
    "AVX": ("avx",),
    "AVX2": ("avx2",),
    "FMA": ("fma",),
    "F16C": ("f16c",),
    "AVX_VNNI": ("avx_vnni",),
    "AVX512": ("avx512f",),
    "AVX512_VNNI": ("avx512_vnni",),
    "AVX512_BF16": ("avx512_bf16",),
    "AMX_INT8": ("amx_tile", "amx_int8"),
    "AMX_BF16": ("amx_tile", "amx_bf16"),
}


def cpu_features(flags: set[str] | None = None) -> dict[str, bool]:
    flags = cpu_flags() if flags is None else flags
    return {name: all(f in flags for f in need) for name, need in CPU_FEATURES.items()}


def parse_llama_system_info(raw: bytes | str) -> dict[str, str]:
    """``llama_print_system_info()`` ("CPU : AVX2 = 1 | AVX512 = 0 | ...") -> {"AVX2": "1", ...}."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    out = {}
    for m in re.finditer(r"([A-Za-z0-9_]+)\s*=\s*([A-Za-z0-9_.]+)", text):
        out[m.group(1)] = m.group(2)
    return out


def numa_nodes() -> int:
    try:
        return sum(1 for p in SYS_NODE.iterdir() if re.fullmatch(r"node\d+", p.name)) or 1
    except OSError:
        return 1


def numactl_path() -> str | None:
    return shutil.which("numactl")


def thp_setting() -> str | None:
    """Transparent huge pages mode: always / madvise / never (None if unknown)."""
    text = _read(THP_ENABLED)
    if not text:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else text.strip()


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, ...)."""
    out = {}
    for line in (_read(PROC_MEMINFO) or "").splitlines():
        k, _, v = line.partition(":")
        parts = v.split()
        if parts and parts[0].isdigit():
            out[k.strip()] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def cgroup_memory() -> tuple[int | None, int | None]:
    """(limit, usage) in bytes of this container's memory cgroup; limit None if unlimited."""
    for lim_p, use_p in ((CGROUP / "memory.max", CGROUP / "memory.current"),
                         (CGROUP / "memory" / "memory.limit_in_bytes",
                          CGROUP / "memory" / "memory.usage_in_bytes")):
        lim = _read(lim_p)
        if lim is None:
            continue
        lim = lim.strip()
        use = _read(use_p)
        usage = int(use) if use and use.strip().isdigit() else None
        if lim == "max" or not lim.isdigit() or int(lim) >= 2**62:
            return None, usage
        return int(lim), usage
    return None, None


def available_memory() -> int | None:
    """Bytes a new process can use: MemAvailable, lowered by a cgroup limit if any."""
    avail = meminfo().get("MemAvailable")
    lim, use = cgroup_memory()
    if lim is not None:
        room = lim - (use or 0)
        avail = room if avail is None else min(avail, room)
    return avail


def cpu_governor() -> str | None:
    text = _read(SYS_CPU / "cpu0" / "cpufreq" / "scaling_governor")
    return text.strip() if text else None


# --- how busy the machine is -----------------------------------------------------------------------
PROC_STAT = Path("/proc/stat")


def cpu_ticks(cpus: list[int] | None = None, text: str | None = None) -> int | None:
    """Clock ticks the CPUs ``cpus`` (default: the ones this process may run on) have spent busy since boot, from
    /proc/stat: user, nice, system, irq, softirq and steal (a hypervisor's other guests also take the core);
    None where /proc/stat cannot be read (not Linux)."""
    text = _read(PROC_STAT) if text is None else text
    if not text:
        return None
    wanted = set(allowed_cpus() if cpus is None else cpus)
    busy, seen = 0, False
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in wanted):
            continue
        fields = [int(x) for x in rest.split()[:8]]
        fields += [0] * (8 - len(fields))
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        busy += user + nice + system + irq + softirq + steal
        seen = True
    return busy if seen else None


@dataclass(frozen=True)
class CpuLoad:
    """Other processes' use of the CPUs this process may run on, over ``seconds``: ``others`` CPUs' worth of
    time (0 .. ``cpus``), and the 1-minute load average (None where unknown)."""

    others: float
    cpus: int
    seconds: float
    loadavg: float | None = None

    def contention(self, threads: int) -> float:
        """The share (0 .. 1) of the cores that ``threads`` threads need which other processes held: their use
        beyond the CPUs the threads leave free.  llama.cpp's threads wait for each other at every layer, so one
        thread that loses its core delays them all."""
        spare = max(0, self.cpus - threads)
        return min(1.0, max(0.0, self.others - spare) / max(1, threads))

    def describe(self, threads: int | None = None) -> str:
        """``other processes used 1.6 of the 2 CPUs, at a load average of 3.02``, for messages."""
        used = f"other processes used {self.others:.1f} of the {self.cpus} CPU{'' if self.cpus == 1 else 's'}"
        if threads is not None:
            used += f" that {threads} thread{'' if threads == 1 else 's'} run on"
        return used + ("" if self.loadavg is None else f", at a load average of {self.loadavg:.2f}")


class CpuWatch:
    """Other processes' CPU use from its creation to each ``read()``: the CPUs' busy time less this process's own
    (every thread of it, llama.cpp's included), so a measurement can tell whether it ran on a busy machine.  The
    load average alone cannot: it counts this process too, and lags a minute behind."""

    def __init__(self) -> None:
        self.cpus = allowed_cpus()
        self.t0, self.own0, self.ticks0 = time.perf_counter(), time.process_time(), cpu_ticks(self.cpus)

    def read(self) -> CpuLoad | None:
        """The load since this watch began; None where the CPUs' time cannot be read or no time has passed."""
        ticks, seconds = cpu_ticks(self.cpus), time.perf_counter() - self.t0
        if ticks is None or self.ticks0 is None or seconds <= 0:
            return None
        spent = (ticks - self.ticks0) / os.sysconf("SC_CLK_TCK") - (time.process_time() - self.own0)
        others = min(float(len(self.cpus)), max(0.0, spent / seconds))
        return CpuLoad(others=others, cpus=len(self.cpus), seconds=seconds, loadavg=load_average())


def load_average() -> float | None:
    """The 1-minute load average, None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cpu_load(seconds: float = 0.3) -> CpuLoad | None:
    """Other processes' CPU use over the next ``seconds`` (this process sleeps meanwhile), for ``doctor``."""
    watch = CpuWatch()
    time.sleep(seconds)
    return watch.read()
