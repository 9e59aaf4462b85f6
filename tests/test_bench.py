"""specstack bench: workloads validate, a tiny run writes every output, reports re-render, replay is exact."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from specstack.bench import replay, report, workloads
from specstack.bench.results import load_results
from specstack.bench.workloads import WorkloadError
from specstack.cli import main
from specstack.commands.bench import preprocess_argv
from specstack.draft_length import FixedK
from specstack.paths import MODELS_DIR
from specstack.types import Draft

BUNDLED = ("code-complete", "code-grounded", "repetitive")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- workloads -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_workloads_load_and_fit_the_context(target, name):
    wl = workloads.load(name)
    assert name in workloads.bundled()
    for r in wl.requests:
        n = len(target.tokenize(r.prompt))
        assert n <= 300, f"{r.id}: prompt has {n} tokens"
        assert n + r.max_tokens <= 512, f"{r.id}: prompt + max_tokens exceeds the 512-token context"
    if name == "repetitive":
        assert all(len(u) >= 12 for u in wl.units()), "each group should be a sequence of 12+ requests"
        assert all(r.group for r in wl.requests)
    else:
        assert 8 <= len(wl.requests) <= 12


def test_the_grounded_edit_workload_holds_third_party_functions_to_copy():
    wl = workloads.load("grounded-edit")
    assert "grounded-edit" in workloads.bundled() and len(wl.requests) == 6
    held_out = set((MODELS_DIR / "held_out.txt").read_text().split())
    for r in wl.requests:
        module, name, kind = r.id.split(":")
        assert kind == "edit" and r.category == "edit" and module.split(".")[0] not in ("os", "email", "json")
        assert f"def {name}(" in r.prompt and r.prompt.rstrip().endswith("```python")  # the answer starts the copy
        assert r.id.split(":")[0] not in held_out
        # The edit made as asked (``bench replay --reference``): the function again, as its prompt shows it but for
        # the edit (one task asks for what the function already does: its answer is the function itself).
        shown = r.prompt.split("```python\n")[1].split("```")[0]
        assert r.reference.endswith("```") and r.reference[:-3].count("\n") == shown.count("\n")
    assert sum(r.reference[:-3] not in r.prompt for r in wl.requests) == 5


def test_bundled_workloads_come_only_from_held_out_files():
    held_out = set((MODELS_DIR / "held_out.txt").read_text().split())
    for name in BUNDLED:
        for r in workloads.load(name).requests:
            assert r.id.split(":")[0] in held_out, f"{name}: {r.id} is not from a held-out file"


def test_groups_run_in_file_order_and_ungrouped_requests_alone():
    lines = [
        '{"prompt": "a", "category": "c", "max_tokens": 4, "group": "g"}',
        '{"prompt": "b", "category": "c", "max_tokens": 4}',
        "",
        '{"prompt": "c", "category": "d", "max_tokens": 4, "group": "g", "id": "third"}',
    ]
    reqs = workloads.parse_lines(lines, "w.jsonl", "w")
    wl = workloads.Workload("w", Path("w.jsonl"), tuple(reqs))
    assert [[r.id for r in u] for u in wl.units()] == [["w:1", "third"], ["w:2"]]
    assert wl.categories == ["c", "d"]


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"prompt": "x", "category": "c"}', "missing required field max_tokens"),
        ('{"prompt": "x", "category": "c", "max_tokens": 0}', "'max_tokens' must be an integer >= 1"),
        ('{"prompt": "x", "category": "c", "max_tokens": "16"}', "'max_tokens' must be an integer >= 1"),
        ('{"prompt": "", "category": "c", "max_tokens": 8}', "'prompt' must be a non-empty string"),
        ('{"prompt": "x", "category": "c", "max_tokens": 8, "max_token": 8}', "unknown field 'max_token'"),
        ('{"prompt": "x", "category": "c", "max_tokens": 8, "reference": 3}', "'reference' must be a non-empty string"),
        ('{"prompt": "x", "category": "c", "max_tokens": 8, "id": "first"}', "duplicate id 'first' (first used on line 1)"),
    ],
)
def test_bad_workload_line_names_file_line_and_problem(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "category": "c", "max_tokens": 8, "id": "first"}\n\n' + line + "\n")
    with pytest.raises(WorkloadError) as exc:
        workloads.load(path)
    assert f"{path}:3:" in str(exc.value) and message in str(exc.value)


def test_bad_workload_is_a_clear_cli_error(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "x", "category": "c", "max_tokens": -1}\n')
    code, out, err = run_cli(capsys, "bench", "run", "--workload", str(path))
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"{path}:1: 'max_tokens' must be an integer >= 1" in err


def test_unknown_method_is_refused_before_running(capsys, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "def f(x):\\n", "category": "c", "max_tokens": 4}\n')
    code, out, err = run_cli(capsys, "bench", "run", "--workload", str(path), "--methods", "none,nope", "-o", str(tmp_path / "o"))
    assert code == 2 and "unknown drafter 'nope'" in err and not (tmp_path / "o").exists()


def test_request_too_long_for_the_context_is_refused(capsys, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "x = 1\\n", "category": "c", "max_tokens": 600}\n')
    code, _, err = run_cli(capsys, "bench", "run", "--workload", str(path), "-o", str(tmp_path / "o"))
    assert code == 2 and f"{path}:1:" in err and "lower max_tokens" in err


def test_missing_matplotlib_is_reported_before_any_measurement(capsys, tmp_path, monkeypatch):
    import sys

    from specstack.commands import bench as bench_cmd

    def no_target(args):
        raise AssertionError("the target was loaded before the plotting check")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.setattr(bench_cmd, "target_from_args", no_target)
    code, out, err = run_cli(capsys, "bench", "run", "--workload", "code-grounded", "-o", str(tmp_path / "o"))
    assert code == 2 and "pip install matplotlib" in err and "--no-plots" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_bench_config_refuses_a_saved_suffix_tree_and_a_large_k_max():
    from specstack.bench.config import BenchConfig
    from specstack.errors import InvalidParameterError

    wl = workloads.load("code-grounded")
    with pytest.raises(InvalidParameterError, match="cache_path is not allowed"):
        BenchConfig(workload=wl, methods=["suffix"], ks=[4], drafter_options={"cache_path": "x.npz"})
    with pytest.raises(InvalidParameterError, match="k must be <= 62"):
        BenchConfig(workload=wl, methods=["suffix@cost"], ks=[4], k_max=100)
    config = BenchConfig(workload=wl, methods=["suffix", "suffix@cost"], ks=[2, 4], k_max=16)
    assert config.configurations() == [("none", 0), ("suffix", 2), ("suffix", 4), ("suffix@cost", 16)]
    assert BenchConfig(workload=wl, methods=["suffix@cost"], ks=[2, 8]).configurations()[1] == ("suffix@cost", 8)


def test_unknown_workload_lists_the_bundled_ones(capsys):
    code, _, err = run_cli(capsys, "bench", "run", "--workload", "nope")
    assert code == 2 and "unknown workload 'nope'" in err and "code-grounded" in err


def test_bench_without_subcommand_means_run():
    assert preprocess_argv(["bench", "--workload", "x"]) == ["bench", "run", "--workload", "x"]
    assert preprocess_argv(["bench", "report", "r.json"]) == ["bench", "report", "r.json"]
    assert preprocess_argv(["bench", "--help"]) == ["bench", "--help"]
    assert preprocess_argv(["generate", "-p", "x"]) == ["generate", "-p", "x"]


# -- a tiny live run ---------------------------------------------------------------------------


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """2 prompts x (plain, prompt-lookup k=2) x temperature (0, 0.7), 16 tokens each, through the CLI."""
    tmp = tmp_path_factory.mktemp("bench")
    rows = [json.loads(line) for line in workloads.resolve("code-grounded").read_text().splitlines()[:2]]
    rows[0]["reference"] = rows[0]["prompt"][-300:]  # an answer that copies the prompt's end (``replay --reference``)
    wl = tmp / "tiny.jsonl"
    wl.write_text("".join(json.dumps({**r, "max_tokens": 16}) + "\n" for r in rows))
    out = tmp / "out"
    argv = ["bench", "run", "--workload", str(wl), "--methods", "none,prompt-lookup", "--k", "2", "--temp", "0,0.7",
            "--cost-max-n", "4", "--cost-reps", "1", "-o", str(out), "-q", "--exact", "on"]
    if not _has_matplotlib():
        argv.append("--no-plots")
    code = main(argv)
    return code, out


def test_tiny_run_writes_json_csv_markdown_and_plots(tiny_run):
    code, out = tiny_run
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in results["runs"]} == {"none", "prompt-lookup"}
    assert len(results["runs"]) == 8 and not results["mismatches"]
    greedy = [r for r in results["runs"] if r["temperature"] == 0]
    assert all(r["identical"] for r in greedy if r["method"] != "none")
    sampled = [r for r in results["runs"] if r["temperature"] > 0]
    assert all(r["identical"] is None for r in sampled)
    for req in {r["request"] for r in sampled}:  # one fixed seed per request, shared by every method
        assert len({r["seed"] for r in sampled if r["request"] == req}) == 1
    assert all(r["output_ids"] and r["stats"]["steps"] for r in results["runs"])
    assert all(q["prompt_ids"] for q in results["workload"]["requests"])
    assert results["cost_curve"]["n"] == [1, 2, 3, 4]
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("method,k,temperature,category") and len(csv_lines) == 5
    md = (out / "results.md").read_text()
    assert "| prompt-lookup | 2 | 0 |" in md and "| prompt-lookup | 2 | 0.7 |" in md
    assert "All 2 speculative outputs at temperature 0 are identical to plain decoding" in md
    assert "On this curve: a verification of 2 rows" in md and "4 rows" in md  # which build suits it (doctor's)
    if not _has_matplotlib():
        pytest.skip("matplotlib is not installed: the PNG plots were skipped")
    for png in ("tokps_vs_k.png", "acceptance_by_position.png", "cost_curve.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_rerenders_the_same_markdown(capsys, tiny_run, tmp_path):
    _, out = tiny_run
    capsys.readouterr()
    argv = ["bench", "report", str(out / "results.json"), "-o", str(tmp_path)]
    code, stdout, _ = run_cli(capsys, *argv, *([] if _has_matplotlib() else ["--no-plots"]))
    assert code == 0
    assert stdout == (out / "results.md").read_text() == (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.csv").read_text() == (out / "results.csv").read_text()


def test_mismatch_is_reported_in_the_tables(tiny_run):
    _, out = tiny_run
    results = json.loads((out / "results.json").read_text())
    bad = copy.deepcopy(results)
    run = next(r for r in bad["runs"] if r["method"] == "prompt-lookup" and r["temperature"] == 0)
    run["identical"] = False
    bad["mismatches"].append({"message": "MISMATCH: prompt-lookup k=2 on request x"})
    md = report.render_markdown(bad)
    assert "**1/2 MISMATCH**" in md and "differ from plain decoding: a bug" in md


def test_replay_equals_live_acceptance_for_prompt_lookup(tiny_run):
    _, out = tiny_run
    results = load_results(out / "results.json")
    live = {r["request"]: r["stats"] for r in results["runs"] if r["method"] == "prompt-lookup" and r["temperature"] == 0}
    got = replay.replay(results, ["prompt-lookup"], [2])
    drafted = [r for r in got["requests"] if r["method"] == "prompt-lookup"]
    assert len(drafted) == 2 and len(got["requests"]) == 4  # plain decoding is replayed too: the speedup's base
    for r in drafted:
        assert (r["n_drafted"], r["n_accepted"]) == (live[r["request"]]["n_drafted"], live[r["request"]]["n_accepted"])
        assert r["steps"] == live[r["request"]]["steps"]
    assert sum(r["n_accepted"] for r in drafted) > 0, "nothing accepted: equality would prove nothing"
    rows = [row for row in got["rows"] if row["method"] == "prompt-lookup"]
    assert rows and all(row["same_as_live"] for row in rows)
    for row in got["rows"]:  # priced by the run's cost curve, beside the live run's rate
        assert row["est_tokens_per_second"] > 0 and row["live_tokens_per_second"] > 0
    plain = next(row for row in got["rows"] if row["method"] == "none")
    assert plain["est_speedup"] == 1.0 and plain["same_as_live"] is None
    assert plain["lowest_speedup"] is None and plain["requests_below"] is None
    # Per request: the lowest of each request's speedup over its own replayed plain decoding, and the count below
    # the floor, so an aggregate cannot hide a prompt the drafter slows down.
    base = {r["request"]: r["decode_s"] for r in got["requests"] if r["method"] == "none"}
    each = {r["request"]: base[r["request"]] / r["decode_s"] for r in drafted}
    row = next(row for row in rows if row["category"] == "all")
    assert row["lowest_speedup"] == pytest.approx(min(each.values()))
    assert row["lowest_request"] == min(each, key=each.get)
    assert row["requests_below"] == sum(x < replay.LOSS_BELOW for x in each.values())


def test_replay_over_reference_answers(capsys, tiny_run):
    """``--reference``: the requests with a reference answer, replayed over it instead of what the model wrote."""
    _, out = tiny_run
    results = load_results(out / "results.json")
    first, second = results["workload"]["requests"]
    assert first["reference_ids"] and "reference_ids" not in second  # tokenized by the run that had the model
    got = replay.replay(results, ["prompt-lookup"], [2], reference=True)
    assert {r["request"] for r in got["requests"]} == {first["id"]}
    plain = next(r for r in got["requests"] if r["method"] == "none")
    drafted = next(r for r in got["requests"] if r["method"] == "prompt-lookup")
    assert plain["n_tokens"] == drafted["n_tokens"] == len(first["reference_ids"]) != 16
    assert drafted["n_accepted"] > 0  # the reference copies the prompt: prompt lookup drafts it
    code, stdout, _ = run_cli(capsys, "bench", "replay", str(out / "results.json"), "--methods", "prompt-lookup",
                              "--reference")
    assert code == 0 and "| prompt-lookup | 2 | all |" in stdout
    from specstack.errors import InvalidParameterError

    del first["reference_ids"]
    with pytest.raises(InvalidParameterError, match="no request in these results has a reference answer"):
        replay.replay(results, ["prompt-lookup"], [2], reference=True)


def test_replay_cli_prints_a_table(capsys, tiny_run):
    _, out = tiny_run
    code, stdout, _ = run_cli(capsys, "bench", "replay", str(out / "results.json"), "--methods", "prompt-lookup,suffix")
    assert code == 0
    assert "| prompt-lookup | 2 | all |" in stdout and "| suffix | 2 | all |" in stdout and "| yes |" in stdout
    assert "| none | - | all |" in stdout and "est. tok/s" in stdout and "live tok/s" in stdout
    assert "lowest request" in stdout and "below 0.97x" in stdout


# -- replay on a recorded target: the engine's own loop over literal tokens ---------------------------


class _Scripted:
    """Proposes a fixed list of drafts in order (chains, or trees given as (tokens, parents)); records what it saw."""

    name = "scripted"

    def __init__(self, drafts):
        self.drafts, self.observed, self.ks = list(drafts), [], []

    def begin(self, prompt_ids, seq=0):
        pass

    def propose(self, requests):
        self.ks.extend(r.budget.max_tokens for r in requests)
        out = []
        for _ in requests:
            d = self.drafts.pop(0) if self.drafts else []
            tokens, parents = d if isinstance(d, tuple) else (d, None)
            out.append(Draft(tuple(tokens), self.name, parents=None if parents is None else tuple(parents)))
        return out

    def advance(self, new_ids, n_accepted, seq=0):
        self.observed.append((list(new_ids), n_accepted))

    def end(self, seq=0, complete=True):
        pass


CURVE = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # t(n) = n seconds: a priced call's seconds are its rows


def _recorded(shapes=None, **kw):
    from specstack.bench.recorded import Recording, RecordedTarget, pricing_model
    from specstack.llama.batching import BatchShapes

    return RecordedTarget([Recording((1, 2), (4, 5, 6, 7, 8, 9))], n_vocab=16, n_ctx=64,
                          shapes=shapes or BatchShapes(min_rows=2, settled=True), costs=pricing_model(CURVE), **kw)


def _replayed(target, drafter, k=3, prompt=(1, 2), max_tokens=6):
    from specstack.engine import Engine
    from specstack.generation import GenerationConfig

    return Engine(target, drafter, clock=target.clock).generate(list(prompt), GenerationConfig(max_tokens=max_tokens),
                                                                policy=FixedK(k)).run()


def test_replay_runs_the_engine_loop_and_prices_its_calls():
    # Output [4, 5, 6, 7, 8, 9]: the first token comes from the engine's plain step (one row, padded to
    # min_rows 2); then draft [5, 6, 1] keeps 5, 6 and the target's 7 (4 rows); then [8, 9] is cut by the
    # engine to k = min(3, tokens left - 1) = 1, so only 8 is verified (2 rows) and 9 is the target's.
    d = _Scripted([[5, 6, 1], [8, 9]])
    target = _recorded()
    gen = _replayed(target, d)
    s = gen.stats
    assert gen.output_ids == [4, 5, 6, 7, 8, 9]
    assert d.observed == [([4], 0), ([5, 6, 7], 2), ([8, 9], 1)]
    assert d.ks == [3, 1]
    assert (s.n_steps, s.n_drafted, s.n_accepted, s.n_tokens) == (3, 4, 3, 6)
    assert s.steps == [("scripted", 0, 0), ("scripted", 3, 2), ("scripted", 1, 1)]
    assert target.call_rows == [2, 2, 4, 2]  # the prefill of [1] (padded), then the three steps
    # The engine's clock saw each call at its price: verification t(2) + t(4) + t(2) = 8 s; the prefill's t(2)
    # is prompt time, outside decode time.
    assert s.verify_s == pytest.approx(8.0, abs=0.05) and s.decode_s == pytest.approx(8.0, abs=0.05)
    assert s.prefill_s == pytest.approx(2.0, abs=0.05)


def test_recorded_calls_are_split_and_padded_as_the_target_would():
    import dataclasses

    from specstack.llama.batching import BatchShapes

    # Exact shapes that split at 3 rows: a 5-row verification is two calls, 3 + 2 rows.
    target = _recorded(BatchShapes(min_rows=2, max_rows=3, settled=True))
    _replayed(target, _Scripted([[5, 6, 7, 8]]), k=4)
    assert target.call_rows[:3] == [2, 2, 3] and target.call_rows[3] == 2
    # Without exactness, calls are padded to the cheapest size on the curve (pad_to): 3 rows run as 4.
    loose = dataclasses.replace(BatchShapes(min_rows=1, settled=True, exact=False), pad_to=(1, 2, 4, 4, 8, 8, 8, 8))
    target = _recorded(loose)
    gen = _replayed(target, _Scripted([[5, 1]]), k=2)
    assert target.call_rows[:3] == [1, 1, 4] and gen.stats.steps[1] == ("scripted", 2, 1)


def test_recorded_tree_follows_the_recorded_branch():
    from specstack.llama.batching import BatchShapes

    # Branches [5, 6] and [5, 9] and [3]: the target follows 5 then 6 (its recorded tokens), rejects the rest.
    shapes = BatchShapes(min_rows=1, settled=True, tree_exact=True)
    target = _recorded(shapes, n_seq_max=4)
    d = _Scripted([([3, 5, 6, 9], [-1, -1, 1, 1])])
    gen = _replayed(target, d, k=4)
    assert gen.output_ids == [4, 5, 6, 7, 8, 9]
    assert gen.stats.n_tree_steps == 1 and gen.stats.steps[1] == ("scripted", 4, 2)
    assert target.tree_relayouts == 1  # 5, 6 were not the first branch: decoded again as a chain, one more call
    assert target.call_rows[2:4] == [5, 3]


def test_recorded_target_refuses_a_context_it_has_no_recording_for():
    from specstack.bench.recorded import RecordingError

    with pytest.raises(RecordingError, match="no recording holds this context"):
        _replayed(_recorded(), _Scripted([]), prompt=(1, 3))


def test_replay_reproduces_the_live_engine_step_by_step(target):
    """For fixed k, the recorded target gives the engine exactly what the live target gave: every step drafts and
    accepts as live did, for a lookup, a retrieval and a model drafter."""
    from specstack.bench.recorded import Recording, RecordedTarget
    from specstack.drafters import BuildContext, create
    from specstack.engine import Engine
    from specstack.generation import GenerationConfig

    rows = [json.loads(line) for line in workloads.resolve("code-grounded").read_text().splitlines()[:2]]
    prompts = [target.tokenize(r["prompt"]) for r in rows]
    configs = [("none", 1), ("prompt-lookup", 3), ("suffix", 4), ("draft-model", 2)]

    def run(tgt, clock=None):
        got = {}
        for method, k in configs:
            drafter = create(method, BuildContext(target=tgt, options={}, temperature=0.0))
            engine = Engine(tgt, drafter, **({"clock": clock} if clock else {}))
            for i, p in enumerate(prompts):
                g = engine.generate(p, GenerationConfig(max_tokens=32), policy=FixedK(k)).run()
                got[(method, i)] = (g.output_ids, g.stats.steps)
        return got

    live = run(target)
    recorded = RecordedTarget([Recording(tuple(p), tuple(live[("none", i)][0])) for i, p in enumerate(prompts)],
                              n_vocab=target.n_vocab, n_ctx=target.n_ctx, shapes=target.shapes, path=target.path,
                              n_threads=target.n_threads)
    replayed = run(recorded, recorded.clock)
    assert replayed == live
    for method, _k in configs[1:]:
        assert sum(a for i in range(2) for _s, _d, a in live[(method, i)][1]) > 0, f"{method} accepted nothing"


def test_replay_group_state_carries_over_to_the_next_request():
    # Two requests with the same output: in one group, the suffix drafter's global tree has seen the
    # first output when the second runs, so the second accepts more than when replayed alone.
    prompt, output = list(range(100, 110)), [7, 3, 9, 4, 11, 5, 8, 2, 12, 6, 13, 1]

    def results(groups):
        reqs = [{"id": f"r{i}", "category": "c", "max_tokens": 12, "prompt_ids": prompt, "prompt": "", "group": g}
                for i, g in enumerate(groups)]
        runs = [{"request": f"r{i}", "category": "c", "method": "none", "k": 0, "temperature": 0.0, "repeat": 0,
                 "output_ids": output, "stats": {}} for i in range(2)]
        cfg = {"ks": [4], "drafter_options": {}, "target": {"path": "/nonexistent.gguf", "n_ctx": 512,
                                                             "threads": 1, "n_vocab": 4096, "capacity": 511}}
        return {"config": cfg, "runs": runs, "workload": {"name": "t", "requests": reqs}}

    def second(groups):
        out = replay.replay(results(groups), ["suffix"], [4])
        return next(r for r in out["requests"] if r["request"] == "r1" and r["method"] == "suffix")["n_accepted"]

    assert second(["g", "g"]) > second([None, None]) == 0


# -- llama.cpp peers (no binaries: run_peer is replaced) ------------------------------------------


def test_peers_run_beside_each_request_and_render(tiny_run, monkeypatch, tmp_path):
    from types import SimpleNamespace

    from specstack.bench import peer_runs
    from specstack.bench import peers as peers_module
    from specstack.bench.config import BenchConfig
    from specstack.bench.records import Tokenized

    calls = []

    def fake_run_peer(method, model, prompt, *, draft=None, n_predict=128, threads=2, k=4, ctx=512, seed=1, bins=None,
                      kernels="stock"):
        calls.append((method, k, n_predict, threads))
        drafted = 0 if method == "llama-plain" else 10
        return {"tok_per_s": 100.0 if method == "llama-plain" else 250.0, "n_predicted": n_predict,
                "n_drafted": drafted, "n_accepted": drafted // 2, "acceptance": 0.5 if drafted else None,
                "text": "x" + " [end of text]", "command": ["fake", method], "k": k}

    monkeypatch.setattr(peers_module, "run_peer", fake_run_peer)
    _, out = tiny_run
    results = load_results(out / "results.json")
    wl = workloads.load(results["workload"]["path"])
    config = BenchConfig(workload=wl, methods=["prompt-lookup", "draft-model"], ks=[2, 4],
                         llama_cpp_bin=tmp_path, drafter_options={"draft_model": "d.gguf"})
    assert peer_runs.peer_methods(config, peers_module.PEER_METHODS) == [
        "llama-plain", "llama-ngram-simple", "llama-lookup", "llama-draft-simple"]
    target = SimpleNamespace(path=Path("t.gguf"), n_threads=2, n_ctx=512)
    peers = peer_runs.PeerRunner(peers_module, config, target)
    tok = Tokenized(wl.requests[0], [1, 2], 7)
    recs = peers.run_request(tok, 0.0, 0, "x\n")
    assert calls[0] == ("llama-plain", 1, 16, 2) and len(recs) == 1 + 3 * 2
    assert all(r["same_text_as_plain"] for r in recs)
    assert peers.run_request(tok, 0.7, 0, "x") == []  # the peer binaries run greedy only
    results["peers"] = recs
    md = report.render_markdown(results)
    assert "## llama.cpp peers" in md and "| llama-lookup [stock kernels] | 4 | 0 | 250.0 | 2.50x |" in md
    assert "vs stock kernels" not in md  # a column only where specstack's kernels ran too (--peer-kernels)


def test_sequence_curves_give_each_grouped_request_its_speedup_in_order():
    from specstack.bench.results import sequence_curves

    def run(method, k, req, decode_s, drafted=0, accepted=0):
        return {"method": method, "k": k, "temperature": 0.0, "request": req, "category": "c",
                "stats": {"n_tokens": 10, "decode_s": decode_s, "n_drafted": drafted, "n_accepted": accepted}}

    results = {
        "workload": {"requests": [{"id": "r0", "group": "g"}, {"id": "r1", "group": "g"}, {"id": "alone"}]},
        "runs": [run("none", 0, "r0", 0.01), run("none", 0, "r1", 0.01), run("none", 0, "alone", 0.01),
                 run("suffix", 4, "r0", 0.005, 8, 4), run("suffix", 4, "r1", 0.0025, 8, 8),
                 run("suffix", 4, "alone", 0.001, 8, 8)],
    }
    [curve] = sequence_curves(results)
    assert curve["group"] == "g" and (curve["method"], curve["k"]) == ("suffix", 4)
    assert curve["speedups"] == [2.0, 4.0] and curve["acceptance"] == [0.5, 1.0]
    assert curve["last_quarter"] == 4.0


def test_a_per_request_floor_is_read_from_ratios_paired_within_each_repeat():
    """The machine's speed swings between repeats (plain 0.01 s, then 0.02 s, then 0.01 s), and one repeat of
    request a ran its method in a fast moment (4x): each repeat's ratio is taken against plain decoding in that
    repeat, and the median of those pairs is 0.90x; the report names a as the lowest request."""
    from specstack.bench.results import paired_speedups

    def run(method, req, rep, decode_s, drafted=0, accepted=0):
        return {"method": method, "k": 4, "temperature": 0.0, "request": req, "category": "c", "repeat": rep,
                "stats": {"n_tokens": 9, "decode_s": decode_s, "n_drafted": drafted, "n_accepted": accepted}}

    plain = [0.01, 0.02, 0.01]
    runs = [run("none", req, rep, t) for req in ("a", "b") for rep, t in enumerate(plain)]
    runs += [run("suffix", "a", rep, t / 0.9 if rep != 1 else 0.005, 4, 2) for rep, t in enumerate(plain)]
    runs += [run("suffix", "b", rep, t / 1.5, 4, 4) for rep, t in enumerate(plain)]
    results = {"workload": {"requests": [{"id": "a", "category": "c"}, {"id": "b", "category": "c"}]}, "runs": runs}
    paired = paired_speedups(results)[("suffix", 4, 0.0)]
    assert paired["a"][0] == pytest.approx(0.9) and paired["a"][1:] == (6, 12)
    assert paired["b"][0] == pytest.approx(1.5)
    md = "\n".join(report._per_request(results))
    assert "| a | 0.90x (6/12) |" in md and "| b | 1.50x (12/12) |" in md and "| **lowest** | **0.90x** (a) |" in md


# -- demo: a preset of the runner ------------------------------------------------------------------


def test_demo_prints_one_row_per_method_from_the_runner(capsys):
    code, out, err = run_cli(capsys, "demo", "--prompts", "1", "-n", "8", "--exact", "on")  # identity is asserted
    lines = out.splitlines()
    assert lines[-1].startswith("exact shapes: on (--exact on)")
    assert code == 0 and lines[0].split() == ["method", "tok/s", "speedup", "accept", "mean", "len", "identical"]
    rows = {line.split()[0]: line.split() for line in lines[2:7]}
    assert list(rows) == ["none", "prompt-lookup", "prompt-lookup+cost", "draft-model", "draft-model+cost"]
    assert rows["none"][2] == "1.00x" and rows["none"][-1] == "-"
    assert all(r[-1] == "1/1" for m, r in rows.items() if m != "none")  # greedy: identical to plain
    assert "MISMATCH" not in err


def test_greedy_mismatches_fail_the_run_only_in_exact_mode():
    """Under --exact off (or auto choosing off) calls run unpadded and unsplit, so near-ties may flip by
    design: a note and exit 0, not "lossless speculation is broken" and exit 1."""
    from specstack.commands.bench import mismatch_outcome
    from specstack.llama import INEXACT, BatchShapes

    assert mismatch_outcome(0, BatchShapes()) == ("", 0)
    message, code = mismatch_outcome(2, BatchShapes(settled=True, why="--exact on"))
    assert code == 1 and "lossless speculation is broken" in message
    message, code = mismatch_outcome(2, INEXACT)
    assert code == 0 and "expected with exact shapes off (--exact off)" in message
