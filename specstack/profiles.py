"""Profiles: the best speculation settings per content type, written by ``specstack tune``.

A profile is a small TOML file: a ``[default]`` table and one
``[category.NAME]`` table per content type, each with ``drafter``,
``k_policy`` and ``k``.  ``specstack generate --profile FILE [--category C]``
applies it; flags given explicitly on the command line still win.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from .errors import InvalidParameterError

SETTINGS = ("drafter", "k_policy", "k")


def write_profile(path: Path, best: dict[str, dict[str, Any]], default: dict[str, Any], header: str) -> None:
    lines = [f"# {line}" for line in header.splitlines()]
    lines += ["", "[default]", *_table(default)]
    for category, settings in best.items():
        lines += ["", f"[category.{_string(category)}]", *_table(settings)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _string(value: str) -> str:
    """A TOML basic string.  JSON's escapes of quotes, backslashes and control characters are valid
    TOML; other characters stay literal (TOML has no surrogate-pair escapes), except DEL, which
    TOML forbids unescaped."""
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def _table(settings: dict[str, Any]) -> list[str]:
    out = []
    for key, value in settings.items():
        plain = isinstance(value, (int, float)) and not isinstance(value, bool)
        out.append(f"{key} = {value!r}" if plain else f"{key} = {_string(value)}")
    return out


def read_toml(path: Path, what: str, fix: str) -> dict[str, Any]:
    """A TOML file's tables; a missing or malformed file is an error that names it and ``fix``."""
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidParameterError(f"cannot read {what} {path}: {exc.strerror}; {fix}") from None
    except UnicodeDecodeError as exc:
        raise InvalidParameterError(f"{what} {path} is not UTF-8 text (byte {exc.start}; a binary file?); {fix}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidParameterError(f"{what} {path} is not valid TOML ({exc}); {fix}") from None


def load_profile(path: Path, category: str | None = None) -> dict[str, Any]:
    """Settings for ``category`` (falling back to [default]) from a profile file; each checked for its type."""
    data = read_toml(path, "profile", f"write one with `specstack tune -o {path}`")
    layout = "settings go in a [default] table or [category.NAME] tables, as `specstack tune` writes them"
    stray = set(data) - {"default", "category"}
    if stray:
        raise InvalidParameterError(f"profile {path} has unknown top-level keys {', '.join(sorted(stray))}; {layout}")
    cats = data.get("category", {})
    if not isinstance(data.get("default", {}), dict) or not isinstance(cats, dict):
        raise InvalidParameterError(f"profile {path}: default and category must be tables; {layout}")
    settings = dict(data.get("default", {}))
    if category is not None:
        if category not in cats or not isinstance(cats[category], dict):
            known = ", ".join(cats) or "none"
            raise InvalidParameterError(f"profile {path} has no category {category!r} (it has: {known})")
        settings.update(cats[category])
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise InvalidParameterError(f"profile {path} has unknown settings: {', '.join(sorted(unknown))} "
                                    f"(known: {', '.join(SETTINGS)})")
    for key, value in settings.items():
        ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 1) if key == "k" else isinstance(value, str)
        if not ok:
            want = "an integer of at least 1" if key == "k" else "a string"
            raise InvalidParameterError(f"profile {path}: {key} must be {want} (got {value!r})")
    return settings
