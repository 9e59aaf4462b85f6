"""Issue 29, items 13-15 and 20-22: outputs checked before measuring, damaged datastores and cost caches
named and repaired, measurements reused where they still hold and not cached when the machine was busy,
and bench's cost-curve phase shown and described as measured."""

from __future__ import annotations

import json
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


def test_tune_creates_a_missing_folder_for_its_profile(tmp_path, capsys):
    out = tmp_path / "new" / "p.toml"
    code, _, _ = run_cli(capsys, *TUNE, "-o", str(out))
    assert code == 0 and out.is_file()


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
