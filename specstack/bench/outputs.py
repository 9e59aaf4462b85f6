"""Checking where a bench or tune run will write, before it measures anything.

A sweep takes minutes; finding only at its end that ``-o`` names a folder, a path under a file, or a file
nobody may write (``/proc/version``) loses all of it.  So each output is tried for real up front: the folder
is created and a scratch file written in it, an existing file is opened for appending (which changes nothing).
Permission bits alone cannot tell: as root every mode allows writing, yet /proc refuses it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import InvalidParameterError


def check_output_file(path: Path, flag: str = "-o") -> None:
    """Refuse ``path`` unless a file can be written there; creates missing parent folders (as ``bench -o`` does)."""
    path = Path(path)
    if path.is_dir():
        raise InvalidParameterError(f"{flag} {path} is a folder; give a file name, e.g. {flag} {path / 'specstack-profile.toml'}")
    _make_folder(path.parent, flag, path)
    if path.exists():
        _try(lambda: open(path, "ab").close(), flag, path, "cannot be written")
    else:
        _probe(path.parent, flag, path)


def check_output_dir(path: Path, flag: str = "-o") -> None:
    """Refuse ``path`` unless it is, or can be made, a folder that files can be written to (creates it)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InvalidParameterError(f"{flag} {path} is a file, not a folder; give a folder to write the results to "
                                    "(it is created if missing)")
    _make_folder(path, flag, path)
    _probe(path, flag, path)


def _make_folder(folder: Path, flag: str, given: Path) -> None:
    """Create ``folder`` and its parents, naming the part of the path that is in the way when that fails."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise InvalidParameterError(f"{flag} {given}: {blocker} is a file, so nothing can be written under it; "
                                    "choose another path")
    _try(lambda: folder.mkdir(parents=True, exist_ok=True), flag, given, f"its folder {folder} cannot be created")


def _probe(folder: Path, flag: str, given: Path) -> None:
    """Write and remove a scratch file in ``folder``: the one test that a later write will succeed."""
    def touch() -> None:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".specstack-write-check-")
        os.close(fd)
        os.unlink(name)

    _try(touch, flag, given, f"nothing can be written in {folder}")


def _try(action: Callable[[], object], flag: str, given: Path, what: str) -> None:
    try:
        action()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InvalidParameterError(f"{flag} {given}: {what} ({reason}); choose a path you can write to") from None
