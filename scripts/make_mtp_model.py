"""Make the bundled MTP model ``pycoder-6m-mtp``: pycoder-6m's trained trunk as ``glm4moe`` plus a trained NextN block.

Steering tool, not part of the product. llama.cpp (the tree vendored in llama-cpp-python 0.3.36) runs
multi-token prediction ("NextN", ``--spec-type draft-mtp``) for a handful of architectures; ``glm4moe``
is the one whose trunk is plain llama, so pycoder-6m's trunk converts into it *exactly* and only the
NextN block (about 0.72M parameters) needs training:

- trunk: pycoder-6m's tensors; ``attn_q``/``attn_k`` rows permuted per head (llama's adjacent-pair
  rotation -> glm4moe's NeoX rotate-halves), ``ffn_norm`` renamed ``post_attention_norm``;
  ``leading_dense_block_count`` = 6 keeps the trunk dense. Tied output (no ``output.weight``).
- NextN block ``blk.6`` (``glm4moe.nextn_predict_layers`` = 1), as ``src/models/glm4-moe.cpp``
  ``graph_mtp`` computes it:

    x  = eh_proj(concat(rms(emb(x_p)) * enorm, rms(h_{p-1}) * hnorm))      embedding half first
    x += wo(attn(rms(x) * attn_norm))        GQA 8/4 heads, head_dim 32, NeoX rope base 1e4, own KV
    y  = rms(x) * post_attention_norm
    x += expert(y) + shared_expert(y)         one routed expert (weight sigmoid/sum = exactly 1) + shared
    h' = rms(x) * shared_head_norm            the next chained step's h
    logits = h' @ token_embd^T                the trunk's tied head (frozen)

  ``h_{p-1}`` is the trunk's post-final-norm hidden row at p-1 (``t_h_nextn``; zeros at position 0),
  and the head predicts ``x_{p+1}``. The rows are computed by llama.cpp itself (unmasked
  ``llama_set_embeddings_nextn`` over 512-token prefills), so training sees what inference feeds.

Commands (python = an environment with torch CPU, numpy, gguf and llama-cpp-python 0.3.36):

  python scripts/make_mtp_model.py corpus WORK     # train/held-out token ids with pycoder-6m's vocab (llama.cpp)
  python scripts/make_mtp_model.py trunk  WORK     # WORK/trunk.gguf: the trunk + an untrained head
  N_WIN=2000 THREADS=1 python scripts/make_mtp_model.py hidden WORK   # h rows of N_WIN random windows
  THREADS=1 TIME_BUDGET=1200 python scripts/make_mtp_model.py train WORK
  python scripts/make_mtp_model.py export WORK     # -> specstack/models/pycoder-6m-mtp.gguf
  python scripts/make_mtp_model.py validate WORK   # llama.cpp vs torch; trunk vs pycoder-6m; acceptance

Environment: SRC (default specstack/models/pycoder-6m.gguf), GGUF (export/validate path), N_WIN,
THREADS, TIME_BUDGET (cosine over wall time, seconds), BATCH (windows per step), LR, SEED.
"""
import ctypes, hashlib, json, math, os, sys, time
from pathlib import Path

import numpy as np

STDLIB = Path(os.__file__).parent
REPO = Path(__file__).resolve().parents[1]
SRC = Path(os.environ.get("SRC", REPO / "specstack" / "models" / "pycoder-6m.gguf"))
GGUF = Path(os.environ.get("GGUF", REPO / "specstack" / "models" / "pycoder-6m-mtp.gguf"))
SEQ = 512
E, H, KV, HD, V = 256, 8, 4, 32, 4096
FFE = 256  # width of the routed expert and of the shared expert
EPS = 1e-5
THREADS = int(os.environ.get("THREADS", "1"))


def held_out(path: Path) -> bool:
    """The family's held-out rule (``train_models.py``): about 4% of files, never trained on."""
    return hashlib.sha256(str(path.relative_to(STDLIB)).encode()).digest()[0] < 10


# -- llama.cpp helpers ---------------------------------------------------------------------------

def _llama():
    import llama_cpp as C
    C.llama_backend_init()
    return C


def _quiet(C):
    @C.llama_log_callback
    def _cb(level, text, user):
        pass
    C.llama_log_set(_cb, None)
    return _cb


