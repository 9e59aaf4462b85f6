"""specstack.ui: the one progress display, table formatter and byte-size format."""

from __future__ import annotations

import io

import pytest

from specstack import ui


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_in_a_log_prints_the_first_and_last_update_and_throttles_the_rest():
    out = io.StringIO()
    bar = ui.Progress("scan", 5, unit="files", stream=out, interval=3600)
    for i in range(1, 6):
        bar.update(i, f"f{i}")
    bar.close("done: 5 files")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue()
    assert lines[0].startswith("scan 1/5 files  20%") and lines[0].endswith("f1")
    assert lines[1].startswith("scan 5/5 files 100%") and lines[1].endswith("f5")
    assert lines[2] == "done: 5 files"


def test_progress_on_a_terminal_redraws_one_line_and_erases_it():
    out = _Tty()
    with ui.Progress("bench", 10, stream=out) as bar:
        bar.update(2)
        bar.update(4, "x" * 500)
    text = out.getvalue()
    assert text.count("\r") == 4 and "\n" not in text  # two draws, then an erase (out and back)
    assert all(len(seg) <= ui.WIDTH for seg in text.split("\r"))
    assert text.endswith("\r" + " " * ui.WIDTH + "\r")


def test_quiet_progress_prints_nothing():
    out = _Tty()
    bar = ui.Progress("x", 3, stream=out, quiet=True)
    bar.update(1)
    bar.close("summary")
    assert out.getvalue() == ""


def test_progress_line_shows_fraction_elapsed_and_eta():
    bar = ui.Progress("tune held-out", 200.0, unit="tokens", stream=io.StringIO())
    assert bar.line(50, 30.0, "req 1") == "tune held-out 50/200 tokens  25%  0m30s elapsed, ETA 1m30s  req 1"
    assert bar.line(0, 5.0) == "tune held-out 0/200 tokens   0%  0m05s elapsed, ETA ?"
    assert ui.Progress("w", 3.0, stream=io.StringIO()).line(1.5, 0.0).startswith("w 1.5/3  50%")


@pytest.mark.parametrize("seconds,text", [(0, "0m00s"), (65.4, "1m05s"), (3599.6, "1h00m"), (7380, "2h03m")])
def test_durations(seconds, text):
    assert ui.fmt_duration(seconds) == text


def test_table_aligns_labels_left_and_numbers_right():
    text = ui.table(["method", "tok/s", "ok"], [["none", "1285.7", "6/6"], ["prompt-lookup+cost", "21.4", "-"]], rule=True)
    assert text.splitlines() == [
        "method               tok/s   ok",
        "-------------------------------",
        "none                1285.7  6/6",
        "prompt-lookup+cost    21.4    -",
    ]


def test_table_with_explicit_alignment_indent_and_no_header():
    text = ui.table([], [["a", "1", "long value"], ["bbb", "22", "v"]], align="lrl", indent="  ")
    assert text.splitlines() == ["  a     1  long value", "  bbb  22  v"]  # trailing spaces stripped
    assert ui.table([], []) == ""


def test_table_pads_short_rows():
    assert ui.table(["a", "b"], [["x"]], align="ll").splitlines() == ["a  b", "x"]


def test_markdown_table_is_unpadded():
    assert ui.markdown_table(["m", "k"], [["none", 0], ["suffix", 4]]) == "| m | k |\n|---|---|\n| none | 0 |\n| suffix | 4 |"


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (11_600_000, "11.1 MiB"),
                                    (3 * 2**30, "3.0 GiB"), (2**41, "2.0 TiB"), (None, "-")])
def test_fmt_bytes(n, text):
    assert ui.fmt_bytes(n) == text


def test_fmt_bytes_missing_marker():
    assert ui.fmt_bytes(None, missing="?") == "?"
