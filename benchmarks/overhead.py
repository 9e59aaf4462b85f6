"""Overhead of specstack's loop: plain decoding through specstack vs llama-cpp-python's own loop.

Same model, threads, prompts and token count; the two run interleaved
(A B A B ...) so machine noise hits both alike.  Reports the median ratio.

    python benchmarks/overhead.py [--prompts 8] [-n 128] [--repeat 3] [-m MODEL]
"""

from __future__ import annotations

import argparse
import statistics
import time

import llama_cpp

from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.paths import DEFAULT_TARGET
from specstack.prompts import held_out_prompts
from specstack.llama import INEXACT, LlamaModel, ModelConfig, default_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=0)
    args = ap.parse_args()
    threads = args.threads or default_threads()
    ours = LlamaModel(ModelConfig(args.model, n_ctx=512, n_threads=threads))
    engine = Engine(ours, create("none", BuildContext(ours)))
    # The same loop without the exactness padding (one-token batches, like llama.cpp's own plain decoding):
    # separates the cost of the Python loop from the cost of batch-invariant evaluation.
    raw = LlamaModel(ModelConfig(args.model, n_ctx=512, n_threads=threads, min_batch=1))
    raw.set_shapes(INEXACT)  # never pad or split: llama.cpp's own plain shapes
    raw_engine = Engine(raw, create("none", BuildContext(raw)))
    theirs = llama_cpp.Llama(model_path=args.model, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompts = held_out_prompts(args.prompts)
    ratios, raw_ratios, t_ours, t_theirs, t_raw, same = [], [], 0.0, 0.0, 0.0, 0
    for rep in range(args.repeat):
        for p in prompts:
            ids = ours.tokenize(p)
            t0 = time.perf_counter()
            out = theirs.create_completion(ids, max_tokens=args.max_tokens, temperature=0.0, top_k=1)
            t1 = time.perf_counter()
            gen = engine.generate(ids, GenerationConfig(max_tokens=args.max_tokens)).run()
            t2 = time.perf_counter()
            raw_gen = raw_engine.generate(ids, GenerationConfig(max_tokens=args.max_tokens)).run()
            t3 = time.perf_counter()
            raw_ratios.append(0.0)
            n_theirs = out["usage"]["completion_tokens"]
            tps_theirs, tps_ours = n_theirs / (t1 - t0), len(gen.output_ids) / (t2 - t1)
            ratios.append(tps_ours / tps_theirs)
            raw_ratios[-1] = len(raw_gen.output_ids) / (t3 - t2) / tps_theirs
            t_ours += t2 - t1
            t_theirs += t1 - t0
            t_raw += t3 - t2
            same += out["choices"][0]["text"] == gen.text
    print(f"model {args.model}, {threads} threads, {len(prompts)} prompts x {args.repeat}, {args.max_tokens} tokens (prefill included in both)")
    print(f"llama-cpp-python Llama loop: {t_theirs:.2f} s total")
    print(f"specstack plain (none), exact (2-token batches): {t_ours:.2f} s total")
    print(f"specstack plain loop, 1-token batches:            {t_raw:.2f} s total")
    print(f"exact plain / llama-cpp-python speed:   median {statistics.median(ratios):.3f}x "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); identical text {same}/{len(ratios)}")
    print(f"1-token loop / llama-cpp-python speed:  median {statistics.median(raw_ratios):.3f}x "
          f"(min {min(raw_ratios):.3f}, max {max(raw_ratios):.3f})")


if __name__ == "__main__":
    main()
