"""The edits that put specstack's verification kernels into llama.cpp's CPU backend (ggml-cpu), as plain text.

Why text edits anchored on exact strings, not a patch file: a fresh machine may have no ``patch`` binary, and an
anchor that is missing or occurs twice must stop the build with the file and the anchor named, rather than apply
somewhere near.  Every edit checks for its own result first, so applying twice changes nothing.

Pure: no llama_cpp, no build; ``kernel_build`` applies these to the tree it extracts from llama-cpp-python's sdist.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

SOURCES_DIR = Path(__file__).resolve().parent / "ggml_cpu"
SOURCE_FILES = ("specstack-verify.c", "specstack-attn.c", "specstack-verify.h")
CPU_DIR = Path("ggml/src/ggml-cpu")  # ggml-cpu's sources, inside the llama.cpp tree


class EditError(RuntimeError):
    """An anchor the edits need is missing or not unique: this llama.cpp tree is not the one they were written for."""


@dataclass(frozen=True)
class Edit:
    """Insert ``text`` right after ``anchor`` (a string that must occur exactly once) in ``path``."""

    path: str  # relative to the llama.cpp tree
    anchor: str
    text: str

    @property
    def result(self) -> str:
        """What the anchor reads as once the edit is in: its presence means the edit was applied."""
        return self.anchor + self.text


_MUL_MAT_CALL = "    if (specstack_verify_mul_mat(params, dst)) {\n        return;\n    }\n\n"
_REPACK_SKIP = "    if (specstack_verify_takes(cur)) {\n        return nullptr;\n    }\n"

# After the Hadamard hint (a MUL_MAT that is really a transform, which ggml handles apart) and before llama.cpp's
# own kernels (tiled, llamafile, the generic loop), so ours see every plain MUL_MAT first.
EDITS: tuple[Edit, ...] = (
    Edit("ggml/src/ggml-cpu/CMakeLists.txt", "        ggml-cpu/ggml-cpu.c\n", "        ggml-cpu/specstack-verify.c\n"),
    Edit("ggml/src/ggml-cpu/CMakeLists.txt", "        ggml-cpu/specstack-verify.c\n", "        ggml-cpu/specstack-attn.c\n"),
    Edit("ggml/src/ggml-cpu/ggml-cpu.c", '#include "tiled/tiled.h"\n', '#include "specstack-verify.h"\n'),
    Edit("ggml/src/ggml-cpu/ggml-cpu.c",
         "        ggml_compute_forward_fwht(params, dst);\n        return;\n    }\n\n", _MUL_MAT_CALL),
    Edit("ggml/src/ggml-cpu/repack.cpp", '#include "arch-fallback.h"\n', '#include "specstack-verify.h"\n'),
    # a weight our kernels take stays in its plain layout: the repack buffer would otherwise convert it
    Edit("ggml/src/ggml-cpu/repack.cpp",
         "static const ggml::cpu::tensor_traits * ggml_repack_get_optimal_repack_type(const struct ggml_tensor * cur) {\n",
         _REPACK_SKIP),
    # flash attention: one query row with a KV of 512+ is split over the threads and its partials reduced, an
    # order of operations no multi-row call has; with ours, every row is computed alone, as in a verification
    Edit("ggml/src/ggml-cpu/ops.cpp", '#include "ggml-cpu.h"\n', '#include "specstack-verify.h"\n'),
    Edit("ggml/src/ggml-cpu/ops.cpp", "    const bool use_split_kv_path = !use_ref && ",
         "!specstack_verify_rowwise_attention() && "),
    # ours first where it takes the call (specstack-attn.c: 1-63 rows, F16 K/V), each row by blocks of the context
    Edit("ggml/src/ggml-cpu/ops.cpp",
         "static void ggml_compute_forward_flash_attn_ext_f16(\n        const ggml_compute_params * params,\n"
         "        ggml_tensor * dst) {\n",
         "    if (specstack_verify_flash_attn(params, dst)) {\n        return;\n    }\n"),
)


def apply_edits(tree: Path, sources: Path = SOURCES_DIR, edits: tuple[Edit, ...] = EDITS) -> list[str]:
    """Copy our C sources into ``tree``'s ggml-cpu and apply ``edits``; returns what changed (empty: nothing did).

    Raises ``EditError`` naming the file and the anchor where an anchor is missing or occurs more than once."""
    changed = [name for name in SOURCE_FILES if _copy_source(sources / name, tree / CPU_DIR / name)]
    for edit in edits:
        if _apply_one(tree, edit):
            changed.append(f"{edit.path}: after {edit.anchor.strip()!r}")
    return changed


def _copy_source(src: Path, dst: Path) -> bool:
    """Copy ``src`` over ``dst`` unless it is already there byte for byte."""
    if dst.exists() and dst.read_bytes() == src.read_bytes():
        return False
    shutil.copyfile(src, dst)
    return True


def _apply_one(tree: Path, edit: Edit) -> bool:
    """Apply one edit; False where it was already in."""
    path = tree / edit.path
    if not path.is_file():
        raise EditError(f"{path}: no such file (the edit after {edit.anchor.strip()!r} needs it)")
    text = path.read_text()
    if text.count(edit.result) == 1:
        return False
    n = text.count(edit.anchor)
    if n != 1:
        said = "does not occur" if n == 0 else f"occurs {n} times"
        raise EditError(f"{path}: the anchor {edit.anchor!r} {said} (it must occur exactly once): this llama.cpp "
                        "tree is not the one specstack's kernel edits were written for")
    path.write_text(text.replace(edit.anchor, edit.result))
    return True


def edits_digest(edits: tuple[Edit, ...] = EDITS) -> str:
    """A digest of the edit list, part of the kernel build's cache key."""
    return hashlib.sha256(json.dumps([asdict(e) for e in edits]).encode()).hexdigest()


def sources_digest(sources: Path = SOURCES_DIR) -> dict[str, str]:
    """Each C source's digest, part of the kernel build's cache key: new kernels mean a new build."""
    return {name: hashlib.sha256((sources / name).read_bytes()).hexdigest() for name in SOURCE_FILES}
