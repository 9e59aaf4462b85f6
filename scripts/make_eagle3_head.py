"""Make the bundled EAGLE-3 draft head ``pycoder-6m-eagle3``: a one-layer head over pycoder-6m's hidden states.

Steering tool, not part of the product (design: ``docs/design-eagle3-dflash.md``, sections 1, 2 and 5).
llama.cpp (the tree vendored in llama-cpp-python 0.3.36) runs EAGLE-3 heads as the ``eagle3`` architecture
(``--spec-type draft-eagle3``); this script trains one for the bundled target and writes it in the exact
layout that arch loads, so specstack's drafter and llama.cpp's own binary can both run it.

The head, as ``V/src/models/eagle3.cpp`` computes it (V = the vendored llama.cpp tree):

    encoder:  g_P = fc . [L1_P | L3_P | L5_P]        Li_P = the residual entering target block i at P
                                                    (``target_layers`` [1, 3, 5]; no norm_before_fc)
    decoder at draft position P, input (t_{P+1}, g):
        e   = rms(emb(t_{P+1})) * attn_norm          the target's token_embd, borrowed (ctx_other)
        gn  = rms(g) * attn_norm_2                   (HF ``hidden_norm``)
        x   = concat(e, gn)                          embedding first (eagle3.cpp:220), 512 wide
        a   = wo . attn(wq x, wk x, wv x)            8/4 heads, head_dim 32, NORM (adjacent-pair) RoPE at P,
                                                    causal over the head's own KV
        f   = a + g                                  norm_before_residual = false: raw g (eagle3.cpp:217)
        h   = f + down(silu(gate y) * up y),  y = rms(f) * ffn_norm
        logits = output . (rms(h) * output_norm)     2,048-token draft vocabulary, scattered to the
                                                    target's 4,096 ids through ``d2t`` (I64, absolute ids)
    h (pre-norm) is the next chained step's g (``t_h_nextn``, eagle3.cpp:286-288).

llama.cpp feeds step 1 (the seed and every prefilled/verified position) ``g_P`` from the encoder and
chains drafted steps on the previous step's ``h``; the head at P predicts t_{P+2}, i.e. the target's
distribution at P+1.

Training (``train``): the frozen target (``train_models.build``, weights from pycoder-6m.gguf) gives the
layer inputs and the teacher distribution on the fly; the loss is soft cross-entropy against the target's
distribution restricted to the draft vocabulary, with EAGLE-3's training-time test: K unrolled steps where
step j at position P takes the previous step's h at P-1 and attends to step-1 keys at positions <= P-j+1
plus step-i keys (i = 2..j) at P-j+i (what llama.cpp's draft KV holds at chained step j).

Commands (python = the torch venv with system site packages: torch CPU, numpy, gguf, llama-cpp-python):

  python scripts/make_eagle3_head.py corpus WORK     # token ids (llama.cpp tokenizer) + the draft vocab
  THREADS=1 TIME_BUDGET=2400 nice -n 19 python scripts/make_eagle3_head.py train WORK
  python scripts/make_eagle3_head.py export WORK     # -> specstack/models/pycoder-6m-eagle3.gguf
  python scripts/make_eagle3_head.py validate WORK   # torch vs llama.cpp; llama-speculative-simple acceptance

Environment: SRC (target GGUF), GGUF (head path), THREADS, TIME_BUDGET (cosine over wall time, seconds),
BATCH (windows per step), UNROLL (K, default 3), LR, SEED, N_PROMPTS, N_GEN.
"""
import ctypes, hashlib, math, os, re, subprocess, sys, time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHARED", REPO.parent / "shared"))
SRC = Path(os.environ.get("SRC", REPO / "specstack" / "models" / "pycoder-6m.gguf"))
GGUF = Path(os.environ.get("GGUF", REPO / "specstack" / "models" / "pycoder-6m-eagle3.gguf"))
BINS = Path(os.environ.get("LLAMA_BINS", Path.home() / ".cache" / "specstack" / "llama-bins" / "bin"))
SEQ = 512
E, H, KV, HD, V = 256, 8, 4, 32, 4096      # the target's width, heads, vocab; the head's heads equal the target's
FF = 512                                    # the head's SwiGLU width
N_DRAFT = 2048                              # draft vocabulary: the most frequent training tokens
LAYERS = (1, 3, 5)                          # layer-input ids (id i = residual entering target block i)
EPS = 1e-5
ROPE_BASE = 10000.0
THREADS = int(os.environ.get("THREADS", "1"))
UNROLL = int(os.environ.get("UNROLL", "3"))

