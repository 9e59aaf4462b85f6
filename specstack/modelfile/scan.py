"""Inventory of GGUF models in folders, and which of them can draft for which.

``scan(dirs)`` reads only metadata (``gguf_meta.read_gguf``), caches one entry
per file keyed by path + size + mtime (and one verdict per file pair), so a
second scan of an unchanged folder reads no model file at all.

Cache file: ``$SPECSTACK_CACHE_DIR/models-scan.json``, else
``$XDG_CACHE_HOME/specstack/...``, else ``~/.cache/specstack/...``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from ..paths import cache_dir
from . import compat as _check
from ..errors import ModelLoadError, SpecstackError
from .meta import GGUFInfo, HeadInfo, read_gguf
from ..ui import fmt_bytes, table

CACHE_VERSION = 4  # 2: entries carry "rewind"; 3: "nextn_layers" and "mtp"; 4: "head", "block_count", "embedding_length"
CACHE_NAME = "models-scan.json"

ProgressFn = Callable[[int, int, Path], None]


def _h(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def _digests(info: GGUFInfo) -> dict[str, str]:
    tok = hashlib.sha256(info.string_array_bytes("tokenizer.ggml.tokens")).hexdigest()
    merges = hashlib.sha256(info.string_array_bytes("tokenizer.ggml.merges")).hexdigest()
    types = info.token_types
    scores = info.scores
    types_d = _h([types.astype("<i4").tobytes()]) if types is not None else "-"
    scores_d = _h([scores.astype("<f4").tobytes()]) if scores is not None else "-"
    options = {k: info.get(k) for k in _check._OPTION_KEYS}
    rest = json.dumps([info.tokenizer_model, info.pre, info.special_tokens(), options],
                      sort_keys=True, default=str)
    full = _h([tok.encode(), merges.encode(), types_d.encode(), scores_d.encode(), rest.encode()])
    return {"tokens": tok, "merges": merges, "full": full}


def _active_params(info: GGUFInfo) -> int:
    """Parameters used per token: MoE expert tensors count only for the experts used."""
    n, used = info.expert_count, info.expert_used_count
    if not n or not used or n <= used:
        return info.n_params
    expert = sum(t.n_elements for t in info.tensors if "_exps" in t.name)
    return info.n_params - expert + expert * used // n


def _entry(path: Path, st: os.stat_result) -> tuple[dict[str, Any], GGUFInfo | None]:
    base = {"path": str(path), "name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        info = read_gguf(path)
    except ModelLoadError as exc:
        msg = str(exc)
        prefix = f"{path}: "
        return {**base, "status": "error", "error": msg[len(prefix):] if msg.startswith(prefix) else msg}, None
    split = None
    if info.get("split.count"):
        split = f"{int(info.get('split.no', 0)) + 1}/{int(info.get('split.count'))}"
    e = {
        **base,
        "status": "ok",
        "warnings": list(info.warnings),
        "gguf_version": info.version,
        "architecture": info.architecture,
        "model_name": info.name,
        "n_params": info.n_params,
        "n_active_params": _active_params(info),
        "tensor_count": info.tensor_count,
        "tensor_bytes": info.tensor_bytes,
        "vocab_only": info.tensor_count == 0,
        "file_type": info.file_type_name if info.tensor_count else None,
        "context_length": info.context_length,
        "n_vocab": info.n_vocab,
        "tokenizer_model": info.tokenizer_model,
        "pre": info.pre,
        "special_tokens": info.special_tokens(),
        "vocab_fingerprint": info.vocab_fingerprint,
        "expert_count": info.expert_count,
        "expert_used_count": info.expert_used_count,
        "recurrence": info.recurrence,
        "rewind": info.rewind,
        "nextn_layers": info.nextn_layers,
        "mtp": info.mtp_mode,
        "head": info.head.to_dict() if info.head else None,  # a trained draft head (eagle3, dflash)
        "block_count": info.block_count,
        "embedding_length": info.embedding_length,
        "split": split,
        "digests": _digests(info),
    }
    return e, info


def _key(e: dict[str, Any]) -> str:
    return f"{e['path']}|{e['size']}|{e['mtime_ns']}"


@dataclass
class ScanResult:
    entries: list[dict[str, Any]]
    matrix: list[dict[str, Any]]
    cache_path: Path | None
    files_read: int = 0
    cache_hits: int = 0
    pairs_compared: int = 0
    pair_cache_hits: int = 0
    cache_error: str | None = None

    @property
    def models(self) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["status"] == "ok"]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e for e in self.entries if e["status"] != "ok"]

    def to_dict(self) -> dict[str, Any]:
        strip = lambda e: {k: v for k, v in e.items() if k != "digests"}  # noqa: E731
        return {
            "files": [strip(e) for e in self.entries],
            "errors": [{"path": e["path"], "error": e["error"]} for e in self.errors],
            "draft_matrix": self.matrix,
            "cache": {"path": str(self.cache_path) if self.cache_path else None,
                      "file_hits": self.cache_hits, "files_read": self.files_read,
                      "pair_hits": self.pair_cache_hits, "pairs_compared": self.pairs_compared,
                      "error": self.cache_error},
        }


def find_gguf_files(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    seen: set[Path] = set()
    for p in paths:
        p = Path(p).expanduser()
        if p.is_file():
            files = [p]
        elif p.is_dir():
            files = []
            for root, dirs, names in os.walk(p, followlinks=False):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                files.extend(Path(root) / n for n in sorted(names) if n.lower().endswith(".gguf"))
        else:
            raise ModelLoadError(f"{p}: no such file or folder; give folders that contain .gguf models")
        for f in files:
            r = f.resolve()
            if r not in seen:
                seen.add(r)
                out.append(r)
    return out


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        if data.get("version") == CACHE_VERSION and isinstance(data.get("files"), dict):
            data.setdefault("pairs", {})
            return data
    except (OSError, ValueError, AttributeError):
        pass
    return {"version": CACHE_VERSION, "files": {}, "pairs": {}}


def _save_cache(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".models-scan.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def scan(paths: Iterable[str | Path], *, use_cache: bool = True,
         progress: ProgressFn | None = None) -> ScanResult:
    files = find_gguf_files(paths)
    cpath = cache_dir() / CACHE_NAME if use_cache else None
    cache = _load_cache(cpath) if cpath else {"version": CACHE_VERSION, "files": {}, "pairs": {}}
    res = ScanResult(entries=[], matrix=[], cache_path=cpath)
    infos: dict[str, GGUFInfo] = {}
    dirty = False

    for i, f in enumerate(files):
        if progress:
            progress(i + 1, len(files), f)
        try:
            st = f.stat()
        except OSError as exc:
            res.entries.append({"path": str(f), "name": f.name, "size": None, "mtime_ns": None,
                                "status": "error", "error": f"cannot stat ({exc.strerror or exc})"})
            continue
        cached = cache["files"].get(str(f))
        if cached and cached.get("size") == st.st_size and cached.get("mtime_ns") == st.st_mtime_ns:
            res.cache_hits += 1
            res.entries.append(cached)
            continue
        entry, info = _entry(f, st)
        res.files_read += 1
        if info is not None:
            infos[str(f)] = info
        cache["files"][str(f)] = entry
        res.entries.append(entry)
        dirty = True

    res.matrix, dirty_pairs = _matrix(res, cache, infos)
    dirty = dirty or dirty_pairs
    if cpath and dirty:
        cache["files"] = {p: e for p, e in cache["files"].items() if os.path.exists(p)}
        live = {_key(e) for e in cache["files"].values()}
        cache["pairs"] = {k: v for k, v in cache["pairs"].items()
                          if all(part in live for part in k.split("||"))}
        try:
            _save_cache(cpath, cache)
        except OSError as exc:
            res.cache_error = f"cannot write the cache {cpath}: {exc.strerror or exc}"
    return res


def _pair_verdict(t: dict, d: dict, cache: dict, infos: dict[str, GGUFInfo],
                  res: ScanResult) -> tuple[dict[str, Any], bool]:
    td, dd = t["digests"], d["digests"]
    if td["full"] == dd["full"]:
        return {"verdict": _check.IDENTICAL, "reasons": [], "notes": []}, False
    if t["tokenizer_model"] != d["tokenizer_model"]:
        return {"verdict": _check.INCOMPATIBLE, "reasons": ["tokenizer models differ"], "notes": []}, False
    if t["n_vocab"] == d["n_vocab"] and td["tokens"] != dd["tokens"]:
        return {"verdict": _check.INCOMPATIBLE, "reasons": ["token texts differ"], "notes": []}, False
    key = f"{_key(t)}||{_key(d)}"
    hit = cache["pairs"].get(key)
    if hit:
        res.pair_cache_hits += 1
        return hit, False
    for e in (t, d):
        if e["path"] not in infos:
            infos[e["path"]] = read_gguf(e["path"], tensors=False)
    rep = _check.compare(infos[t["path"]], infos[d["path"]])
    res.pairs_compared += 1
    v = {"verdict": rep.verdict, "reasons": rep.reasons, "notes": rep.notes}
    cache["pairs"][key] = v
    return v, True


def _matrix(res: ScanResult, cache: dict, infos: dict[str, GGUFInfo]) -> tuple[list[dict], bool]:
    models = [e for e in res.entries if e["status"] == "ok" and not e["vocab_only"] and e["n_params"]]
    dirty = False
    out = []
    for t in sorted((e for e in models if not e.get("head")), key=lambda e: -e["n_active_params"]):
        drafts, heads = [], []
        for d in models:
            if d is t or d["n_active_params"] >= t["n_active_params"]:
                continue
            try:
                v, changed = _pair_verdict(t, d, cache, infos, res)
            except SpecstackError:
                continue
            dirty = dirty or changed
            if v["verdict"] in (_check.INCOMPATIBLE, _check.TRANSLATABLE) and d.get("head"):
                continue  # a head for another tokenizer: another family's, not worth a line
            if d.get("head"):
                heads.append(_head_row(t, d, v["verdict"]))
                continue
            if v["verdict"] == _check.INCOMPATIBLE:
                continue
            drafts.append(_draft_row(t, d, v))
        drafts.sort(key=lambda x: -x["size_ratio"])
        # Drafts by id and drafts through text are two groups: a translatable draft was listed as if its
        # vocabulary were "identical or compatible".
        by_id = [d for d in drafts if d["verdict"] != _check.TRANSLATABLE]
        out.append({"target": t["path"], "name": t["name"], "n_params": t["n_params"],
                    "n_active_params": t["n_active_params"], "drafts": by_id,
                    "translatable": [d for d in drafts if d["verdict"] == _check.TRANSLATABLE], "heads": heads})
    return out, dirty


def _draft_row(t: dict[str, Any], d: dict[str, Any], v: dict[str, Any]) -> dict[str, Any]:
    """A draft model for target ``t``, with what the engine must know about the pair."""
    notes = list(v["notes"])
    for role, side in (("draft", d), ("target", t)):
        if side["recurrence"] != "none":
            notes.append(f"{role} is {_check.rewind_line(side['recurrence'], side['rewind'])}")
    if (d["context_length"] or 0) and (t["context_length"] or 0) and d["context_length"] < t["context_length"]:
        notes.append(f"draft context {d['context_length']} < target {t['context_length']}")
    return {
        "path": d["path"], "name": d["name"], "n_params": d["n_params"],
        "n_active_params": d["n_active_params"],
        "size_ratio": round(t["n_active_params"] / max(1, d["n_active_params"]), 2),
        "verdict": v["verdict"], "reasons": v["reasons"], "notes": notes,
    }


def _head_row(t: dict[str, Any], d: dict[str, Any], verdict: str) -> dict[str, Any]:
    """A trained draft head of target ``t``'s tokenizer: whether it fits ``t`` (``compat.head_problems``)."""
    target = _check.HeadTarget(t["name"], t["architecture"], t.get("embedding_length"), t.get("block_count"),
                               t["n_vocab"])
    head = _check.head_report(target, HeadInfo.from_dict(d["head"]), d["name"], verdict)
    return {"path": d["path"], "name": d["name"], "n_params": d["n_params"], **head}


