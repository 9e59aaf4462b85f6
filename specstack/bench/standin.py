"""Cost-faithful stand-in targets: a big model that computes exactly a small model's function.

A stand-in zero-pads a llama-architecture GGUF to a wider hidden size, a wider FFN and more
attention heads, and adds layers that write nothing to the residual stream. Its logits equal the
source's, while every decode step moves the bytes and does the FLOPs of the big shape. So
acceptance comes from the real (small) trained model and cost comes from the big one.

Why it is exact (d = source width, W = stand-in width; original coordinates come first):

- The residual stream holds m copies of the source's d coordinates, then zeros: the embedding
  columns are repeated m times and every weight that writes to the residual (attention output,
  FFN down) has its rows repeated m times and zero rows after that. Zero coordinates stay zero.
- RMSNorm over W coordinates: mean_W(x^2) = (m d / W) mean_d(x^2). With epsilon scaled by
  c^2 = m d / W and the norm weight by c on the first copy (zero elsewhere), the normalised
  coordinates the next matrices read are unchanged, and the other copies read as zeros.
  m is the smallest count with W / (m d) a power of 4 (m = 1 when W/d is 1, 4, 16, ..; m = 2
  for 2, 8, 32, ..; m = 3 for 3, 12, ..): then c is a power of two and every rescaling
  is exact in floating point, so the stand-in's logits equal the source's bit for bit. With
  m = 1 and W/d = 2 the norms would be off by an F32 ulp, which Q8_0 activation rounding
  amplifies to logit differences of ~0.04 and real greedy flips. Widths that are not a whole
  multiple of d fall back to m = 1, c = sqrt(d / W): close, not bit-exact.
- Extra query heads have zero Wq rows, so they attend uniformly over values they never pass on
  (their Wo columns are zero). KV heads grow in the same ratio and original heads come first, so
  llama.cpp's grouped-query mapping (query head h reads KV head h // (n_head / n_head_kv)) still
  sends original query heads to original KV heads.
- Extra FFN units have zero gate/up rows and zero down columns.
- Extra layers copy a source layer's weights (realistic magnitudes, so no overflow) but have zero
  attention-output and FFN-down matrices, so they add exactly zero.

Quantized stand-ins are made with llama.cpp's own quantizer. The source width fills whole quant
blocks, so the original blocks quantize identically. Q4_K_M also picks some tensor types by layer
index (``use_more_bits`` in llama-quant.cpp), so the source layers are placed at layer slots that
get the same types as in the source; the zero layers fill the other slots.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..errors import InvalidParameterError, ModelLoadError, SpecstackError, UnsupportedModelError

FTYPES = ("f16", "q8_0", "q4_k_m")
# Quant block length (elements per row block) per ftype; rows of the source must fill whole blocks.
_BLOCK = {"f16": 1, "q8_0": 32, "q4_k_m": 256}

_ARCH = "llama"
_PER_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
              "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
# Mixture of experts: a router (F32) and stacked expert matrices [n_expert, rows, cols].
_PER_LAYER_MOE = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class StandinError(SpecstackError):
    """A stand-in cannot be made from this source with these settings."""


@dataclass(frozen=True)
class LlamaShape:
    """The shape of a dense llama-architecture model, as llama.cpp reads it from GGUF."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int  # per expert for MoE models
    n_vocab: int
    tied_output: bool
    n_expert: int = 0  # 0: dense
    n_expert_used: int = 0

    @property
    def per_layer(self) -> tuple[str, ...]:
        return _PER_LAYER_MOE if self.n_expert else _PER_LAYER

    @property
    def n_params(self) -> int:
        d, hd = self.n_embd, self.head_dim
        attn = d * hd * (2 * self.n_head + 2 * self.n_head_kv)
        ffn = 3 * d * self.n_ff * max(1, self.n_expert) + d * self.n_expert
        norms = 2 * d
        embd = self.n_vocab * d * (1 if self.tied_output else 2)
        return self.n_layer * (attn + ffn + norms) + embd + d


