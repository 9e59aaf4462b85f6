"""Issue 29, items 13-15 and 20-22: outputs checked before measuring, damaged datastores and cost caches
named and repaired, measurements reused where they still hold and not cached when the machine was busy,
and bench's cost-curve phase shown and described as measured."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from specstack.cli import main
from specstack.errors import SpecstackError
from specstack.retrieval.datastore import Datastore, write_store

V = 50  # vocabulary of the hand-made datastores


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- 13: outputs are checked before anything is measured -----------------------------------------

TUNE = ("tune", "--prompts", "1", "--sources", "prompt-lookup", "--policies", "fixed", "-k", "2", "-n", "4")


def _bad_outputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """-o values that cannot be written: (path, what the error must say)."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    return {"folder": (tmp_path, "is a folder"), "under a file": (a_file / "x", "is a file"),
            "proc": (Path("/proc/version"), "cannot be written")}


@pytest.mark.parametrize("which", ["folder", "under a file", "proc"])
def test_tune_refuses_an_output_it_cannot_write_before_the_sweep(tmp_path, capsys, which):
    path, message = _bad_outputs(tmp_path)[which]
    if which == "proc" and not path.exists():
        pytest.skip("no /proc here")
    code, out, err = run_cli(capsys, *TUNE, "-o", str(path))
    assert code == 2 and message in err and str(path) in err
    assert "tune code-complete" not in err and not out  # refused before the sweep: no progress, no table


@pytest.mark.parametrize("which", ["existing file", "under a file"])
def test_bench_run_refuses_an_output_folder_it_cannot_write_before_measuring(tmp_path, capsys, which):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    path = a_file if which == "existing file" else a_file / "x"
    code, _, err = run_cli(capsys, "bench", "run", "--workload", "code-grounded", "--limit", "1", "--methods", "none",
                           "--no-plots", "--no-cost-curve", "-o", str(path))
    assert code == 2 and "is a file" in err and str(path) in err
    assert "bench: code-grounded" not in err  # refused before the target loaded
    assert a_file.read_text() == "x"


def test_a_missing_folder_for_an_output_is_created_and_left_clean(tmp_path):
    from specstack.bench.outputs import check_output_dir, check_output_file

    check_output_file(tmp_path / "new" / "p.toml")
    check_output_dir(tmp_path / "runs" / "one")
    assert list((tmp_path / "new").iterdir()) == [] and list((tmp_path / "runs" / "one").iterdir()) == []


# -- 14: a damaged datastore is named, with the command that rebuilds it ---------------------------

def _store(tmp_path: Path) -> Path:
    write_store(tmp_path / "s", [[1, 2, 3, 1, 2, 4], [3, 2, 1]], n_vocab=V)
    return tmp_path / "s"


def _rewrite(path: Path, name: str, change) -> None:
    arr = np.load(path / name).copy()
    change(arr)
    np.save(path / name, arr)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: (p / "sa.npy").write_bytes(b""), "sa.npy: it is empty"),
        (lambda p: _rewrite(p, "sa.npy", lambda a: a.__setitem__(0, 10_000)), "sa.npy holds positions outside"),
        (lambda p: _rewrite(p, "sa.npy", lambda a: a.__setitem__(0, -3)), "sa.npy holds positions outside"),
        (lambda p: _rewrite(p, "sa.npy", lambda a: a.__setitem__(slice(None), a[::-1])), "not sorted"),
        (lambda p: _rewrite(p, "tokens.npy", lambda a: a.__setitem__(0, V + 7)), "outside the vocabulary"),
        (lambda p: _rewrite(p, "index.npy", lambda a: a.__setitem__(2, a[-1])), "index.npy"),
    ],
)
def test_a_damaged_datastore_is_refused_at_open_with_the_rebuild_command(tmp_path, damage, message):
    store = _store(tmp_path)
    Datastore(store)  # intact: opens
    damage(store)
    with pytest.raises(SpecstackError, match=message) as e:
        Datastore(store)
    text = str(e.value)
    assert "corrupt" in text and f"specstack datastore build CORPUS -o {store}" in text


def test_a_zero_byte_suffix_array_is_one_line_through_the_cli(tmp_path, capsys):
    store = _store(tmp_path)
    (store / "sa.npy").write_bytes(b"")
    code, _, err = run_cli(capsys, "datastore", "info", str(store))
    assert code == 2 and "corrupt" in err and "specstack datastore build" in err and "Traceback" not in err


