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
BATCH (windows per step), ANCHORS (blocks per window), LR, SEED, QK_INIT (q/k norm init: attention sharpness),
N_PROMPTS, N_GEN, N_MAX (validate: comma-separated --spec-draft-n-max values), HEAD (validate another GGUF).
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
            qk = float(os.environ.get("QK_INIT", "2.0"))
            self.q_norm, self.k_norm = nn.Parameter(torch.full((HD,), qk)), nn.Parameter(torch.full((HD,), qk))
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



def _load_head(path: Path):
    """A torch head holding a GGUF head's weights (F16 -> F32): what llama.cpp runs, bit for bit in weights."""
    import torch
    head = build_head(_target_embed())
    T = e3._gguf_tensors(path)
    names = head.gguf_tensors().keys()
    params = dict(zip(names, [head.fc, head.enc_norm, head.output_norm]
                      + [p for L in head.layers for p in (L.attn_norm, L.wq, L.wk, L.wv, L.wo, L.q_norm, L.k_norm,
                                                           L.ffn_norm, L.gate, L.up, L.down)]))
    with torch.no_grad():
        for k, prm in params.items():
            prm.copy_(torch.from_numpy(T[k].astype(np.float32)).view_as(prm))
    head.eval()
    return head


# -- training --------------------------------------------------------------------------------------------

def _soft_ce(logits, teacher_logits):
    """Soft cross-entropy against the teacher's full distribution."""
    import torch.nn.functional as F
    return -(F.softmax(teacher_logits, -1) * F.log_softmax(logits, -1)).sum(-1).mean()


def _block_len(rng) -> int:
    """8 (what llama.cpp's driver runs at n_max 7) half of the time, else uniform in 2..8, so shorter
    blocks (a smaller n_max, specstack's k policies) are trained too."""
    return BLOCK if rng.random() < 0.5 else int(rng.integers(2, BLOCK + 1))


def block_loss(head, target, t, anchors, L):
    """Windows t [B,T], anchors [B,A], block length L -> (loss, per-slot argmax agreement with the target)."""
    import torch
    B, T = t.shape
    A = anchors.shape[1]
    with torch.no_grad():
        feats, tl = e3.target_forward(target, t)
    pos_ctx = torch.arange(T)[None].expand(B, -1)
    ctx = head.context_kv(head.encode(feats), pos_ctx)
    rows, pos, mask = blocks_batch(t, anchors, L)
    _, lg = head.block(rows, pos, ctx, mask)
    lg = lg.view(B, A, L, V)[:, :, 1:]                                   # slots 1..L-1
    want = (anchors[:, :, None] + torch.arange(L - 1)).reshape(B, -1)     # the target at n+i-1 predicts n+i
    teach = torch.gather(tl, 1, want[:, :, None].expand(-1, -1, V)).view(B, A, L - 1, V)
    loss = _soft_ce(lg.reshape(-1, V), teach.reshape(-1, V))
    with torch.no_grad():
        agree = (lg.argmax(-1) == teach.argmax(-1)).float().mean((0, 1))
    return loss, agree


