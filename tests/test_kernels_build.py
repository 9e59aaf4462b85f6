"""specstack's build of llama.cpp's CPU backend (issue 57): the edits, the build, the preload and what it reports.

The builds run in subprocesses with a cache of their own (``SPECSTACK_CACHE_DIR``, its ``kernels/``: the session's
SPECSTACK_KERNELS_DIR is dropped; the sdist linked in, never downloaded again), because which library a process runs is fixed at its first import of llama_cpp.  One real build
(about 30 s on 2 cores) serves the whole module; the failing builds fail at cmake's compiler check, in seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from specstack.llama import KernelStatus
from specstack.llama import kernel_edits
from specstack.llama.kernel_build import BUILDING_LINE, first_error, obtain_sdist
from specstack.llama.kernel_key import AVX2_FLAGS, NATIVE_FLAGS, choose_isa, feature_flags, find_install

REPO = Path(__file__).resolve().parents[1]
EDITED = tuple(sorted({edit.path for edit in kernel_edits.EDITS}))  # every file the edits touch
FALLBACK_LINE = "running on llama-cpp-python's stock CPU backend"
# a subprocess: load the bundled model, run one call, say which libggml-cpu is mapped and what the status says
LOAD = """
import json
from specstack.llama import LlamaModel, ModelConfig, kernel_status, system_info
from specstack.paths import DEFAULT_TARGET
model = LlamaModel(ModelConfig(DEFAULT_TARGET), role="target")
logits = model.eval([1, 2, 3, 4])
maps = sorted({l.split(None, 5)[5].strip() for l in open("/proc/self/maps") if "libggml-cpu" in l})
print(json.dumps({"status": kernel_status().to_dict(), "maps": maps, "finite": bool((logits == logits).all()),
                  "system_info": system_info()}))
"""


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """llama-cpp-python's sdist, of the installed version (downloaded once into the user's cache if missing)."""
    return obtain_sdist(find_install().version, tmp_path_factory.mktemp("sdist-log") / "log")


def fresh_cache(root: Path, sdist: Path) -> Path:
    """A cache folder of its own holding the sdist, as a machine that never built the kernels has it."""
    (root / "llama-bins").mkdir(parents=True)
    (root / "llama-bins" / sdist.name).symlink_to(sdist.resolve())
    return root


def run_load(cache: Path, script: str = LOAD, **env: str) -> tuple[dict, str]:
    """Run ``script`` in a fresh interpreter on this checkout with ``cache`` as its cache: (its JSON, its stderr)."""
    full = {k: v for k, v in os.environ.items() if k not in ("SPECSTACK_KERNELS", "SPECSTACK_KERNELS_DIR", "CC", "CXX")}
    full.update(SPECSTACK_CACHE_DIR=str(cache), PYTHONPATH=str(REPO), **env)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=full, cwd=str(cache),
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory, sdist) -> tuple[Path, dict, str]:
    """One real build: (its cache, the first run's JSON, its stderr)."""
    cache = fresh_cache(tmp_path_factory.mktemp("kernels-built"), sdist)
    data, err = run_load(cache)
    return cache, data, err


# -- the edits ------------------------------------------------------------------------------------------------------
@pytest.fixture()
def tree(tmp_path, sdist) -> Path:
    """The files the edits touch, fresh from the sdist, in a llama.cpp tree's layout."""
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        for rel in EDITED:
            member = tar.getmember(f"{top}/vendor/llama.cpp/{rel}")
            dest = tmp_path / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(tar.extractfile(member).read())
    return tmp_path


def test_the_edits_apply_once_and_a_second_apply_changes_nothing(tree):
    changed = kernel_edits.apply_edits(tree)
    assert len(changed) == len(kernel_edits.SOURCE_FILES) + len(kernel_edits.EDITS)
    cpu = tree / "ggml/src/ggml-cpu"
    c = (cpu / "ggml-cpu.c").read_text()
    assert c.count('#include "specstack-verify.h"') == 1 and c.count("specstack_verify_mul_mat(params, dst)") == 1
    # ours runs inside ggml_compute_forward_mul_mat, before llama.cpp's tiled kernels
    body = c[c.index("void ggml_compute_forward_mul_mat("):]
    assert body.index("specstack_verify_mul_mat") < body.index("ggml_compute_forward_mul_mat_tiled")
    assert "ggml-cpu/specstack-verify.c\n" in (cpu / "CMakeLists.txt").read_text()
    repack = (cpu / "repack.cpp").read_text()
    fn = repack[repack.index("ggml_repack_get_optimal_repack_type(const struct ggml_tensor * cur) {"):]
    assert fn.split("\n")[1].strip() == "if (specstack_verify_takes(cur)) {"
    assert (cpu / "specstack-verify.c").read_bytes() == (kernel_edits.SOURCES_DIR / "specstack-verify.c").read_bytes()
    before = {p: p.read_bytes() for p in cpu.iterdir()}
    assert kernel_edits.apply_edits(tree) == []
    assert {p: p.read_bytes() for p in cpu.iterdir()} == before


def test_a_missing_anchor_names_the_file_and_the_anchor(tree):
    repack = tree / "ggml/src/ggml-cpu/repack.cpp"
    repack.write_text(repack.read_text().replace('#include "arch-fallback.h"\n', ""))
    with pytest.raises(kernel_edits.EditError) as err:
        kernel_edits.apply_edits(tree)
    assert str(repack) in str(err.value) and "arch-fallback.h" in str(err.value) and "does not occur" in str(err.value)


def test_an_anchor_found_twice_is_refused(tree):
    cmake = tree / "ggml/src/ggml-cpu/CMakeLists.txt"
    cmake.write_text(cmake.read_text() + "        ggml-cpu/ggml-cpu.c\n")
    with pytest.raises(kernel_edits.EditError, match="occurs 2 times"):
        kernel_edits.apply_edits(tree)


# -- what is built for ----------------------------------------------------------------------------------------------
AVX2_WHEEL = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "
              "OPENMP = 1 | REPACK = 1 |")