def _draft_group(matrix: list[dict], key: str, none: str) -> list[str]:
    """Each target's drafts under ``key`` as indented lines, in one table so the columns line up down the matrix."""
    draft_lines = iter(table([], [[d["name"], fmt_params(d["n_active_params"]), f"{d['size_ratio']:.1f}x",
                                   d["verdict"]] for row in matrix for d in row[key]],
                             align="lrrl", indent="    ").splitlines())
    lines = []
    for row in matrix:
        lines.append(f"  {row['name']} ({fmt_params(row['n_active_params'])}):")
        if not row[key]:
            lines.append(none)
        for d in row[key]:
            lines += [next(draft_lines)] + [f"      note: {n}" for n in d["notes"]]
    return lines


def _head_group(matrix: list[dict]) -> list[str]:
    """Trained draft heads (eagle3, dflash) of each target's tokenizer: whether each fits, and if not, why."""
    rows = [row for row in matrix if row.get("heads")]
    if not rows:
        return []
    lines = ["", "trained draft heads (EAGLE-3, DFlash: `specstack check TARGET HEAD` says more):"]
    for row in rows:
        lines.append(f"  {row['name']} ({fmt_params(row['n_active_params'])}):")
        for h in row["heads"]:
            lines.append(f"    {h['name']}: {'fits' if h['fits'] else 'does not fit'}: {h['describe']}")
            lines += [f"      - {p}" for p in h["problems"]]
    return lines


