"""``bench run --peer-kernels stock|specstack|both``: llama.cpp's own binaries on stock kernels and on specstack's.

Without building any binary: fake bin folders hold shell scripts that replay captured llama.cpp output and log their
argv, so what is checked is which folder each peer runs from, that the option reaches the runner from the CLI, and
that every record and row says which kernels it ran on.  The one test that runs the real specstack-kernel binaries
(``KERNELS=specstack scripts/build_llama_bins.sh``) is skipped, saying so, where they are not built.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from specstack.bench import peer_runs, peers, report, workloads
from specstack.bench.config import PEER_KERNELS, BenchConfig, peer_kernel_sets
from specstack.bench.peer_results import peer_rows
from specstack.bench.records import Tokenized
from specstack.cli import main
from specstack.errors import InvalidParameterError
from specstack.llama.kernel_tree import bins_key
from specstack.paths import DEFAULT_TARGET

FIXTURES = Path(__file__).parent / "fixtures" / "peers"
BUILD = "KERNELS=specstack scripts/build_llama_bins.sh"
# the binary each fake replays: its captured stderr and stdout
REPLAYS = {"llama-completion": ("completion-plain.stderr.txt", None),
           "llama-speculative-simple": ("speculative-simple-draft-simple-k4.stderr.txt",
                                        "speculative-simple-draft-simple-k4.stdout.txt"),
           "llama-lookup": ("lookup-k4.stderr.txt", None)}


def fake_bins(folder: Path, kernels: str, key: str | None = None) -> Path:
    """A bin folder as build_llama_bins.sh leaves it, its binaries replaying captured runs and logging their argv."""
    folder.mkdir(parents=True)
    for name, (stderr, stdout) in REPLAYS.items():
        out = f'cat "{FIXTURES / stdout}"' if stdout else "echo ' x'"
        script = folder / name
        script.write_text(f'#!/bin/sh\necho "$0 $*" >> "{folder}/calls"\ncat "{FIXTURES / stderr}" >&2\n{out}\n')
        script.chmod(0o755)
    (folder / "VERSION").write_text("0.3.36\ntargets: ...\n" + "\n".join(REPLAYS) + "\n")
    if kernels == "specstack":
        (folder / "KERNELS").write_text(f"specstack {key or bins_key('0.3.36')}\n")
    return folder


@pytest.fixture
def folders(tmp_path, monkeypatch) -> dict[str, Path]:
    """A stock and a specstack-kernel bin folder; the specstack one found as bench finds it (its variable)."""
    out = {"stock": fake_bins(tmp_path / "stock", "stock"), "specstack": fake_bins(tmp_path / "ours", "specstack")}
    monkeypatch.setenv(peers.SPECSTACK_BIN_DIR_ENV, str(out["specstack"]))
    monkeypatch.delenv(peers.BIN_DIR_ENV, raising=False)
    return out


def calls(folder: Path) -> list[str]:
    path = folder / "calls"
    return path.read_text().splitlines() if path.exists() else []


# -- resolving the folders -------------------------------------------------------------------------------------------
def test_choices_expand_stock_first():
    assert PEER_KERNELS == ("stock", "specstack", "both")
    assert [peer_kernel_sets(c) for c in (None, "stock", "specstack", "both")] == [
        ("stock",), ("stock",), ("specstack",), ("stock", "specstack")]
    with pytest.raises(InvalidParameterError, match="--peer-kernels must be one of"):
        BenchConfig(workload=workloads.load("code-grounded"), methods=[], ks=[4], peer_kernels="mine")


def test_each_kernel_set_resolves_to_its_own_folder(folders):
    assert peers.kernel_folders(("stock", "specstack"), folders["stock"]) == folders
    assert peers.bin_dir(folders["stock"]) == folders["stock"]  # stock, as before --peer-kernels
    assert peers.kernels_of(folders["stock"]) == "stock" and peers.kernels_of(folders["specstack"]) == "specstack"


def test_missing_specstack_bins_are_one_line_naming_the_build(tmp_path, monkeypatch):
    monkeypatch.setenv(peers.SPECSTACK_BIN_DIR_ENV, str(tmp_path / "none"))
    config = BenchConfig(workload=workloads.load("code-grounded"), methods=[], ks=[4], peer_kernels="specstack")
    target = SimpleNamespace(path=DEFAULT_TARGET, n_threads=1, n_ctx=512)
    with pytest.raises(peers.PeerError) as err:
        peer_runs.load_peers(config, target)  # before anything is measured
    said = str(err.value)
    assert "\n" not in said and BUILD in said and str(tmp_path / "none") in said


def test_a_folder_on_the_other_kernels_is_refused(folders, monkeypatch):
    with pytest.raises(peers.PeerError, match="on specstack kernels, not stock"):
        peers.bin_dir(folders["specstack"], "stock")  # --llama-cpp-bin at our bins would mislabel every row
    monkeypatch.setenv(peers.SPECSTACK_BIN_DIR_ENV, str(folders["stock"]))
    with pytest.raises(peers.PeerError, match="on stock kernels, not specstack"):
        peers.bin_dir(None, "specstack")


def test_specstack_bins_from_older_kernels_are_refused(tmp_path, monkeypatch):
    stale = fake_bins(tmp_path / "stale", "specstack", key="0" * 20)
    monkeypatch.setenv(peers.SPECSTACK_BIN_DIR_ENV, str(stale))
    with pytest.raises(peers.PeerError, match="older specstack kernels") as err:
        peers.bin_dir(None, "specstack")
    assert BUILD in str(err.value)


# -- the runner and the rows -----------------------------------------------------------------------------------------
def test_both_runs_each_peer_on_each_folder_and_labels_rows(folders):
    wl = workloads.load("code-grounded")
    config = BenchConfig(workload=wl, methods=["prompt-lookup"], ks=[4], llama_cpp_bin=folders["stock"],
                         peers=["llama-plain", "llama-ngram-mod"], peer_kernels="both")
    runner = peer_runs.load_peers(config, SimpleNamespace(path=DEFAULT_TARGET, n_threads=1, n_ctx=512))
    assert runner.folders == folders
    assert runner.configurations() == [("llama-plain", 0, "stock"), ("llama-plain", 0, "specstack"),
                                       ("llama-ngram-mod", 4, "stock"), ("llama-ngram-mod", 4, "specstack")]
    recs = runner.run_request(Tokenized(wl.requests[0], [1, 2], 7), 0.0, 0, "x")
    assert [(r["method"], r["kernels"]) for r in recs] == [(m, k) for m, _, k in runner.configurations()]
    assert not any(r.get("error") for r in recs), recs
    for kernels, folder in folders.items():  # each record's binary came from its own kernels' folder
        assert all(Path(r["command"][0]).parent == folder for r in recs if r["kernels"] == kernels)
        assert len(calls(folder)) == 2
    rows = peer_rows({"peers": recs, "runs": [], "config": {}})
    labels = {r["label"] for r in rows}
    assert labels == {"llama-plain [stock kernels]", "llama-plain [specstack kernels]",
                      "llama-ngram-mod [stock kernels]", "llama-ngram-mod [specstack kernels]"}
    ours = next(r for r in rows if r["label"] == "llama-ngram-mod [specstack kernels]")
    assert ours["vs_stock_kernels"] == pytest.approx(1.0)  # the same replayed output on both: no kernel gain


def test_records_from_before_the_option_read_as_stock():
    rec = {"request": "r", "method": "llama-plain", "k": 0, "temperature": 0.0, "tokens_per_second": 10.0,
           "n_tokens": 4}
    (row,) = peer_rows({"peers": [rec], "runs": [], "config": {}})
    assert row["kernels"] == "stock" and row["label"] == "llama-plain [stock kernels]"


def test_the_cli_option_reaches_the_runner_and_the_results(folders, tmp_path):
    """A real bench run on the bundled target, the peers faked: --peer-kernels both runs both folders, the JSON
    records which kernels each peer ran on, and the table labels each row and compares it with stock."""
    rows = [json.loads(line) for line in workloads.resolve("code-grounded").read_text().splitlines()[:1]]
    wl = tmp_path / "one.jsonl"
    wl.write_text("".join(json.dumps({**r, "max_tokens": 4}) + "\n" for r in rows))
    out = tmp_path / "out"
    code = main(["bench", "run", "--workload", str(wl), "--methods", "none", "-k", "4", "-t", "1", "--no-cost-curve",
                 "--no-warmup", "--no-plots", "-q", "--exact", "off", "--llama-cpp-bin", str(folders["stock"]),
                 "--peers", "llama-plain", "--peer-kernels", "both", "-o", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["peer_kernels"] == "both"
    assert [(p["method"], p["kernels"]) for p in results["peers"]] == [("llama-plain", "stock"),
                                                                      ("llama-plain", "specstack")]
    for kernels, folder in folders.items():
        (call,) = calls(folder)
        assert Path(shlex.split(call)[0]).parent == folder, kernels
    md = (out / "results.md").read_text()
    assert "| llama-plain [stock kernels] |" in md and "| llama-plain [specstack kernels] |" in md
    assert "vs stock kernels" in md


def test_a_bad_choice_is_refused_before_measuring(tmp_path, capsys):
    code = main(["bench", "run", "--workload", "code-grounded", "--peer-kernels", "mine", "-o", str(tmp_path / "o")])
    assert code == 2 and "--peer-kernels must be one of stock, specstack, both" in capsys.readouterr().err


def test_missing_specstack_bins_stop_the_cli_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(peers.SPECSTACK_BIN_DIR_ENV, str(tmp_path / "none"))
    code = main(["bench", "run", "--workload", "code-grounded", "--peer-kernels", "both", "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and BUILD in err and "loaded" not in err  # said before the model loads


# -- the real specstack-kernel binaries, where built ------------------------------------------------------------------
def _specstack_bins() -> Path | None:
    try:
        return peers.bin_dir(None, "specstack")
    except peers.PeerError:
        return None


@pytest.mark.skipif(_specstack_bins() is None,
                    reason=f"llama.cpp's binaries with specstack's kernels are not built (or stale): {BUILD}")
def test_specstack_kernel_binary_runs_and_says_so():
    res = peers.run_peer("llama-plain", DEFAULT_TARGET, "def fibonacci(n):\n", n_predict=16, threads=1,
                         kernels="specstack")
    assert res["kernels"] == "specstack" and res["n_predicted"] >= 16 and res["text"]
    assert Path(res["command"][0]).parent == _specstack_bins()


# -- the edited tree the specstack-kernel bins build from ------------------------------------------------------------
def test_sync_rewrites_only_what_differs(tmp_path):
    """A changed C source or edit must rebuild only what it touches: unchanged files keep their mtimes (cmake's
    incremental build), stale ones go."""
    from specstack.llama.kernel_tree import sync_tree

    src, dst = tmp_path / "fresh", tmp_path / "tree"
    for rel, text in {"a.c": "same", "sub/b.c": "new", "sub/c.h": "added"}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    for rel, text in {"a.c": "same", "sub/b.c": "old", "gone/d.c": "stale"}.items():
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        (dst / rel).write_text(text)
    before = (dst / "a.c").stat().st_mtime_ns
    changed = sync_tree(src, dst)
    assert sorted(changed) == ["removed gone/d.c", "sub/b.c", "sub/c.h"]
    assert {str(p.relative_to(dst)) for p in dst.rglob("*")} == {"a.c", "sub", "sub/b.c", "sub/c.h"}
    assert (dst / "sub/b.c").read_text() == "new" and (dst / "a.c").stat().st_mtime_ns == before
    assert sync_tree(src, dst) == []


def test_the_bins_key_follows_the_c_sources(monkeypatch):
    from specstack.llama import kernel_tree

    key = bins_key("0.3.36")
    assert key == bins_key("0.3.36") != bins_key("0.3.37")
    monkeypatch.setattr(kernel_tree, "sources_digest", lambda: {"specstack-verify.c": "changed"})
    assert bins_key("0.3.36") != key