# Literal GGUF key names, copied from the vendored V/gguf-py/gguf/constants.py (Keys.LLM, :166-176): the
# installed gguf 0.19.0 lacks them (design note, blocker 5).
KEY_TARGET_LAYERS = "{arch}.target_layers"                  # constants.py:166
KEY_TARGET_HIDDEN_SIZE = "{arch}.target_hidden_size"        # constants.py:167
KEY_NORM_BEFORE_RESIDUAL = "{arch}.norm_before_residual"    # constants.py:175
KEY_NORM_BEFORE_FC = "{arch}.norm_before_fc"                # constants.py:176
ARCH = "eagle3"                                             # MODEL_ARCH.EAGLE3, constants.py:1396


def _mtp_script():
    """``make_mtp_model.py`` owns the family's corpus step (llama.cpp tokenization, held-out rule)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import make_mtp_model
    return make_mtp_model


# -- corpus ----------------------------------------------------------------------------------------

def corpus(work: Path):
    """Token ids as ``make_mtp_model.py corpus`` makes them, plus ``d2t``: the N_DRAFT most frequent
    training tokens, ascending (absolute target ids; a token outside it can never be drafted)."""
    if not (work / "train_ids.npy").exists():
        _mtp_script().corpus(work)
    ids = np.load(work / "train_ids.npy")
    counts = np.bincount(ids.astype(np.int64), minlength=V)
    d2t = np.sort(np.argsort(-counts, kind="stable")[:N_DRAFT]).astype(np.int64)
    np.save(work / "d2t.npy", d2t)
    held = np.load(work / "held_ids.npy").astype(np.int64)
    cover = lambda a: float(np.isin(a, d2t).mean())
    print(f"train tokens {len(ids)}; draft vocab {N_DRAFT} covers {cover(ids):.4f} of training tokens, "
          f"{cover(held):.4f} of held-out tokens")


# -- the frozen target in torch ----------------------------------------------------------------------

def _gguf_tensors(path: Path) -> dict:
    import gguf
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}


def load_target():
    """pycoder-6m as ``train_models.build`` defines it, weights from the GGUF (F16 -> F32), frozen."""
    import torch
    sys.path.insert(0, str(SHARED / "tools"))
    import train_models
    model = train_models.build(train_models.MODELS["pycoder-6m"])
    T = _gguf_tensors(SRC)
    sd = {"embed.weight": T["token_embd.weight"], "norm.weight": T["output_norm.weight"]}
    for i in range(len(model.blocks)):
        g, p = f"blk.{i}.", f"blocks.{i}."
        for src, dst in (("attn_norm", "attn_norm"), ("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v"),
                         ("attn_output", "o"), ("ffn_norm", "ffn_norm"), ("ffn_gate", "gate"),
                         ("ffn_up", "up"), ("ffn_down", "down")):
            sd[p + dst + ".weight"] = T[g + src + ".weight"]
    model.load_state_dict({k: torch.from_numpy(v.astype(np.float32)) for k, v in sd.items()})
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def target_forward(model, idx):
    """idx [B,T] -> (features [B,T,3E] = the inputs of blocks LAYERS concatenated in order, logits [B,T,V])."""
    import torch
    T = idx.shape[1]
    x = model.embed(idx)
    feats = []
    for i, b in enumerate(model.blocks):
        if i in LAYERS:
            feats.append(x)
        x = b(x, model.cos[:, :T], model.sin[:, :T])
    return torch.cat(feats, -1), model.norm(x) @ model.embed.weight.T


# -- the head in torch ---------------------------------------------------------------------------------

def build_head(embed, d2t, out_norm):
    """The eagle3 head; ``embed`` is the target's token_embd (frozen, borrowed at inference through
    ctx_other), ``output`` starts from its rows ``d2t`` and ``output_norm`` from the target's."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def rms(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, EPS)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(int(os.environ.get("SEED", "0")))
            r = lambda *s, std=0.02: nn.Parameter(torch.randn(*s, generator=g) * std)
            self.register_buffer("embed", embed, persistent=False)
            fc = torch.randn(E, 3 * E, generator=g) * 0.02
            fc[:, 2 * E:] += torch.eye(E)  # start from the deepest named layer's state passed through
            self.fc = nn.Parameter(fc)
            self.attn_norm, self.attn_norm_2 = nn.Parameter(torch.ones(E)), nn.Parameter(torch.ones(E))
            self.wq, self.wk, self.wv = r(H * HD, 2 * E), r(KV * HD, 2 * E), r(KV * HD, 2 * E)
            self.wo = r(E, H * HD, std=0.01)
            self.ffn_norm = nn.Parameter(torch.ones(E))
            self.gate, self.up, self.down = r(FF, E), r(FF, E), r(E, FF, std=0.01)
            self.output_norm = nn.Parameter(out_norm.clone())
            self.output = nn.Parameter(embed[d2t].clone())
            inv = 1.0 / (ROPE_BASE ** (torch.arange(0, HD, 2).float() / HD))
            ang = torch.arange(SEQ).float()[:, None] * inv[None, :]
            self.register_buffer("cos", ang.cos()[None, None], persistent=False)  # [1,1,T,HD/2]
            self.register_buffer("sin", ang.sin()[None, None], persistent=False)

        @staticmethod
        def rope(x, cos, sin):
            """llama.cpp ROPE_TYPE_NORM: rotate adjacent pairs (2i, 2i+1)."""
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)

        def encode(self, feats):
            return feats @ self.fc.T

        def qkv(self, tok, g, pos0=0):
            """Per-row inputs (token, g) at positions pos0.. -> q, k, v [B,heads,T,HD]."""
            B, T = tok.shape
            x = torch.cat((rms(self.embed[tok], self.attn_norm), rms(g, self.attn_norm_2)), -1)
            cos, sin = self.cos[:, :, pos0:pos0 + T], self.sin[:, :, pos0:pos0 + T]
            q = self.rope((x @ self.wq.T).view(B, T, H, HD).transpose(1, 2), cos, sin)
            k = self.rope((x @ self.wk.T).view(B, T, KV, HD).transpose(1, 2), cos, sin)
            v = (x @ self.wv.T).view(B, T, KV, HD).transpose(1, 2)
            return q, k, v

        def finish(self, o, g):
            """Attention output [B,H,T,HD] and the raw g -> (pre-norm h, draft-vocab logits)."""
            B, _, T, _ = o.shape
            f = o.transpose(1, 2).reshape(B, T, H * HD) @ self.wo.T + g
            y = rms(f, self.ffn_norm)
            h = f + (F.silu(y @ self.gate.T) * (y @ self.up.T)) @ self.down.T
            return h, rms(h, self.output_norm) @ self.output.T

        def step1(self, tok, g):
            """Teacher-forced step 1 over a whole window: causal attention over its own keys."""
            q, k, v = self.qkv(tok, g)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.finish(o, g), (k, v)

        def unrolled(self, tok, g1, K):
            """Training-time test: [(h_j, logits_j)] for steps j = 1..K over positions 0..T-1 (step j is
            valid at P >= j-1). Step j at P: input (tok[P], h_{j-1}[P-1]); keys = step-1 keys at
            positions <= P-j+1 and step-i keys at P-j+i (i = 2..j), as llama.cpp's draft KV holds them."""
            T = tok.shape[1]
            (h, lg), kv1 = self.step1(tok, g1)
            outs, ks, vs = [(h, lg)], [kv1[0]], [kv1[1]]
            ar = torch.arange(T)
            for j in range(2, K + 1):
                g = torch.cat((torch.zeros_like(h[:, :1]), h[:, :-1]), 1)
                q, k, v = self.qkv(tok, g)
                ks.append(k)
                vs.append(v)
                blocks = [ar[None, :] <= ar[:, None] - j + 1]
                blocks += [ar[None, :] == ar[:, None] - j + i for i in range(2, j + 1)]
                mask = torch.cat(blocks, 1)  # [T, j*T]
                o = F.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=mask,
                                                   enable_gqa=True)
                h, lg = self.finish(o, g)
                outs.append((h, lg))
            return outs

        def gguf_tensors(self):
            n = lambda p: p.detach().float().numpy()
            return {"fc.weight": n(self.fc), "blk.0.attn_norm.weight": n(self.attn_norm),
                    "blk.0.attn_norm_2.weight": n(self.attn_norm_2), "blk.0.attn_q.weight": n(self.wq),
                    "blk.0.attn_k.weight": n(self.wk), "blk.0.attn_v.weight": n(self.wv),
                    "blk.0.attn_output.weight": n(self.wo), "blk.0.ffn_norm.weight": n(self.ffn_norm),
                    "blk.0.ffn_gate.weight": n(self.gate), "blk.0.ffn_up.weight": n(self.up),
                    "blk.0.ffn_down.weight": n(self.down), "output_norm.weight": n(self.output_norm),
                    "output.weight": n(self.output)}

    return Head()


