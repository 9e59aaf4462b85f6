"""A trained draft head (EAGLE-3, DFlash) padded for a stand-in of its target: the head's function at the big shape's
cost.

A zero-padded stand-in (the package docstring) computes its source's function at a bigger model's cost; a head
trained for the source (``pycoder-6m-eagle3.gguf``, ``pycoder-6m-dflash.gguf``) cannot run beside it as is, because
llama.cpp's ``eagle3`` and ``dflash`` architectures read the target's layer inputs at the target's width and borrow its
token embeddings (DFlash its output layer too). Padded the same way, the head drafts what it drafts for the source
while every draft step moves the bytes of a head for the big shape (decoder layers as wide as the stand-in, an ``fc``
of three target widths), so acceptance comes from the trained head and the draft's price from a real head's shape.

Why it is exact (d = the source's width, W the stand-in's, m its residual copies, c = sqrt(m d / W), read from
the stand-in's ``specstack.standin.*`` keys):

- The stand-in's layer inputs are its residual stream: m copies of the source's, then zeros. ``fc`` reads the first
  copy of each of the three and writes m copies of g, so g lives in the stand-in's residual layout, as the head's
  own residual (``f = a + g``, ``h = f + ffn``) and its chained rows (``h`` is the next step's g) must.
- Every residual-width norm (EAGLE-3's ``attn_norm`` on the borrowed embedding row and ``attn_norm_2`` on g, DFlash's
  ``enc.output_norm`` on g, ``attn_norm``, ``ffn_norm``, ``output_norm``) sees m copies over W coordinates: weight
  c on the first copy, zeros elsewhere, epsilon times c^2, as the stand-in's own norms. DFlash's per-head q/k norms
  act on head_dim values that padding does not change, but share that one epsilon: with c < 1 they see it scaled
  (1e-5 becomes 2.5e-6 at c = 1/2, beside mean squares near 1), so a DFlash head is close, not bit-exact, there.
- q/k/v read ``[norm(e) | norm(g)]`` (EAGLE-3, 2W wide: the source's columns at 0..d and W..W+d) or the layer's
  normalised row (DFlash: columns 0..d). Extra query and KV heads
  have zero rows (head_dim and the query-per-KV ratio stay the source's, so source heads keep their KV heads), and
  ``attn_output`` has zero columns for them and writes m copies; extra FFN units have zero gate/up rows and zero
  down columns; ``output`` reads the first copy; ``d2t`` is copied.
- Layer ids: id i (the residual entering source block i) is the residual entering the stand-in block that holds
  source block i (``specstack.standin.live_layers``): the zero-output blocks between add nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ...errors import InvalidParameterError, UnsupportedModelError
from .metadata import copy_field
from .output import check_output
from .source import open_source, read_field
from .writer import gguf_file

if TYPE_CHECKING:  # gguf is imported lazily: the rest of specstack runs without it
    from gguf import GGUFReader

ARCHS = ("eagle3", "dflash")
_HEAD_NORMS = ("attn_q_norm", "attn_k_norm")  # per head: copied as they are


@dataclass(frozen=True)
class HeadPad:
    """How a head of width ``d`` pads to a stand-in: its width, residual copies, norm scale, heads, FFN, layer ids."""

    arch: str
    d: int
    width: int
    copies: int
    norm_scale: float
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    target_layers: tuple[int, ...]


def _n_tokens(reader: GGUFReader) -> int:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return 0 if tokens is None else len(tokens.data)


def plan_head_pad(head: GGUFReader, standin: GGUFReader, ffn: int | None = None) -> HeadPad:
    """The padding of ``head`` (an eagle3 or dflash GGUF) for ``standin`` (a stand-in of the head's target), from
    metadata; refused with the fix when the head is neither or the stand-in is not one of its target."""
    arch = read_field(head, "general.architecture")
    if arch not in ARCHS:
        raise UnsupportedModelError("--head takes a trained draft head GGUF: an EAGLE-3 or DFlash one "
                                    "(general.architecture eagle3 or dflash)")
    tgt = read_field(standin, "general.architecture")
    copies, live = read_field(standin, "specstack.standin.residual_copies"), \
        read_field(standin, "specstack.standin.live_layers")
    if copies is None or live is None:
        raise InvalidParameterError("the stand-in has no specstack.standin.* keys (residual copies, live layers): "
                                    "make it with specstack bench make-standin")
    d = int(read_field(head, f"{arch}.embedding_length"))
    width = int(read_field(standin, f"{tgt}.embedding_length"))
    ids = [int(i) for i in read_field(head, f"{arch}.target_layers")]
    if int(read_field(head, f"{arch}.target_hidden_size") or d) != d or max(ids) >= len(live) \
            or int(copies) * d > width or _n_tokens(head) != _n_tokens(standin):
        raise UnsupportedModelError(f"this head (width {d}, layer ids {ids}, {_n_tokens(head)} tokens) was not "
                                    f"trained for the stand-in's source ({len(live)} layers, {_n_tokens(standin)} "
                                    "tokens); pad the head trained for that source")
    n_head, n_head_kv = int(read_field(head, f"{arch}.attention.head_count")), \
        int(read_field(head, f"{arch}.attention.head_count_kv"))
    head_dim = int(read_field(head, f"{arch}.attention.key_length") or d // n_head)
    out_heads = width // head_dim
    return HeadPad(arch=arch, d=d, width=width, copies=int(copies), norm_scale=math.sqrt(int(copies) * d / width),
                   n_head=out_heads, n_head_kv=out_heads * n_head_kv // n_head, head_dim=head_dim,
                   n_ff=int(ffn or read_field(standin, f"{tgt}.feed_forward_length")),
                   target_layers=tuple(int(live[i]) for i in ids))


def pad_head(head: Path, standin: Path, out: Path, ffn: int | None = None) -> HeadPad:
    """Write ``head`` padded for ``standin`` to ``out`` (F16 matrices, F32 norms, the head's tokenizer); returns
    the padding. ``ffn``: the padded head's FFN width (default: the stand-in's, a real head's layer)."""
    out = Path(out)
    check_output(out)
    reader, target = open_source(Path(head)), open_source(Path(standin))
    pad = plan_head_pad(reader, target, ffn)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    eps = float(read_field(reader, f"{pad.arch}.attention.layer_norm_rms_epsilon")) * pad.norm_scale ** 2
    n_ctx = int(read_field(target, f"{read_field(target, 'general.architecture')}.context_length"))
    with gguf_file(out, pad.arch) as w:
        _write_keys(w, reader, pad, eps, n_ctx)
        for name, array in _padded(tensors, pad).items():
            w.add_tensor(name, array)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return pad


def _write_keys(w, reader: GGUFReader, pad: HeadPad, eps: float, n_ctx: int) -> None:
    """The head's keys at the padded shape; tokenizer and flags copied (the stand-in tokenizes as its source)."""
    from gguf import GGUFValueType as V

    shape = {"embedding_length": pad.width, "feed_forward_length": pad.n_ff, "attention.head_count": pad.n_head,
             "attention.head_count_kv": pad.n_head_kv, "target_hidden_size": pad.width, "context_length": n_ctx}
    for f in reader.fields.values():
        key = f.name
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        short = key[len(pad.arch) + 1:] if key.startswith(pad.arch + ".") else None
        if short in shape:
            w.add_key_value(key, shape[short], V.UINT32)
        elif short == "attention.layer_norm_rms_epsilon":
            w.add_key_value(key, eps, V.FLOAT32)
        elif short == "target_layers":
            w.add_key_value(key, list(pad.target_layers), V.ARRAY, sub_type=V.INT32)
        elif key == "general.name":
            w.add_key_value(key, f"{f.contents()}-standin-w{pad.width}", V.STRING)
        else:
            copy_field(w, f)


def _padded(src: dict[str, np.ndarray], pad: HeadPad) -> dict[str, np.ndarray]:
    """Every tensor of the head at the padded shape (the module docstring's rules), in the head's order."""
    d, W, m = pad.d, pad.width, pad.copies
    out: dict[str, np.ndarray] = {}
    for name, a in src.items():
        stem = name.rsplit(".", 1)[0]
        kind = stem.split(".", 2)[-1] if stem.startswith("blk.") else stem
        if kind in _HEAD_NORMS or name == "d2t":
            out[name] = a.copy()
        elif a.ndim == 1 and kind.endswith("norm") or kind == "attn_norm_2":
            v = np.zeros(W, np.float32)
            v[:d] = a.astype(np.float32) * np.float32(pad.norm_scale)
            out[name] = v
        elif kind in ("fc", "attn_q", "attn_k", "attn_v"):  # first copy of each d-wide input block in
            rows = {"fc": d, "attn_q": pad.n_head * pad.head_dim}.get(kind, pad.n_head_kv * pad.head_dim)
            n_in = a.shape[1] // d
            p = np.zeros((a.shape[0], n_in * W), np.float16)
            for k in range(n_in):
                p[:, k * W : k * W + d] = a[:, k * d : (k + 1) * d]
            out[name] = _copies(p, W, m) if kind == "fc" else _rows(p, rows)  # fc writes g: m copies out
        elif kind == "attn_output":  # (d, heads*hd) -> (W, heads'*hd), m copies out
            p = np.zeros((d, pad.n_head * pad.head_dim), np.float16)
            p[:, : a.shape[1]] = a
            out[name] = _copies(p, W, m)
        elif kind in ("ffn_gate", "ffn_up"):  # (ff, d) -> (ff', W)
            p = np.zeros((pad.n_ff, W), np.float16)
            p[: a.shape[0], :d] = a
            out[name] = p
        elif kind == "ffn_down":  # (d, ff) -> (W, ff'), m copies out
            p = np.zeros((d, pad.n_ff), np.float16)
            p[:, : a.shape[1]] = a
            out[name] = _copies(p, W, m)
        elif kind == "output":  # (n_draft, d) -> (n_draft, W)
            p = np.zeros((a.shape[0], W), np.float16)
            p[:, :d] = a
            out[name] = p
        else:
            raise UnsupportedModelError(f"{name}: a tensor this padding does not know (a head with its own token_embd, "
                                        "rope_freqs, DSpark or DFlash2 tensors is not supported)")
    return out


def _rows(a: np.ndarray, rows: int) -> np.ndarray:
    """``a``'s rows first, zero rows up to ``rows`` (extra heads)."""
    out = np.zeros((rows, a.shape[1]), a.dtype)
    out[: a.shape[0]] = a
    return out


def _copies(rows: np.ndarray, width: int, m: int) -> np.ndarray:
    """``rows`` (d, n) written to m copies of the residual layout, zeros after: (width, n)."""
    d = rows.shape[0]
    out = np.zeros((width, rows.shape[1]), rows.dtype)
    for j in range(m):
        out[j * d : (j + 1) * d] = rows
    return out