def _load(C, path: Path, load_mtp=False, vocab_only=False):
    mp = C.llama_model_default_params()
    mp.load_mtp = load_mtp
    mp.vocab_only = vocab_only
    m = C.llama_model_load_from_file(str(path).encode(), mp)
    assert m, f"could not load {path}"
    return m


def _ctx(C, model, n_seq=1, mtp_of=None):
    cp = C.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = SEQ
    cp.n_seq_max = n_seq
    cp.n_threads = cp.n_threads_batch = THREADS
    if mtp_of is not None:
        cp.ctx_type = C.LLAMA_CONTEXT_TYPE_MTP
        cp.ctx_other = mtp_of
        cp.n_rs_seq = 0
    c = C.llama_init_from_model(model, cp)
    assert c, "context"
    return c


class _Batch:
    """``llama_batch_ext``: token rows with positions, an optional h row each (``set_embd_token``)."""

    def __init__(self, C, ctx):
        self.C, self.b = C, C.llama_batch_ext_init(ctx)

    def fill(self, toks, pos0=0, outputs=True, h=None):
        C = self.C
        C.llama_batch_ext_clear(self.b)
        hh = None if h is None else np.ascontiguousarray(h, dtype=np.float32)
        for j, t in enumerate(toks):
            i = C.llama_batch_ext_add_token(self.b, 0, int(t))
            assert i >= 0, i
            C.llama_batch_ext_set_pos(self.b, i, (C.llama_pos * 1)(pos0 + j))
            if hh is not None:
                row = hh[j]
                e = C.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.size)
                assert C.llama_batch_ext_set_embd_token(self.b, i, e)
            C.llama_batch_ext_set_output_logits(self.b, i, bool(outputs))
        return self

    def run(self, ctx):
        rc = self.C.llama_process(ctx, self.C.LLAMA_PROCESS_TYPE_DECODE, self.b)
        assert rc == 0, rc


# -- corpus --------------------------------------------------------------------------------------

def corpus(work: Path):
    """The family's corpus, tokenized by llama.cpp with pycoder-6m's vocabulary (equal to the training
    tokenizer's, checked in the models README): each file starts with <|endoftext|> (id 0)."""
    C = _llama()
    keep = _quiet(C)
    m = _load(C, SRC, vocab_only=True)
    vocab = C.llama_model_get_vocab(m)
    files = sorted(p for p in STDLIB.rglob("*.py") if "site-packages" not in p.parts)
    train, held, names = [], [], []
    buf = (C.llama_token * (1 << 22))()
    for p in files:
        try:
            text = p.read_text(encoding="utf-8").encode()
        except (UnicodeDecodeError, OSError):
            continue
        n = C.llama_tokenize(vocab, text, len(text), buf, len(buf), False, False)
        assert n >= 0, (p, n)
        ids = [0] + list(buf[:n])
        if held_out(p):
            held.append(ids)
            names.append(str(p.relative_to(STDLIB)))
        else:
            train.extend(ids)
    work.mkdir(parents=True, exist_ok=True)
    np.save(work / "train_ids.npy", np.array(train, np.uint16))
    np.save(work / "held_ids.npy", np.array([t for f in held for t in f], np.uint16))
    (work / "held_out.txt").write_text("\n".join(names) + "\n")
    same = (work / "held_out.txt").read_text() == (REPO / "specstack" / "models" / "held_out.txt").read_text()
    print(f"train tokens {len(train)}, held-out files {len(held)} (list equals the bundled held_out.txt: {same})")
    del keep


# -- GGUF ----------------------------------------------------------------------------------------

def _trunk_tensors():
    import gguf
    src = gguf.GGUFReader(str(SRC))
    return src, {t.name: np.array(t.data) for t in src.tensors}


