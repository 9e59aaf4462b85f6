"""Make the bundled DFlash draft head ``pycoder-6m-dflash``: a two-layer block-diffusion head over pycoder-6m.

Steering tool, not part of the product (design: ``docs/design-eagle3-dflash.md``, sections 1, 2 and 5).
llama.cpp (the tree vendored in llama-cpp-python 0.3.36) runs DFlash heads as the ``dflash`` architecture
(``--spec-type draft-dflash``); this script trains one for the bundled target and writes it in the exact
layout that arch loads (the plain DFlash branch: no DSpark Markov head, no DFlash2 selector, no DSV4 stages),
so specstack's drafter and llama.cpp's own binary can both run it.

The head, as ``V/src/models/dflash.cpp`` computes it (V = the vendored llama.cpp tree):

    embedding batch (one row per verified target position p, the target's layer inputs [L1|L3|L5]_p):
        g_p = rms(fc . [L1|L3|L5]_p) * enc.output_norm
        per layer l:  K_l[p] = rope(rms_head(Wk_l g_p) * k_norm_l, p),  V_l[p] = Wv_l g_p   -> the KV cache
        (no attention, no attn_norm: dflash.cpp:607-673)
    token batch [x_n, MASK x (L-1)] at positions n..n+L-1 (MASK = tokenizer.ggml.mask_token_id = 0):
        x = emb(tokens)                               the target's token_embd, borrowed (ctx_other)
        per layer: h = rms(x) * attn_norm
                   q, k, v = rope(rms_head(Wq h) * q_norm), rope(rms_head(Wk h) * k_norm), Wv h   (NEOX rope)
                   x = x + Wo . attn(q, [K_l ctx | k], [V_l ctx | v])   non-causal over every cell of the
                                                   sequence: injected context p < n and the whole block
                   x = x + down(silu(gate y) * up y),  y = rms(x) * ffn_norm
        logits = output . (rms(x) * output_norm)     the target's (tied) output, borrowed (ctx_other)
    Slot i >= 1 of the block predicts the token at n+i (common/speculative.cpp:1296-1318).

llama.cpp's driver (``common_speculative_impl_draft_dflash``) injects every target-verified row, the caller cuts
rejected rows (``seq_rm``), so the context at a draft is exactly the positions < n; the block is always
``n_max + 1`` long (n_max clamped to ``block_size - 1``; the per-call budget ``dp.n_max`` is not read), and its
KV rows are cut before verification.

Training (``train``): the frozen target (``make_eagle3_head.load_target``) gives the layer inputs and the
teacher on the fly; per 512-token window, context K/V for every position once, then A random anchors n with
blocks ``[x_n, MASK x (L-1)]`` (L per step: 8 half of the time, else uniform in 2..8) attending to context
positions < n and their own block; loss = soft cross-entropy of slot i against the target's distribution at
n+i-1 (its prediction of x_{n+i}), over the full vocabulary.

Commands (python = the torch venv with system site packages: torch CPU, numpy, gguf, llama-cpp-python):

  python scripts/make_dflash_head.py corpus WORK     # reuse (or make) the EAGLE-3 corpus: train/held ids
  python scripts/make_dflash_head.py random OUT.gguf # a random-weight head (the training init) in the layout
  THREADS=1 TIME_BUDGET=2100 nice -n 19 python scripts/make_dflash_head.py train WORK
  python scripts/make_dflash_head.py export WORK     # -> specstack/models/pycoder-6m-dflash.gguf
  python scripts/make_dflash_head.py validate WORK   # torch vs llama.cpp; llama-speculative-simple acceptance

Environment: SRC (target GGUF), GGUF (head path), THREADS, TIME_BUDGET (cosine over wall time, seconds),
BATCH (windows per step), ANCHORS (blocks per window), LR, SEED, N_PROMPTS, N_GEN, N_MAX (validate).
"""
import ctypes, hashlib, math, os, re, subprocess, sys, time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_eagle3_head as e3  # noqa: E402  (corpus, the frozen target, tokenizer copy, prompts, ext calls)

REPO = e3.REPO
SRC = e3.SRC
GGUF = Path(os.environ.get("GGUF", REPO / "specstack" / "models" / "pycoder-6m-dflash.gguf"))
BINS = e3.BINS
SEQ = e3.SEQ
E, H, KV, HD, V = e3.E, e3.H, e3.KV, e3.HD, e3.V   # draft n_embd must equal the target's (driver sizes)
FF = 768                                    # the head's SwiGLU width
N_LAYER = 2
BLOCK = 8                                   # dflash.block_size: drafts <= 7
MASK_ID = 0                                 # <|endoftext|>: slot 0 is always the anchor, slots >= 1 masks
LAYERS = e3.LAYERS                          # (1, 3, 5)
EPS = e3.EPS
ROPE_BASE = e3.ROPE_BASE
THREADS = e3.THREADS
ARCH = "dflash"                             # MODEL_ARCH.DFLASH, constants.py:1397
KEY_TARGET_LAYERS = "{arch}.target_layers"  # constants.py:166
KEY_BLOCK_SIZE = "{arch}.block_size"        # llama-arch.cpp:374
KEY_MASK_ID = "tokenizer.ggml.mask_token_id"  # llama-arch.cpp:402; llama_vocab_mask is -1 without it