NATIVE_512 = "CPU : AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | AVX512_VNNI = 1 | OPENMP = 1 | REPACK = 1 |"


def test_the_isa_follows_the_installed_library():
    assert choose_isa(AVX2_WHEEL, {"avx2", "avx512f"}) == ("avx2", AVX2_FLAGS)  # CI's AVX2 wheel on an AVX-512 CPU
    assert choose_isa(AVX2_WHEEL, {"avx2", "fma"}) == ("native", NATIVE_FLAGS)  # an AVX2 CPU: native is the same
    assert choose_isa(NATIVE_512, {"avx2", "avx512f"}) == ("native", NATIVE_FLAGS)
    assert "-DGGML_AVX512=OFF" in AVX2_FLAGS and "-DGGML_NATIVE=OFF" in AVX2_FLAGS


def test_ggml_cpu_options_follow_the_installed_library():
    assert feature_flags(AVX2_WHEEL) == ("-DGGML_OPENMP=ON", "-DGGML_LLAMAFILE=ON", "-DGGML_CPU_REPACK=ON")
    assert feature_flags(NATIVE_512) == ("-DGGML_OPENMP=ON", "-DGGML_LLAMAFILE=OFF", "-DGGML_CPU_REPACK=ON")


def test_the_first_error_of_a_log_is_said_in_a_line():
    log = ["-- Detecting C compiler", "CMake Error at x.cmake:65 (message):", "  The C compiler", "",
           '    "/usr/bin/false"', "", "  is not able to compile", "-- Configuring incomplete, errors occurred!"]
    said = 'CMake Error at x.cmake:65 (message): The C compiler "/usr/bin/false" is not able to compile'
    assert first_error(log) == said
    assert first_error(["all fine"]) is None


# -- the build and the preload --------------------------------------------------------------------------------------
def test_loading_a_model_maps_our_library_and_says_so(built, sdist):
    cache, data, err = built
    status = KernelStatus(**data["status"])
    assert status.active and status.why_not is None, status
    ours = (cache / "kernels" / status.key / "libggml-cpu.so.0").resolve()
    assert data["maps"] == [str(ours)] and status.library == str(ours)
    assert data["finite"]
    assert err.count(BUILDING_LINE) == 1
    inputs = json.loads((cache / "kernels" / status.key / "inputs.json").read_text())
    assert inputs["sources"] == kernel_edits.sources_digest() and inputs["llama_cpp_python"] == find_install().version
    assert {"edits", "system_info", "compilers", "cmake_flags"} <= set(inputs) and inputs["isa"] == status.isa
    assert not list((cache / "kernels").glob(".build-*"))  # built aside, renamed into place


def test_a_second_process_loads_the_cached_build_without_building(built):
    cache, first, _ = built
    data, err = run_load(cache)
    assert data["status"] == first["status"] and data["maps"] == first["maps"]
    assert BUILDING_LINE not in err and FALLBACK_LINE not in err


def test_stock_runs_the_stock_library_and_says_why(built):
    cache, ours, _ = built
    data, err = run_load(cache, SPECSTACK_KERNELS="stock")
    assert ours["system_info"] == data["system_info"]  # built for the instruction sets and options the stock one has
    status = KernelStatus(**data["status"])
    stock = str(find_install().cpu_library.resolve())
    assert not status.active and status.why_not == "SPECSTACK_KERNELS=stock"
    assert data["maps"] == [stock] and status.library == stock
    assert BUILDING_LINE not in err