def write_gguf(out: Path, head: dict, name: str):
    """The glm4moe GGUF: pycoder-6m's trunk (exact) + the NextN block ``head`` (numpy arrays by GGUF name
    suffix, F32 masters: matrices are written F16, norms F32)."""
    import gguf
    src, T = _trunk_tensors()
    f = lambda k: src.fields[k].contents()
    L = f("llama.block_count")
    assert (f("llama.embedding_length"), f("llama.attention.head_count"), f("llama.attention.head_count_kv")) == (E, H, KV)
    w = gguf.GGUFWriter(str(out), "glm4moe")
    w.add_name(name)
    w.add_block_count(L + 1)
    w.add_nextn_predict_layers(1)
    w.add_leading_dense_block_count(L)
    w.add_context_length(SEQ)
    w.add_embedding_length(E)
    w.add_feed_forward_length(f("llama.feed_forward_length"))
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_dimension_count(HD)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(1)
    w.add_expert_used_count(1)
    w.add_expert_shared_count(1)
    w.add_expert_feed_forward_length(FFE)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(V)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for k, fld in src.fields.items():  # tokenizer.* verbatim
        if not k.startswith("tokenizer."):
            continue
        t = fld.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            if fld.types[-1] == gguf.GGUFValueType.STRING:
                w.add_array(k, [bytes(fld.parts[i]).decode("utf-8") for i in fld.data])
            else:
                w.add_array(k, [fld.parts[i].tolist()[0] for i in fld.data])
        elif t == gguf.GGUFValueType.STRING:
            w.add_string(k, fld.contents())
        elif t == gguf.GGUFValueType.UINT32:
            w.add_uint32(k, int(fld.contents()))
        elif t == gguf.GGUFValueType.BOOL:
            w.add_bool(k, bool(fld.contents()))
        else:
            raise ValueError(f"unhandled tokenizer field {k} ({t})")
    perm = np.concatenate([np.arange(0, HD, 2), np.arange(1, HD, 2)])

    def neox(m, heads):  # rows: heads blocks of HD, pairs (2i, 2i+1) -> (i, i + HD/2)
        return m.reshape(heads, HD, -1)[:, perm, :].reshape(heads * HD, -1)

    w.add_tensor("token_embd.weight", T["token_embd.weight"])
    w.add_tensor("output_norm.weight", T["output_norm.weight"])
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", T[p + "attn_norm.weight"])
        w.add_tensor(p + "attn_q.weight", neox(T[p + "attn_q.weight"], H))
        w.add_tensor(p + "attn_k.weight", neox(T[p + "attn_k.weight"], KV))
        w.add_tensor(p + "attn_v.weight", T[p + "attn_v.weight"])
        w.add_tensor(p + "attn_output.weight", T[p + "attn_output.weight"])
        w.add_tensor(p + "post_attention_norm.weight", T[p + "ffn_norm.weight"])
        for n in ("gate", "up", "down"):
            w.add_tensor(p + f"ffn_{n}.weight", T[p + f"ffn_{n}.weight"])
    p = f"blk.{L}."
    for key, arr in head.items():
        arr = np.asarray(arr, np.float32)
        w.add_tensor(p + key, arr if arr.ndim == 1 or key == "ffn_gate_inp.weight" else arr.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


HEAD_KEYS = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight",
             "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
             "post_attention_norm.weight", "ffn_gate_inp.weight", "exp_probs_b.bias",
             "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
             "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")


def trunk(work: Path):
    """The trunk with an untrained (small random) head: what ``hidden`` runs (its h rows need no head)."""
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.02
    one = lambda: np.ones(E, np.float32)
    head = {"nextn.eh_proj.weight": r(E, 2 * E), "nextn.enorm.weight": one(), "nextn.hnorm.weight": one(),
            "nextn.shared_head_norm.weight": one(), "attn_norm.weight": one(), "attn_q.weight": r(H * HD, E),
            "attn_k.weight": r(KV * HD, E), "attn_v.weight": r(KV * HD, E), "attn_output.weight": r(E, H * HD),
            "post_attention_norm.weight": one(), "ffn_gate_inp.weight": r(1, E), "exp_probs_b.bias": np.zeros(1, np.float32),
            "ffn_gate_exps.weight": r(1, FFE, E), "ffn_up_exps.weight": r(1, FFE, E), "ffn_down_exps.weight": r(1, E, FFE),
            "ffn_gate_shexp.weight": r(FFE, E), "ffn_up_shexp.weight": r(FFE, E), "ffn_down_shexp.weight": r(E, FFE)}
    write_gguf(work / "trunk.gguf", head, "pycoder-6m-mtp-untrained")
    print("wrote", work / "trunk.gguf")


# -- hidden rows -----------------------------------------------------------------------------------

def _hidden_rows(C, ctx, bt, toks):
    import llama_cpp.llama_cpp_ext as X
    C.llama_memory_clear(C.llama_get_memory(ctx), True)
    bt.fill(toks, 0, outputs=False).run(ctx)
    return np.ctypeslib.as_array(X.llama_get_embeddings_nextn(ctx), shape=(len(toks), E))


