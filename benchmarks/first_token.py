"""First token on a model never seen before: specstack generate against llama-completion's load plus first token.

Each round, interleaved: ``llama-completion -n 1`` (its whole wall time: load, prompt, one token), then
``specstack generate`` with an empty cache (cold: its shapes and costs are then measured beside the
generation) and again with that cache (warm).  specstack's figure is the time from process start to
the first byte on stdout, which is its first token.

    python benchmarks/first_token.py -m gemma-3-270m-q4_k_m.gguf -t 2 --llama-cpp-bin ~/.cache/specstack/llama-bins/bin
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "The capital of France is"


def peer(binary: Path, model: Path, threads: int) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(binary), "-m", str(model), "-p", PROMPT, "-n", "1", "-t", str(threads), "--temp", "0", "-no-cnv"],
                   capture_output=True, check=True)
    return time.perf_counter() - t0


def ours(model: Path, threads: int, cache: Path) -> tuple[float, float]:
    """Seconds to the first stdout byte, and to exit."""
    env = {**os.environ, "SPECSTACK_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "specstack", "generate", "-m", str(model), "-p", PROMPT, "-n", "40",
                             "-t", str(threads)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.perf_counter() - t0
    proc.communicate()
    return first, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-cpp-bin", type=Path, default=Path.home() / ".cache/specstack/llama-bins/bin")
    args = ap.parse_args()
    binary = args.llama_cpp_bin / "llama-completion"
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for r in range(args.rounds):
            base = peer(binary, args.model, args.threads)
            shutil.rmtree(cache, ignore_errors=True)
            cold, cold_exit = ours(args.model, args.threads, cache)
            warm, _ = ours(args.model, args.threads, cache)
            print(f"round {r + 1}: llama-completion load + 1 token {base:.2f} s | specstack first token cold {cold:.2f} s "
                  f"({cold / base:.2f}x; exits after {cold_exit:.1f} s) | warm {warm:.2f} s ({warm / base:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