# -- the cost cache: damage (15), keys (20), noise (21) ---------------------------------------------

import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402

from specstack.calibration import cache as cost_cache, curve, modes, shapes, timing  # noqa: E402
from specstack.paths import DEFAULT_TARGET  # noqa: E402
from specstack.llama import BatchShapes, LlamaModel, ModelConfig  # noqa: E402

GENERATE = ("generate", "-m", str(DEFAULT_TARGET), "-p", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
            "-n", "8", "--drafter", "prompt-lookup", "--exact", "on")  # on: what is measured does not hang on a verdict
CTX = 1024  # past the bundled target's 512 trained positions, so that its measurements are as deep as a big model's


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Path:
    """A cost cache holding what a first `generate -c 1024 --exact on` on the bundled target measured, and the
    verdict of --exact auto (read-only: copy it).  Cached whatever the machine's load (``quiet``)."""
    folder = tmp_path_factory.mktemp("measured-cache")
    old, limit = os.environ.get("SPECSTACK_CACHE_DIR"), timing.NOISE_LIMIT
    os.environ["SPECSTACK_CACHE_DIR"] = str(folder)
    timing.NOISE_LIMIT = math.inf
    try:
        assert main([*GENERATE, "-c", str(CTX)]) == 0
        model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=CTX), role="target")
        shapes.ensure_shapes(model, "auto")
        model.close()
    finally:
        if old is None:
            os.environ.pop("SPECSTACK_CACHE_DIR", None)
        else:
            os.environ["SPECSTACK_CACHE_DIR"] = old
        timing.NOISE_LIMIT = limit
    kinds = {k.split("-")[0] for k in json.loads((folder / "costs.json").read_text())}
    assert kinds == {"shapes", "exact", "curve"}, kinds
    return folder / "costs.json"


@pytest.fixture
def cache(measured, tmp_path, monkeypatch) -> Path:
    """A copy of ``measured`` as this test's cache; lines said once are said again."""
    monkeypatch.setenv("SPECSTACK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost_cache, "_said", set())
    monkeypatch.setattr(curve, "_checked", set())
    shutil.copy(measured, tmp_path / "costs.json")
    return tmp_path / "costs.json"


@pytest.fixture
def quiet(monkeypatch) -> None:
    """Timings count as quiet however busy the machine is: tests of what is cached must not depend on the
    load that other work puts on the machine (what noise does is tested with timings made noisy, below)."""
    monkeypatch.setattr(timing, "NOISE_LIMIT", math.inf)


def _entries(path: Path) -> dict:
    return json.loads(path.read_text())


def _key(path: Path, kind: str) -> str:
    [key] = [k for k in _entries(path) if k.startswith(kind)]
    return key


def test_a_cost_cache_that_is_not_an_object_is_replaced_with_one_line(quiet, cache, capsys):
    cache.write_text("[1, 2, 3]")
    code, _, err = run_cli(capsys, *GENERATE, "-c", str(CTX))
    assert code == 0 and err.count("is damaged (not a JSON object)") == 1 and "Traceback" not in err
    assert {k.split("-")[0] for k in _entries(cache)} == {"shapes", "curve"}  # measured again, rewritten


def test_damaged_cost_cache_entries_are_discarded_measured_again_and_repaired(quiet, cache, capsys):
    entries = _entries(cache)
    shapes, curve = _key(cache, "shapes-"), _key(cache, "curve-")
    entries[shapes]["min_rows"] = "2"  # a traceback inside BatchShapes before
    entries[curve]["curve_s"] = [-1.0] * len(entries[curve]["curve_s"])
    cache.write_text(json.dumps(entries))
    code, _, err = run_cli(capsys, *GENERATE, "-c", str(CTX))
    assert code == 0 and "Traceback" not in err
    assert err.count("discarding a damaged entry") == 2, err  # one line for each entry
    assert "min_rows is '2'" in err and "curve_s[0] is -1.0" in err
    repaired = _entries(cache)
    assert BatchShapes.from_dict(repaired[shapes]).min_rows >= 1
    assert min(repaired[curve]["curve_s"]) > 0
    code, _, err = run_cli(capsys, *GENERATE, "-c", str(CTX))
    assert code == 0 and "damaged" not in err and "measuring" not in err  # repaired for good


def test_a_damaged_exactness_verdict_is_discarded_and_measured_again(quiet, cache, capsys):
    entries = _entries(cache)
    verdict = _key(cache, "exact-auto-")
    entries[verdict]["pad"] = -0.5  # a negative cost
    cache.write_text(json.dumps(entries))
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=CTX), role="target")
    try:
        assert shapes.cached_shapes(model, "auto") is None  # as if never measured: a run measures it
        assert capsys.readouterr().err.count("discarding a damaged entry") == 1
        shapes.ensure_shapes(model, "auto")
    finally:
        model.close()
    assert modes.ExactCost.parse(_entries(cache)[verdict]).pad >= 0
    assert "damaged" not in capsys.readouterr().err  # said once


