"""Train the bundled hybrid model ``pycoder-lfm2``: a small LFM2 (short-conv + attention) code model.

Steering tool, not part of the product. It makes a real, trained model in llama.cpp's ``lfm2``
architecture, a hybrid whose conv layers keep a *recurrent* state (llama.cpp's hybrid memory:
a KV cache for the attention layers plus a rolling conv state for the others). That is the case
where speculative decoding cannot simply drop rejected tokens from a KV cache, so specstack needs
a real one to test against. Same corpus, tokenizer and recipe as the llama-architecture pycoder
family (see ``/work/shared/tools/train_models.py`` and the models README), so it pairs with
``pycoder-1m`` as a draft.

Architecture (as llama.cpp's ``src/models/lfm2.cpp`` computes it):

  x = x + op(attn_norm(x))          op = short conv or GQA attention, per layer
  x = x + ffn(ffn_norm(x))          SwiGLU: down(silu(gate(h)) * up(h))
  logits = token_embd_norm(x) @ token_embd^T       (tied output)

  short conv:  b, c, h = split3(in_proj(x));  y = out_proj(c * causal_depthwise_conv(b * h))
               kernel of l_cache taps, no bias; tap l_cache-1 multiplies the current token
  attention:   q/k RMSNorm per head (weight of head_dim) *before* RoPE; NeoX RoPE (rotate
               halves), base 10000; scale 1/sqrt(head_dim); heads share K/V (GQA)

GGUF: ``lfm2.attention.head_count_kv`` is a per-layer array, 0 on conv layers; that is how
llama.cpp decides which layers are recurrent. F16 matrices, F32 norms and conv kernels.

How the bundled file was made (python = /work/trainenv: torch 2.13 CPU, tokenizers, numpy, gguf;
LLAMA_PY = /work/venv, llama-cpp-python 0.3.36, used by ``validate`` and ``agree``):

  python scripts/train_lfm2.py corpus   /work/lfm2work   # train_ids.npy with the shared tokenizer
  THREADS=1 TIME_BUDGET=3100 python scripts/train_lfm2.py train /work/lfm2work
  python scripts/train_lfm2.py export   /work/lfm2work   # -> specstack/models/pycoder-lfm2.gguf
  python scripts/train_lfm2.py validate /work/lfm2work   # llama.cpp vs torch, batched vs 1-by-1
  /work/venv/bin/python scripts/train_lfm2.py agree /work/lfm2work   # pycoder-1m as its draft

``train`` follows the family's recipe (AdamW 0.9/0.95, weight decay 0.1, 40 warm-up steps, cosine
to 10%, bf16 autocast, random 512-token windows) with batch 16. The machine was shared, so the
cosine ran over wall time (TIME_BUDGET seconds; STEPS caps it) rather than a fixed step count:
the step count reached is in the log and in pycoder-lfm2.md. With TIME_BUDGET=0 it is a plain
STEPS-step cosine. On a contended 2-core machine THREADS=1 was 10x faster than 2 threads.
A checkpoint (OUT/pycoder-lfm2.pt) is written every 50 steps, so ``export`` works mid-run.

Environment: TOKENIZER (default /work/shared/models/tokenizer.json), STEPS, BATCH, LR, THREADS,
TIME_BUDGET, GGUF (export/validate path), LLAMA_PY (default /work/venv/bin/python); for
``validate``: N_TOK; for ``agree``: TARGET, DRAFTS, N_PROMPTS, N_GEN, STRIP=1.
"""
import hashlib, json, math, os, subprocess, sys, time
from pathlib import Path

import numpy as np

STDLIB = Path(os.__file__).parent
REPO = Path(__file__).resolve().parents[1]
SEQ = 512
VOCAB = 4096
EOT = "<|endoftext|>"
NAME = "pycoder-lfm2"
TOKENIZER = Path(os.environ.get("TOKENIZER", "/work/shared/models/tokenizer.json"))
GGUF = Path(os.environ.get("GGUF", REPO / "specstack" / "models" / f"{NAME}.gguf"))
LLAMA_PY = os.environ.get("LLAMA_PY", "/work/venv/bin/python")

