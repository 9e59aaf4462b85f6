"""Does draft-model with the cost policy keep up with plain decoding where drafting does not pay?

Each prompt runs as one `specstack generate -n N` does (a fresh engine and policy, so a first look and its
probes are paid every time), plain decoding and `draft-model@cost` interleaved prompt by prompt; the time
counts from `generate` to the last token, prefill included. Prints the aggregate tok/s ratio and the
median per-prompt ratio (issue 29, item 27: at least 0.97x).

    python benchmarks/draft_parity.py -t 1
    python benchmarks/draft_parity.py -t 2 -m STANDIN.gguf -md gemma-3-270m-q4_k_m.gguf --prompts 4 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from specstack.generation import GenerationConfig
from specstack.loading import TargetSpec, build_engine, load_target
from specstack.paths import DEFAULT_TARGET
from specstack.prompts import held_out_prompts

STDLIB = ("textwrap.py", "json/decoder.py", "string.py", "shlex.py", "bisect.py", "heapq.py")


def prompts_for(model: str, n: int) -> list[str]:
    """Held-out prompts for the bundled vocabulary; the heads of stdlib modules for any other model."""
    if os.path.abspath(model) == os.path.abspath(DEFAULT_TARGET):
        return held_out_prompts(n)
    lib = os.path.dirname(os.__file__)
    return [open(os.path.join(lib, name), encoding="utf-8").read()[:1500] for name in STDLIB][:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=str(DEFAULT_TARGET))
    p.add_argument("-md", "--model-draft", default=None, help="draft GGUF (default: the bundled one)")
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("-n", "--max-tokens", type=int, default=96)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    target = load_target(TargetSpec(Path(args.model), threads=args.threads, exact="auto", tree_branches=1))
    options = {"draft_model": args.model_draft} if args.model_draft else {}
    total = {"none": 0.0, "draft-model": 0.0}
    tokens = {"none": 0, "draft-model": 0}
    ratios, drafted = [], 0
    for _ in range(args.rounds):
        for prompt in prompts_for(args.model, args.prompts):
            rate = {}
            for name in ("none", "draft-model"):
                engine = build_engine(target, name, "cost", drafter_options=options)  # its own policy and cost model
                t0 = time.perf_counter()
                gen = engine.generate(prompt, GenerationConfig(max_tokens=args.max_tokens)).run()
                seconds = time.perf_counter() - t0
                total[name] += seconds
                tokens[name] += len(gen.output_ids)
                rate[name] = len(gen.output_ids) / seconds
                drafted += gen.stats.n_drafted if name == "draft-model" else 0
            ratios.append(rate["draft-model"] / rate["none"])
    plain = tokens["none"] / total["none"]
    print(f"draft-model@cost / plain: aggregate {tokens['draft-model'] / total['draft-model'] / plain:.3f}, "
          f"median per prompt {statistics.median(ratios):.3f}; plain {plain:.1f} tok/s; {drafted} tokens drafted")


if __name__ == "__main__":
    main()
