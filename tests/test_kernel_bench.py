"""benchmarks/kernel_roofline.py's bit-identity checker, on stock ggml (llama-cpp-python's own libggml-cpu).

The checker runs MUL_MAT once with n activation rows, once per row, and compares both with vec_dot row by row.
Stock ggml is the control: the paths that keep one row's arithmetic whatever n is must come out identical, and
the paths that change it (ggml-cpu/tiled/ from 8 rows for K-quants, the repacked Q4_K gemm from 4) must not, so
a checker that always said "identical" fails here. Needs a C compiler and ggml's headers (skipped without)."""

from __future__ import annotations

import importlib.util
import platform
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from specstack.host import sysinfo

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("kernel_roofline", REPO / "benchmarks" / "kernel_roofline.py")
kr = importlib.util.module_from_spec(spec)
sys.modules.setdefault("kernel_roofline", kr)  # dataclasses look their module up there
spec.loader.exec_module(kr)

X86_AVX2_FMA = platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= sysinfo.cpu_flags()


@pytest.fixture(scope="module", autouse=True)
def harness():
    try:
        return kr.build()
    except kr.HarnessError as exc:
        pytest.skip(f"no harness here: {exc}")


def kinds(out, threads):
    """{comparison: identical} at one thread count."""
    check = next(c for c in out["checks"] if c["threads"] == threads)
    return {k: check[k]["identical"] for k in ("batch_vs_single", "batch_vs_vec_dot", "single_vs_vec_dot")}


def same_at_every_thread_count(out):
    return all(c["batch_vs_first_threads"]["identical"] for c in out["checks"])


def test_the_outputs_compared_are_the_matmul():
    out = kr.identity(None, "q4_K", 1024, 64, 2, threads=(1,))
    assert out["lib"].endswith("libggml-cpu.so.0") and "llama_cpp" in out["lib"]
    assert out["float_max_abs"] > 1  # random rows of 1024 products: far from zeros that would compare equal
    assert out["vec_dot_vs_float_max_abs_diff"] < 0.05 * out["float_max_abs"]


def test_stock_vec_dot_loop_keeps_rows_identical_below_8_rows():
    """Q4_K below 8 rows in a plain buffer: the vec_dot chunk loop, one row's arithmetic, at 1-3 threads."""
    out = kr.identity(None, "q4_K", 1024, 640, 4, threads=(1, 2, 3))
    assert out["identical"], out["checks"]
    assert not out["repacked"] and out["vec_dot_type"] == "q8_K"


def test_control_stock_tiled_path_breaks_identity_from_8_rows():
    """The control: from 8 rows ggml-cpu/tiled/ takes K-quants and sums in another order. One row alone still
    goes through vec_dot, so the batch differs from it and from the single rows, by float rounding only."""
    out = kr.identity(None, "q4_K", 2048, 640, 8, threads=(1, 2, 3))
    assert not out["identical"]
    for t in (1, 2, 3):
        assert kinds(out, t) == {"batch_vs_single": False, "batch_vs_vec_dot": False, "single_vs_vec_dot": True}
    check = out["checks"][0]["batch_vs_single"]
    assert check["rows_differing"] == 8 and 0 < check["max_abs_diff"] < 1e-3
    assert same_at_every_thread_count(out)  # tiles split output rows among threads, never K


def test_control_tiled_forced_moves_one_row_off_vec_dot_too():
    out = kr.identity(None, "q6_K", 2048, 640, 2, threads=(1, 2), env={"GGML_CPU_TILED_MM_FORCE": "1"})
    assert out["tiled_mm_force"] == "1"
    assert kinds(out, 1) == {"batch_vs_single": True, "batch_vs_vec_dot": False, "single_vs_vec_dot": False}


@pytest.mark.skipif(not X86_AVX2_FMA, reason="repack's Q4_K 8x8 layout is taken on AVX2 here")
def test_control_repacked_q4_k_gemm_differs_from_its_gemv():
    """Repacked Q4_K (llama.cpp's default buffer): 4+ rows run the gemm, one row the gemv, and neither is vec_dot."""
    out = kr.identity(None, "q4_K", 2048, 640, 4, threads=(1, 2), buft="extra")
    assert out["repacked"] and out["weight_buft"] == "CPU_REPACK"
    assert kinds(out, 1) == {"batch_vs_single": False, "batch_vs_vec_dot": False, "single_vs_vec_dot": False}


