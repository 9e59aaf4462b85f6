"""What a verification row costs on this machine and llama.cpp build: t(n) for n rows with logits for every row.

    python scripts/row_cost.py MODEL.gguf [THREADS] [stock|specstack] [DEPTH]

It calls llama-cpp-python directly, not through specstack, on purpose: it measures the build (llamafile's tinyBLAS
on or off, say), so that two builds installed in two environments can be compared with one script, and nothing of
specstack's loop is in the figures.  The third argument picks the CPU backend: llama-cpp-python's own (``stock``, the
default) or specstack's build with its verification kernels (``specstack``, ``docs/kernels.md``), loaded before
llama_cpp is imported.  n rows are decoded at depth 250 (or DEPTH) and removed again; each figure is the fastest
of 9 (interference only adds time).  ``docs/drafters.md`` ("What a verified row costs") has what it measured.
"""

from __future__ import annotations

import sys
import time

if len(sys.argv) > 3 and sys.argv[3] == "specstack":
    from specstack.llama import kernel_status  # loads specstack's libggml-cpu before llama_cpp

    print(kernel_status().line())
elif len(sys.argv) > 3 and sys.argv[3] != "stock":
    raise SystemExit(f"the backend is stock or specstack, not {sys.argv[3]!r}")

import llama_cpp as lc  # noqa: E402

DEPTH = 250
REPS = 9
SIZES = (1, 2, 3, 4, 8, 16, 17)


def main(path: str, threads: int) -> None:
    lc.llama_backend_init()
    quiet = lc.llama_log_callback(lambda *_: None)  # kept alive for the process: llama.cpp calls it later
    lc.llama_log_set(quiet, None)
    model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    params.n_ctx, params.no_perf, params.flash_attn_type = 4096, True, 1
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    memory = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(512, 0, 1)

    def decode(ids: list[int], pos0: int, all_logits: bool) -> None:
        batch.n_tokens = len(ids)
        for i, tok in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos0 + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = all_logits or i == len(ids) - 1
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit(f"llama_decode failed on {len(ids)} rows")

    def seconds(n: int) -> float:
        best = float("inf")
        for _ in range(REPS):
            start = time.perf_counter()
            decode([100 + i for i in range(n)], DEPTH, True)
            best = min(best, time.perf_counter() - start)
            lc.llama_memory_seq_rm(memory, 0, DEPTH, -1)
        return best

    for start in range(0, DEPTH, 512):  # the prefill, in calls no wider than the batch
        decode([(i * 7919) % 1000 + 10 for i in range(start, min(start + 512, DEPTH))], start, False)
    print(lc.llama_print_system_info().decode().strip())
    seconds(1)  # a first call allocates the graph: not a row's cost
    one = seconds(1)
    print(" n   t(n) ms  t(n)/t(1)")
    for n in SIZES:
        t = seconds(n)
        print(f"{n:2d} {t * 1000:9.2f} {t / one:10.2f}")
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    if len(sys.argv) > 4:
        DEPTH = int(sys.argv[4])
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