# ---- formatting ----------------------------------------------------------------------------
def fmt_params(n: int | None) -> str:
    if not n:
        return "-"
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suf}"
    return str(n)


def _mtp_cell(e: dict[str, Any]) -> str:
    """NextN layers and how they draft: ``1 (--drafter mtp)``; a trained head's kind and layers: ``eagle3 head
    (layers 1,3,5)``; ``-`` without either (an older cache entry has none)."""
    head = e.get("head")
    if head:
        return f"{head['kind']} head (layers {','.join(map(str, head['target_layers'])) or 'none'})"
    n = e.get("nextn_layers") or 0
    if not n:
        return "-"
    return f"{n} ({'--drafter mtp' if e.get('mtp') == 'single head' else e.get('mtp') or 'no MTP graph here'})"


def render(res: ScanResult) -> str:
    rows = [("FILE", "ARCH", "PARAMS", "QUANT", "SIZE", "CTX", "VOCAB", "FINGERPRINT", "EXPERTS",
             "RECURRENT", "MTP/HEAD")]
    for e in res.models:
        moe = (f"{e['expert_count']} ({e['expert_used_count']} used)" if e["expert_count"] else "-")
        params = "vocab only" if e["vocab_only"] else fmt_params(e["n_params"])
        if e["n_active_params"] != e["n_params"]:
            params += f" ({fmt_params(e['n_active_params'])} act)"
        name = e["name"] + (f" [split {e['split']}]" if e.get("split") else "")
        rows.append((name, e["architecture"] or "?", params, e["file_type"] or "-",
                     fmt_bytes(e["size"]), str(e["context_length"] or "-"),
                     f"{e['n_vocab']} {e['tokenizer_model'] or '-'}",
                     (e["vocab_fingerprint"] or "-")[:12], moe,
                     f"{e['recurrence']}: {e['rewind']}" if e["recurrence"] != "none" else "-",
                     _mtp_cell(e)))
    lines = [f"{len(res.entries)} .gguf file(s): {len(res.models)} readable, {len(res.errors)} unreadable "
             f"({res.files_read} read, {res.cache_hits} from cache)"]
    lines.append(table(rows[0], rows[1:], align="l" * len(rows[0])))
    for e in res.models:
        for w in e.get("warnings", []):
            lines.append(f"warning: {e['name']}: {w}")

    lines.append("")
    if not res.matrix:
        lines.append("draft matrix: no models with weights found (vocab-only files cannot draft)")
    else:
        lines.append("draft matrix (identical or compatible vocabulary; ratio = target/draft "
                     "active params, largest first):")
        lines += _draft_group(res.matrix, "drafts", "    (no smaller model with a compatible vocabulary)")
        if any(row["translatable"] for row in res.matrix):
            lines.append("")
            lines.append("translatable vocabulary (token ids mean other text: draft-model translates the drafts "
                         "through text, losslessly; the note says how much of the target's vocabulary the draft "
                         "spells alike; see `specstack check`):")
            lines += _draft_group([row for row in res.matrix if row["translatable"]], "translatable", "")
        lines += _head_group(res.matrix)
    if res.errors:
        lines.append("")
        lines.append(f"unreadable files ({len(res.errors)}, skipped):")
        for e in res.errors:
            lines.append(f"  {e['path']}: {e['error']}")
    if res.cache_error:
        lines.append(f"warning: {res.cache_error}")
    return "\n".join(lines)
