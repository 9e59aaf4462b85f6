"""Write (and check) ``pycoder-mamba2-random.gguf``: a tiny pure-recurrent test model.

A steering tool, not a language model.  The weights are seeded random numbers
(plus one hand-wired layer, below); the model was never trained and says
nothing about how well any drafter works.  It exists for one purpose:
testing that speculative decoding stays lossless on an architecture whose
recurrent state llama.cpp cannot roll back.  llama.cpp's ``mamba2``
architecture is not in ``llm_arch_supports_rs_rollback``: a context asked for
``n_rs_seq > 0`` silently gets 0, and ``llama_memory_seq_rm`` of a sequence's
tail returns False, so a speculative decoder has to checkpoint the sequence
state before verifying a draft and restore it when the draft is rejected.
Output through that path must equal plain greedy decoding token for token.
NEVER use this model to measure acceptance rates or speed-ups.

It shares the pycoder vocabulary (the tokenizer metadata is copied from
specstack/models/pycoder-1m.gguf), so the bundled pycoder drafters and the
model-free drafters (prompt lookup, suffix trees) can draft for it.

Shape: mamba2, d_model 128, 2 layers, d_inner 256 (8 heads of 32), d_state 256,
1 group, conv kernel 4, vocab 4096, untied output.  token_embd, output,
ssm_in and ssm_out are F16; the rest (norms, conv1d, A, D, dt bias) F32.

Layer 1 is a Mamba-2-style random init.  Layer 0 is wired as an
"induction" layer so that greedy decoding copies from the context instead of
collapsing onto one token: the SSM is linear attention with decay, so its
B (keys) come from the *previous* token through the conv's lag-1 tap, its
C (queries) from the current token through the lag-0 tap with the same
projection, and its x (values) from the current token.  The state then
retrieves "what followed the earlier occurrences of the current token", and
the output matrix is the matched filter for those value codes.  The residual
stream is split: dims 0..63 carry the token embedding (dim 0 is a constant
"bias" channel that holds the gate z open), dims 64..127 carry the retrieved
prediction, and only those feed the logits.  Greedy continuations therefore
repeat spans of the prompt and soon settle into a loop of a few context
tokens, which gives prompt-lookup and suffix drafters drafts that get
accepted (and rejected) in tests.  Where the current token has no earlier
occurrence the prediction is noise (any token).  The distributions are not
point masses (median top-1 probability ~0.5-0.7), so sampled tests work too.

Run from the repository root:

    python scripts/make_mamba2.py build  [--out tests/fixtures/pycoder-mamba2-random.gguf]
    python scripts/make_mamba2.py validate [MODEL]   # llama.cpp vs the numpy reference below
    python scripts/make_mamba2.py state    [MODEL]   # rollback / seq-state save-restore probe

``build`` uses numpy and gguf only; ``validate`` and ``state`` need llama_cpp.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_SOURCE = ROOT / "specstack" / "models" / "pycoder-1m.gguf"
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "pycoder-mamba2-random.gguf"

ARCH = "mamba2"
SEED = 20251122
N_VOCAB = 4096
D_MODEL = 128
N_LAYER = 2
D_INNER = 256
HEAD_DIM = 32
N_HEAD = D_INNER // HEAD_DIM  # ssm.time_step_rank
D_STATE = 256
N_GROUP = 1
D_CONV = 4
EPS = 1e-5
N_CTX_TRAIN = 4096
INDUCTION_LAYER = 0

CONV_DIM = D_INNER + 2 * N_GROUP * D_STATE
D_IN_PROJ = D_INNER + CONV_DIM + N_HEAD  # z | x B C | dt
HALF = D_MODEL // 2  # residual dims [0, HALF): token embedding; [HALF, D_MODEL): prediction

F16_TENSORS = ("token_embd.weight", "output.weight", "ssm_in.weight", "ssm_out.weight")

PY_TEXT = '''import os
import sys


def read_lines(path):
    with open(path) as f:
        return [line.rstrip() for line in f]


def count_words(lines):
    counts = {}
    for line in lines:
        for word in line.split():
            counts[word] = counts.get(word, 0) + 1
    return counts


def main():
    lines = read_lines(sys.argv[1])
    counts = count_words(lines)
    for word, n in sorted(counts.items()):
        print(word, n)
'''


# ----------------------------------------------------------------------------
# reference forward pass (numpy), following llama.cpp's build_mamba2_layer and
# the CPU ggml_ssm_conv / ggml_ssm_scan kernels
# ----------------------------------------------------------------------------

def silu(x):
    return x / (1.0 + np.exp(-x))


def softplus(x):
    # ggml_compute_softplus_f32
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def rms_norm(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def matmul(x, w, f16_act):
    """x (T, n_in) @ w (n_out, n_in).T; ggml's CPU F16 matmul rounds the activations to F16 first."""
    if f16_act:
        x = x.astype(np.float16).astype(np.float32)
    return x @ w.T