@pytest.mark.parametrize("entry, message", [
    ([1, 2, 3], "expected an object"),
    ({"min_rows": 2}, "missing max_rows"),
    ({**BatchShapes().to_dict(), "pad_logits": "yes"}, "pad_logits is 'yes'"),
    ({**BatchShapes().to_dict(), "min_rows": 0}, "min_rows 0"),
    ({**BatchShapes().to_dict(), "max_rows": 1.5}, "max_rows is 1.5"),
    ({**BatchShapes().to_dict(), "colour": 1}, "unknown colour"),
])
def test_cached_shapes_are_checked_field_by_field(entry, message):
    with pytest.raises(ValueError, match=message):
        BatchShapes.from_dict(entry)


@pytest.mark.parametrize("entry, message", [
    ("x", "expected an object"),
    ({"pad": 0.1, "split": 0.0}, "missing rows"),
    ({"pad": "0.1", "split": 0.0, "rows": 17}, "pad is '0.1'"),
    ({"pad": float("nan"), "split": 0.0, "rows": 17}, "pad is nan"),
    ({"pad": 0.1, "split": -1, "rows": 17}, "split is -1"),
    ({"pad": 0.1, "split": 0.0, "rows": True}, "rows is True"),
])
def test_a_cached_exactness_verdict_is_checked(entry, message):
    with pytest.raises(ValueError, match=message):
        modes.ExactCost.parse(entry)


@pytest.mark.parametrize("entry, message", [
    ({"curve_s": "fast", "row_depth_s": 0.0}, "not a list"),
    ({"curve_s": [], "row_depth_s": 0.0}, "not a list"),
    ({"curve_s": [0.001, None], "row_depth_s": 0.0}, r"curve_s\[1\] is None"),
    ({"curve_s": [0.001, 0.0], "row_depth_s": 0.0}, r"curve_s\[1\] is 0.0, not positive"),
    ({"seconds": [0.001], "row_depth_s": 0.0}, "missing curve_s"),
    ({"curve_s": [0.001]}, "missing row_depth_s"),  # a curve cached before rows were priced by depth
    ({"curve_s": [0.001], "row_depth_s": -1e-6}, "row_depth_s is -1e-06, not at least 0"),
])
def test_a_cached_cost_curve_is_checked(entry, message):
    with pytest.raises(ValueError, match=message):
        curve._parse_curve(entry, 1)


def test_a_new_context_size_reuses_the_measurements(quiet, cache, capsys):
    """Item 20: the measured costs do not depend on -c, so a new one finds every entry a run at another -c
    stored and adds none.  (A cached curve may still be timed again where one-row calls now take 5x more or
    less than it says: ``curve._still_true``, which a busy machine can trigger.)"""
    before = _entries(cache)
    code, _, err = run_cli(capsys, *GENERATE, "-c", str(2 * CTX))
    assert code == 0 and "first run" not in err and "measuring" not in err, err
    after = _entries(cache)
    assert after.keys() == before.keys()
    assert all(after[k] == before[k] for k in after if not k.startswith("curve-"))


def test_a_new_slot_count_reuses_the_measurements(quiet, cache):
    """Item 20: a target of three slots (separate KV streams) finds the shapes and curve one slot measured."""
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=CTX, n_slots=3), role="target")
    try:
        assert shapes.cached_shapes(model, "on") is not None
        shapes.ensure_shapes(model, "on")  # from the cache
        assert curve.curve_key(model, 17)[0] == 17 and curve.curve_cached(model, 17)
    finally:
        model.close()
    assert "shapes-" in cache.read_text()