@dataclass(frozen=True)
class StandinPlan:
    """How the source maps into the stand-in.

    ``layer_source[i]`` is the source layer whose weights stand-in layer i holds, and
    ``layer_live[i]`` says whether it is the real one (True) or a zero-output copy.
    """

    src: LlamaShape
    out: LlamaShape
    layer_source: tuple[int, ...]
    layer_live: tuple[bool, ...]
    copies: int  # m: copies of the source's residual coordinates
    norm_scale: float  # c = sqrt(m d / W); norm weights are multiplied by c, epsilon by c^2

    @property
    def bit_exact(self) -> bool:
        """True when c is a power of two, so the rescaled norms round exactly like the source's."""
        return math.frexp(self.norm_scale)[0] == 0.5


# ---------------------------------------------------------------------------------------------
# Planning (pure)
# ---------------------------------------------------------------------------------------------

def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    # Copied from llama.cpp src/llama-quant.cpp: Q4_K_M/Q5_K_M give attn_v and ffn_down of
    # these layers Q6_K.
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def live_layer_slots(n_src: int, n_out: int) -> list[int]:
    """Stand-in layer indices for the source layers, in order.

    Picks the earliest slots whose ``use_more_bits`` pattern equals the source's, so Q4_K_M gives
    each source layer the same tensor types in both models. Greedy earliest matching finds such a
    subsequence whenever one exists; otherwise the source layers go first.
    """
    slots: list[int] = []
    pos = 0
    for j in range(n_src):
        want = _use_more_bits(j, n_src)
        while pos < n_out and _use_more_bits(pos, n_out) != want:
            pos += 1
        if pos >= n_out:
            return list(range(n_src))
        slots.append(pos)
        pos += 1
    return slots


def residual_copies(d: int, width: int) -> int:
    """m: how many copies of the d source coordinates to keep, so that width / (m d) is a power
    of 4 (see the module docstring); 1 when width is not a whole multiple of d."""
    if width % d:
        return 1
    ratio = width // d
    while ratio % 4 == 0:
        ratio //= 4
    return ratio


