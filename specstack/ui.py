"""The one terminal layer: a progress display, a table formatter and byte sizes.

Every command that shows progress or prints a table goes through here, so a change to how
progress looks in a log file, or how columns line up, is made once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from typing import Self, TextIO

WIDTH = 100  # a TTY progress line is cut and padded to this, so a shorter one erases a longer


class Progress:
    """Progress of `total` units of work on stderr: label, done/total, elapsed and ETA.

    On a TTY the line is redrawn in place with `\\r`; anywhere else (a log file, a pipe) it prints
    a plain line at most every `interval` seconds plus the last one, so logs stay short.
    `total` may be a float when units are weights of expected work rather than counts.
    """

    def __init__(self, label: str, total: float, unit: str = "", stream: TextIO | None = None,
                 quiet: bool = False, interval: float = 5.0) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.quiet, self.interval = quiet, interval
        self.tty = isatty(self.stream)
        self.t0 = time.perf_counter()
        self._last = float("-inf")
        self._drawn = False

    def update(self, done: float, note: str = "") -> None:
        """Show that `done` of `total` units are finished (an absolute count, not an increment)."""
        if self.quiet:
            return
        now = time.perf_counter()
        if not self.tty and now - self._last < self.interval and done < self.total:
            return  # a log gets a line every few seconds, not thousands
        self._last = now
        line = self.line(done, now - self.t0, note)
        if self.tty:
            self.stream.write("\r" + line[:WIDTH].ljust(WIDTH))
            self._drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def line(self, done: float, elapsed: float, note: str = "") -> str:
        """The text of one update; split out so its format can be tested without a clock."""
        frac = min(done / self.total, 1.0) if self.total > 0 else 1.0
        eta = fmt_duration(elapsed * (1 - frac) / frac) if frac > 0 else "?"  # nothing done: no rate yet
        unit = f" {self.unit}" if self.unit else ""
        parts = [f"{self.label} {_num(done)}/{_num(self.total)}{unit} {100 * frac:3.0f}%",
                 f"{fmt_duration(elapsed)} elapsed, ETA {eta}"]
        return "  ".join(parts + ([note] if note else []))

    def close(self, summary: str = "") -> None:
        """Erase the TTY line, then print `summary` (if any) on a line of its own."""
        if self.quiet:
            return
        if self.tty and self._drawn:
            self.stream.write("\r" + " " * WIDTH + "\r")
        if summary:
            self.stream.write(summary + "\n")
        self.stream.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def isatty(stream: TextIO) -> bool:
    """Whether `stream` is a terminal; False for streams without isatty or already closed."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def fmt_duration(seconds: float) -> str:
    """`1m05s` or `2h03m`: short enough for a progress line, exact enough for an ETA."""
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str = "",
          sep: str = "  ", indent: str = "", rule: bool = False) -> str:
    """Columns padded to their widest cell, for a terminal.

    `align` has one `l` or `r` per column; a column without one is left-aligned if it is the
    first, right-aligned otherwise (labels, then numbers). An empty `header` prints the rows
    only; `rule` draws a dashed line under the header. Trailing spaces are stripped.
    """
    body = [[str(c) for c in r] for r in ([header] if header else []) + list(rows)]
    if not body:
        return ""
    ncol = max(len(r) for r in body)
    body = [r + [""] * (ncol - len(r)) for r in body]
    widths = [max(len(r[i]) for r in body) for i in range(ncol)]
    sides = [align[i] if i < len(align) else ("l" if i == 0 else "r") for i in range(ncol)]
    lines = [(indent + sep.join(c.rjust(w) if a == "r" else c.ljust(w)
                                for c, w, a in zip(r, widths, sides))).rstrip() for r in body]
    if header and rule:
        lines.insert(1, indent + "-" * (sum(widths) + len(sep) * (ncol - 1)))
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub Markdown table; cells are not padded, so a row can be found by plain text search."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt_bytes(n: int | None, missing: str = "-") -> str:
    """Binary units with one decimal (`1.5 GiB`), as memory and file sizes are reported."""
    if n is None:
        return missing
    for div, suf in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.1f} {suf}"
    return f"{n} B"
