"""Draft/target vocabulary compatibility: the verdict behind ``specstack check``.

A draft model proposes token *ids* that the target verifies, so the two
vocabularies must give every id the same meaning. ``check_pair`` compares the
tokenizer metadata of two GGUF files (never their weights) and returns a
``CompatReport`` with one of four verdicts:

- ``identical``: same tokenizer model, pre-tokenizer, tokens, token types,
  merges/scores and special tokens.
- ``compatible``: every id the two share means the same thing, and the
  tokenization of ordinary text is the same. That covers a vocabulary that
  extends the other with tokens plain text never produces (control, unused,
  user-defined), a different pre-tokenizer *label* with identical tokens and
  merges, and different special-token settings (BOS/EOS/EOT/PAD ids, add_bos).
- ``translatable``: a shared id means different text, the tokenizer models
  differ, the merges (or SentencePiece scores) differ so the same text
  tokenizes differently, or the extra ids are ordinary tokens: ids cannot be
  shared, so ``draft-model`` translates drafts through text
  (``drafters/translate.py``); the report gives the text overlap.
- ``incompatible``: a side has no vocabulary at all.

``require_draftable`` is what the draft-model drafter calls: it raises
``VocabMismatchError`` on an incompatible pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import TokenType

from ..errors import VocabMismatchError
from . import archs
from .archs import DRAFTED_HEADS
from .meta import TOKEN_TYPE_NAMES, GGUFInfo, HeadInfo, read_gguf

IDENTICAL = "identical"
COMPATIBLE = "compatible"
TRANSLATABLE = "translatable"  # ids mean different text, but drafts can be translated through text
INCOMPATIBLE = "incompatible"
EXIT_CODES = {IDENTICAL: 0, COMPATIBLE: 1, INCOMPATIBLE: 2, TRANSLATABLE: 3}

N_EXAMPLES = 5
SPECIAL_NAMES = ("bos", "eos", "eot", "pad", "add_bos", "add_eos")
# token types that tokenizing plain text never produces: unknown, control, unused.
# (llama.cpp matches user-defined tokens literally in text, so those count as ordinary.)
_NEVER_FROM_TEXT = {TokenType.UNKNOWN.value, TokenType.CONTROL.value, TokenType.UNUSED.value}
_TOKT_NORMAL = TokenType.NORMAL.value
_OPTION_KEYS = ("tokenizer.ggml.add_space_prefix", "tokenizer.ggml.remove_extra_whitespaces")


def _side(info: GGUFInfo) -> dict[str, Any]:
    return {
        "path": str(info.path),
        "architecture": info.architecture,
        "n_vocab": info.n_vocab,
        "tokenizer_model": info.tokenizer_model,
        "pre": info.pre,
        "n_merges": len(info.merges),
        "special_tokens": info.special_tokens(),
        "vocab_fingerprint": info.vocab_fingerprint,
        "recurrence": info.recurrence,
        "rewind": info.rewind,
        "nextn_layers": info.nextn_layers,
        "mtp": info.mtp_mode,
        "head": info.architecture if info.is_head else None,
        "layer_inputs": archs.exports_layer_inputs(info.architecture),
        "warnings": list(info.warnings),
    }


def mtp_line(nextn_layers: int, mode: str | None, arch: str | None = None) -> str:
    """What a model's multi-token-prediction (NextN) layers mean for drafting, in one phrase ("" without any)."""
    if not nextn_layers:
        return ""
    what = f"{nextn_layers} NextN layer{'s' if nextn_layers > 1 else ''}"
    if mode == "single head":
        return f"{what} ({mode}): --drafter mtp drafts from {'them' if nextn_layers > 1 else 'it'}"
    if mode is None:
        return f"{what}, but this llama.cpp has no MTP graph for {arch or 'its architecture'}"
    return f"{what} ({mode}): not drafted from by specstack yet (single-head models only)"


