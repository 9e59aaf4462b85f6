"""A whole llama.cpp tree with specstack's kernel edits in, for ``KERNELS=specstack scripts/build_llama_bins.sh``.

The bench runs llama.cpp's own binaries as peers; built once from the stock tree and once from this one, they say
which part of a gain is the kernels' and which the drafting's.  Why a module and not shell: the edits and their
digests live in ``kernel_edits``, and the bins must carry exactly the edits specstack's own library carries.

``prepare`` syncs rather than re-extracts: only files whose bytes change are written, so an edited C source
recompiles ggml-cpu alone instead of all of llama.cpp (a quarter of an hour on 2 cores).

    python3 -m specstack.llama.kernel_tree key VERSION       # the build's key: version, C sources, edit list
    python3 -m specstack.llama.kernel_tree prepare SDIST TREE  # TREE = the sdist's llama.cpp, with our edits

Stdlib and ``kernel_edits`` only: no llama_cpp, no build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from .kernel_edits import apply_edits, edits_digest, sources_digest

VENDORED = "vendor/llama.cpp/"  # where the llama-cpp-python sdist keeps llama.cpp


def bins_key(version: str) -> str:
    """What the specstack-kernel bins are built from: a change to any of it builds them again."""
    inputs = {"llama_cpp_python": version, "sources": sources_digest(), "edits": edits_digest()}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


def prepare(sdist: Path, tree: Path) -> list[str]:
    """Make ``tree`` the sdist's llama.cpp with specstack's edits applied; returns the paths written or removed.

    A fresh copy is edited in a scratch folder beside ``tree`` and synced in, so a tree edited by an older edit
    list (or by hand) ends up exactly as the current edits make it, and unchanged files keep their mtimes."""
    tree.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fresh-", dir=tree.parent) as tmp:
        fresh = extract_llama_cpp(sdist, Path(tmp))
        apply_edits(fresh)
        return sync_tree(fresh, tree)


def extract_llama_cpp(sdist: Path, dest: Path) -> Path:
    """All of the sdist's ``vendor/llama.cpp`` (the examples and tools the bins build need more than ggml)."""
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        prefix = f"{top}/{VENDORED}"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise ValueError(f"{sdist} holds no {VENDORED}")
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **kwargs)
    return dest / prefix


def sync_tree(src: Path, dst: Path) -> list[str]:
    """Make ``dst`` hold exactly ``src``'s files, writing only those that differ; returns what changed."""
    changed: list[str] = []
    wanted = {p.relative_to(src) for p in src.rglob("*") if p.is_file()}
    for rel in sorted(wanted):
        target = dst / rel
        if target.is_file() and not target.is_symlink() and _same_bytes(src / rel, target):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.is_dir():
            _remove(target)
        shutil.copy2(src / rel, target)
        changed.append(str(rel))
    if dst.is_dir():
        for path in sorted(dst.rglob("*"), reverse=True):  # children before their folders
            rel = path.relative_to(dst)
            if (path.is_file() or path.is_symlink()) and rel not in wanted:
                path.unlink()
                changed.append(f"removed {rel}")
            elif path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
                path.rmdir()
    return changed


def _same_bytes(a: Path, b: Path) -> bool:
    return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def main(argv: list[str] | None = None) -> int:
    """``key VERSION`` prints the key; ``prepare SDIST TREE`` syncs the edited tree and says what changed (stderr)."""
    ap = argparse.ArgumentParser(prog="python3 -m specstack.llama.kernel_tree", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("key").add_argument("version")
    prep = sub.add_parser("prepare")
    prep.add_argument("sdist", type=Path)
    prep.add_argument("tree", type=Path)
    args = ap.parse_args(argv)
    if args.command == "key":
        print(bins_key(args.version))
        return 0
    changed = prepare(args.sdist, args.tree)
    print(f"kernel_tree: {len(changed)} file(s) written or removed in {args.tree}", file=sys.stderr)
    for line in changed[:20]:
        print(f"  {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