def _fresh_head(work: Path, target):
    import torch
    d2t = torch.from_numpy(np.load(work / "d2t.npy"))
    return build_head(target.embed.weight.detach().clone(), d2t, target.norm.weight.detach().clone()), d2t


def _soft_ce(logits, teacher_logits):
    """Soft cross-entropy against the teacher's distribution restricted (renormalised) to the draft vocab."""
    import torch.nn.functional as F
    p = F.softmax(teacher_logits, -1)
    return -(p * F.log_softmax(logits, -1)).sum(-1).mean()


def train(work: Path):
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(THREADS)
    ids = np.load(work / "train_ids.npy")
    target = load_target()
    head, d2t = _fresh_head(work, target)
    params = [p for p in head.parameters() if p.requires_grad]
    print(f"head: {sum(p.numel() for p in params) / 1e6:.3f}M trainable params; unroll K={UNROLL}; "
          f"{len(ids)} training tokens", flush=True)
    lr0 = float(os.environ.get("LR", "2e-3"))
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim == 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=lr0, betas=(0.9, 0.95))
    B, warm = int(os.environ.get("BATCH", "4")), 20
    budget = float(os.environ.get("TIME_BUDGET", "2400"))
    weights = [0.8 ** j for j in range(UNROLL)]
    rng = np.random.default_rng(int(os.environ.get("SEED", "0")) + 1)
    t0, step, hist = time.time(), 0, []
    while (time.time() - t0) < budget:
        frac = (time.time() - t0) / budget
        lr = lr0 * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for pg in opt.param_groups:
            pg["lr"] = lr
        starts = rng.integers(0, len(ids) - SEQ, B)
        t = torch.from_numpy(np.stack([ids[s:s + SEQ] for s in starts]).astype(np.int64))
        with torch.no_grad():
            feats, tl = target_forward(target, t)
            teacher = tl[:, 1:, d2t]           # the target at P+1 predicts what the head at P drafts
        outs = head.unrolled(t[:, 1:], head.encode(feats[:, :-1]), UNROLL)
        losses = [_soft_ce(lg[:, j:], teacher[:, j:]) for j, (_, lg) in enumerate(outs)]
        loss = sum(w * l for w, l in zip(weights, losses)) / sum(weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        hist.append([l.item() for l in losses])
        if step % 10 == 0:
            m = np.mean(hist[-10:], 0)
            print(f"step {step} loss/step {' '.join(f'{x:.3f}' for x in m)} lr {lr:.2e} {time.time() - t0:.0f}s "
                  f"({(time.time() - t0) / (step + 1):.2f}s/step)", flush=True)
        if step % 50 == 0:
            torch.save({"state": head.state_dict(), "step": step}, work / "head.pt")
        step += 1
    torch.save({"state": head.state_dict(), "step": step, "seconds": time.time() - t0}, work / "head.pt")
    print(f"done: {step} steps ({step * B} windows, {step * B * (SEQ - 1) / 1e6:.2f}M head positions) in "
          f"{time.time() - t0:.0f}s; last-20 mean loss per step {np.mean(hist[-20:], 0).round(3).tolist()}", flush=True)


def _trained(work: Path):
    import torch
    target = load_target()
    head, d2t = _fresh_head(work, target)
    ck = torch.load(work / "head.pt")
    head.load_state_dict(ck["state"])
    head.eval()
    return target, head, d2t, ck


# -- GGUF ------------------------------------------------------------------------------------------------

def _copy_tokenizer(w, src):
    """The target's ``tokenizer.*`` keys verbatim: llama.cpp loads the draft's vocabulary from the head."""
    import gguf
    for k, fld in src.fields.items():
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


def write_gguf(out: Path, tensors: dict, d2t: np.ndarray, name: str):
    """The eagle3 GGUF: keys of design section 1, matrices F16, norms F32, ``d2t`` I64; no token_embd (borrowed)."""
    import gguf
    src = gguf.GGUFReader(str(SRC))
    f = lambda k: src.fields[k].contents()
    assert (f("llama.embedding_length"), f("llama.attention.head_count"), f("llama.attention.head_count_kv")) == (E, H, KV)
    assert max(LAYERS) < f("llama.block_count")
    w = gguf.GGUFWriter(str(out), ARCH)
    w.add_name(name)
    w.add_context_length(SEQ)
    w.add_embedding_length(E)
    w.add_block_count(1)
    w.add_feed_forward_length(FF)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_rope_dimension_count(HD)
    w.add_array(KEY_TARGET_LAYERS.format(arch=ARCH), [int(i) for i in LAYERS])   # INT32 array
    w.add_uint32(KEY_TARGET_HIDDEN_SIZE.format(arch=ARCH), int(f("llama.embedding_length")))
    w.add_bool(KEY_NORM_BEFORE_RESIDUAL.format(arch=ARCH), False)
    w.add_bool(KEY_NORM_BEFORE_FC.format(arch=ARCH), False)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _copy_tokenizer(w, src)
    for key, arr in tensors.items():
        arr = np.asarray(arr, np.float32)
        w.add_tensor(key, arr if arr.ndim == 1 else arr.astype(np.float16))
    w.add_tensor("d2t", np.ascontiguousarray(d2t, dtype=np.int64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def export(work: Path):
    _, head, d2t, ck = _trained(work)
    write_gguf(GGUF, head.gguf_tensors(), d2t.numpy(), "pycoder-6m-eagle3")
    print(f"wrote {GGUF} ({GGUF.stat().st_size} bytes; head from step {ck['step']}); "
          f"sha256 {hashlib.sha256(GGUF.read_bytes()).hexdigest()}")


# -- validation -------------------------------------------------------------------------------------------

def _prompts(work: Path) -> list:
    """The first N_PROMPTS held-out files (``held_out.txt`` order), each cut to its first ~PROMPT_CHARS
    characters at a line end, so prompt + N_GEN tokens fit the target's 512-token context."""
    import sysconfig
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = (REPO / "specstack" / "models" / "held_out.txt").read_text().split()
    n, cap = int(os.environ.get("N_PROMPTS", "6")), int(os.environ.get("PROMPT_CHARS", "900"))
    out = []
    (work / "prompts").mkdir(exist_ok=True)
    for name in names:
        text = (stdlib / name).read_text(encoding="utf-8")
        if len(text) < cap:
            continue
        cut = text[:cap]
        cut = cut[: cut.rfind("\n") + 1]
        path = work / "prompts" / (name.replace("/", "__") + ".txt")
        path.write_text(cut)
        out.append((name, path))
        if len(out) == n:
            break
    return out


def binary_acceptance(work: Path, n_max: int) -> list:
    """llama.cpp's own ``llama-speculative-simple --spec-type draft-eagle3``: (prompt, drafted, accepted, same
    text as plain greedy) per held-out prompt."""
    n_gen = os.environ.get("N_GEN", "128")
    rows = []
    for name, path in _prompts(work):
        base = [str(BINS / "llama-speculative-simple"), "-m", str(SRC), "-f", str(path), "-n", n_gen, "-t", "1",
                "--temp", "0", "-s", "1"]
        cmd = base + ["-md", str(GGUF), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(n_max)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        log = r.stdout + r.stderr
        get = lambda k: int(re.search(rf"{k}\s*=\s*(\d+)", log).group(1)) if re.search(rf"{k}\s*=\s*(\d+)", log) else None
        if r.returncode != 0 or get("n_drafted") is None:
            print(f"FAILED rc={r.returncode}: {' '.join(cmd)}\n{log[-3000:]}")
            rows.append((name, None, None, None))
            continue
        rows.append((name, get("n_drafted"), get("n_accept"), get("n_predict")))
        (work / "prompts" / (path.stem + f".k{n_max}.log")).write_text(log)
    return rows


def _ext(C, name, argtypes, restype):
    """A mangled ``llama-ext.h`` function from the loaded libllama (C++ linkage; design note, blocker 2)."""
    f = getattr(C.llama_cpp._lib, name)
    f.argtypes, f.restype = argtypes, restype
    return f


def torch_vs_llama(work: Path, n_win: int = 2):
    """On held-out windows: the torch target's layer inputs vs llama.cpp's ``llama_get_embeddings_layer_inp``,
    and the torch head (steps 1 and a 2-step chain) vs llama.cpp's eagle3 encoder + decoder."""
    import torch
    import llama_cpp as C
    import llama_cpp.llama_cpp_ext as X
    C.llama_backend_init()
    mtp = _mtp_script()
    keep = mtp._quiet(C)
    set_li = _ext(C, "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                  [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None)
    get_li = _ext(C, "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                  [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float))
    target, head, d2t, ck = _trained(work)
    tm = mtp._load(C, SRC)
    tctx = mtp._ctx(C, tm)
    for i in LAYERS:
        set_li(tctx, i, True)
    dm = mtp._load(C, GGUF)
    cp = C.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = SEQ
    cp.n_threads = cp.n_threads_batch = THREADS
    cp.ctx_other = tctx
    dctx = C.llama_init_from_model(dm, cp)
    assert dctx, "eagle3 context"
    X.llama_set_embeddings_nextn(dctx, True, False)  # every row's pre-norm h (and the encoder's g)
    held = np.load(work / "held_ids.npy")
    starts = np.random.default_rng(7).integers(0, len(held) - SEQ - 1, n_win)
    d_feat = d_g = d_h = d_lg = d_lg2 = 0.0
    agree = agree2 = n = n2 = 0
    for s in starts:
        t = held[s:s + SEQ].astype(np.int64)
        C.llama_memory_clear(C.llama_get_memory(tctx), True)
        b = C.llama_batch_init(SEQ, 0, 1)
        for j, tok in enumerate(t):
            b.token[j], b.pos[j], b.n_seq_id[j], b.seq_id[j][0], b.logits[j] = int(tok), j, 1, 0, j == SEQ - 1
        b.n_tokens = SEQ
        assert C.llama_decode(tctx, b) == 0
        C.llama_batch_free(b)
        lc_feat = np.concatenate([np.ctypeslib.as_array(get_li(tctx, i), shape=(SEQ, E)).copy() for i in LAYERS], 1)
        with torch.no_grad():
            feats, _ = target_forward(target, torch.from_numpy(t[None]))
        d_feat = max(d_feat, float(np.abs(feats[0].numpy() - lc_feat).max()))
        # encoder: llama.cpp's own features in, g out (classic batch, embd rows of 3*E)
        C.llama_memory_clear(C.llama_get_memory(dctx), True)
        be = C.llama_batch_init(SEQ, 3 * E, 1)
        np.ctypeslib.as_array(be.embd, shape=(SEQ, 3 * E))[:] = lc_feat
        for j in range(SEQ):
            be.pos[j], be.n_seq_id[j], be.seq_id[j][0], be.logits[j] = j, 1, 0, True
        be.n_tokens = SEQ
        assert C.llama_encode(dctx, be) == 0
        C.llama_batch_free(be)
        g_lc = np.ctypeslib.as_array(X.llama_get_embeddings_nextn(dctx), shape=(SEQ, E)).copy()
        with torch.no_grad():
            g_t = head.encode(torch.from_numpy(lc_feat)[None])
            (h_t, lg_t), _ = head.step1(torch.from_numpy(t[None, 1:]), g_t[:, :-1])
        d_g = max(d_g, float(np.abs(g_t[0].numpy() - g_lc).max()))
        # decoder, step 1 over the window: pairs (t[P+1], g_P) at P = 0..SEQ-2, every row an output
        n_rows = SEQ - 1
        bd = C.llama_batch_init(SEQ, E, 1)
        tok_buf = np.zeros(SEQ, np.int32)
        bd.token = tok_buf.ctypes.data_as(ctypes.POINTER(C.llama_token))
        tok_buf[:n_rows] = t[1:]
        np.ctypeslib.as_array(bd.embd, shape=(SEQ, E))[:n_rows] = g_lc[:n_rows]
        for j in range(n_rows):
            bd.pos[j], bd.n_seq_id[j], bd.seq_id[j][0], bd.logits[j] = j, 1, 0, True
        bd.n_tokens = n_rows
        assert C.llama_decode(dctx, bd) == 0
        lg_lc = np.ctypeslib.as_array(C.llama_get_logits(dctx), shape=(n_rows, V)).copy()[:, d2t.numpy()]
        h_lc = np.ctypeslib.as_array(X.llama_get_embeddings_nextn(dctx), shape=(n_rows, E)).copy()
        d_h = max(d_h, float(np.abs(h_t[0].numpy() - h_lc).max()))
        d_lg = max(d_lg, float(np.abs(lg_t[0].numpy() - lg_lc).max()))
        agree += int((lg_t[0].numpy().argmax(1) == lg_lc.argmax(1)).sum())
        n += n_rows
        # a chained row: cut the draft KV at m and write (t[m+1], h_{m-1}) there, as draft() chains on h
        m = SEQ // 2
        C.llama_memory_seq_rm(C.llama_get_memory(dctx), 0, m, -1)
        tok_buf[0] = t[m + 1]
        np.ctypeslib.as_array(bd.embd, shape=(SEQ, E))[0] = h_lc[m - 1]
        bd.pos[0], bd.logits[0] = m, True
        bd.n_tokens = 1
        assert C.llama_decode(dctx, bd) == 0
        lg2_lc = np.ctypeslib.as_array(C.llama_get_logits(dctx), shape=(1, V)).copy()[:, d2t.numpy()]
        bd.token = ctypes.POINTER(C.llama_token)()
        C.llama_batch_free(bd)
        with torch.no_grad():
            tt = torch.from_numpy(t[None, 1:m + 2])
            g2 = torch.cat((g_t[:, :m], torch.from_numpy(h_lc[m - 1])[None, None]), 1)
            (_, lg2_t), _ = head.step1(tt, g2)  # same KV as llama.cpp: step-1 rows 0..m-1, then the chained row
        d_lg2 = max(d_lg2, float(np.abs(lg2_t[0, -1].numpy() - lg2_lc[0]).max()))
        agree2 += int(lg2_t[0, -1].numpy().argmax() == lg2_lc[0].argmax())
        n2 += 1
    print(f"head from step {ck['step']}; {n_win} held-out windows x {SEQ} tokens")
    print(f"target layer inputs {list(LAYERS)}: torch vs llama.cpp max|d| {d_feat:.4f}")
    print(f"encoder g (llama.cpp features in): torch vs llama.cpp max|d| {d_g:.4f}")
    print(f"decoder step 1: pre-norm h max|d| {d_h:.4f}; draft-vocab logits max|d| {d_lg:.4f}, argmax agreement "
          f"{agree / n:.4f} ({n} rows)")
    print(f"chained row (h as g): logits max|d| {d_lg2:.4f}, argmax agreement {agree2}/{n2}")
    del keep


def teacher_forced(work: Path, n_win: int = 8):
    """Torch, held-out windows: how often the head's argmax equals the target's (greedy acceptance at each
    unrolled step, teacher-forced tokens) and the share of target argmaxes inside the draft vocabulary."""
    import torch
    target, head, d2t, _ = _trained(work)
    held = np.load(work / "held_ids.npy")
    starts = np.random.default_rng(11).integers(0, len(held) - SEQ - 1, n_win)
    hits, tot, inside = np.zeros(UNROLL), np.zeros(UNROLL), 0
    with torch.no_grad():
        for s in starts:
            t = torch.from_numpy(held[None, s:s + SEQ].astype(np.int64))
            feats, tl = target_forward(target, t)
            want = tl[0, 1:].argmax(-1)
            inside += int(torch.isin(want, d2t).sum())
            for j, (_, lg) in enumerate(head.unrolled(t[:, 1:], head.encode(feats[:, :-1]), UNROLL)):
                got = d2t[lg[0, j:].argmax(-1)]
                hits[j] += int((got == want[j:]).sum())
                tot[j] += len(got)
    print("teacher-forced argmax agreement with the target, by unrolled step: "
          + ", ".join(f"step {j + 1} {hits[j] / tot[j]:.4f}" for j in range(UNROLL))
          + f"; target argmax inside d2t {inside / tot[0]:.4f}")


def validate(work: Path):
    """(a) llama-speculative-simple loads the head and accepts its drafts (the proof of the layout);
    (b) torch vs llama.cpp on the same inputs; (c) teacher-forced agreement in torch."""
    for n_max in (3, 8):
        rows = binary_acceptance(work, n_max)
        print(f"\nllama-speculative-simple --spec-type draft-eagle3 --spec-draft-n-max {n_max} -n "
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
        torch_vs_llama(work)
        teacher_forced(work)


if __name__ == "__main__":
    cmd, work = sys.argv[1], Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    {"corpus": corpus, "train": train, "export": export, "validate": validate}[cmd](work)