CFG = dict(
    d=256, layers=6, attn_layers=(2, 5), heads=8, kv=4, ffn=512, l_cache=3,
    steps=int(os.environ.get("STEPS", "2000")), batch=int(os.environ.get("BATCH", "16")),
    lr=float(os.environ.get("LR", "2e-3")), warm=40,
    time_budget=float(os.environ.get("TIME_BUDGET", "0")), eps=1e-5, rope_base=10000.0,
)


def held_out(path: Path) -> bool:
    """The family's held-out rule (about 4% of files): never trained on."""
    return hashlib.sha256(str(path.relative_to(STDLIB)).encode()).digest()[0] < 10


def stdlib_files():
    files = sorted(p for p in STDLIB.rglob("*.py") if "site-packages" not in p.parts)
    train, held = [], []
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (held if held_out(p) else train).append((p, text))
    return train, held


def corpus(out: Path):
    """Like train_models.py's corpus step, but encodes with the family's existing tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    assert tok.get_vocab_size() == VOCAB
    train, held = stdlib_files()
    out.mkdir(parents=True, exist_ok=True)
    (out / "held_out.txt").write_text("\n".join(str(p.relative_to(STDLIB)) for p, _ in held) + "\n")
    eot = tok.token_to_id(EOT)
    ids = []
    for _, text in train:
        ids.append(eot)
        ids.extend(tok.encode(text).ids)
    arr = np.array(ids, dtype=np.uint16)
    np.save(out / "train_ids.npy", arr)
    print(f"files train={len(train)} held={len(held)} tokens={len(arr)} "
          f"chars/token={sum(len(t) for _, t in train) / len(arr):.2f}")


def build(cfg):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    d, H, KV, L = cfg["d"], cfg["heads"], cfg["kv"], cfg["l_cache"]
    hd = d // H

    def rope(x, cos, sin):
        # NeoX rotation (llama.cpp LLAMA_ROPE_TYPE_NEOX, the rope type of LLM_ARCH_LFM2):
        # dimension i pairs with i + hd/2
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    class ShortConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.in_proj = nn.Linear(d, 3 * d, bias=False)
            self.conv = nn.Parameter(torch.empty(d, L).uniform_(-1 / math.sqrt(L), 1 / math.sqrt(L)))
            self.out_proj = nn.Linear(d, d, bias=False)

        def forward(self, h):
            T = h.shape[1]
            b, c, x = self.in_proj(h).chunk(3, dim=-1)  # llama.cpp: views at 0, d, 2d
            bx = b * x                                   # (B, T, d)
            pad = F.pad(bx, (0, 0, L - 1, 0))            # L-1 zero columns = empty conv state
            w = self.conv.to(bx.dtype)
            # ggml_ssm_conv: out[t] = sum_k w[:, k] * pad[t + k]
            conv = sum(pad[:, k:k + T] * w[:, k] for k in range(L))
            return self.out_proj(c * conv)

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(d, H * hd, bias=False)
            self.k = nn.Linear(d, KV * hd, bias=False)
            self.v = nn.Linear(d, KV * hd, bias=False)
            self.q_norm = nn.RMSNorm(hd, eps=cfg["eps"])
            self.k_norm = nn.RMSNorm(hd, eps=cfg["eps"])
            self.o = nn.Linear(H * hd, d, bias=False)

        def forward(self, h, cos, sin):
            B, T, _ = h.shape
            q = self.q_norm(self.q(h).view(B, T, H, hd))
            k = self.k_norm(self.k(h).view(B, T, KV, hd))
            v = self.v(h).view(B, T, KV, hd)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.o(a.transpose(1, 2).reshape(B, T, H * hd))

    class Block(nn.Module):
        def __init__(self, is_attn):
            super().__init__()
            self.is_attn = is_attn
            self.attn_norm = nn.RMSNorm(d, eps=cfg["eps"])  # LFM2's operator_norm
            self.op = Attn() if is_attn else ShortConv()
            self.ffn_norm = nn.RMSNorm(d, eps=cfg["eps"])
            self.gate = nn.Linear(d, cfg["ffn"], bias=False)
            self.up = nn.Linear(d, cfg["ffn"], bias=False)
            self.down = nn.Linear(cfg["ffn"], d, bias=False)

        def forward(self, x, cos, sin):
            h = self.attn_norm(x)
            x = x + (self.op(h, cos, sin) if self.is_attn else self.op(h))
            h = self.ffn_norm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, d)
            self.blocks = nn.ModuleList(Block(i in cfg["attn_layers"]) for i in range(cfg["layers"]))
            self.norm = nn.RMSNorm(d, eps=cfg["eps"])
            inv = 1.0 / (cfg["rope_base"] ** (torch.arange(0, hd, 2).float() / hd))
            ang = torch.arange(SEQ).float()[:, None] * inv[None, :]
            self.register_buffer("cos", ang.cos()[None, :, None, :], persistent=False)
            self.register_buffer("sin", ang.sin()[None, :, None, :], persistent=False)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)
            for b in self.blocks:  # scaled residual init
                out = b.op.o if b.is_attn else b.op.out_proj
                nn.init.normal_(out.weight, std=0.02 / math.sqrt(2 * cfg["layers"]))
                nn.init.normal_(b.down.weight, std=0.02 / math.sqrt(2 * cfg["layers"]))

        def forward(self, idx):
            T = idx.shape[1]
            x = self.embed(idx)
            for b in self.blocks:
                x = b(x, self.cos[:, :T], self.sin[:, :T])
            return self.norm(x) @ self.embed.weight.T  # tied output

    return LM()


def train(out: Path):
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    cfg = dict(CFG)
    ids = torch.from_numpy(np.load(out / "train_ids.npy").astype(np.int64))
    model = build(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{NAME}: {n_params/1e6:.2f}M params, {len(ids)/1e6:.2f}M tokens, cfg {cfg}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.1, betas=(0.9, 0.95))
    B, steps, warm = cfg["batch"], cfg["steps"], cfg["warm"]
    g = torch.Generator().manual_seed(1)
    t0 = time.time()
    ck = out / f"{NAME}.pt"
    losses = []

    def save(step):
        tmp = ck.with_suffix(".tmp")
        torch.save({"cfg": cfg, "step": step, "loss": float(np.mean(losses[-20:])), "elapsed": time.time() - t0,
                    "state": model.state_dict()}, tmp)
        os.replace(tmp, ck)

    budget = cfg["time_budget"]
    step = 0
    while True:
        # progress through the cosine: by steps, or by wall time when TIME_BUDGET is set (the
        # machine is shared, so the step rate is not known in advance); stop at 1
        frac = step / steps
        if budget:
            frac = max(frac, (time.time() - t0) / budget)
        if frac >= 1.0:
            break
        lr = cfg["lr"] * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for pg in opt.param_groups:
            pg["lr"] = lr
        starts = torch.randint(0, len(ids) - SEQ - 1, (B,), generator=g)
        x = torch.stack([ids[s:s + SEQ] for s in starts])
        y = torch.stack([ids[s + 1:s + SEQ + 1] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step <= 5 or step % 10 == 0:
            print(f"{NAME} step {step} loss {loss.item():.3f} (mean of last 10: {np.mean(losses[-10:]):.3f}) "
                  f"lr {lr:.2e} progress {frac:.3f} {(time.time()-t0)/step:.2f}s/step "
                  f"elapsed {time.time()-t0:.0f}s", flush=True)
        if step % 50 == 0:
            save(step)
    save(step)
    print(f"done {step} steps ({step * B * SEQ / 1e6:.1f}M tokens) in {time.time()-t0:.0f}s, "
          f"final loss {losses[-1]:.3f}, mean of last 20 steps {np.mean(losses[-20:]):.3f}", flush=True)


def load(out: Path):
    import torch

    ck = torch.load(out / f"{NAME}.pt")
    model = build(ck["cfg"])
    model.load_state_dict(ck["state"])
    model.eval()
    return ck, model


def export(out: Path):
    import gguf

    ck, _ = load(out)
    cfg, sd = ck["cfg"], ck["state"]
    tokjson = json.loads(TOKENIZER.read_text())
    vocab = tokjson["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == VOCAB, len(tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokjson["model"]["merges"]]
    eot = vocab[EOT]

    GGUF.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(GGUF), "lfm2")
    w.add_name(NAME)
    w.add_context_length(SEQ)
    w.add_embedding_length(cfg["d"])
    w.add_block_count(cfg["layers"])
    w.add_feed_forward_length(cfg["ffn"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv([cfg["kv"] if i in cfg["attn_layers"] else 0 for i in range(cfg["layers"])])
    w.add_layer_norm_rms_eps(cfg["eps"])
    w.add_rope_freq_base(cfg["rope_base"])
    w.add_shortconv_l_cache(cfg["l_cache"])
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == EOT else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_add_bos_token(True)

    def t(key, dtype=np.float16):
        return sd[key].float().numpy().astype(dtype)

    w.add_tensor("token_embd.weight", t("embed.weight"))
    w.add_tensor("token_embd_norm.weight", t("norm.weight", np.float32))  # LFM2's output norm
    for i in range(cfg["layers"]):
        p = f"blocks.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", t(p + "attn_norm.weight", np.float32))
        if i in cfg["attn_layers"]:
            w.add_tensor(f"blk.{i}.attn_q.weight", t(p + "op.q.weight"))
            w.add_tensor(f"blk.{i}.attn_k.weight", t(p + "op.k.weight"))
            w.add_tensor(f"blk.{i}.attn_v.weight", t(p + "op.v.weight"))
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", t(p + "op.q_norm.weight", np.float32))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", t(p + "op.k_norm.weight", np.float32))
            w.add_tensor(f"blk.{i}.attn_output.weight", t(p + "op.o.weight"))
        else:
            # conv kernel: numpy (d, l_cache) = GGUF ne {l_cache, d}; F32 (ggml_ssm_conv wants F32)
            w.add_tensor(f"blk.{i}.shortconv.conv.weight", t(p + "op.conv", np.float32))
            w.add_tensor(f"blk.{i}.shortconv.in_proj.weight", t(p + "op.in_proj.weight"))
            w.add_tensor(f"blk.{i}.shortconv.out_proj.weight", t(p + "op.out_proj.weight"))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", t(p + "ffn_norm.weight", np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", t(p + "gate.weight"))
        w.add_tensor(f"blk.{i}.ffn_up.weight", t(p + "up.weight"))
        w.add_tensor(f"blk.{i}.ffn_down.weight", t(p + "down.weight"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    sha = hashlib.sha256(GGUF.read_bytes()).hexdigest()
    print(f"wrote {GGUF} ({GGUF.stat().st_size} bytes, sha256 {sha}) from step {ck['step']} "
          f"(loss {ck['loss']:.3f})")


# ---------------------------------------------------------------------------------------------
# validation: torch (this interpreter) vs llama.cpp (LLAMA_PY, a subprocess)

N_TOK = int(os.environ.get("N_TOK", "64"))  # tokens compared (BOS + the file's first N_TOK-1)


def held_text(name="held_out_prompt"):
    """A held-out file and a code prompt cut from it (ends after a def line and its first body line)."""
    _, held = stdlib_files()
    held = sorted(held, key=lambda pt: str(pt[0]))
    for p, text in held:
        lines = text.splitlines(keepends=True)
        for i in range(40, len(lines) - 2):
            if lines[i].lstrip().startswith("def ") and lines[i].rstrip().endswith(":") \
                    and lines[i + 1].strip() and not lines[i + 1].strip().startswith(('"', "'", "#")):
                # without the final newline: byte-level BPE joins a newline with the next line's
                # indent ("\n       " + " x"), so a prompt ending in a bare "\n" reads as
                # "next line starts at column 0" to every pycoder model
                prompt = "".join(lines[:i + 2])[-1200:].rstrip("\n")
                return p, text, prompt
    raise SystemExit("no prompt found")


def _llama(req: Path):
    """Runs under LLAMA_PY: llama.cpp logits for the request's tokens, batched and one by one."""
    import llama_cpp

    r = json.loads(req.read_text())
    toks = r["tokens"]
    llm = llama_cpp.Llama(model_path=r["gguf"], logits_all=True, n_ctx=SEQ, verbose=False, n_threads=2)
    assert llm.tokenize(r["check_text"].encode(), add_bos=True, special=False) == r["check_tokens"], \
        "llama.cpp tokenization differs from the training tokenizer"
    llm.reset()
    llm.eval(toks)
    batched = np.array(llm.scores[:len(toks)], dtype=np.float32)
    llm.reset()
    single = []
    for i, t in enumerate(toks):
        llm.eval([t])
        single.append(np.array(llm.scores[i], dtype=np.float32))
    single = np.stack(single)
    # greedy generation from a held-out prompt
    llm.reset()
    p = llm.tokenize(r["prompt"].encode(), add_bos=True, special=False)
    gen = []
    for t in llm.generate(p, temp=0.0, top_k=1, reset=True):
        if t == llm.token_eos() or len(gen) >= r["n_gen"]:
            break
        gen.append(t)
    text = llm.detokenize(gen).decode("utf-8", "replace")
    np.savez(req.with_suffix(".npz"), batched=batched, single=single, gen=np.array(gen))
    req.with_suffix(".gen.txt").write_text(text)