def plan_standin(src: LlamaShape, width: int, layers: int, ffn: int | None = None,
                 ftype: str = "f16") -> StandinPlan:
    """Check the request and work out the stand-in's shape and layer layout."""
    if ftype not in FTYPES:
        raise InvalidParameterError(f"unknown --ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    hd = src.head_dim
    ratio = src.n_head // src.n_head_kv
    if width < src.n_embd:
        raise InvalidParameterError(
            f"--width {width} is smaller than the source's hidden size {src.n_embd}; a stand-in can only grow")
    if width % (hd * ratio):
        raise InvalidParameterError(
            f"--width {width} must be a multiple of {hd * ratio} (head_dim {hd} x {ratio} query heads per KV "
            f"head), so whole heads can be added in the source's grouped-query ratio")
    if layers < src.n_layer:
        raise InvalidParameterError(
            f"--layers {layers} is fewer than the source's {src.n_layer} layers; a stand-in can only grow")
    if layers > 512:
        raise InvalidParameterError(f"--layers {layers} is more than llama.cpp's limit of 512")
    n_ff = ffn if ffn is not None else round(src.n_ff * width / src.n_embd)
    if n_ff < src.n_ff:
        raise InvalidParameterError(f"--ffn {n_ff} is smaller than the source's FFN width {src.n_ff}")
    block = _BLOCK[ftype]
    for what, n_src, n_new in (("hidden size", src.n_embd, width), ("FFN width", src.n_ff, n_ff)):
        if n_src % block or n_new % block:
            raise InvalidParameterError(
                f"{ftype} quantizes rows in blocks of {block}: the source {what} ({n_src}) and the stand-in's "
                f"({n_new}) must both be multiples of {block}, or the quantized stand-in would not match")
    n_head = width // hd
    out = LlamaShape(n_embd=width, n_layer=layers, n_head=n_head, n_head_kv=n_head // ratio, head_dim=hd,
                     n_ff=n_ff, n_vocab=src.n_vocab, tied_output=src.tied_output, n_expert=src.n_expert,
                     n_expert_used=src.n_expert_used)
    slots = live_layer_slots(src.n_layer, layers)
    source = [i % src.n_layer for i in range(layers)]
    live = [False] * layers
    for j, slot in enumerate(slots):
        source[slot], live[slot] = j, True
    m = residual_copies(src.n_embd, width)
    return StandinPlan(src=src, out=out, layer_source=tuple(source), layer_live=tuple(live),
                       copies=m, norm_scale=math.sqrt(m * src.n_embd / width))


# ---------------------------------------------------------------------------------------------
# Reading the source
# ---------------------------------------------------------------------------------------------

def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_shape(reader) -> LlamaShape:
    """The llama shape of an open ``gguf.GGUFReader``; raises for anything else."""
    arch = _field(reader, "general.architecture")
    if arch != _ARCH:
        raise UnsupportedModelError(
            f"stand-ins need a dense llama-architecture model; this one is {arch!r}")

    def need(key: str) -> int:
        v = _field(reader, f"{_ARCH}.{key}")
        if not isinstance(v, int):
            raise UnsupportedModelError(f"source lacks a single integer {_ARCH}.{key} (got {v!r})")
        return v

    d, n_head, n_head_kv = need("embedding_length"), need("attention.head_count"), need("attention.head_count_kv")
    head_dim = _field(reader, f"{_ARCH}.attention.key_length") or d // n_head
    if head_dim * n_head != d or (_field(reader, f"{_ARCH}.attention.value_length") or head_dim) != head_dim:
        raise UnsupportedModelError("stand-ins need head_dim x n_head == embedding_length")
    if n_head % n_head_kv:
        raise UnsupportedModelError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    names = {t.name for t in reader.tensors}
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise UnsupportedModelError("source has no token_embd.weight")
    n_expert = _field(reader, f"{_ARCH}.expert_count") or 0
    n_ff = (_field(reader, f"{_ARCH}.expert_feed_forward_length") or need("feed_forward_length")) if n_expert \
        else need("feed_forward_length")
    return LlamaShape(n_embd=d, n_layer=need("block_count"), n_head=n_head, n_head_kv=n_head_kv,
                      head_dim=head_dim, n_ff=n_ff, n_vocab=int(emb.shape[1]),
                      tied_output="output.weight" not in names, n_expert=n_expert,
                      n_expert_used=_field(reader, f"{_ARCH}.expert_used_count") or 0)


# ---------------------------------------------------------------------------------------------
# Padding one tensor (pure numpy; arrays are [rows = out features, cols = in features])
# ---------------------------------------------------------------------------------------------

def _pad2(a: np.ndarray, rows: int, cols: int, dtype: np.dtype, *, row_copies: int = 1,
          col_copies: int = 1) -> np.ndarray:
    """Zero-pad ``a`` to [rows, cols], repeating it ``row_copies`` times down / ``col_copies`` across."""
    out = np.zeros((rows, cols), dtype=dtype)
    r, c = a.shape
    for i in range(row_copies):
        for j in range(col_copies):
            out[i * r:(i + 1) * r, j * c:(j + 1) * c] = a
    return out


def _pad_norm(w: np.ndarray, plan: StandinPlan) -> np.ndarray:
    # Only the first copy is read: the matrices after a norm see the other copies as zeros.
    out = np.zeros(plan.out.n_embd, dtype=np.float32)
    out[: plan.src.n_embd] = (w.astype(np.float64) * plan.norm_scale).astype(np.float32)
    return out


def _layer_tensor(kind: str, a: np.ndarray, plan: StandinPlan, live: bool, dtype: np.dtype) -> np.ndarray:
    o, s = plan.out, plan.src
    q_dim, kv_dim = o.n_head * o.head_dim, o.n_head_kv * o.head_dim
    if kind in ("attn_norm", "ffn_norm"):
        return _pad_norm(a, plan)
    if kind == "ffn_gate_inp":  # the router reads the norm output: its choice stays the source's
        return _pad2(a, o.n_expert, o.n_embd, np.dtype(np.float32))
    if kind.endswith("_exps"):
        base = kind[: -len("_exps")]
        return np.stack([_layer_tensor(base, e, plan, live, dtype) for e in a])
    if kind in ("attn_output", "ffn_down") and not live:
        cols = q_dim if kind == "attn_output" else o.n_ff
        return np.zeros((o.n_embd, cols), dtype=dtype)
    rows, cols = {
        "attn_q": (q_dim, o.n_embd), "attn_k": (kv_dim, o.n_embd), "attn_v": (kv_dim, o.n_embd),
        "attn_output": (o.n_embd, q_dim), "ffn_gate": (o.n_ff, o.n_embd), "ffn_up": (o.n_ff, o.n_embd),
        "ffn_down": (o.n_embd, o.n_ff),
    }[kind]
    writes_residual = kind in ("attn_output", "ffn_down")
    return _pad2(a, rows, cols, dtype, row_copies=plan.copies if writes_residual else 1)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def _as_float(t) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q

    if t.tensor_type in (Q.F16, Q.F32):
        return np.asarray(t.data)
    if t.tensor_type == Q.BF16:
        from gguf.quants import dequantize

        return dequantize(t.data, t.tensor_type)
    raise UnsupportedModelError(
        f"tensor {t.name} is {t.tensor_type.name}; make stand-ins from an F32/F16/BF16 source and "
        f"quantize with --ftype instead")


def _tensor_jobs(reader, plan: StandinPlan) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(name, make array) for every stand-in tensor, in llama.cpp's usual order."""
    o, s = plan.out, plan.src
    by_name = {t.name: t for t in reader.tensors}
    known = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
    known |= {f"blk.{i}.{k}.weight" for i in range(s.n_layer) for k in s.per_layer}
    unknown = sorted(set(by_name) - known)
    if unknown:
        raise UnsupportedModelError(
            f"source has tensors a plain llama stand-in cannot pad: {', '.join(unknown[:5])}")
    missing = sorted(known - set(by_name) - {"output.weight", "rope_freqs.weight"})
    if missing:
        raise UnsupportedModelError(f"source lacks tensors: {', '.join(missing[:5])}")
    f16 = np.dtype(np.float16)

    def mat(name: str, rows: int, cols: int, col_copies: int = 1):
        return lambda: _pad2(_as_float(by_name[name]), rows, cols, f16, col_copies=col_copies)

    # The embedding writes the residual (m copies); as the tied output it is read through the
    # output norm, which zeroes all but the first copy.
    yield "token_embd.weight", mat("token_embd.weight", o.n_vocab, o.n_embd, plan.copies)
    if "rope_freqs.weight" in by_name:
        yield "rope_freqs.weight", lambda: np.array(_as_float(by_name["rope_freqs.weight"]), dtype=np.float32)
    for i in range(o.n_layer):
        j, live = plan.layer_source[i], plan.layer_live[i]
        for kind in o.per_layer:
            src = by_name[f"blk.{j}.{kind}.weight"]
            dtype = np.dtype(np.float32) if kind.endswith("norm") or kind == "ffn_gate_inp" else f16
            yield (f"blk.{i}.{kind}.weight",
                   (lambda src=src, kind=kind, live=live, dtype=dtype:
                    _layer_tensor(kind, _as_float(src), plan, live, dtype)))
    yield "output_norm.weight", lambda: _pad_norm(_as_float(by_name["output_norm.weight"]), plan)
    if not s.tied_output:
        yield "output.weight", mat("output.weight", o.n_vocab, o.n_embd)


def _shape_of(name: str, plan: StandinPlan) -> tuple[tuple[int, ...], np.dtype]:
    """numpy shape and dtype of a stand-in tensor, without building it."""
    o = plan.out
    q_dim, kv_dim = o.n_head * o.head_dim, o.n_head_kv * o.head_dim
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    if name in ("token_embd.weight", "output.weight"):
        return (o.n_vocab, o.n_embd), f16
    if name == "output_norm.weight":
        return (o.n_embd,), f32
    if name == "rope_freqs.weight":
        return (o.head_dim // 2,), f32
    kind = name.split(".")[2]
    if kind == "ffn_gate_inp":
        return (o.n_expert, o.n_embd), f32
    if kind.endswith("_exps"):
        inner, dtype = _shape_of(name.replace(kind, kind[: -len("_exps")]), plan)
        return (o.n_expert, *inner), dtype
    return {
        "attn_norm": ((o.n_embd,), f32), "ffn_norm": ((o.n_embd,), f32),
        "attn_q": ((q_dim, o.n_embd), f16), "attn_k": ((kv_dim, o.n_embd), f16),
        "attn_v": ((kv_dim, o.n_embd), f16), "attn_output": ((o.n_embd, q_dim), f16),
        "ffn_gate": ((o.n_ff, o.n_embd), f16), "ffn_up": ((o.n_ff, o.n_embd), f16),
        "ffn_down": ((o.n_embd, o.n_ff), f16),
    }[kind]


def _copy_metadata(reader, writer, plan: StandinPlan, eps: float) -> None:
    from gguf import GGUFValueType as V

    o = plan.out
    updates = {
        f"{_ARCH}.embedding_length": o.n_embd,
        f"{_ARCH}.feed_forward_length": o.n_ff,
        f"{_ARCH}.expert_feed_forward_length": o.n_ff,
        f"{_ARCH}.attention.head_count": o.n_head,
        f"{_ARCH}.attention.head_count_kv": o.n_head_kv,
        f"{_ARCH}.block_count": o.n_layer,
    }
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = f.types[0]
        if f.name in updates:
            writer.add_key_value(f.name, updates[f.name], vtype)
        elif f.name == f"{_ARCH}.attention.layer_norm_rms_epsilon":
            writer.add_key_value(f.name, eps, V.FLOAT32)
        elif f.name == "general.file_type":
            writer.add_key_value(f.name, 1, V.UINT32)  # LLAMA_FTYPE_MOSTLY_F16
        elif f.name == "general.name":
            writer.add_key_value(f.name, f"{f.contents()}-standin-w{o.n_embd}-l{o.n_layer}", V.STRING)
        elif vtype == V.ARRAY:
            sub = f.types[-1]
            # Raw bytes for strings: token pieces need not be valid UTF-8.
            val = [bytes(f.parts[i]) for i in f.data] if sub == V.STRING else f.contents()
            writer.add_key_value(f.name, val, V.ARRAY, sub_type=sub)
        elif vtype == V.STRING:
            writer.add_key_value(f.name, bytes(f.parts[-1]), V.STRING)
        else:
            writer.add_key_value(f.name, f.contents(), vtype)
    src_name = _field(reader, "general.name") or "?"
    writer.add_key_value("specstack.standin.source", str(src_name), V.STRING)
    writer.add_key_value("specstack.standin.residual_copies", plan.copies, V.UINT32)
    writer.add_key_value("specstack.standin.live_layers",
                         [i for i, live in enumerate(plan.layer_live) if live], V.ARRAY, sub_type=V.INT32)


class _Progress:
    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.last_decile = -1

    def __call__(self, i: int, name: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            end = "\n" if i == self.total else ""
            print(f"\r{self.label}: tensor {i}/{self.total} {name:<32}", end=end, file=sys.stderr, flush=True)
        elif (decile := i * 10 // self.total) != self.last_decile:
            self.last_decile = decile
            print(f"{self.label}: tensor {i}/{self.total} {name}", file=sys.stderr, flush=True)


def write_standin_f16(src: Path, out: Path, width: int, layers: int, *, ffn: int | None = None,
                      ftype_for_checks: str = "f16", progress: bool = True) -> StandinPlan:
    """Write the F16 stand-in, one tensor at a time (peak memory: the largest tensor)."""
    import gguf

    reader = _open(src)
    plan = plan_standin(read_shape(reader), width, layers, ffn, ftype_for_checks)
    s, o = plan.src, plan.out
    eps_src = _field(reader, f"{_ARCH}.attention.layer_norm_rms_epsilon")
    if not isinstance(eps_src, float):
        raise UnsupportedModelError(f"source lacks {_ARCH}.attention.layer_norm_rms_epsilon")
    eps = float(np.float32(eps_src) * np.float32(plan.copies * s.n_embd / o.n_embd))

    jobs = list(_tensor_jobs(reader, plan))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(tmp, _ARCH)
    try:
        alignment = _field(reader, "general.alignment")
        if alignment:
            writer.data_alignment = int(alignment)
        _copy_metadata(reader, writer, plan, eps)
        for name, _ in jobs:
            shape, dtype = _shape_of(name, plan)
            writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        tick = _Progress("make-standin", len(jobs), progress)
        for i, (name, make) in enumerate(jobs, 1):
            arr = make()
            expect = _shape_of(name, plan)
            assert arr.shape == expect[0] and arr.dtype == expect[1], (name, arr.shape, arr.dtype, expect)
            writer.write_tensor_data(arr)
            tick(i, name)
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return plan


def _open(path: Path):
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"source model {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/struct errors on non-GGUF input
        raise ModelLoadError(f"cannot read {path} as GGUF: {exc}") from exc


def quantize_gguf(src: Path, out: Path, ftype: str, *, threads: int = 2, verbose: bool = False) -> Path:
    """Quantize a GGUF with llama.cpp's own quantizer (``llama_model_quantize``, via target.py)."""
    from ..target import quantize

    if ftype not in ("q8_0", "q4_k_m"):
        raise InvalidParameterError(f"cannot quantize to {ftype!r}; choose one of q8_0, q4_k_m")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger("llama-cpp-python")  # llama-cpp-python's log callback filters on it
    old_level = log.level
    log.setLevel(logging.DEBUG if verbose else logging.ERROR)
    try:
        rc = quantize(src, out, ftype, threads=threads)
    finally:
        log.setLevel(old_level)
    if rc != 0:
        raise StandinError(f"llama.cpp failed to quantize {src} to {ftype} (return code {rc})")
    return out


def make_standin(src: Path, out: Path, width: int, layers: int, ftype: str = "f16", *,
                 ffn: int | None = None, threads: int = 2, progress: bool = True) -> Path:
    """Write a stand-in of ``src`` with hidden size ``width`` and ``layers`` layers to ``out``.

    The FFN grows in proportion to ``width`` unless ``ffn`` is given. ``ftype`` "f16" writes the
    padded model directly; "q8_0" and "q4_k_m" write it to a temporary F16 file next to ``out``
    and quantize that with llama.cpp. Returns ``out``.
    """
    out = Path(out)
    if ftype not in FTYPES:
        raise InvalidParameterError(f"unknown ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    if ftype == "f16":
        write_standin_f16(Path(src), out, width, layers, ffn=ffn, progress=progress)
        return out
    tmp = out.with_name(out.name + ".f16.partial")
    try:
        write_standin_f16(Path(src), tmp, width, layers, ffn=ffn, ftype_for_checks=ftype, progress=progress)
        if progress:
            print(f"make-standin: quantizing to {ftype} with llama.cpp", file=sys.stderr, flush=True)
        quantize_gguf(tmp, out, ftype, threads=threads)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------------------------------------
# CLI: `specstack bench make-standin`
# ---------------------------------------------------------------------------------------------

def register_cli(bench_subparsers) -> argparse.ArgumentParser:
    """Add ``make-standin`` to ``specstack bench``'s subparsers."""
    from ..paths import DEFAULT_TARGET

    p = bench_subparsers.add_parser(
        "make-standin",
        help="write a big zero-padded copy of a model that computes exactly the same function",
        description="Write a cost-faithful stand-in target: the source llama model zero-padded to a "
        "wider hidden size, FFN and head count, plus layers that add nothing. Its greedy output "
        "equals the source's; its decode cost is that of the big shape. Example (about 1.05B "
        "parameters): --width 2048 --layers 22 --ffn 5632.",
    )
    p.add_argument("--from", dest="src", type=Path, default=DEFAULT_TARGET,
                   help="source GGUF (dense llama architecture, F16/F32); default: the bundled target")
    p.add_argument("--width", type=int, required=True, help="hidden size of the stand-in")
    p.add_argument("--layers", type=int, required=True, help="number of layers of the stand-in")
    p.add_argument("--ffn", type=int, default=None,
                   help="FFN width (default: the source's FFN/hidden ratio times --width)")
    p.add_argument("--ftype", choices=FTYPES, default="f16", help="weight format (default f16)")
    p.add_argument("--threads", type=int, default=2, help="quantization threads (default 2)")
    p.add_argument("-o", "--output", type=Path, required=True, help="where to write the stand-in GGUF")
    p.set_defaults(func=_cmd_make_standin)
    return p


def _cmd_make_standin(args: argparse.Namespace) -> int:
    src = Path(args.src)
    plan = plan_standin(read_shape(_open(src)), args.width, args.layers, args.ffn, args.ftype)
    make_standin(src, args.output, args.width, args.layers, args.ftype, ffn=args.ffn, threads=args.threads)
    o, s = plan.out, plan.src
    size = Path(args.output).stat().st_size
    print(f"wrote {args.output}: {args.ftype}, {o.n_params / 1e6:.1f}M parameters "
          f"(source {s.n_params / 1e6:.2f}M), {size / 1e6:.1f} MB; width {o.n_embd}, {o.n_layer} layers, "
          f"{o.n_head} heads ({o.n_head_kv} KV), FFN {o.n_ff}; source layers at "
          f"{[i for i, live in enumerate(plan.layer_live) if live]}; "
          f"{'bit-exact' if plan.bit_exact else 'not bit-exact (width is not a power-of-2 multiple of the source)'}")
    return 0