def test_a_longer_cached_curve_serves_a_shorter_one(quiet, cache):
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=CTX), role="target")
    try:
        shapes.ensure_shapes(model, "on")  # as the measuring run
        assert curve.curve_key(model, 5)[1] == curve.curve_key(model, 17)[1]  # one entry for every length
        assert curve.curve_cached(model, 5) and curve.curve_cached(model, 17) and not curve.curve_cached(model, 40)
    finally:
        model.close()


# -- 21: timings taken while the machine is busy are measured again, and never cached ----------------

def test_timing_noise_is_the_gap_between_the_two_fastest_timings():
    quiet = {1: [1.00, 1.02, 1.9], 2: [2.0, 2.04, 2.05]}
    busy = {1: [1.0, 3.0, 9.0], 2: [2.0, 2.02]}
    assert timing.timing_noise(quiet) == pytest.approx(0.02)
    assert timing.timing_noise(busy) == pytest.approx(2.0)  # the worst kind
    assert timing.timing_noise({**busy, 3: [1, 1], 4: [1, 1]}, quantile=0.5) == pytest.approx(0.0)  # the typical kind
    assert timing.timing_noise({1: [1.0]}) == 0.0  # one timing says nothing


def test_steady_measures_again_only_while_timings_are_noisy_and_pools_them(real_noise_limit):
    runs: list[int] = []

    def measure(pattern):
        def once() -> dict[str, list[float]]:
            runs.append(1)
            return {"a": list(pattern)}
        return once

    samples, noise = timing.steady(measure([1.0, 1.01]))
    assert len(runs) == 1 and noise < timing.NOISE_LIMIT
    runs.clear()
    samples, noise = timing.steady(measure([1.0, 5.0]))  # pooled: 1.0 and 1.0 agree after the second try
    assert len(runs) == 2 and samples["a"] == [1.0, 5.0, 1.0, 5.0] and noise == 0.0


class Busy:
    """Real timings of a real measurement, each later one delayed more, as on a machine whose load keeps
    rising: the two fastest never agree.  (Load itself cannot be made to order in a test.)"""

    def __init__(self, real) -> None:
        self.real, self.calls, self.n = real, 0, 0

    def __call__(self, *args, **kwargs) -> dict:
        self.calls += 1
        out = {}
        for kind, times in self.real(*args, **kwargs).items():
            out[kind] = []
            for t in times:
                self.n += 1
                out[kind].append(t * 2.0 ** self.n)  # each timing twice the one before
        return out


def _machine(monkeypatch, quiet: bool) -> None:
    """Whether a start finds the cores quiet (``timing.quiet_now``), whatever load runs beside this test."""
    monkeypatch.setattr(timing, "quiet_now", lambda threads: quiet)


def test_a_curve_timed_on_a_busy_machine_is_kept_until_a_quiet_start(real_noise_limit, cache, capsys, monkeypatch):
    """Issue 55 item 5: a start under load used to measure again every time (a server ready in ~30 s instead of
    3.5 s).  A busy machine's curve is cached marked busy, used at once by starts while the machine stays busy,
    and measured again at the first start that finds it quiet."""
    entries = _entries(cache)
    del entries[_key(cache, "curve-")]
    cache.write_text(json.dumps(entries))
    busy = Busy(curve.time_calls)
    monkeypatch.setattr(curve, "time_calls", busy)
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=CTX), role="target")
    try:
        first = curve.calibrate(model, exact="on")
        per_try = 2 if curve.deep_depth(model, 17) is not None else 1  # the curve's depth, then a deeper one
        assert first.source == "calibrated" and busy.calls == timing.MEASURE_TRIES * per_try  # bounded retries
        err = capsys.readouterr().err
        assert err.count("the machine was busy while timing its cost curve") == 1 and "keeping them" in err
        assert "busy" in _entries(cache)[_key(cache, "curve-")]
        # a start while the machine stays busy: the kept curve, nothing measured (``_still_true``'s check of t(1)
        # against this test's own load is tested apart)
        monkeypatch.setattr(curve, "time_calls", busy.real)
        monkeypatch.setattr(curve, "_still_true", lambda model, costs: True)
        monkeypatch.setattr(timing, "NOISE_LIMIT", math.inf)  # (however busy the machine running this test is)
        _machine(monkeypatch, quiet=False)
        monkeypatch.setattr(curve, "_checked", set())
        assert curve.calibrate(model, exact="on").source == "cache"
        assert "as measured at an earlier start on a busy machine" in capsys.readouterr().err
        assert "busy" in _entries(cache)[_key(cache, "curve-")]  # quiet again: the next start measures and caches
        _machine(monkeypatch, quiet=True)
        monkeypatch.setattr(curve, "_checked", set())
        assert curve.calibrate(model, exact="on").source == "calibrated"
        assert "busy" not in _entries(cache)[_key(cache, "curve-")]
    finally:
        model.close()