def heldout_windows(encode, n_windows=16):
    """n_windows (x, y) 512-token windows from the held-out files (BOS-separated), fixed seed."""
    _, held = stdlib_files()
    ids = []
    for _, text in held:
        ids.append(0)
        ids.extend(encode(text))
    ids = np.array(ids)
    starts = np.random.default_rng(7).integers(0, len(ids) - SEQ - 1, n_windows)
    return [(ids[s:s + SEQ], ids[s + 1:s + SEQ + 1]) for s in starts], len(ids)


def heldout_loss(model, n_windows=16):
    """Mean next-token loss of the torch model (fp32) on the held-out windows."""
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    wins, n = heldout_windows(lambda t: tok.encode(t).ids, n_windows)
    x = torch.tensor(np.stack([w[0] for w in wins]))
    y = torch.tensor(np.stack([w[1] for w in wins]))
    with torch.no_grad():
        return F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1)).item(), n


def validate(out: Path):
    import torch
    from tokenizers import Tokenizer

    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    ck, model = load(out)
    tok = Tokenizer.from_file(str(TOKENIZER))
    path, text, prompt = held_text()
    toks = [0] + tok.encode(text).ids[: N_TOK - 1]
    with torch.no_grad():
        ref = model(torch.tensor([toks]))[0].float().numpy()
    check_text = "def f(x):\n\treturn x + 'é ünïcode' # tab\n"
    req = out / "validate_req.json"
    req.write_text(json.dumps({"gguf": str(GGUF), "tokens": toks, "prompt": prompt, "n_gen": 64,
                               "check_text": check_text,
                               "check_tokens": [0] + tok.encode(check_text).ids}))
    subprocess.run([LLAMA_PY, __file__, "_llama", str(req)], check=True)
    res = np.load(req.with_suffix(".npz"))
    batched, single = res["batched"], res["single"]
    am = lambda a: a.argmax(-1)
    print(f"checkpoint step {ck['step']} (train loss {ck['loss']:.3f}); held-out file "
          f"{path.relative_to(STDLIB)}, {len(toks)} tokens")
    print(f"llama.cpp batched vs torch fp32: argmax agreement {np.mean(am(batched) == am(ref)):.3f}, "
          f"max |dlogit| {np.abs(batched - ref).max():.4f}")
    print(f"llama.cpp one-by-one vs torch:   argmax agreement {np.mean(am(single) == am(ref)):.3f}, "
          f"max |dlogit| {np.abs(single - ref).max():.4f}")
    print(f"llama.cpp batched vs one-by-one: argmax agreement {np.mean(am(batched) == am(single)):.3f}, "
          f"max |dlogit| {np.abs(batched - single).max():.4f}")
    # torch greedy continuation of the same prompt: does llama.cpp's generation match it?
    p = [0] + tok.encode(prompt).ids
    cur = list(p)
    with torch.no_grad():
        for _ in range(len(res["gen"])):
            cur.append(int(model(torch.tensor([cur[-SEQ:]]))[0, -1].argmax()))
    tgen = cur[len(p):]
    same = sum(1 for a, b in zip(tgen, res["gen"].tolist()) if a == b)
    first_diff = next((i for i, (a, b) in enumerate(zip(tgen, res["gen"].tolist())) if a != b), None)
    print(f"greedy {len(tgen)} tokens: torch and llama.cpp identical for the first "
          f"{first_diff if first_diff is not None else len(tgen)} tokens ({same} positions equal)")
    loss, n = heldout_loss(model)
    print(f"held-out loss (fp32, 16 windows of {SEQ} from {n} held-out tokens): {loss:.3f} nats/token")
    print("---- prompt tail ----")
    print(prompt[-300:])
    print("---- llama.cpp greedy continuation ----")
    print(req.with_suffix(".gen.txt").read_text())