def head_line(head: HeadInfo) -> str:
    """What a trained draft head's GGUF says it reads, in one phrase (``specstack check``, ``models scan``, doctor)."""
    layers = ", ".join(str(i) for i in head.target_layers) or "none named"
    parts = [f"{head.kind} head reading target layers {layers}"]
    if head.target_hidden_size is not None:
        parts.append(f"target hidden size {head.target_hidden_size}")
    if head.has_d2t:
        parts.append("its own reduced vocabulary (d2t)")
    if head.block_size is not None:
        parts.append(f"block {head.block_size}")
    if head.kind != "eagle3":
        parts.append(f"mask token {head.mask_token_id if head.mask_token_id is not None else 'missing'}")
    how = (f"--drafter {head.kind} -md drafts from it" if head.kind in DRAFTED_HEADS
           else "specstack cannot draft from it yet")
    return ", ".join(parts) + f"; {how}"


def layer_input_line(arch: str | None) -> str:
    """Whether EAGLE-3/DFlash heads can draft for a target of ``arch`` in this llama.cpp, in one phrase."""
    if archs.exports_layer_inputs(arch):
        return f"{arch} exports layer inputs: an EAGLE-3 or DFlash head trained for it can read them"
    return (f"{arch or 'this architecture'} exports no layer inputs in this llama.cpp: no EAGLE-3 or DFlash head "
            "can draft for it (--drafter mtp or draft-model can)")


@dataclass(frozen=True)
class HeadTarget:
    """What a head's fit needs of its target: plain data, from a ``GGUFInfo`` (check) or a cached scan entry."""

    name: str
    architecture: str | None
    n_embd: int | None
    n_layer: int | None
    n_vocab: int
    head_kind: str | None = None  # the "target" is itself a head (given in the wrong order)

    @classmethod
    def of(cls, info: GGUFInfo) -> HeadTarget:
        return cls(Path(info.path).name, info.architecture, info.embedding_length, info.block_count, info.n_vocab,
                   info.head.kind if info.head else None)


def head_problems(target: HeadTarget, head: HeadInfo, head_name: str, vocab_verdict: str) -> list[str]:
    """Why ``head`` cannot draft for ``target``, one line per mismatch naming it and the fix; [] where it fits.

    Everything here would otherwise stop llama.cpp at load or abort the process at the first call (a layer id
    past the target's, a target graph without layer inputs), or draft nothing (no mask token)."""
    if target.head_kind is not None:
        return [f"{target.name} is itself a {target.head_kind} head, not a model to draft for: give the model the "
                f"head was trained on as the target (specstack check TARGET {head_name})"]
    out = _head_vocab(target, head, head_name, vocab_verdict)
    if not archs.exports_layer_inputs(target.architecture):
        out.append(f"{target.name} is {target.architecture or 'of an unknown architecture'}, whose graph in this "
                   f"llama.cpp exports no layer inputs, so no {head.kind} head can read it (llama.cpp would abort): "
                   "use a target whose architecture does (llama, qwen3, qwen35, gemma4, gpt-oss, ...) or "
                   "--drafter mtp / draft-model")
    out += _head_layers(target, head, head_name) + _head_width(target, head, head_name)
    if head.kind != "eagle3":
        out += _head_mask(target, head, head_name)
    return out


def _head_vocab(target: HeadTarget, head: HeadInfo, head_name: str, verdict: str) -> list[str]:
    """A head drafts the target's own token ids: its tokenizer must be the target's (identical, or differing only in
    settings it never reads, such as add_bos), with the same number of ids."""
    if verdict in (IDENTICAL, COMPATIBLE) and head.n_vocab == target.n_vocab:
        return []
    what = verdict if verdict not in (IDENTICAL, COMPATIBLE) else f"{head.n_vocab} ids vs {target.n_vocab}"
    return [f"{head_name}'s tokenizer is not {target.name}'s ({what}): a head drafts the target's own token ids; use "
            "the head converted for this target (llama.cpp's converter copies the target's tokenizer)"]