def test_an_exactness_verdict_timed_on_a_busy_machine_is_kept_until_a_quiet_start(real_noise_limit, cache, capsys,
                                                                                   monkeypatch):
    entries = _entries(cache)
    del entries[_key(cache, "exact-auto-")]
    cache.write_text(json.dumps(entries))
    busy = Busy(modes._time_exact_kinds)
    monkeypatch.setattr(modes, "_time_exact_kinds", busy)
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=CTX), role="target")
    try:
        assert shapes.cached_shapes(model, "auto") is None
        got = shapes.ensure_shapes(model, "auto")
        assert got.settled and busy.calls == timing.MEASURE_TRIES
        assert "the machine was busy while timing what exactness costs" in capsys.readouterr().err
        _machine(monkeypatch, quiet=False)  # the next start, still busy: the kept verdict, at once
        kept = shapes.cached_shapes(model, "auto")
        assert kept is not None and kept.exact == got.exact and "until a start on a quiet machine" in kept.why
        _machine(monkeypatch, quiet=True)  # a quiet start: to be measured again
        assert shapes.cached_shapes(model, "auto") is None
    finally:
        model.close()


# -- 22: bench's cost-curve phase has a progress bar; results.md states the exact mode it measured ----

@pytest.fixture(scope="module")
def bench_off(tmp_path_factory) -> tuple[int, str, Path]:
    """A tiny `bench run --exact off` with the cost curve and progress shown: (exit code, stderr, folder)."""
    import contextlib
    import io

    from specstack.bench import workloads

    tmp = tmp_path_factory.mktemp("bench22")
    row = json.loads(workloads.resolve("code-grounded").read_text().splitlines()[0])
    wl = tmp / "one.jsonl"
    wl.write_text(json.dumps({**row, "max_tokens": 4}) + "\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["bench", "run", "--workload", str(wl), "--methods", "none", "-k", "2", "--cost-max-n", "3",
                     "--cost-reps", "2", "--no-plots", "--no-warmup", "--exact", "off", "-o", str(tmp / "out")])
    return code, err.getvalue(), tmp / "out"


def test_bench_cost_curve_phase_shows_a_progress_bar(bench_off):
    code, err, _ = bench_off
    assert code == 0
    lines = [line for line in err.splitlines() if "verification cost curve" in line]
    assert lines and lines[-1].startswith("bench: timing the verification cost curve t(n), n = 1..3 6/6 calls 100%")


def test_results_md_states_the_exact_mode_and_what_a_plain_step_cost(bench_off):
    _, _, out = bench_off
    md = (out / "results.md").read_text()
    assert "Exact mode: off (--exact off)" in md
    assert "pads one-token steps to two" not in md and "padded one-token steps" not in md
    assert "In this run one-token steps ran unpadded, so a plain step cost t(1)." in md


def test_results_md_of_a_padded_exact_run_says_a_plain_step_cost_t2(bench_off):
    from specstack.bench import report

    _, _, out = bench_off
    results = json.loads((out / "results.json").read_text())
    results["config"]["target"].update(exact=True, min_rows=2, exact_why="--exact on")
    md = report.render_markdown(results)
    assert "Exact mode: on (--exact on): greedy speculative outputs must equal plain decoding" in md
    assert "padded one-token steps to 2 rows (batch-invariant logits), so a plain step cost t(2)." in md


def test_bench_report_to_a_folder_it_cannot_write_is_one_line(bench_off, tmp_path, capsys):
    _, _, out = bench_off
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = run_cli(capsys, "bench", "report", str(out / "results.json"), "--no-plots", "-o", str(a_file))
    assert code == 2 and f"cannot write the results to {a_file}" in err


