"""``specstack check TARGET DRAFT``: can DRAFT draft for TARGET (same token ids)?"""

from __future__ import annotations

import json

from ..modelfile.compat import CompatReport, check_pair, mtp_line, rewind_line
from ..paths import DEFAULT_DRAFT, DEFAULT_TARGET
from ..ui import table

_VERDICT_LINE = {
    "identical": "identical: the vocabularies are the same; DRAFT can draft for TARGET",
    "compatible": "compatible: every shared id means the same text; DRAFT can draft for TARGET "
                  "(see the notes)",
    "translatable": "translatable: token ids mean different text; DRAFT drafts for TARGET through text "
                    "(draft tokens -> text -> target tokens, verified by exact match: lossless)",
    "incompatible": "incompatible: a side has no vocabulary; DRAFT cannot draft for TARGET",
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="vocabulary compatibility verdict for a target/draft pair",
        description="Compare the vocabularies of a target and a draft GGUF (metadata only, no "
        "weights are loaded). Exit status: 0 identical, 1 compatible, 3 translatable (different vocabularies: drafts are translated through text), 2 incompatible (or error).",
    )
    p.add_argument("target", nargs="?", default=str(DEFAULT_TARGET),
                   help="target model GGUF (default: bundled pycoder-6m)")
    p.add_argument("draft", nargs="?", default=str(DEFAULT_DRAFT),
                   help="draft model GGUF (default: bundled pycoder-1m)")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    report = check_pair(args.target, args.draft)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render(report))
    return report.exit_code


def _head_lines(head: dict | None) -> list[str]:
    """A trained draft head (eagle3, dflash) given as DRAFT: what it reads, and whether it fits TARGET."""
    if head is None:
        return []
    if head["fits"]:
        return [f"  head: {head['describe']}", "  head fit: it fits TARGET (tokenizer, hidden size, layer ids, "
                "layer inputs" + (", mask token)" if head["kind"] != "eagle3" else ")")]
    return [f"  head: {head['describe']}", "  head fit: it cannot draft for TARGET:"] + [
        f"    - {p}" for p in head["problems"]]


def _r(s) -> str:
    return "(none)" if s is None else repr(s)


def render(rep: CompatReport) -> str:
    t, d = rep.target, rep.draft
    verdict = (f"{rep.verdict} vocabulary, but the head cannot draft for TARGET (see head)" if rep.head_refused
               else _VERDICT_LINE[rep.verdict])
    out = [f"verdict: {verdict}", ""]
    out.append(table(["", "file", "vocab", "tokenizer/pre"],
                     [[role, s["path"], s["n_vocab"], f"{s['tokenizer_model']}/{s['pre'] or '(none)'}"]
                      for role, s in (("target", t), ("draft", d))], align="llrl", indent="  "))
    for role, s in (("target", t), ("draft", d)):
        if s["recurrence"] != "none":
            out.append(f"  {role} state: {rewind_line(s['recurrence'], s['rewind'])}")
        if s.get("nextn_layers"):
            out.append(f"  {role} MTP: {mtp_line(s['nextn_layers'], s['mtp'], s.get('architecture'))}")
    out += _head_lines(rep.head)
    if rep.reasons:
        out.append("")
        out.append("differences:")
        out.extend(f"  - {r}" for r in rep.reasons)
    out.append("")
    if rep.n_differing:
        out.append(f"token texts: {rep.n_differing} of {rep.n_common} shared ids differ; first ones:")
        for diff in rep.first_differences:
            out.append(f"  id {diff['id']:>7}: target {_r(diff['target'])}  draft {_r(diff['draft'])}")
    else:
        out.append(f"token texts: all {rep.n_common} shared ids are the same")
    if rep.extra:
        ex = rep.extra
        out.append(f"extra ids: the {ex['side']} has {ex['count']} more; first ones:")
        for e in ex["first"]:
            out.append(f"  id {e['id']:>7}: {_r(e['text'])} ({e['type'] or 'type unknown'})")
    m = rep.merges
    if m.get("target") or m.get("draft"):
        state = "identical" if m["identical"] else "differ"
        out.append(f"merges: target {m['target']}, draft {m['draft']}, {state}")
        if "first_difference" in m:
            fd = m["first_difference"]
            out.append(f"  first difference at #{fd['index']}: target {_r(fd['target'])}  "
                       f"draft {_r(fd['draft'])}")
    if rep.token_type_differences:
        td = rep.token_type_differences
        out.append(f"token types: {td['count']} ids differ; first ones:")
        for e in td["first"]:
            out.append(f"  id {e['id']:>7} {_r(e['text'])}: target {e['target']}  draft {e['draft']}")
    if rep.special_differences:
        out.append("special tokens that differ:")
        for name, sd in rep.special_differences.items():
            if name.startswith("add_"):
                out.append(f"  {name:8} target {sd['target']}  draft {sd['draft']}")
            else:
                def fmt(i, txt):
                    return "unset" if i is None else f"{i} {_r(txt)}" if txt is not None else f"{i} (out of range)"
                out.append(f"  {name:8} target {fmt(sd['target'], sd['target_text'])}  "
                           f"draft {fmt(sd['draft'], sd['draft_text'])}")
    else:
        sp = t["special_tokens"]
        out.append("special tokens: same (" + ", ".join(f"{k}={v}" for k, v in sp.items() if v is not None)
                   + ")")
    for role, s in (("target", t), ("draft", d)):
        for warn in s["warnings"]:
            out.append(f"warning ({role}): {warn}")
    if rep.notes:
        out.append("")
        out.extend(f"note: {n}" for n in rep.notes)
    return "\n".join(out)