# -- the head in torch ---------------------------------------------------------------------------------

def build_head(embed):
    """The dflash head; ``embed`` is the target's token_embd (frozen; llama.cpp borrows it through
    ctx_other both as the input embedding and, tied, as the lm head)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def rms(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, EPS)

    class Layer(nn.Module):
        def __init__(self, r):
            super().__init__()
            self.attn_norm, self.ffn_norm = nn.Parameter(torch.ones(E)), nn.Parameter(torch.ones(E))
            self.q_norm, self.k_norm = nn.Parameter(torch.ones(HD)), nn.Parameter(torch.ones(HD))
            self.wq, self.wk, self.wv = r(H * HD, E), r(KV * HD, E), r(KV * HD, E)
            self.wo = r(E, H * HD, std=0.01)
            self.gate, self.up, self.down = r(FF, E), r(FF, E), r(E, FF, std=0.01)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(int(os.environ.get("SEED", "0")))
            r = lambda *s, std=0.02: nn.Parameter(torch.randn(*s, generator=g) * std)
            self.register_buffer("embed", embed, persistent=False)
            fc = torch.randn(E, 3 * E, generator=g) * 0.02
            fc[:, 2 * E:] += torch.eye(E)  # start from the deepest named layer's state passed through
            self.fc = nn.Parameter(fc)
            self.enc_norm, self.output_norm = nn.Parameter(torch.ones(E)), nn.Parameter(torch.ones(E))
            self.layers = nn.ModuleList(Layer(r) for _ in range(N_LAYER))
            inv = 1.0 / (ROPE_BASE ** (torch.arange(0, HD, 2).float() / HD))
            ang = torch.arange(SEQ + BLOCK).float()[:, None] * inv[None, :]
            self.register_buffer("cos", ang.cos(), persistent=False)  # [P, HD/2]
            self.register_buffer("sin", ang.sin(), persistent=False)

        def rope(self, x, pos):
            """llama.cpp ROPE_TYPE_NEOX: rotate the halves (i, i + HD/2). x [B,heads,T,HD], pos [B,T]."""
            cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
            x1, x2 = x[..., :HD // 2], x[..., HD // 2:]
            return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1)

        def encode(self, feats):
            """[B,T,3E] layer inputs -> g [B,T,E] (fc, then enc.output_norm)."""
            return rms(feats @ self.fc.T, self.enc_norm)

        def context_kv(self, g, pos):
            """What the embedding batch writes into each layer's KV cache: [(K, V) [B,KV,T,HD]]."""
            B, T, _ = g.shape
            out = []
            for L in self.layers:
                k = rms((g @ L.wk.T).view(B, T, KV, HD), L.k_norm).transpose(1, 2)
                v = (g @ L.wv.T).view(B, T, KV, HD).transpose(1, 2)
                out.append((self.rope(k, pos), v))
            return out

        def block(self, tok, pos, ctx, mask):
            """Token rows tok/pos [B,R] attend to ``ctx`` (context K/V per layer) and to the rows themselves
            under ``mask`` [B,1,R,Tc+R] (True = visible) -> (final hidden [B,R,E], logits [B,R,V])."""
            B, R = tok.shape
            x = self.embed[tok]
            for L, (kc, vc) in zip(self.layers, ctx):
                h = rms(x, L.attn_norm)
                q = self.rope(rms((h @ L.wq.T).view(B, R, H, HD), L.q_norm).transpose(1, 2), pos)
                k = self.rope(rms((h @ L.wk.T).view(B, R, KV, HD), L.k_norm).transpose(1, 2), pos)
                v = (h @ L.wv.T).view(B, R, KV, HD).transpose(1, 2)
                o = F.scaled_dot_product_attention(q, torch.cat((kc, k), 2), torch.cat((vc, v), 2),
                                                   attn_mask=mask, enable_gqa=True)
                x = x + o.transpose(1, 2).reshape(B, R, H * HD) @ L.wo.T
                y = rms(x, L.ffn_norm)
                x = x + (F.silu(y @ L.gate.T) * (y @ L.up.T)) @ L.down.T
            x = rms(x, self.output_norm)
            return x, x @ self.embed.T

        def gguf_tensors(self):
            n = lambda p: p.detach().float().numpy()
            out = {"fc.weight": n(self.fc), "enc.output_norm.weight": n(self.enc_norm),
                   "output_norm.weight": n(self.output_norm)}
            for i, L in enumerate(self.layers):
                b = f"blk.{i}."
                out.update({b + "attn_norm.weight": n(L.attn_norm), b + "attn_q.weight": n(L.wq),
                            b + "attn_k.weight": n(L.wk), b + "attn_v.weight": n(L.wv),
                            b + "attn_output.weight": n(L.wo), b + "attn_q_norm.weight": n(L.q_norm),
                            b + "attn_k_norm.weight": n(L.k_norm), b + "ffn_norm.weight": n(L.ffn_norm),
                            b + "ffn_gate.weight": n(L.gate), b + "ffn_up.weight": n(L.up),
                            b + "ffn_down.weight": n(L.down)})
            return out

    return Head()