def mamba2_layer(W, il, cur, f16_act=True):
    """One mixer on normalized input cur (T, D_MODEL) from an empty state; returns (T, D_MODEL)."""
    p = f"blk.{il}."
    T = cur.shape[0]
    zxbcdt = matmul(cur, W[p + "ssm_in.weight"], f16_act)
    z = zxbcdt[:, :D_INNER]
    xBC = zxbcdt[:, D_INNER:D_INNER + CONV_DIM]
    dt = zxbcdt[:, D_INNER + CONV_DIM:]

    # causal depthwise conv: window column k multiplies x_{t-(D_CONV-1)+k}
    w = W[p + "ssm_conv1d.weight"]  # (CONV_DIM, D_CONV)
    pad = np.concatenate([np.zeros((D_CONV - 1, CONV_DIM), np.float32), xBC], axis=0)
    conv = np.zeros_like(xBC)
    for k in range(D_CONV):
        conv += pad[k:k + T] * w[:, k]
    xBC = silu(conv + W[p + "ssm_conv1d.bias"])

    x = xBC[:, :D_INNER].reshape(T, N_HEAD, HEAD_DIM)
    B = xBC[:, D_INNER:D_INNER + N_GROUP * D_STATE].reshape(T, N_GROUP, D_STATE)
    C = xBC[:, D_INNER + N_GROUP * D_STATE:].reshape(T, N_GROUP, D_STATE)
    dt = softplus(dt + W[p + "ssm_dt.bias"])  # (T, N_HEAD)
    A = W[p + "ssm_a"][:, 0]  # (N_HEAD,), already -exp(A_log)
    gh = np.arange(N_HEAD) // (N_HEAD // N_GROUP)  # head -> group (repeat_interleave)

    state = np.zeros((N_HEAD, HEAD_DIM, D_STATE), np.float32)
    y = np.zeros((T, N_HEAD, HEAD_DIM), np.float32)
    for t in range(T):
        dA = np.exp(dt[t] * A)
        xdt = x[t] * dt[t][:, None]
        state = state * dA[:, None, None] + xdt[:, :, None] * B[t][gh][:, None, :]
        y[t] = np.einsum("hps,hs->hp", state, C[t][gh])

    y = y + x * W[p + "ssm_d"][:, 0][None, :, None]
    y = y * silu(z.reshape(T, N_HEAD, HEAD_DIM))  # ggml_swiglu_split(z, y)
    y = rms_norm(y.reshape(T, N_GROUP, D_INNER // N_GROUP), W[p + "ssm_norm.weight"])
    return matmul(y.reshape(T, D_INNER), W[p + "ssm_out.weight"], f16_act)


def reference_logits(W, tokens, f16_act=True):
    """Logits (T, N_VOCAB) for every position of tokens, starting from an empty state."""
    h = W["token_embd.weight"][np.asarray(tokens)].astype(np.float32)
    for il in range(N_LAYER):
        cur = rms_norm(h, W[f"blk.{il}.attn_norm.weight"])
        h = h + mamba2_layer(W, il, cur, f16_act)
    h = rms_norm(h, W["output_norm.weight"])
    return matmul(h, W["output.weight"], f16_act)


def load_weights(path):
    """All tensors of a GGUF as float32 numpy arrays in the writer's (numpy) layout."""
    import gguf

    r = gguf.GGUFReader(str(path))
    W = {}
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        W[t.name] = np.array(t.data, dtype=np.float32).reshape(shape)
    return W


# ----------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------

def inv_softplus(y):
    return y + np.log(-np.expm1(-y))


def random_layer(rng, out_scale):
    """A Mamba-2-like init, with the output projection scaled down to keep the residual sane."""
    w_in = rng.standard_normal((D_IN_PROJ, D_MODEL)) / np.sqrt(D_MODEL)
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), N_HEAD))
    return {
        "attn_norm.weight": 1.0 + 0.1 * rng.standard_normal(D_MODEL),
        "ssm_in.weight": w_in,
        "ssm_conv1d.weight": 0.5 * rng.standard_normal((CONV_DIM, D_CONV)),
        "ssm_conv1d.bias": 0.1 * rng.standard_normal(CONV_DIM),
        "ssm_dt.bias": inv_softplus(dt),
        "ssm_a": -np.exp(np.log(rng.uniform(1.0, 16.0, (N_HEAD, 1)))),
        "ssm_d": 1.0 + 0.1 * rng.standard_normal((N_HEAD, 1)),
        "ssm_norm.weight": 1.0 + 0.1 * rng.standard_normal((N_GROUP, D_INNER // N_GROUP)),
        "ssm_out.weight": out_scale * rng.standard_normal((D_MODEL, D_INNER)) / np.sqrt(D_INNER),
    }


def induction_layer(rng, key_scale=0.3, key_bias=-4.5, val_scale=0.25, gate=0.6, memory=(300, 10000)):
    """Linear attention over the context: key = previous token, query = current token, value = current token."""
    IN = slice(1, HALF)
    w_in = np.zeros((D_IN_PROJ, D_MODEL))
    # z: held open by the constant channel 0 (silu(z) ~ 3), lightly modulated by the token
    w_in[:D_INNER, 0] = gate
    w_in[:D_INNER, IN] = 0.02 * rng.standard_normal((D_INNER, HALF - 1))
    # x (values) from the current token
    xs = D_INNER
    w_in[xs:xs + D_INNER, IN] = val_scale * rng.standard_normal((D_INNER, HALF - 1))
    # B (keys) and C (queries): one shared projection; the conv taps pick which token each sees
    k = key_scale * rng.standard_normal((N_GROUP * D_STATE, HALF - 1))
    bs = xs + D_INNER
    cs = bs + N_GROUP * D_STATE
    w_in[bs:cs, IN] = k
    w_in[cs:cs + N_GROUP * D_STATE, IN] = k
    # dt rows stay zero: dt = softplus(dt_bias) = 1 per head

    conv = np.zeros((CONV_DIM, D_CONV))
    conv[:D_INNER, D_CONV - 1] = 1.0  # x: lag 0
    conv[D_INNER:D_INNER + N_GROUP * D_STATE, D_CONV - 2] = 1.0  # B: lag 1 (previous token)
    conv[D_INNER + N_GROUP * D_STATE:, D_CONV - 1] = 1.0  # C: lag 0
    conv_b = np.zeros(CONV_DIM)
    conv_b[D_INNER:] = key_bias  # sparse keys after silu (few channels active per token)
    decay = 1.0 - 1.0 / np.geomspace(*memory, N_HEAD)  # per-head memory in tokens
    return {
        "attn_norm.weight": np.ones(D_MODEL),
        "ssm_in.weight": w_in,
        "ssm_conv1d.weight": conv,
        "ssm_conv1d.bias": conv_b,
        "ssm_dt.bias": np.full(N_HEAD, inv_softplus(1.0)),
        "ssm_a": np.log(decay)[:, None],  # dt = 1, so dA = exp(A) = decay
        "ssm_d": np.full((N_HEAD, 1), 0.02),
        "ssm_norm.weight": np.ones((N_GROUP, D_INNER // N_GROUP)),
        # write the retrieved value into the prediction half of the residual
        "ssm_out.weight": np.concatenate(
            [np.zeros((HALF, D_INNER)), 1.1 * rng.standard_normal((HALF, D_INNER))], axis=0),
    }


def f16(a):
    return np.asarray(a, np.float16).astype(np.float32)


def build_weights(seed=SEED, logit_scale=2.0):
    """The tensors to write, as float32 arrays already rounded to their stored precision."""
    rng = np.random.default_rng(seed)
    W = {}
    emb = np.zeros((N_VOCAB, D_MODEL))
    emb[:, 0] = 4.0
    emb[:, 1:HALF] = rng.standard_normal((N_VOCAB, HALF - 1))
    W["token_embd.weight"] = emb
    for il in range(N_LAYER):
        layer = induction_layer(rng) if il == INDUCTION_LAYER else random_layer(rng, 0.3)
        for name, a in layer.items():
            W[f"blk.{il}.{name}"] = a
    W["output_norm.weight"] = np.ones(D_MODEL)
    # The values are silu outputs with a large common component; project it out of the
    # induction layer's output, so that a retrieved mixture of values reads as its tokens
    # and not as one direction shared by every token.
    y = value_inputs(W)
    mu = y.mean(axis=0)
    mu /= np.linalg.norm(mu)
    o = W[f"blk.{INDUCTION_LAYER}.ssm_out.weight"]
    W[f"blk.{INDUCTION_LAYER}.ssm_out.weight"] = o - np.outer(o @ mu, mu)
    W = {k: (f16(v) if k.endswith(F16_TENSORS) else np.asarray(v, np.float32)) for k, v in W.items()}

    # Output: the matched filter of each token's value code.  Push every token through
    # the induction layer as if it were the whole retrieved context, read the prediction
    # half that the layer writes, centre and normalize.
    W["output.weight"] = np.zeros((N_VOCAB, D_MODEL), np.float32)
    codes = value_codes(W)
    codes -= codes.mean(axis=0)
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    out = np.zeros((N_VOCAB, D_MODEL))
    out[:, HALF:] = logit_scale * codes
    W["output.weight"] = f16(out)
    return W


def value_codes(W):
    """(N_VOCAB, HALF): what the induction layer writes when it retrieves token j."""
    y = value_inputs(W)
    return (y @ W[f"blk.{INDUCTION_LAYER}.ssm_out.weight"].T)[:, HALF:]


def value_inputs(W):
    """(N_VOCAB, D_INNER): the induction layer's normed, gated SSM output when it retrieves token j."""
    il = INDUCTION_LAYER
    p = f"blk.{il}."
    h = W["token_embd.weight"].astype(np.float32)
    assert il == 0, "the codes are computed from the embeddings"
    cur = rms_norm(h, W[p + "attn_norm.weight"])
    zx = cur @ W[p + "ssm_in.weight"].T
    z = zx[:, :D_INNER]
    x = silu(zx[:, D_INNER:2 * D_INNER] + W[p + "ssm_conv1d.bias"][:D_INNER])
    y = x * silu(z)
    return rms_norm(y.reshape(-1, N_GROUP, D_INNER // N_GROUP), W[p + "ssm_norm.weight"]).reshape(-1, D_INNER)


def write_gguf(W, path):
    import gguf

    src = gguf.GGUFReader(str(TOKENIZER_SOURCE))

    def field(name):
        return src.fields[name].contents()

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("pycoder-mamba2-random")
    w.add_description("random-weight mamba2 test model (pycoder vocab); for losslessness tests only")
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(D_MODEL)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(N_LAYER)
    w.add_ssm_conv_kernel(D_CONV)
    w.add_ssm_inner_size(D_INNER)
    w.add_ssm_state_size(D_STATE)
    w.add_ssm_time_step_rank(N_HEAD)
    w.add_ssm_group_count(N_GROUP)
    w.add_layer_norm_rms_eps(EPS)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    w.add_tokenizer_model(field("tokenizer.ggml.model"))
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(field("tokenizer.ggml.tokens"))
    w.add_token_types(field("tokenizer.ggml.token_type"))
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    w.add_add_bos_token(field("tokenizer.ggml.add_bos_token"))

    order = ["token_embd.weight", "output_norm.weight", "output.weight"]
    order += sorted((k for k in W if k.startswith("blk.")), key=lambda k: (int(k.split(".")[1]), k))
    for name in order:
        a = W[name]
        w.add_tensor(name, a.astype(np.float16) if name.endswith(F16_TENSORS) else a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------

def induction_score(W, rng, n=40, trials=5):
    """Greedy next-token accuracy on the second copy of a repeated random token sequence."""
    hits = 0
    for _ in range(trials):
        seq = rng.integers(1, N_VOCAB, n)
        toks = np.concatenate([[0], seq, seq])
        pred = reference_logits(W, toks, f16_act=False).argmax(-1)
        hits += int((pred[n + 1:2 * n] == toks[n + 2:2 * n + 1]).sum())
    return hits / (trials * (n - 1))


def cmd_build(args):
    t0 = time.time()
    W = build_weights(args.seed)
    out = Path(args.out)
    write_gguf(W, out)
    data = out.read_bytes()
    print(f"wrote {out} ({len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}) in {time.time() - t0:.1f}s")
    W2 = load_weights(out)
    assert set(W2) == set(W) and all(np.array_equal(W2[k], W[k]) for k in W), "GGUF round trip differs"
    print(f"induction accuracy (repeated random tokens): {induction_score(W, np.random.default_rng(1)):.3f}")


def _llama(path, **kw):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=256, verbose=False, **kw)


def cmd_validate(args):
    path = Path(args.model)
    llm = _llama(path)
    toks = llm.tokenize(PY_TEXT.encode())[: args.n]
    W = load_weights(path)

    llm.reset()
    llm.eval(toks)
    batched = np.array(llm.scores[: len(toks)], dtype=np.float32)
    llm.reset()
    for t in toks:
        llm.eval([t])
    single = np.array(llm.scores[: len(toks)], dtype=np.float32)

    print(f"model {path.name}: {len(toks)} tokens of Python text")
    print(f"logit range (llama.cpp): [{batched.min():.2f}, {batched.max():.2f}], "
          f"finite={bool(np.isfinite(batched).all())}")
    for label, f16_act in (("f32 activations", False), ("f16-rounded activations", True)):
        ref = reference_logits(W, toks, f16_act)
        d = np.abs(ref - batched)
        agree = (ref.argmax(-1) == batched.argmax(-1)).mean()
        print(f"reference ({label}) vs llama.cpp batched: argmax agreement {agree:.3f}, "
              f"max|dlogit| {d.max():.2e}, mean|dlogit| {d.mean():.2e}")
    llm.reset()
    for i in range(0, len(toks), 5):
        llm.eval(toks[i:i + 5])
    chunked = np.array(llm.scores[: len(toks)], dtype=np.float32)
    for label, other in (("one-token-at-a-time", single), ("in chunks of 5", chunked)):
        d = np.abs(other - batched)
        print(f"llama.cpp {label} vs batched: argmax agreement "
              f"{(other.argmax(-1) == batched.argmax(-1)).mean():.3f}, max|dlogit| {d.max():.2e}")

    # greedy continuation, for a look at the model's behaviour
    llm.reset()
    out = []
    for tok in llm.generate(toks, temp=0.0, top_k=1):
        out.append(tok)
        if len(out) >= args.gen:
            break
    text = llm.detokenize(out).decode("utf-8", "replace")
    print(f"greedy continuation ({len(out)} tokens, {len(set(out))} distinct):\n{text!r}")
    ctx = set(toks)
    print(f"fraction of generated tokens present in the prompt: {np.mean([t in ctx for t in out]):.2f}")


def cmd_state(args):
    import ctypes

    import llama_cpp as lc

    path = Path(args.model)
    llm = _llama(path)
    model = llm._model.model
    print("llama_model_is_recurrent:", bool(lc.llama_model_is_recurrent(model)),
          " llama_model_is_hybrid:", bool(lc.llama_model_is_hybrid(model)))

    cp = lc.llama_context_default_params()
    cp.n_ctx = 512
    cp.n_batch = 512
    cp.n_seq_max = 2
    cp.n_rs_seq = 4
    ctx = lc.llama_init_from_model(model, cp)
    print("llama_init_from_model(n_rs_seq=4, n_seq_max=2):", "NULL" if not ctx else "ok",
          " llama_n_rs_seq(ctx) =", lc.llama_n_rs_seq(ctx) if ctx else None)
    mem = lc.llama_get_memory(ctx)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    toks = llm.tokenize(PY_TEXT.encode())[:20]

    def decode(tokens, pos0, seq=0):
        b = lc.llama_batch_init(len(tokens), 0, 1)
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1
        b.n_tokens = len(tokens)
        rc = lc.llama_decode(ctx, b)
        assert rc == 0, rc
        out = np.array([np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
                        for i in range(len(tokens))])
        lc.llama_batch_free(b)
        return out

    decode(toks[:10], 0)
    print("pos_max after 10 tokens:", lc.llama_memory_seq_pos_max(mem, 0))
    ok = lc.llama_memory_seq_rm(mem, 0, 8, -1)
    print("llama_memory_seq_rm(mem, 0, 8, -1) ->", bool(ok), " pos_max:", lc.llama_memory_seq_pos_max(mem, 0))

    flags = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if hasattr(lc, "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY") else 1
    for fl in (0, flags):
        size = lc.llama_state_seq_get_size_ext(ctx, 0, fl)
        print(f"llama_state_seq_get_size_ext(ctx, 0, flags={fl}) = {size} bytes")
    size = lc.llama_state_seq_get_size_ext(ctx, 0, flags)
    buf = (ctypes.c_uint8 * size)()
    t0 = time.perf_counter()
    n = lc.llama_state_seq_get_data_ext(ctx, buf, size, 0, flags)
    print(f"first save right after a decode: {(time.perf_counter() - t0) * 1e6:.1f} us")
    reps = 200  # the averages below are cache-hot
    t0 = time.perf_counter()
    for _ in range(reps):
        n = lc.llama_state_seq_get_data_ext(ctx, buf, size, 0, flags)
    t_save = (time.perf_counter() - t0) / reps
    first = decode(toks[10:15], 10)
    t0 = time.perf_counter()
    for _ in range(reps):
        m = lc.llama_state_seq_set_data_ext(ctx, buf, n, 0, flags)
    t_restore = (time.perf_counter() - t0) / reps
    print(f"saved {n} bytes in {t_save * 1e6:.1f} us; set_data_ext returned {m} in {t_restore * 1e6:.1f} us")
    print("pos_max after restore:", lc.llama_memory_seq_pos_max(mem, 0))
    second = decode(toks[10:15], 10)
    print("logits after restore identical to the first time:", bool(np.array_equal(first, second)),
          f"(max|d| {np.abs(first - second).max():.1e})")
    m = lc.llama_state_seq_set_data_ext(ctx, buf, n, 1, flags)
    third = decode(toks[10:15], 10, seq=1)
    print(f"restored into seq 1 (returned {m}); logits there identical:", bool(np.array_equal(first, third)))
    pmax = lc.llama_memory_seq_pos_max(mem, 0)
    print(f"llama_memory_seq_rm(mem, 0, {pmax + 1}, -1) (nothing to remove) ->",
          bool(lc.llama_memory_seq_rm(mem, 0, pmax + 1, -1)))
    print("llama_memory_seq_rm(mem, 0, 0, -1) (whole sequence) ->", bool(lc.llama_memory_seq_rm(mem, 0, 0, -1)),
          " pos_max:", lc.llama_memory_seq_pos_max(mem, 0))
    lc.llama_free(ctx)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the GGUF")
    b.add_argument("--out", default=str(DEFAULT_OUT))
    b.add_argument("--seed", type=int, default=SEED)
    v = sub.add_parser("validate", help="compare llama.cpp's logits with the numpy reference")
    v.add_argument("model", nargs="?", default=str(DEFAULT_OUT))
    v.add_argument("--n", type=int, default=48, help="tokens to evaluate")
    v.add_argument("--gen", type=int, default=64, help="greedy tokens to print")
    s = sub.add_parser("state", help="probe recurrent-state rollback and seq state save/restore")
    s.add_argument("model", nargs="?", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    {"build": cmd_build, "validate": cmd_validate, "state": cmd_state}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