def _head_layers(target: HeadTarget, head: HeadInfo, head_name: str) -> list[str]:
    """The layer ids a head names: present, three for eagle3, each a layer input the target has (< n_layer)."""
    ids = head.target_layers
    if not ids:
        return [f"{head_name} names no target layers ({head.kind.replace('dspark', 'dflash')}.target_layers): "
                "reconvert it with llama.cpp's convert_hf_to_gguf.py"]
    out = []
    if head.kind == "eagle3" and len(ids) != 3:
        out.append(f"{head_name} names {len(ids)} target layers; an eagle3 head reads exactly 3 (llama.cpp refuses "
                   "to load it otherwise): reconvert it")
    bad = [i for i in ids if i < 0 or (target.n_layer is not None and i >= target.n_layer)]
    if bad:
        out.append(f"{head_name} reads target layer{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} but "
                   f"{target.name} has {target.n_layer} layers (ids 0..{(target.n_layer or 1) - 1}): it was trained "
                   "for another model; use the target it was trained for")
    return out


def _head_width(target: HeadTarget, head: HeadInfo, head_name: str) -> list[str]:
    """Hidden sizes: eagle3's ``target_hidden_size`` is the target's n_embd; a DFlash head, and an eagle3 head
    that borrows the target's embeddings or output, runs at the target's n_embd itself."""
    if target.n_embd is None:
        return []
    if head.kind == "eagle3":
        if head.target_hidden_size is None:
            return [f"{head_name} has no eagle3.target_hidden_size (llama.cpp refuses to load it): reconvert it"]
        if head.target_hidden_size != target.n_embd:
            return [f"{head_name} was trained on a target of hidden size {head.target_hidden_size}, {target.name}'s "
                    f"is {target.n_embd}: use the target it was trained for"]
        borrowed = [w for w, b in (("token embeddings", head.borrows_embeddings), ("output", head.borrows_output)) if b]
        if borrowed and head.n_embd != target.n_embd:
            return [f"{head_name} borrows {target.name}'s {' and '.join(borrowed)} but its width {head.n_embd} is not "
                    f"the target's {target.n_embd}: ship them in the head, or train it at the target's width"]
        return []
    if head.n_embd != target.n_embd:
        return [f"{head_name}'s width {head.n_embd} is not {target.name}'s {target.n_embd}: a DFlash head runs at "
                "its target's width; use the target it was trained for"]
    return []


def _head_mask(target: HeadTarget, head: HeadInfo, head_name: str) -> list[str]:
    """DFlash fills its block with the mask token: without one llama.cpp rejects every block."""
    if head.mask_token_id is None:
        return [f"{head_name} has no tokenizer.ggml.mask_token_id, without which llama.cpp rejects every DFlash "
                "block: add the key (gguf-py's gguf_set_metadata.py) or reconvert the head"]
    if not 0 <= head.mask_token_id < target.n_vocab:
        return [f"{head_name}'s mask token {head.mask_token_id} is outside {target.name}'s {target.n_vocab} tokens: "
                "reconvert the head with the target's tokenizer"]
    return []


def head_report(target: HeadTarget, head: HeadInfo, head_name: str, vocab_verdict: str) -> dict[str, Any]:
    """A head's fit as ``CompatReport.head`` and the scan's matrix keep it (JSON-ready)."""
    problems = head_problems(target, head, head_name, vocab_verdict)
    return {**head.to_dict(), "describe": head_line(head), "fits": not problems, "problems": problems}


def rewind_line(recurrence: str, rewind: str) -> str:
    """What speculation does with rejected tokens on such a model (``recurrent``), in one phrase."""
    if recurrence == "none":
        return "attention KV: rejected tokens are cut by position"
    if rewind == "rollback":
        return f"{recurrence}: rejected tokens are rolled back by llama.cpp (n_rs_seq snapshots)"
    return (f"{recurrence}: no rollback for this architecture; the state is checkpointed before each "
            "draft and restored after a rejection")


def _text(info: GGUFInfo, i: int | None) -> str | None:
    if i is None or not (0 <= i < info.n_vocab):
        return None
    return info.tokens[i]