def blocks_batch(tok, anchors, L):
    """Block rows for anchors [B,A] in windows tok [B,T]: (tokens [B,A*L], positions [B,A*L], mask
    [B,1,A*L,T+A*L]): each block ``[x_n, MASK x (L-1)]`` at n..n+L-1 sees context positions < n and its own
    block, as llama.cpp's non-causal KV mask shows it after the driver's seq_rm."""
    import torch
    B, T = tok.shape
    A = anchors.shape[1]
    off = torch.arange(L)
    pos = (anchors[:, :, None] + off).reshape(B, A * L)
    rows = torch.full((B, A, L), MASK_ID, dtype=torch.long)
    rows[:, :, 0] = torch.gather(tok, 1, anchors)
    ctx_vis = torch.arange(T)[None, None, :] < anchors.repeat_interleave(L, 1)[:, :, None]   # [B,AL,T]
    blk = torch.arange(A).repeat_interleave(L)
    own = (blk[:, None] == blk[None, :])[None].expand(B, -1, -1)                              # [B,AL,AL]
    return rows.reshape(B, A * L), pos, torch.cat((ctx_vis, own), 2)[:, None]


def _target_embed():
    """The target's token_embd (F16 -> F32), the only target tensor the head reads."""
    import torch
    return torch.from_numpy(e3._gguf_tensors(SRC)["token_embd.weight"].astype(np.float32))


# -- corpus ----------------------------------------------------------------------------------------

def corpus(work: Path):
    """Reuse the EAGLE-3 corpus (llama.cpp tokenization, held-out rule) when WORK holds it, else make it."""
    if not (work / "train_ids.npy").exists():
        e3._mtp_script().corpus(work)
    ids, held = np.load(work / "train_ids.npy"), np.load(work / "held_ids.npy")
    print(f"train tokens {len(ids)}; held-out tokens {len(held)}")


# -- GGUF ------------------------------------------------------------------------------------------------

def write_gguf(out: Path, tensors: dict, name: str):
    """The dflash GGUF (design section 1): keys, tokenizer + mask id, matrices F16, norms F32; no token_embd
    nor output (borrowed from the target through ctx_other). Written to a temporary name, then renamed."""
    import gguf
    src = gguf.GGUFReader(str(SRC))
    f = lambda k: src.fields[k].contents()
    assert (f("llama.embedding_length"), f("llama.attention.head_count"), f("llama.attention.head_count_kv")) == (E, H, KV)
    assert max(LAYERS) < f("llama.block_count")
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    w.add_name(name)
    w.add_context_length(SEQ)
    w.add_embedding_length(E)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(FF)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_rope_dimension_count(HD)
    w.add_array(KEY_TARGET_LAYERS.format(arch=ARCH), [int(i) for i in LAYERS])   # INT32 array
    w.add_uint32(KEY_BLOCK_SIZE.format(arch=ARCH), BLOCK)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    e3._copy_tokenizer(w, src)
    w.add_uint32(KEY_MASK_ID, MASK_ID)
    for key, arr in tensors.items():
        arr = np.asarray(arr, np.float32)
        w.add_tensor(key, arr if arr.ndim == 1 else arr.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)


def random_head(out: Path):
    """The training init (SEED) written as a head: the layout check, before any training."""
    head = build_head(_target_embed())
    write_gguf(out, head.gguf_tensors(), "pycoder-6m-dflash-random")
    print(f"wrote {out} ({out.stat().st_size} bytes); sha256 {hashlib.sha256(out.read_bytes()).hexdigest()}")


if __name__ == "__main__":
    cmd, arg = sys.argv[1], Path(sys.argv[2])
    if cmd == "random":
        random_head(arg)
        sys.exit(0)
    arg.mkdir(parents=True, exist_ok=True)
    {"corpus": corpus}[cmd](arg)