@pytest.mark.skipif(not X86_AVX2_FMA, reason="measured on x86 AVX2+FMA, where tinyBLAS's Q8_0 tile is vec_dot's sum")
@pytest.mark.parametrize("type_", ["q8_0", "q5_0"])
def test_stock_tinyblas_q8_0_and_q5_0_rows_are_identical_here(type_):
    """llamafile's tinyBLAS takes Q8_0/Q5_0 from 2 rows; on x86 with AVX2 and FMA its tile accumulates each
    block as vec_dot does (one fma a block in 8 lanes, the same horizontal sum), so the rows come out the same
    bits: not the expected failure. This test fails where that stops holding (another ISA, another ggml)."""
    out = kr.identity(None, type_, 640, 1001, 7, threads=(1, 2, 3))
    assert out["identical"], out["checks"]


def test_another_library_is_loaded_by_its_path(tmp_path):
    """--lib NAME=PATH: the harness loads that file, and says so (here a link to the stock one, named apart)."""
    link = tmp_path / "libggml-cpu-other.so"
    link.symlink_to(kr.stock_lib().cpu)
    lib = kr.lib_from(f"other={link}")
    assert lib.name == "other" and lib.base == kr.stock_lib().base
    out = kr.identity(lib, "q8_0", 64, 8, 2, threads=(1,))
    assert Path(out["lib"]) == kr.stock_lib().cpu.resolve()


def test_a_missing_library_is_a_clear_error(tmp_path):
    with pytest.raises(kr.HarnessError, match="no library at"):
        kr.identity(kr.lib_from(f"gone={tmp_path / 'nope.so'}"), "q8_0", 64, 8, 2, threads=(1,))


def test_bench_reports_every_path_for_a_shape():
    shape = kr.Shape("test", "tiny", "q4_K", 256, 64)
    result = kr.bench(kr.default_paths(), [shape], [1, 8], rounds=1, min_time=0.001, working_set_mib=1,
                      log=lambda s: None)
    assert [r["path"] for r in result["rows"]] == ["stock", "stock, tiled forced", "stock, repacked"]
    for row in result["rows"]:
        assert set(row["ms"]) == {"1", "8"} and all(v > 0 for v in row["ms"].values())
    result.update(n=[1, 8], threads=1, cpus=2,
                  roofline={"isa": "AVX2", "instruction": "x", "point": {"threads": 1, "read_gbps": 20.0,
                                                                          "int8_gmacs": 70.0}})
    text = kr.markdown(result)
    assert "| test tiny q4_K 256x64 | stock |" in text and "roofline floor" in text and "GMAC/s" in text


def test_sweep_tabulates_identity_per_path_and_n():
    """The table a kernel author reads: "same" where the vec_dot loop runs, "differs" where the tiled path takes."""
    shape = kr.Shape("test", "tiny", "q4_K", 512, 64)
    rows = kr.identity_sweep(kr.default_paths()[:1], [shape], [4, 8], threads=(1, 2), log=lambda s: None)
    assert [r["path"] for r in rows] == ["stock"]
    text = kr.identity_markdown(rows, [4, 8])
    assert text.splitlines()[2].startswith("| test tiny q4_K 512x64 | stock | same | differs (")


def test_the_report_keeps_the_higher_of_two_probes():
    before = {"isa": "AVX2", "instruction": "x", "point": {"threads": 1, "read_gbps": 24.0, "int8_gmacs": 200.0}}
    after = {"isa": "AVX2", "instruction": "x", "point": {"threads": 1, "read_gbps": 42.0, "int8_gmacs": 190.0}}
    assert kr._best_roof(before, after)["point"] == {"threads": 1, "read_gbps": 42.0, "int8_gmacs": 200.0}
    assert kr._best_roof(None, after) == after