def hidden(work: Path):
    """h rows of N_WIN random 512-token training windows (and 16 held-out windows), as llama.cpp computes them."""
    import llama_cpp.llama_cpp_ext as X
    C = _llama()
    keep = _quiet(C)
    m = _load(C, work / "trunk.gguf")
    ctx = _ctx(C, m)
    X.llama_set_embeddings_nextn(ctx, True, False)  # a row for every token of the batch
    bt = _Batch(C, ctx)
    for name, ids_file, n_win, seed in (("held", "held_ids.npy", 16, 7),
                                        ("train", "train_ids.npy", int(os.environ.get("N_WIN", "2400")), 1)):
        ids = np.load(work / ids_file)
        starts = np.random.default_rng(seed).integers(0, len(ids) - SEQ - 1, n_win)
        toks = np.stack([ids[s:s + SEQ + 1] for s in starts]).astype(np.uint16)
        hs = np.lib.format.open_memmap(work / f"h_{name}.npy", "w+", np.float16, (n_win, SEQ, E))
        t0 = time.time()
        for i in range(n_win):
            hs[i] = _hidden_rows(C, ctx, bt, toks[i, :SEQ])
            if i % 100 == 0 or i == n_win - 1:
                print(f"{name}: {i + 1}/{n_win} windows, {(i + 1) * SEQ / (time.time() - t0):.0f} tok/s", flush=True)
        hs.flush()
        np.save(work / f"tok_{name}.npy", toks)
    del keep


# -- the head in torch ------------------------------------------------------------------------------

def build(embed):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def rms(x, w):
        return F.rms_norm(x, (E,), w, EPS)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(int(os.environ.get("SEED", "0")))
            r = lambda *s, std=0.02: nn.Parameter(torch.randn(*s, generator=g) * std)
            self.register_buffer("embed", embed, persistent=False)  # frozen, tied: input embedding and output head
            self.enorm, self.hnorm = nn.Parameter(torch.ones(E)), nn.Parameter(torch.ones(E))
            eh = torch.randn(E, 2 * E, generator=g) * 0.02
            eh[:, E:] += torch.eye(E)  # start from the h row passed through
            self.eh_proj = nn.Parameter(eh)
            self.attn_norm = nn.Parameter(torch.ones(E))
            self.wq, self.wk, self.wv = r(H * HD, E), r(KV * HD, E), r(KV * HD, E)
            self.wo = r(E, H * HD, std=0.01)
            self.post_norm = nn.Parameter(torch.ones(E))
            self.g1, self.u1, self.d1 = r(FFE, E), r(FFE, E), r(E, FFE, std=0.01)  # routed expert
            self.g2, self.u2, self.d2 = r(FFE, E), r(FFE, E), r(E, FFE, std=0.01)  # shared expert
            self.head_norm = nn.Parameter(torch.ones(E))
            inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2).float() / HD))
            ang = torch.arange(SEQ).float()[:, None] * inv[None, :]
            self.register_buffer("cos", ang.cos()[None, None], persistent=False)
            self.register_buffer("sin", ang.sin()[None, None], persistent=False)

        def rope(self, x):  # NeoX: rotate halves
            T = x.shape[2]
            c, s = self.cos[:, :, :T], self.sin[:, :, :T]
            x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
            return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)

        def forward(self, tok, h):
            """tok [B,T] (x_p), h [B,T,E] (h_{p-1}) -> (logits [B,T,V] for x_{p+1}, h' [B,T,E])."""
            B, T = tok.shape
            e = self.embed[tok]
            x = torch.cat((rms(e, self.enorm), rms(h, self.hnorm)), -1) @ self.eh_proj.T
            a = rms(x, self.attn_norm)
            q = (a @ self.wq.T).view(B, T, H, HD).transpose(1, 2)
            k = (a @ self.wk.T).view(B, T, KV, HD).transpose(1, 2)
            v = (a @ self.wv.T).view(B, T, KV, HD).transpose(1, 2)
            q, k = self.rope(q), self.rope(k)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(B, T, H * HD) @ self.wo.T
            y = rms(x, self.post_norm)
            x = x + (F.silu(y @ self.g1.T) * (y @ self.u1.T)) @ self.d1.T \
                  + (F.silu(y @ self.g2.T) * (y @ self.u2.T)) @ self.d2.T
            hn = rms(x, self.head_norm)
            return hn @ self.embed.T, hn

        def gguf_tensors(self):
            n = lambda p: p.detach().float().numpy()
            return {"nextn.eh_proj.weight": n(self.eh_proj), "nextn.enorm.weight": n(self.enorm),
                    "nextn.hnorm.weight": n(self.hnorm), "nextn.shared_head_norm.weight": n(self.head_norm),
                    "attn_norm.weight": n(self.attn_norm), "attn_q.weight": n(self.wq), "attn_k.weight": n(self.wk),
                    "attn_v.weight": n(self.wv), "attn_output.weight": n(self.wo),
                    "post_attention_norm.weight": n(self.post_norm),
                    "ffn_gate_inp.weight": np.zeros((1, E), np.float32), "exp_probs_b.bias": np.zeros(1, np.float32),
                    "ffn_gate_exps.weight": n(self.g1)[None], "ffn_up_exps.weight": n(self.u1)[None],
                    "ffn_down_exps.weight": n(self.d1)[None], "ffn_gate_shexp.weight": n(self.g2),
                    "ffn_up_shexp.weight": n(self.u2), "ffn_down_shexp.weight": n(self.d2)}

    return Head()