def train(work: Path):
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(THREADS)
    ids = np.load(work / "train_ids.npy")
    target = e3.load_target()
    head = build_head(target.embed.weight.detach().clone())
    params = [p for p in head.parameters() if p.requires_grad]
    B, A = int(os.environ.get("BATCH", "4")), int(os.environ.get("ANCHORS", "64"))
    print(f"head: {sum(p.numel() for p in params) / 1e6:.3f}M trainable params; {B} windows x {A} blocks a step; "
          f"{len(ids)} training tokens", flush=True)
    lr0 = float(os.environ.get("LR", "2e-3"))
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim == 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=lr0, betas=(0.9, 0.95))
    warm = 20
    budget = float(os.environ.get("TIME_BUDGET", "2100"))
    rng = np.random.default_rng(int(os.environ.get("SEED", "0")) + 1)
    t0, step, hist = time.time(), 0, []
    while (time.time() - t0) < budget:
        frac = (time.time() - t0) / budget
        lr = lr0 * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for pg in opt.param_groups:
            pg["lr"] = lr
        L = _block_len(rng)
        starts = rng.integers(0, len(ids) - SEQ, B)
        t = torch.from_numpy(np.stack([ids[s:s + SEQ] for s in starts]).astype(np.int64))
        anchors = torch.from_numpy(rng.integers(1, SEQ - L + 1, (B, A)))
        loss, agree = block_loss(head, target, t, anchors, L)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        hist.append((L, loss.item(), agree.numpy()))
        if step % 10 == 0:
            last = hist[-10:]
            full = [a for l, _, a in hist[-40:] if l == BLOCK]
            acc = " ".join(f"{x:.2f}" for x in np.mean(full, 0)) if full else "-"
            print(f"step {step} L {L} loss {np.mean([x for _, x, _ in last]):.3f} agree@slot(L=8, last 40) {acc} "
                  f"lr {lr:.2e} {time.time() - t0:.0f}s ({(time.time() - t0) / (step + 1):.2f}s/step)", flush=True)
        if step % 50 == 0:
            torch.save({"state": head.state_dict(), "step": step}, work / "head.pt")
        step += 1
    torch.save({"state": head.state_dict(), "step": step, "seconds": time.time() - t0}, work / "head.pt")
    full = [a for l, _, a in hist[-100:] if l == BLOCK]
    print(f"done: {step} steps ({step * B} windows, {step * B * A} blocks) in {time.time() - t0:.0f}s; "
          f"last-20 mean loss {np.mean([x for _, x, _ in hist[-20:]]):.3f}; agreement by slot at L=8 (last 100 steps) "
          f"{np.mean(full, 0).round(3).tolist() if full else '-'}", flush=True)


def _trained(work: Path):
    import torch
    head = build_head(_target_embed())
    ck = torch.load(work / "head.pt")
    head.load_state_dict(ck["state"])
    head.eval()
    return head, ck


def export(work: Path):
    head, ck = _trained(work)
    write_gguf(GGUF, head.gguf_tensors(), "pycoder-6m-dflash")
    print(f"wrote {GGUF} ({GGUF.stat().st_size} bytes; head from step {ck['step']}); "
          f"sha256 {hashlib.sha256(GGUF.read_bytes()).hexdigest()}")


# -- validation -------------------------------------------------------------------------------------------

def binary_acceptance(work: Path, head_path: Path, n_max: int) -> list:
    """llama.cpp's own ``llama-speculative-simple --spec-type draft-dflash``: (prompt, drafted, accepted,
    predicted) per held-out prompt (``make_eagle3_head._prompts``: the first N_PROMPTS files cut at ~900 chars)."""
    n_gen = os.environ.get("N_GEN", "128")
    rows = []
    for name, path in e3._prompts(work):
        cmd = [str(BINS / "llama-speculative-simple"), "-m", str(SRC), "-f", str(path), "-n", n_gen, "-t", "1",
               "--temp", "0", "-s", "1", "-md", str(head_path), "--spec-type", "draft-dflash",
               "--spec-draft-n-max", str(n_max)]
        for _ in range(3):  # the binary's async logger can exit before its last lines are written: retry
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            log = r.stdout + r.stderr
            get = lambda k: int(m.group(1)) if (m := re.search(rf"{k}\s*=\s*(\d+)", log)) else None
            if r.returncode != 0 or get("n_accept") is not None:
                break
        if r.returncode != 0 or get("n_drafted") is None:
            print(f"FAILED rc={r.returncode}: {' '.join(cmd)}\n{log[-3000:]}")
            rows.append((name, None, None, None))
            continue
        rows.append((name, get("n_drafted"), get("n_accept"), get("n_predict")))
        (work / "prompts" / (path.stem + f".dflash.k{n_max}.log")).write_text(log)
    return rows