def test_llama_cpp_imported_first_is_reported_as_stock(built):
    cache, _, _ = built
    data, _ = run_load(cache, "import llama_cpp\n" + LOAD)
    status = KernelStatus(**data["status"])
    assert not status.active and "imported before" in status.why_not
    assert data["maps"] == [str(find_install().cpu_library.resolve())] == [status.library]


def test_a_failed_build_falls_back_once_and_is_not_retried(tmp_path, sdist):
    cache = fresh_cache(tmp_path / "cache", sdist)
    data, err = run_load(cache, CC="false", CXX="false")  # cmake finds no working compiler
    status = KernelStatus(**data["status"])
    assert not status.active and "build failed" in status.why_not and "cmake configure" in status.why_not
    assert "false" in status.why_not  # the log's first error: cmake's, naming the compiler
    assert data["maps"] == [str(find_install().cpu_library.resolve())]
    assert err.count(BUILDING_LINE) == 1 and err.count(FALLBACK_LINE) == 1 and status.log in err
    record = cache / "kernels" / status.key / "failed.json"
    assert Path(status.log).is_file() and json.loads(record.read_text())["log_tail"]
    stamp = record.stat().st_mtime_ns

    again, err = run_load(cache, CC="false", CXX="false")
    assert again["status"] == data["status"]
    assert BUILDING_LINE not in err and err.count(FALLBACK_LINE) == 1  # remembered, said again, not rebuilt
    assert record.stat().st_mtime_ns == stamp

    _, err = run_load(cache, CC="false", CXX="false", SPECSTACK_KERNELS="rebuild")
    assert err.count(BUILDING_LINE) == 1 and record.stat().st_mtime_ns != stamp


def test_two_processes_build_once(tmp_path, sdist):
    """The second waits on the lock, then finds the result (a failure here: cheap) and builds nothing."""
    cache = fresh_cache(tmp_path / "cache", sdist)
    env = {k: v for k, v in os.environ.items() if k not in ("SPECSTACK_KERNELS", "SPECSTACK_KERNELS_DIR")}
    env.update(SPECSTACK_CACHE_DIR=str(cache), PYTHONPATH=str(REPO), CC="false", CXX="false")
    script = "from specstack.llama import kernel_status; print(kernel_status().key)"
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=str(tmp_path)) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(err.count(BUILDING_LINE) for _, err in outs) == 1
    assert len({out.strip() for out, _ in outs}) == 1


# -- where it is reported -------------------------------------------------------------------------------------------
ACTIVE = {"active": True, "why_not": None, "key": "abc", "library": "/c/kernels/abc/libggml-cpu.so.0",
          "isa": "native", "log": "/c/kernels/abc/build.log"}
FAILED = {**ACTIVE, "active": False, "why_not": "the kernel build failed: cmake configure failed (exit 1)",
          "library": "/site/llama_cpp/lib/libggml-cpu.so.0"}


def test_doctor_says_which_backend_runs():
    from specstack.host import doctor

    assert doctor._kernel_check({"kernels": ACTIVE})[0].status == "ok"
    warn = doctor._kernel_check({"kernels": FAILED})[0]
    assert warn.status == "warn" and "build.log" in warn.message and "SPECSTACK_KERNELS=rebuild" in warn.fix
    stock = doctor._kernel_check({"kernels": {**FAILED, "why_not": "SPECSTACK_KERNELS=stock", "key": None}})[0]
    assert stock.status == "info" and "SPECSTACK_KERNELS=stock" in stock.message
    assert doctor._kernel_check({"kernels": None}) == []


def test_the_bench_header_says_which_backend_ran():
    from specstack.bench.report import _kernels_line

    assert "build abc" in _kernels_line(ACTIVE) and "stock" in _kernels_line(FAILED)
    assert "build abc" in _kernels_line({**ACTIVE, "a later field": 1})  # a results.json of a later version


def test_cost_curves_are_keyed_by_the_kernel_build(target, monkeypatch):
    import specstack.llama as llama
    from specstack.calibration.cache import machine_key

    monkeypatch.setattr(llama, "kernel_status", lambda: KernelStatus(**FAILED))
    stock = machine_key(target)
    monkeypatch.setattr(llama, "kernel_status", lambda: KernelStatus(**ACTIVE))
    ours = machine_key(target)
    monkeypatch.setattr(llama, "kernel_status", lambda: KernelStatus(**{**ACTIVE, "key": "other"}))
    assert ours == stock + [["kernels", "abc"]] and machine_key(target) != ours