def _embed():
    import torch
    _, T = _trunk_tensors()
    return torch.from_numpy(T["token_embd.weight"].astype(np.float32))


def _inputs(toks, hs, idx):
    """Windows ``idx``: x_p, h_{p-1} (zeros at 0) and the targets x_{p+1}."""
    import torch
    t = torch.from_numpy(toks[idx].astype(np.int64))
    h = torch.from_numpy(np.asarray(hs[idx], np.float32))
    h = torch.cat((torch.zeros_like(h[:, :1]), h[:, :-1]), 1)
    return t[:, :SEQ], h, t[:, 1:SEQ + 1]


def train(work: Path):
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    torch.set_num_threads(THREADS)
    toks = np.load(work / "tok_train.npy")
    hs = np.load(work / "h_train.npy", mmap_mode="r")
    head = build(_embed())
    params = [p for p in head.parameters() if p.requires_grad]
    print(f"head: {sum(p.numel() for p in params) / 1e6:.3f}M trainable params, {len(toks)} windows", flush=True)
    lr0 = float(os.environ.get("LR", "2e-3"))
    decay = [p for p in params if p.ndim == 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=lr0, betas=(0.9, 0.95))
    B, warm = int(os.environ.get("BATCH", "8")), 20
    budget = float(os.environ.get("TIME_BUDGET", "1200"))
    g = np.random.default_rng(1)
    order = g.permutation(len(toks))
    t0, step, losses = time.time(), 0, []
    while True:
        frac = (time.time() - t0) / budget
        if frac >= 1.0:
            break
        lr = lr0 * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for pg in opt.param_groups:
            pg["lr"] = lr
        at = (step * B) % len(order)
        idx = np.sort(order[at:at + B]) if at + B <= len(order) else np.sort(g.permutation(len(toks))[:B])
        x, h, y = _inputs(toks, hs, idx)
        logits, _ = head(x, h)  # float32: bf16 autocast was 100x slower on this AVX2 CPU (no native bf16)
        loss = F.cross_entropy(logits.float().view(-1, V), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0:
            print(f"step {step} loss {np.mean(losses[-10:]):.3f} lr {lr:.2e} {time.time() - t0:.0f}s "
                  f"({(time.time() - t0) / (step + 1):.2f}s/step)", flush=True)
        if step % 50 == 0:
            torch.save({"state": head.state_dict(), "step": step}, work / "head.pt")
        step += 1
    torch.save({"state": head.state_dict(), "step": step}, work / "head.pt")
    print(f"done: {step} steps ({step * B} windows, {step * B * SEQ / 1e6:.2f}M tokens) in {time.time() - t0:.0f}s; "
          f"last-20 mean loss {np.mean(losses[-20:]):.3f}", flush=True)


def _trained(work: Path):
    import torch
    head = build(_embed())
    ck = torch.load(work / "head.pt")
    head.load_state_dict(ck["state"])
    return head, ck["step"]


def export(work: Path):
    head, step = _trained(work)
    write_gguf(GGUF, head.gguf_tensors(), "pycoder-6m-mtp")
    print(f"wrote {GGUF} ({GGUF.stat().st_size} bytes; head from step {step})")


# -- validation -------------------------------------------------------------------------------------

def validate(work: Path):
    """On the held-out windows: (1) llama.cpp's MTP logits vs the torch head on the same h rows;
    (2) the trunk's logits vs pycoder-6m's; (3) how often the head's argmax (from x_p, h_{p-1}) equals the
    target's argmax at p (the first draft position's greedy acceptance, teacher-forced), and the
    held-out loss of both."""
    import torch
    import llama_cpp.llama_cpp_ext as X
    C = _llama()
    keep = _quiet(C)
    toks = np.load(work / "tok_held.npy")
    hs = np.load(work / "h_held.npy")
    head, step = _trained(work)
    m = _load(C, GGUF, load_mtp=True)
    tgt = _ctx(C, m)
    X.llama_set_embeddings_nextn(tgt, True, False)
    mtp = _ctx(C, m, mtp_of=tgt)
    X.llama_set_embeddings_nextn(mtp, True, True)
    ref = _load(C, SRC)
    rctx = _ctx(C, ref)
    bt, bm, br = _Batch(C, tgt), _Batch(C, mtp), _Batch(C, rctx)
    n_win = int(os.environ.get("N_VAL", "8"))
    dmax, agree_lc, agree, agree_tgt_next, n, loss_head, loss_tgt, trunk_d, trunk_agree = 0.0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0
    for w in range(n_win):
        t = toks[w]
        C.llama_memory_clear(C.llama_get_memory(tgt), True)
        bt.fill(t[:SEQ], 0, outputs=True).run(tgt)
        lt = np.ctypeslib.as_array(C.llama_get_logits(tgt), shape=(SEQ, V)).copy()
        h = np.ctypeslib.as_array(X.llama_get_embeddings_nextn(tgt), shape=(SEQ, E)).copy()
        hprev = np.concatenate([np.zeros((1, E), np.float32), h[:-1]])
        C.llama_memory_clear(C.llama_get_memory(mtp), True)
        bm.fill(t[:SEQ], 0, outputs=True, h=hprev).run(mtp)
        lm = np.ctypeslib.as_array(C.llama_get_logits(mtp), shape=(SEQ, V)).copy()
        C.llama_memory_clear(C.llama_get_memory(rctx), True)
        br.fill(t[:SEQ], 0, outputs=True).run(rctx)
        lr = np.ctypeslib.as_array(C.llama_get_logits(rctx), shape=(SEQ, V)).copy()
        trunk_d = max(trunk_d, float(np.abs(lr - lt).max()))
        trunk_agree += int((lr.argmax(1) == lt.argmax(1)).sum())
        with torch.no_grad():
            lg, _ = head(torch.from_numpy(t[None, :SEQ].astype(np.int64)), torch.from_numpy(hprev[None]))
        lg = lg[0].numpy()
        dmax = max(dmax, float(np.abs(lg - lm).max()))
        agree_lc += int((lg.argmax(1) == lm.argmax(1)).sum())
        # the head at p (x_p, h_{p-1}) and the target's row p both predict x_{p+1}
        agree += int((lm.argmax(1) == lt.argmax(1)).sum())
        y = t[1:SEQ + 1].astype(np.int64)
        lsm = lambda z: z - z.max(1, keepdims=True) - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True))
        loss_head += float(-lsm(lm)[np.arange(SEQ), y].sum())
        loss_tgt += float(-lsm(lt)[np.arange(SEQ), y].sum())
        n += SEQ
    print(f"head from step {step}; {n_win} held-out windows x {SEQ} tokens")
    print(f"llama.cpp MTP vs torch head: max|dlogit| {dmax:.4f}, argmax agreement {agree_lc / n:.4f}")
    print(f"trunk (glm4moe) vs pycoder-6m (llama): max|dlogit| {trunk_d:.4f}, argmax agreement {trunk_agree / n:.4f}")
    print(f"head argmax == target argmax for the same next token (greedy acceptance at draft position 1, teacher-forced): "
          f"{agree / n:.4f}")
    print(f"held-out loss: head {loss_head / n:.3f} (predicts x_(p+1) without seeing x_p's hidden state), target {loss_tgt / n:.3f}")
    del keep


if __name__ == "__main__":
    cmd, work = sys.argv[1], Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    {"corpus": corpus, "trunk": trunk, "hidden": hidden, "train": train, "export": export, "validate": validate}[cmd](work)