@dataclass
class CompatReport:
    target: dict[str, Any]
    draft: dict[str, Any]
    verdict: str
    reasons: list[str] = field(default_factory=list)        # why not identical / why incompatible
    notes: list[str] = field(default_factory=list)          # what the engine must take care of
    n_common: int = 0
    n_differing: int = 0                                     # ids < n_common whose text differs
    first_differences: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] | None = None                      # ids only one side has
    special_differences: dict[str, dict[str, Any]] = field(default_factory=dict)
    token_type_differences: dict[str, Any] = field(default_factory=dict)
    merges: dict[str, Any] = field(default_factory=dict)
    scores: dict[str, Any] = field(default_factory=dict)
    option_differences: dict[str, dict[str, Any]] = field(default_factory=dict)
    head: dict[str, Any] | None = None                       # a trained head's fit (``head_report``), if a side is one

    @property
    def head_refused(self) -> bool:
        return self.head is not None and not self.head["fits"]

    @property
    def exit_code(self) -> int:
        """The vocabulary verdict's code; a trained head that cannot draft for the target is incompatible (2)."""
        return EXIT_CODES[INCOMPATIBLE] if self.head_refused else EXIT_CODES[self.verdict]

    @property
    def ok(self) -> bool:
        return self.verdict != INCOMPATIBLE and not self.head_refused

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "target": self.target,
            "draft": self.draft,
            "reasons": list(self.reasons),
            "notes": list(self.notes),
            "tokens": {
                "n_common": self.n_common,
                "n_differing": self.n_differing,
                "first_differences": self.first_differences,
            },
            "extra": self.extra,
            "special_differences": self.special_differences,
            "token_type_differences": self.token_type_differences,
            "merges": self.merges,
            "scores": self.scores,
            "option_differences": self.option_differences,
            "head": self.head,
        }

    def explain(self) -> str:
        t, d = self.target, self.draft
        lines = [
            f"vocabulary check: {self.verdict}",
            f"  target {t['path']}: {t['n_vocab']} tokens, {t['tokenizer_model']}/{t['pre'] or '-'}",
            f"  draft  {d['path']}: {d['n_vocab']} tokens, {d['tokenizer_model']}/{d['pre'] or '-'}",
        ]
        for r in self.reasons:
            lines.append(f"  - {r}")
        if self.n_differing:
            first = self.first_differences[0]
            lines.append(
                f"  first differing id {first['id']}: target {_show(first['target'])} "
                f"vs draft {_show(first['draft'])} ({self.n_differing} of {self.n_common} shared ids differ)")
        elif self.n_common:
            lines.append(f"  all {self.n_common} shared ids have the same text")
        if self.special_differences:
            for name, sd in self.special_differences.items():
                if name.startswith("add_"):
                    lines.append(f"  special {name}: target {sd['target']} vs draft {sd['draft']}")
                else:
                    lines.append(
                        f"  special {name}: target {_fmt_id(sd['target'], sd.get('target_text'))} "
                        f"vs draft {_fmt_id(sd['draft'], sd.get('draft_text'))}")
        else:
            lines.append("  special tokens: same")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


def _show(s: str | None) -> str:
    return "(none)" if s is None else repr(s)


def _fmt_id(i: int | None, text: str | None) -> str:
    if i is None:
        return "unset"
    return f"{i} {_show(text)}" if text is not None else f"{i} (out of range)"


@dataclass
class _Found:
    """What the checks of ``compare`` found: ``fatal`` makes a pair incompatible (or translatable), ``soft`` at most
    compatible."""

    fatal: list[str] = field(default_factory=list)
    soft: list[str] = field(default_factory=list)


def compare(target: GGUFInfo, draft: GGUFInfo) -> CompatReport:
    """Compare two already-read GGUF infos (see ``check_pair``): each part of the tokenizer in turn, then the
    verdict from what they found."""
    rep = CompatReport(target=_side(target), draft=_side(draft), verdict=IDENTICAL)
    found = _Found()
    for check in (_vocabularies, _token_texts, _extra_ids, _pre_tokenizers, _merges, _sp_scores, _token_types,
                  _special_tokens, _options):
        check(target, draft, rep, found)
    return _verdict(target, draft, rep, found)


