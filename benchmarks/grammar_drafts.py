"""The grammar source: how many output tokens a grammar's forced text drafted, and what it did to speed.

Three JSON schemas and one GBNF grammar over an extraction prompt (a short business document in the prompt), greedy,
one model load. Each runs plain (``--drafter none``), with a drafter and ``--no-grammar-drafts``, and with the
drafter and the grammar source (the default), in alternating order over ``--rounds`` rounds so machine noise hits
all three alike; outputs must be identical. Reported per case: output tokens, verification steps, tokens drafted /
accepted by each source, and tokens per second against plain (median over the rounds).

    python benchmarks/grammar_drafts.py -m GGUF [-t 1] [--drafter prompt-lookup] [--policy cost] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from specstack.calibration import ensure_shapes
from specstack.constraints import Constraints
from specstack.generation import GenerationConfig
from specstack.llama import LlamaModel, ModelConfig
from specstack.llama.schema_gbnf import schema_to_gbnf
from specstack.loading import build_engine
from specstack.paths import DEFAULT_TARGET
from specstack.ui import table

DOCUMENT = ("Invoice INV-2291 from Northwind Traders, 14 Harbour Street, Portsmouth, was issued on 3 March 2024 to "
            "Contoso Ltd. It lists 12 units of the Model R7 router at 89.50 each and 3 support contracts at 240.00 "
            "each. Payment is due within 30 days to account GB29 NWBK 6016 1331 9268 19. Contact: Maria Anders, "
            "accounts@northwind.example.")
SCHEMAS: dict[str, dict[str, Any]] = {
    "invoice (6 keys)": {"type": "object", "properties": {
        "invoice_number": {"type": "string"}, "seller": {"type": "string"}, "buyer": {"type": "string"},
        "date": {"type": "string"}, "due_days": {"type": "integer"}, "contact_email": {"type": "string"}},
        "required": ["invoice_number", "seller", "buyer", "date", "due_days", "contact_email"],
        "additionalProperties": False},
    "line items (array)": {"type": "object", "properties": {"lines": {"type": "array", "maxItems": 4, "items": {
        "type": "object", "properties": {"item": {"type": "string"}, "quantity": {"type": "integer"},
                                         "unit_price": {"type": "number"}},
        "required": ["item", "quantity", "unit_price"], "additionalProperties": False}}},
        "required": ["lines"], "additionalProperties": False},
    "contact (enum)": {"type": "object", "properties": {
        "name": {"type": "string"}, "email": {"type": "string"}, "company": {"type": "string"},
        "role": {"type": "string", "enum": ["seller", "buyer", "bank"]}},
        "required": ["name", "email", "company", "role"], "additionalProperties": False},
}
CALL = r'''root ::= "record_invoice(number=" str ", seller=" str ", buyer=" str ", due_days=" [0-9]+ ")"
str ::= "\"" [^"\n]{1,40} "\""
'''


def prompt_for(name: str, chat: bool) -> str:
    ask = f"Extract the document's {name.split(' (')[0]} as JSON." if name in SCHEMAS else \
        "Write the call that records this invoice."
    text = f"{ask}\n\n{DOCUMENT}"
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n" if chat else text + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(DEFAULT_TARGET))
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-n", type=int, default=160, help="most tokens a request")
    ap.add_argument("--drafter", default="prompt-lookup")
    ap.add_argument("--policy", default="cost", help="k policy (cost: the default; fixed: -k every step)")
    ap.add_argument("-k", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in Gemma's turn markup")
    ap.add_argument("--exact", choices=("on", "auto"), default="on",
                    help="as generate's --exact (on, the default here: every mode's output must equal plain's)")
    args = ap.parse_args()
    model = LlamaModel(ModelConfig(args.model, n_ctx=2048, n_threads=args.threads), role="target")
    ensure_shapes(model, args.exact)  # on: output identical to plain decoding, checked (auto may turn it off)
    cases = {name: schema_to_gbnf(s) for name, s in SCHEMAS.items()} | {"GBNF call": CALL}
    modes = [("plain", "none", True), ("no grammar drafts", args.drafter, False), ("grammar drafts", args.drafter, True)]
    rows = []
    for name, grammar in cases.items():
        runs: dict[str, list] = {m: [] for m, _, _ in modes}
        for r in range(args.rounds):
            for mode, drafter, on in (modes if r % 2 == 0 else modes[::-1]):
                engine = build_engine(model, drafter, args.policy, k=args.k)
                cfg = GenerationConfig(max_tokens=args.n, constraints=Constraints(grammar=grammar), grammar_drafts=on)
                runs[mode].append(engine.generate(prompt_for(name, args.chat), cfg).run())
        plain = runs["plain"][0]
        for mode, _, _ in modes:
            gens = runs[mode]
            if any(g.output_ids != plain.output_ids for g in gens) and model.shapes.exact:
                raise SystemExit(f"{name}, {mode}: the output differs from plain decoding")
            st = gens[0].stats
            rate = statistics.median(g.stats.tokens_per_second for g in gens)
            base = statistics.median(g.stats.tokens_per_second for g in runs["plain"])
            sources = ", ".join(f"{s} {v.n_accepted}/{v.n_drafted}" for s, v in st.by_source.items()) or "-"
            rows.append([name, mode, st.n_tokens, st.n_steps, sources, f"{rate:.1f}", f"{rate / base:.2f}x"])
    print(table(["case", "mode", "tokens", "steps", "accepted/drafted by source", "tok/s", "vs plain"], rows))


if __name__ == "__main__":
    main()