def agree(out: Path):
    """Runs under LLAMA_PY (llama.cpp only). Greedy target tokens on bundled held-out prompts;
    each draft teacher-forced on them: argmax agreement and mean sum(min(p, q)) at temperature 1.
    TARGET / DRAFTS (comma-separated) override the models; N_PROMPTS, N_GEN the sizes."""
    import llama_cpp

    models = REPO / "specstack" / "models"
    target = os.environ.get("TARGET", str(GGUF))
    drafts = os.environ.get("DRAFTS", str(models / "pycoder-1m.gguf")).split(",")
    n_prompts, n_gen = int(os.environ.get("N_PROMPTS", "6")), int(os.environ.get("N_GEN", "128"))
    rows = [json.loads(l) for l in (REPO / "specstack/data/prompts/code-complete.jsonl").open() if l.strip()]
    rows = rows[:n_prompts]
    if os.environ.get("STRIP") == "1":  # drop the prompts' final newline (see held_text)
        rows = [dict(r, prompt=r["prompt"].rstrip("\n")) for r in rows]
    load = lambda m: llama_cpp.Llama(model_path=m, logits_all=True, n_ctx=SEQ, verbose=False, n_threads=2)
    tgt = load(target)

    def probs(z):
        z = z - z.max(-1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(-1, keepdims=True)

    seqs = []
    for r in rows:
        p = tgt.tokenize(r["prompt"].encode(), add_bos=True, special=False)
        tgt.reset()
        tgt.eval(p)
        gen = []
        while len(gen) < n_gen and len(p) + len(gen) < SEQ:
            t = int(np.argmax(tgt.scores[tgt.n_tokens - 1]))
            if t == tgt.token_eos():
                break
            gen.append(t)
            tgt.eval([t])
        tz = np.array(tgt.scores[len(p) - 1:len(p) - 1 + len(gen)], dtype=np.float32)
        seqs.append((r["id"], p, gen, tz))
    # held-out loss of every model in llama.cpp, on the same windows as ``validate``'s torch loss
    wins, n = heldout_windows(lambda t: tgt.tokenize(t.encode(), add_bos=False, special=False))
    for m in [target] + drafts:
        llm = tgt if m == target else load(m)
        nll = []
        for x, y in wins:
            llm.reset()
            llm.eval(x.tolist())
            z = np.array(llm.scores[:SEQ], dtype=np.float64)
            z -= z.max(-1, keepdims=True)
            nll.append(np.log(np.exp(z).sum(-1)) - z[np.arange(SEQ), y])
        print(f"held-out loss in llama.cpp, {Path(m).name}: {np.mean(nll):.3f} nats/token "
              f"({len(wins)} windows of {SEQ} from {n} held-out tokens)")
    print(f"target {Path(target).name}; {len(rows)} prompts from code-complete.jsonl, up to {n_gen} greedy tokens")
    for d in drafts:
        dr = load(d)
        acc, mins = [], []
        for rid, p, gen, tz in seqs:
            dr.reset()
            dr.eval(p + gen)
            dz = np.array(dr.scores[len(p) - 1:len(p) - 1 + len(gen)], dtype=np.float32)
            acc.append(float(np.mean(dz.argmax(-1) == np.array(gen))))
            mins.append(float(np.minimum(probs(tz), probs(dz)).sum(-1).mean()))
        print(f"draft {Path(d).name}: argmax agreement per prompt " + " ".join(f"{a:.2f}" for a in acc)
              + f"  mean {np.mean(acc):.3f}; mean sum(min(p,q)) at T=1 {np.mean(mins):.3f}")


if __name__ == "__main__":
    cmd, out = sys.argv[1], Path(sys.argv[2])
    {"corpus": lambda: corpus(out), "train": lambda: train(out), "export": lambda: export(out),
     "validate": lambda: validate(out), "agree": lambda: agree(out),
     "_llama": lambda: _llama(out)}[cmd]()