def _vocabularies(target: GGUFInfo, draft: GGUFInfo, rep: CompatReport, found: _Found) -> None:
    """Both files hold a vocabulary, of the same tokenizer model."""
    if not target.tokens or not draft.tokens:
        missing = [n for n, i in (("target", target), ("draft", draft)) if not i.tokens]
        found.fatal.append(f"no vocabulary (tokenizer.ggml.tokens) in the {' and '.join(missing)}")
    if target.tokenizer_model != draft.tokenizer_model:
        found.fatal.append(f"tokenizer models differ: target {target.tokenizer_model!r} vs draft "
                           f"{draft.tokenizer_model!r}")


def _token_texts(target: GGUFInfo, draft: GGUFInfo, rep: CompatReport, found: _Found) -> None:
    """The shared ids' texts, id by id (``rep.n_common`` is the shared range every later check reads)."""
    tt, dt = target.tokens, draft.tokens
    n = min(len(tt), len(dt))
    rep.n_common = n
    if tt[:n] != dt[:n]:
        diff = [i for i in range(n) if tt[i] != dt[i]]
        rep.n_differing = len(diff)
        rep.first_differences = [{"id": i, "target": tt[i], "draft": dt[i]}
                                 for i in diff[:N_EXAMPLES]]
        found.fatal.append(f"{len(diff)} of {n} shared token ids have different text")


def _extra_ids(target: GGUFInfo, draft: GGUFInfo, rep: CompatReport, found: _Found) -> None:
    """Ids one vocabulary has beyond the other: fatal where plain text tokenizes to them, else special ids to mask."""
    n = rep.n_common
    if len(target.tokens) == len(draft.tokens) or not n:
        return
    bigger, side = (target, "target") if len(target.tokens) > len(draft.tokens) else (draft, "draft")
    types = bigger.token_types
    ext_types = types[n:] if types is not None and len(types) == bigger.n_vocab else None
    counts: dict[str, int] = {}
    if ext_types is not None:
        vals, cnts = np.unique(ext_types, return_counts=True)
        counts = {TOKEN_TYPE_NAMES.get(int(v), str(int(v))): int(c) for v, c in zip(vals, cnts)}
    rep.extra = {
        "side": side,
        "count": bigger.n_vocab - n,
        "types": counts,
        "first": [{"id": i, "text": bigger.tokens[i],
                   "type": TOKEN_TYPE_NAMES.get(int(ext_types[i - n]), "?") if ext_types is not None else None}
                  for i in range(n, min(n + N_EXAMPLES, bigger.n_vocab))],
    }
    other = "draft" if side == "target" else "target"
    if ext_types is None:
        textual = bigger.n_vocab - n
    else:
        textual = int(np.count_nonzero(~np.isin(ext_types, list(_NEVER_FROM_TEXT))))
    rep.extra["ordinary"] = textual
    if textual:
        found.fatal.append(f"the {side} has {bigger.n_vocab - n} extra ids, {textual} of them tokens that "
                           f"plain text tokenizes to (normal or user-defined; the {other} cannot "
                           f"represent them)")
        return
    found.soft.append(f"the {side} extends the {other} with {bigger.n_vocab - n} special ids "
                      f"({', '.join(f'{c} {k}' for k, c in counts.items())}) outside ordinary "
                      f"tokenization")
    if side == "draft":
        rep.notes.append(f"mask draft ids >= {n} (the target has only {n} tokens)")
    else:
        rep.notes.append(f"target ids >= {n} (special tokens) cannot be fed to the draft; "
                         f"map or stop on them")


def _pre_tokenizers(target: GGUFInfo, draft: GGUFInfo, rep: CompatReport, found: _Found) -> None:
    if target.pre != draft.pre:
        found.soft.append(f"pre-tokenizer labels differ: target {target.pre or '(none)'!r} vs draft "
                          f"{draft.pre or '(none)'!r}")


