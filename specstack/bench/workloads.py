"""Benchmark workloads: JSONL files of requests, loaded and validated line by line.

One JSON object per line::

    {"prompt": "def f(x):\\n", "category": "complete", "max_tokens": 128, "id": "f", "group": "g1"}

``prompt``, ``category`` and ``max_tokens`` are required; ``id`` defaults to
``<file stem>:<line>``; requests sharing a ``group`` run in sequence, in file
order, on one engine per method (so cross-request drafter state, e.g. the
``suffix`` drafter's global tree, can learn from earlier outputs).  Blank lines
are skipped.  Bundled workloads live in ``specstack/data/workloads/`` (made by
``scripts/make_workloads.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..errors import SpecstackError
from ..paths import DATA_DIR

WORKLOADS_DIR = DATA_DIR / "workloads"
REQUIRED = ("prompt", "category", "max_tokens")
OPTIONAL = ("id", "group", "reference")


class WorkloadError(SpecstackError):
    """A workload file is missing or has a malformed line."""


@dataclass(frozen=True)
class Request:
    """One benchmark request.  ``line`` is its 1-based line number in the file."""

    id: str
    prompt: str
    category: str
    max_tokens: int
    group: str | None = None
    line: int = 0
    # The answer the request asks for, as an instruction-tuned model would write it (a grounded edit made as asked):
    # ``bench replay --reference`` drafts over it where the model at hand answers otherwise (a pretrained one).
    reference: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "category": self.category, "max_tokens": self.max_tokens}
        if self.group is not None:
            out["group"] = self.group
        out["prompt"] = self.prompt
        if self.reference is not None:
            out["reference"] = self.reference
        return out


@dataclass(frozen=True)
class Workload:
    name: str
    path: Path
    requests: tuple[Request, ...]

    def units(self) -> list[list[Request]]:
        """Requests in run order: each group is one unit (file order), each ungrouped request its own.

        Units are ordered by their first line, so a file reads top to bottom.
        """
        units: list[list[Request]] = []
        by_group: dict[str, list[Request]] = {}
        for r in self.requests:
            if r.group is None:
                units.append([r])
            elif r.group in by_group:
                by_group[r.group].append(r)
            else:
                by_group[r.group] = [r]
                units.append(by_group[r.group])
        return units

    @property
    def categories(self) -> list[str]:
        return list(dict.fromkeys(r.category for r in self.requests))

    def head(self, n: int) -> "Workload":
        """The first ``n`` requests (for quick runs)."""
        return Workload(self.name, self.path, self.requests[:n])


def bundled() -> list[str]:
    """Names of the bundled workloads."""
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.jsonl"))


def resolve(name_or_path: str | Path) -> Path:
    """A bundled workload name (``code-grounded``) or a path to a JSONL file."""
    p = Path(name_or_path).expanduser()
    if p.suffix == ".jsonl" or p.exists() or "/" in str(name_or_path):
        if not p.is_file():
            raise WorkloadError(f"workload file not found: {p}")
        return p
    bundled_path = WORKLOADS_DIR / f"{name_or_path}.jsonl"
    if not bundled_path.is_file():
        raise WorkloadError(
            f"unknown workload {str(name_or_path)!r}: give a .jsonl file or one of: {', '.join(bundled()) or '(none bundled)'}"
        )
    return bundled_path


def load(name_or_path: str | Path) -> Workload:
    """Load and validate a workload; any bad line raises WorkloadError naming file and line."""
    path = resolve(name_or_path)
    try:
        with open(path, encoding="utf-8") as f:
            requests = parse_lines(f, source=str(path), stem=path.stem)
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path}: not UTF-8 text (byte {exc.start}); a workload is JSON Lines, one request "
                            "per line") from None
    except OSError as exc:
        raise WorkloadError(f"cannot read workload {path}: {exc.strerror}") from None
    return Workload(path.stem, path, tuple(requests))


def parse_lines(lines: Iterable[str], source: str = "<workload>", stem: str = "request") -> list[Request]:
    """Parse JSONL lines into requests; errors read ``FILE:LINE: what is wrong``."""
    requests: list[Request] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        req = _parse_one(line, f"{source}:{lineno}", lineno, stem)
        if req.id in seen:
            raise WorkloadError(f"{source}:{lineno}: duplicate id {req.id!r} (first used on line {seen[req.id]})")
        seen[req.id] = lineno
        requests.append(req)
    if not requests:
        raise WorkloadError(f"{source}: the workload has no requests (expected one JSON object per line)")
    return requests


def _parse_one(line: str, where: str, lineno: int, stem: str) -> Request:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object with {', '.join(REQUIRED)}; got {type(obj).__name__}")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise WorkloadError(f"{where}: missing required field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    unknown = sorted(set(obj) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise WorkloadError(
            f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            f"(allowed: {', '.join(REQUIRED + OPTIONAL)})"
        )
    prompt, category, max_tokens = obj["prompt"], obj["category"], obj["max_tokens"]
    if not isinstance(prompt, str) or not prompt:
        raise WorkloadError(f"{where}: 'prompt' must be a non-empty string")
    if not isinstance(category, str) or not category.strip():
        raise WorkloadError(f"{where}: 'category' must be a non-empty string")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise WorkloadError(f"{where}: 'max_tokens' must be an integer >= 1 (got {max_tokens!r})")
    rid = obj.get("id", f"{stem}:{lineno}")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise WorkloadError(f"{where}: 'id' must be a non-empty string or an integer (got {rid!r})")
    group = obj.get("group")
    if group is not None and (isinstance(group, bool) or not isinstance(group, (str, int)) or group == ""):
        raise WorkloadError(f"{where}: 'group' must be a non-empty string or an integer (got {group!r})")
    reference = obj.get("reference")
    if reference is not None and (not isinstance(reference, str) or not reference):
        raise WorkloadError(f"{where}: 'reference' must be a non-empty string (the answer asked for)")
    return Request(
        id=str(rid),
        prompt=prompt,
        category=category.strip(),
        max_tokens=max_tokens,
        group=None if group is None else str(group),
        line=lineno,
        reference=reference,
    )