# -- issue 37, item 17: a verdict measured while other processes hold the cores says so (kept until a quiet start) --

class Held:
    """What ``CpuWatch`` reads while other processes hold every CPU (load cannot be made to order in a test, and
    real load would make the timings noisy too): each watch made is counted."""

    made = 0
    CPUS = 4

    def __init__(self) -> None:
        Held.made += 1

    def read(self):
        from specstack.host.sysinfo import CpuLoad

        return CpuLoad(others=float(self.CPUS), cpus=self.CPUS, seconds=0.5, loadavg=9.0)


def test_an_exactness_verdict_measured_on_busy_cores_says_so_and_is_kept_marked(real_noise_limit, cache, capsys,
                                                                               monkeypatch):
    """On one model and thread count, a start-up measured "+60% / +138%" and the bench "+3% / +131%": timings
    that agree with each other can still be a busy machine's.  Other processes' CPU use now counts as busy by the
    noise rule's limit: the measurement is taken again, the verdict says it was busy, and it is cached marked so."""
    entries = _entries(cache)
    del entries[_key(cache, "exact-auto-")]
    cache.write_text(json.dumps(entries))
    Held.made = 0
    monkeypatch.setattr(timing, "CpuWatch", Held)
    code, out, err = run_cli(capsys, "generate", "-m", str(DEFAULT_TARGET), "-p", "def f(a):\n", "-n", "4", "-c",
                             str(CTX), "--drafter", "prompt-lookup", "--exact", "auto", "-t", "2")
    assert code == 0, err
    said = out + err
    # on a noisy machine the reason also says how far the repeated timings differed, before the CPU use
    busy = re.search(r"measured while the machine was busy \((repeated timings differed by \d+%; )?other processes "
                     r"used 4\.0 of the 4 CPUs that 2 threads run on, at a load average of 9\.00\), so kept only "
                     r"until a start on a quiet machine measures it again", said)
    assert busy, said
    # taken again while busy, bounded: the verdict's tries, and the cost curve's where this run measures it too
    # (plus one watch, at most, of a later look at the kept verdict: is the machine quiet now? ``quiet_now``)
    assert Held.made in (timing.MEASURE_TRIES, 2 * timing.MEASURE_TRIES, timing.MEASURE_TRIES + 1,
                         2 * timing.MEASURE_TRIES + 1)
    assert "busy" in _entries(cache)[_key(cache, "exact-auto-")]  # kept for starts while the machine stays busy
    monkeypatch.setattr(timing, "NOISE_LIMIT", math.inf)  # a quiet machine (whatever load runs beside this test)
    monkeypatch.setattr(timing, "_quiet", {})  # (the busy check above is remembered for a minute)
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=CTX, n_threads=2), role="target")
    try:
        assert "busy" not in shapes.ensure_shapes(model, "auto").why
        assert "busy" not in _entries(cache)[_key(cache, "exact-auto-")]
    finally:
        model.close()


def test_a_cost_curve_timed_on_busy_cores_is_kept_marked_busy(real_noise_limit, cache, monkeypatch):
    """A curve timed while other processes held the cores (Gemma 3 270M: t(1) 79 ms where a quiet one is 20) was
    cached as a quiet machine's, since load that delays every call alike passes the noise rule, and priced every
    later run; the cores are watched as the exactness verdict's are, so such a curve is cached marked busy, and
    the first start on a quiet machine measures it again."""
    from specstack.calibration.curve import calibrate

    entries = {k: v for k, v in _entries(cache).items() if not k.startswith("curve-")}
    cache.write_text(json.dumps(entries))
    Held.made = 0
    monkeypatch.setattr(timing, "CpuWatch", Held)
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=CTX, n_threads=2), role="target")
    try:
        assert len(calibrate(model, n_max=4).curve) >= 4
        assert Held.made == timing.MEASURE_TRIES  # taken again while busy, bounded
        assert "busy" in _entries(cache)[_key(cache, "curve-")]
        monkeypatch.setattr(timing, "NOISE_LIMIT", math.inf)  # a quiet machine
        monkeypatch.setattr(timing, "_quiet", {})
        monkeypatch.setattr(curve, "_checked", set())
        calibrate(model, n_max=4)
        assert "busy" not in _entries(cache)[_key(cache, "curve-")]
    finally:
        model.close()