class _Llama:
    """pycoder-6m and a dflash head in llama.cpp, driven as ``common_speculative_impl_draft_dflash`` drives them:
    target layer inputs injected as embedding rows, then ``[x_n, MASK x n_max]`` blocks, non-causal."""

    def __init__(self, head_path: Path):
        import llama_cpp as C
        C.llama_backend_init()
        self.C, mtp = C, e3._mtp_script()
        self.keep = mtp._quiet(C)
        self.set_li = e3._ext(C, "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                              [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None)
        self.get_li = e3._ext(C, "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                              [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float))
        self.tm = mtp._load(C, SRC)
        self.tctx = mtp._ctx(C, self.tm)
        for i in LAYERS:
            self.set_li(self.tctx, i, True)
        self.dm = mtp._load(C, head_path)
        cp = C.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = SEQ
        cp.n_threads = cp.n_threads_batch = THREADS
        cp.ctx_other = self.tctx
        self.dctx = C.llama_init_from_model(self.dm, cp)
        assert self.dctx, "dflash context"
        C.llama_set_causal_attn(self.dctx, False)
        self.tb, self.db = mtp._Batch(C, self.tctx), mtp._Batch(C, self.dctx)

    def features(self, t: np.ndarray) -> np.ndarray:
        """The target over t at positions 0.. -> [len(t), 3E] layer inputs, llama.cpp's own."""
        C = self.C
        C.llama_memory_clear(C.llama_get_memory(self.tctx), True)
        self.tb.fill(t, outputs=False)
        C.llama_batch_ext_set_output_logits(self.tb.b, len(t) - 1, True)
        self.tb.run(self.tctx)
        return np.concatenate([np.ctypeslib.as_array(self.get_li(self.tctx, i), shape=(len(t), E)).copy()
                               for i in LAYERS], 1)

    def inject(self, feats: np.ndarray, pos0: int):
        """Embedding rows at positions pos0.. (the driver's ``batch_inject``)."""
        C, b = self.C, self.db.b
        C.llama_batch_ext_clear(b)
        rows = np.ascontiguousarray(feats, dtype=np.float32)
        for j, row in enumerate(rows):
            e = C.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.size)
            i = C.llama_batch_ext_add_embd(b, 0, e)
            assert i >= 0, i
            C.llama_batch_ext_set_pos(b, i, (C.llama_pos * 1)(pos0 + j))
            C.llama_batch_ext_set_output_logits(b, i, False)
        self.db.run(self.dctx)

    def block(self, x_n: int, n: int, n_max: int) -> np.ndarray:
        """``[x_n, MASK x n_max]`` at n.. -> logits [n_max+1, V]; the block's KV rows cut afterwards."""
        C = self.C
        self.db.fill([x_n] + [MASK_ID] * n_max, pos0=n, outputs=True).run(self.dctx)
        out = np.ctypeslib.as_array(C.llama_get_logits(self.dctx), shape=(n_max + 1, V)).copy()
        C.llama_memory_seq_rm(C.llama_get_memory(self.dctx), 0, n, -1)
        return out

    def clear(self):
        self.C.llama_memory_clear(self.C.llama_get_memory(self.dctx), True)


def torch_vs_llama(work: Path, head_path: Path, n_win: int = 2, n_anchor: int = 6, n_max: int = BLOCK - 1) -> dict:
    """On held-out windows, the torch head (the GGUF's weights) against llama.cpp's dflash graph on the same
    (llama.cpp's) target features: anchors in increasing order, context injected up to each anchor, as the
    driver leaves it; logits of every block slot compared."""
    import torch
    head = _load_head(head_path)
    ll = _Llama(head_path)
    held = np.load(work / "held_ids.npy")
    rng = np.random.default_rng(7)
    d_lg, agree, n_rows = 0.0, 0, 0
    for s in rng.integers(0, len(held) - SEQ - 1, n_win):
        t = held[s:s + SEQ].astype(np.int64)
        feats = ll.features(t)
        ll.clear()
        anchors = np.sort(rng.choice(np.arange(1, SEQ - n_max), n_anchor, replace=False))
        done = 0
        with torch.no_grad():
            g = head.encode(torch.from_numpy(feats)[None])
            ctx_all = head.context_kv(g, torch.arange(SEQ)[None])
        for n in anchors:
            ll.inject(feats[done:n], done)
            done = n
            lg_lc = ll.block(int(t[n]), int(n), n_max)
            with torch.no_grad():
                ctx = [(k[:, :, :n], v[:, :, :n]) for k, v in ctx_all]
                rows = torch.tensor([[int(t[n])] + [MASK_ID] * n_max])
                pos = torch.arange(n, n + n_max + 1)[None]
                mask = torch.ones(1, 1, n_max + 1, n + n_max + 1, dtype=torch.bool)
                _, lg_t = head.block(rows, pos, ctx, mask)
            lg_t = lg_t[0].numpy()
            d_lg = max(d_lg, float(np.abs(lg_t - lg_lc).max()))
            agree += int((lg_t.argmax(1) == lg_lc.argmax(1)).sum())
            n_rows += n_max + 1
    res = {"windows": n_win, "blocks": n_win * n_anchor, "rows": n_rows, "max_abs_dlogit": d_lg,
           "argmax_agreement": agree / n_rows}
    print(f"torch vs llama.cpp ({head_path.name}): {n_win} held-out windows x {n_anchor} blocks of {n_max + 1}; "
          f"logits max|d| {d_lg:.4f}, argmax agreement {agree}/{n_rows} = {agree / n_rows:.4f}")
    return res


def teacher_forced(work: Path, head_path: Path, n_win: int = 8, n_anchor: int = 32):
    """Torch, held-out windows, blocks of 8: per slot, how often the head's argmax equals the target's (the
    chance a draft at that slot is right given the earlier slots were), and the expected accepted length."""
    import torch
    target = e3.load_target()
    head = _load_head(head_path)
    held = np.load(work / "held_ids.npy")
    rng = np.random.default_rng(11)
    hits, run_len, n = np.zeros(BLOCK - 1), 0.0, 0
    with torch.no_grad():
        for s in rng.integers(0, len(held) - SEQ - 1, n_win):
            t = torch.from_numpy(held[None, s:s + SEQ].astype(np.int64))
            anchors = torch.from_numpy(rng.integers(1, SEQ - BLOCK + 1, (1, n_anchor)))
            feats, tl = e3.target_forward(target, t)
            ctx = head.context_kv(head.encode(feats), torch.arange(SEQ)[None])
            rows, pos, mask = blocks_batch(t, anchors, BLOCK)
            _, lg = head.block(rows, pos, ctx, mask)
            got = lg.view(n_anchor, BLOCK, V)[:, 1:].argmax(-1)
            want_pos = anchors[0][:, None] + torch.arange(BLOCK - 1)
            ok = (got == tl[0].argmax(-1)[want_pos]).numpy()
            hits += ok.sum(0)
            run_len += float(np.cumprod(ok, 1).sum())
            n += n_anchor
    print("teacher-forced argmax agreement with the target by block slot (1..7): "
          + " ".join(f"{h / n:.3f}" for h in hits) + f"; mean accepted prefix of a 7-token draft {run_len / n:.2f}")


def validate(work: Path):
    """(a) llama-speculative-simple loads the head and accepts its drafts (the proof of the layout);
    (b) torch vs llama.cpp on the same inputs; (c) teacher-forced agreement in torch."""
    head_path = Path(os.environ.get("HEAD", GGUF))
    for n_max in [int(x) for x in os.environ.get("N_MAX", "7,3").split(",")]:
        rows = binary_acceptance(work, head_path, n_max)
        print(f"\nllama-speculative-simple --spec-type draft-dflash --spec-draft-n-max {n_max} -n "
              f"{os.environ.get('N_GEN', '128')} --temp 0 -t 1")
        print("| prompt (held-out file, first lines) | drafted | accepted | rate |")
        print("|---|---|---|---|")
        for name, dr, ac, _ in rows:
            print(f"| {name} | {dr} | {ac} | {ac / dr:.3f} |" if dr else f"| {name} | failed | | |")
        ok = [r for r in rows if r[1]]
        if ok:
            dr, ac = sum(r[1] for r in ok), sum(r[2] for r in ok)
            print(f"| total | {dr} | {ac} | {ac / dr:.3f} |")
    if os.environ.get("SKIP_TORCH") != "1":
        print()
        torch_vs_llama(work, head_path)
        teacher_forced(work, head_path)

if __name__ == "__main__":
    cmd, arg = sys.argv[1], Path(sys.argv[2])
    if cmd == "random":
        random_head(arg)
        sys.exit(0)
    arg.mkdir(parents=True, exist_ok=True)
    {"corpus": corpus, "train": train, "export": export, "validate": validate}[cmd](arg)