def _merges(target: GGUFInfo, draft: GGUFInfo, rep: CompatReport, found: _Found) -> None:
    """BPE merges: a difference in the shared ones tokenizes the same text differently; one list extending the
    other builds extra tokens."""
    tm, dm = target.merges, draft.merges
    rep.merges = {"target": len(tm), "draft": len(dm), "identical": tm == dm}
    if tm == dm:
        return
    m = min(len(tm), len(dm))
    first = next((i for i in range(m) if tm[i] != dm[i]), None)
    if first is not None:
        rep.merges["first_difference"] = {"index": first, "target": tm[first], "draft": dm[first]}
        rep.merges["n_differing"] = sum(1 for i in range(m) if tm[i] != dm[i])
        found.fatal.append(f"merges differ ({rep.merges['n_differing']} of {m} shared merges, first at "
                           f"#{first}): the same text tokenizes differently")
        return
    longer = "target" if len(tm) > len(dm) else "draft"
    rep.merges["extends"] = longer
    if not (rep.extra and rep.extra["side"] == longer and rep.extra["ordinary"]):
        if not tm or not dm:
            found.fatal.append(f"only the {longer} has BPE merges")
        else:
            found.soft.append(f"the {longer}'s merges extend the other's by {abs(len(tm) - len(dm))}")


def _sp_scores(target: GGUFInfo, draft: GGUFInfo, rep: CompatReport, found: _Found) -> None:
    """SentencePiece scores act as merge priorities: ordinary tokens' must agree."""
    ts, ds, n = target.scores, draft.scores, rep.n_common
    if ts is None or ds is None or not n:
        return
    m = min(n, len(ts), len(ds))
    neq = np.nonzero(ts[:m] != ds[:m])[0]
    if not len(neq):
        return
    types = target.token_types
    normal = neq[types[neq] == _TOKT_NORMAL] if types is not None and len(types) >= m else neq
    rep.scores = {"n_differing": int(len(neq)), "n_differing_normal": int(len(normal)),
                  "first": [int(i) for i in neq[:N_EXAMPLES]]}
    if len(normal) and target.tokenizer_model in ("llama", "t5", "ugm", None):
        found.fatal.append(f"scores of {len(normal)} ordinary tokens differ (first id {int(normal[0])}): "
                           f"the same text tokenizes differently")
    else:
        found.soft.append(f"scores differ on {len(neq)} special ids")


def _token_types(target: GGUFInfo, draft: GGUFInfo, rep: CompatReport, found: _Found) -> None:
    """Token types in the shared range."""
    ttypes, dtypes, n, tt = target.token_types, draft.token_types, rep.n_common, target.tokens
    if ttypes is None or dtypes is None:
        if (ttypes is None) != (dtypes is None):
            found.soft.append("only one file has token types")
        return
    if not n:
        return
    m = min(n, len(ttypes), len(dtypes))
    neq = np.nonzero(ttypes[:m] != dtypes[:m])[0]
    if not len(neq):
        return
    rep.token_type_differences = {
        "count": int(len(neq)),
        "first": [{"id": int(i), "text": tt[i] if i < len(tt) else None,
                   "target": TOKEN_TYPE_NAMES.get(int(ttypes[i]), str(int(ttypes[i]))),
                   "draft": TOKEN_TYPE_NAMES.get(int(dtypes[i]), str(int(dtypes[i])))}
                  for i in neq[:N_EXAMPLES]],
    }
    if not rep.n_differing:
        found.soft.append(f"token types differ on {len(neq)} ids")


def _special_tokens(target: GGUFInfo, draft: GGUFInfo, rep: CompatReport, found: _Found) -> None:
    tsp, dsp = target.special_tokens(), draft.special_tokens()
    for name in SPECIAL_NAMES:
        if tsp[name] != dsp[name]:
            entry: dict[str, Any] = {"target": tsp[name], "draft": dsp[name]}
            if not name.startswith("add_"):
                entry["target_text"] = _text(target, tsp[name])
                entry["draft_text"] = _text(draft, dsp[name])
            rep.special_differences[name] = entry
    if rep.special_differences:
        found.soft.append("special tokens differ: " + ", ".join(rep.special_differences))
        if "eos" in rep.special_differences or "eot" in rep.special_differences:
            rep.notes.append("stop on the target's EOS/EOT; the draft's own end token means nothing "
                             "to the target")