@pytest.fixture(scope="module")
def ours():
    """specstack's own libggml-cpu (docs/kernels.md), as specstack.llama loads it; the session has built it."""
    try:
        return kr.specstack_lib()
    except kr.HarnessError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("qtype,k,m", [("q4_K", 2048, 640), ("q6_K", 2048, 640), ("q5_0", 640, 1024),
                                       ("q8_0", 640, 1024)])
@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_specstack_kernels_keep_every_row_identical(ours, qtype, k, m, n):
    """What the verification kernels promise: a row's output is the same bits at any n, alone, and by vec_dot, at
    1-3 threads, with the weights offered to the repack buffer as llama.cpp does (the kernels keep theirs)."""
    out = kr.identity(ours, qtype, k, m, n, threads=(1, 2, 3), buft="extra")
    assert Path(out["lib"]) == ours.cpu.resolve()
    assert out["identical"], [{k_: c[k_] for k_ in kr.COMPARISONS} for c in out["checks"]]


BLOCK = {"q8_0": 32, "q5_0": 32, "q4_K": 256, "q5_K": 256, "q6_K": 256}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(qtype=st.sampled_from(sorted(BLOCK)), blocks=st.integers(1, 12), m=st.integers(1, 300),
       n=st.integers(1, 32), seed=st.integers(0, 2**31 - 1))
def test_specstack_kernels_are_identical_per_row_for_any_shape_and_weights(ours, qtype, blocks, m, n, seed):
    """Random types, widths, weight rows (odd counts too: the threads' shares), n = 1..32 and weights: every row
    the same bits as alone and as vec_dot's, at 1, 2 and 3 threads (hypothesis picks; a failure names the case)."""
    out = kr.identity(ours, qtype, blocks * BLOCK[qtype], m, n, threads=(1, 2, 3), buft="extra", seed=seed)
    assert out["identical"], [{k_: c[k_] for k_ in kr.COMPARISONS} for c in out["checks"]]


FLOAT_TYPES = ("f16", "bf16", "f32")


@pytest.mark.parametrize("type_", FLOAT_TYPES)
def test_control_stock_float_weights_differ_between_a_batch_and_one_row(type_):
    """Why the float kernels exist: llama.cpp's batched float path (tinyBLAS) sums in another order than its one-row
    vec_dot, so a 2-row call's rows differ from the same rows alone (a MoE router's F32 logits among them)."""
    out = kr.identity(None, type_, 640, 64, 2, threads=(1,))
    assert out["checks"][0]["single_vs_vec_dot"]["identical"]
    assert not out["checks"][0]["batch_vs_single"]["identical"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(type_=st.sampled_from(FLOAT_TYPES), k=st.integers(64, 3000), m=st.integers(1, 150),
       n=st.integers(1, 80), seed=st.integers(0, 2**31 - 1))
def test_specstack_float_kernels_are_identical_per_row_for_any_shape_and_weights(ours, type_, k, m, n, seed):
    """F16, BF16 and F32 weights (whole F16 GGUFs, MoE routers): widths with and without vec_dot's scalar tail,
    odd weight-row counts, n = 1..80 (the in-place walk alone, with the blocked walk after it, and past 32 rows,
    which float weights take too, 32 at a time, so that a prompt's calls compute rows as decoding does): every row
    the same bits as alone and as vec_dot's, at 1, 2 and 3 threads."""
    out = kr.identity(ours, type_, k, m, n, threads=(1, 2, 3), buft="extra", seed=seed)
    assert out["identical"], [{k_: c[k_] for k_ in kr.COMPARISONS} for c in out["checks"]]


@pytest.mark.parametrize("type_", FLOAT_TYPES)
def test_specstack_float_kernels_keep_a_long_row_identical(ours, type_):
    """A 7B's down-projection width (14336: several K-chunks of the blocked walk) at 5, 32 and 40 rows."""
    for n in (5, 32, 40):
        out = kr.identity(ours, type_, 14336, 24, n, threads=(1, 2))
        assert out["identical"], (n, [{k_: c[k_] for k_ in kr.COMPARISONS} for c in out["checks"]])