def _options(target: GGUFInfo, draft: GGUFInfo, rep: CompatReport, found: _Found) -> None:
    for key in _OPTION_KEYS:
        a, b = target.get(key), draft.get(key)
        if a != b:
            rep.option_differences[key.rsplit(".", 1)[1]] = {"target": a, "draft": b}
    if rep.option_differences:
        found.soft.append("tokenizer options differ: " + ", ".join(rep.option_differences))


def _verdict(target: GGUFInfo, draft: GGUFInfo, rep: CompatReport, found: _Found) -> CompatReport:
    """Identical, compatible (soft differences only), translatable (ids mean other text, but both have a
    vocabulary) or incompatible."""
    if found.fatal and target.tokens and draft.tokens:
        rep.verdict = TRANSLATABLE
        rep.reasons = found.fatal + found.soft
        overlap = vocabulary_overlap(target, draft)
        rep.scores["text_overlap"] = round(overlap, 4)
        rep.notes = [f"draft token ids mean different text to the target, so drafts are translated: draft tokens -> "
                     f"text -> the target's tokens, verified by exact match (lossless). {overlap:.1%} of the "
                     "target's tokens have a draft token with the same text"]
    elif found.fatal:
        rep.verdict = INCOMPATIBLE
        rep.reasons = found.fatal + found.soft
        rep.notes = ["a model without a vocabulary cannot draft or be drafted for"]
    elif found.soft:
        rep.verdict = COMPATIBLE
        rep.reasons = found.soft
    return rep


def token_text_bytes(info: GGUFInfo) -> list[bytes | None]:
    """Each token's text as raw bytes (None for control tokens): GPT-2 byte-level and SentencePiece pieces."""
    types = info.token_types
    if info.tokenizer_model == "gpt2":
        table = _gpt2_unicode_to_byte()
        out = []
        for i, t in enumerate(info.tokens):
            if types is not None and int(types[i]) in _NEVER_FROM_TEXT:
                out.append(None)
                continue
            out.append(bytes(table[c] for c in t) if all(c in table for c in t) else t.encode())
        return out
    out = []
    for i, t in enumerate(info.tokens):
        kind = int(types[i]) if types is not None else _TOKT_NORMAL
        if kind in _NEVER_FROM_TEXT:
            out.append(None)
        elif kind == 6 and t.startswith("<0x") and t.endswith(">"):  # byte fallback
            out.append(bytes([int(t[3:-1], 16)]))
        else:
            out.append(t.replace("\u2581", " ").encode())
    return out


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in characters back to bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def vocabulary_overlap(target: GGUFInfo, draft: GGUFInfo) -> float:
    """Share of the target's text tokens that some draft token spells the same (translation quality)."""
    have = {b for b in token_text_bytes(draft) if b}
    want = [b for b in token_text_bytes(target) if b]
    return sum(b in have for b in want) / len(want) if want else 0.0


def check_pair(target_path: str | Path, draft_path: str | Path) -> CompatReport:
    """Compare the vocabularies of two GGUF files without loading weights.

    Raises ``ModelLoadError`` if either file is missing or not a readable GGUF.
    """
    target = read_gguf(target_path, tensors=False)
    draft = read_gguf(draft_path, tensors=False)
    rep = compare(target, draft)
    if draft.is_head:  # a trained head's fit reads its tensor names too (d2t, DSpark's Markov tensors)
        head = read_gguf(draft_path).head
        assert head is not None
        rep.head = head_report(HeadTarget.of(target), head, Path(draft_path).name, rep.verdict)
    elif target.is_head:
        name = Path(target_path).name
        rep.head = {"kind": target.architecture, "describe": f"the target is a {target.architecture} head",
                    "fits": False, "problems": [f"{name} is a {target.architecture} head, not a model to draft for: "
                                                f"give it second (specstack check MODEL {name})"]}
    return rep


def require_draftable(target_path: str | Path, draft_path: str | Path) -> CompatReport:
    """Return the report, or raise ``VocabMismatchError`` if the pair is incompatible."""
    report = check_pair(target_path, draft_path)
    if report.verdict == INCOMPATIBLE:
        raise VocabMismatchError(report.explain() + "\nrun `specstack check TARGET DRAFT` for the full report")
    return report
