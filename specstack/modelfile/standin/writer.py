"""Writing the F16 stand-in: which tensors, in which order, each built only when it is written.

``_tensor_jobs`` lists every stand-in tensor with a function that pads it from the source (so
peak memory is the largest tensor, not the model); ``write_standin_f16`` writes header, key/values
and tensor infos first, then the tensors one by one, to a ``.partial`` file renamed at the end.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from ...errors import UnsupportedModelError
from .metadata import copy_metadata
from .output import metadata_bytes
from .pad import kind_shape, layer_tensor, pad2, pad_norm
from .plan import plan_standin
from .shape import StandinPlan
from .source import as_float, read_field, open_source, read_shape

if TYPE_CHECKING:  # gguf is imported lazily: the rest of specstack runs without it
    from gguf import GGUFReader, GGUFWriter

# (tensor name, build its array); built lazily, one at a time.
_Job = tuple[str, Callable[[], np.ndarray]]



@contextmanager
def gguf_file(out: Path, arch: str) -> Iterator[GGUFWriter]:
    """A GGUF writer for ``out`` that writes ``out.partial`` and renames it only once the block finishes: a failed
    or interrupted write leaves no half file under the real name."""
    import gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        yield writer
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        try:
            writer.close()  # may fail too (a full disk): the half file goes all the same
        finally:
            tmp.unlink(missing_ok=True)
        raise


def _layer_kind(name: str) -> tuple[int, str]:
    """"blk.3.shortconv.in_proj.weight" -> (3, "shortconv.in_proj")."""
    _, i, rest = name.split(".", 2)
    return int(i), rest.rsplit(".", 1)[0]


def _tensor_jobs(reader: GGUFReader, plan: StandinPlan) -> Iterator[_Job]:
    """(name, make array) for every stand-in tensor, in llama.cpp's usual order."""
    o, s = plan.out, plan.src
    by_name = {t.name: t for t in reader.tensors}
    out_norm = f"{s.output_norm}.weight"
    known = {"token_embd.weight", out_norm, "output.weight", "rope_freqs.weight"}
    known |= {f"blk.{j}.{k}.weight" for j in range(s.n_layer) for k in s.layer_kinds(j)}
    unknown = sorted(set(by_name) - known)
    if unknown:
        raise UnsupportedModelError(
            f"source has tensors a plain {s.arch} stand-in cannot pad: {', '.join(unknown[:5])}")
    missing = sorted(known - set(by_name) - {"output.weight", "rope_freqs.weight"})
    if missing:
        raise UnsupportedModelError(f"source lacks tensors: {', '.join(missing[:5])}")
    f16 = np.dtype(np.float16)

    def mat(name: str, rows: int, cols: int, col_copies: int = 1) -> Callable[[], np.ndarray]:
        return lambda: pad2(as_float(by_name[name]), rows, cols, f16, col_copies=col_copies)

    # The embedding writes the residual (m copies); as the tied output it is read through the
    # output norm, which zeroes all but the first copy.
    yield "token_embd.weight", mat("token_embd.weight", o.n_vocab, o.n_embd, plan.copies)
    if s.arch == "lfm2":
        yield out_norm, lambda: pad_norm(as_float(by_name[out_norm]), plan)
    if "rope_freqs.weight" in by_name:
        yield "rope_freqs.weight", lambda: np.array(as_float(by_name["rope_freqs.weight"]), dtype=np.float32)
    for i in range(o.n_layer):
        j = plan.layer_source[i]
        for kind in o.layer_kinds(i):
            src = by_name[f"blk.{j}.{kind}.weight"]
            yield (f"blk.{i}.{kind}.weight",
                   (lambda src=src, kind=kind, i=i: layer_tensor(kind, as_float(src), plan, i)))
    if s.arch != "lfm2":
        yield out_norm, lambda: pad_norm(as_float(by_name[out_norm]), plan)
    if not s.tied_output:
        yield "output.weight", mat("output.weight", o.n_vocab, o.n_embd)


def _shape_of(name: str, plan: StandinPlan) -> tuple[tuple[int, ...], np.dtype]:
    """numpy shape and dtype of a stand-in tensor, without building it."""
    o = plan.out
    if name in ("token_embd.weight", "output.weight"):
        return (o.n_vocab, o.n_embd), np.dtype(np.float16)
    if name == f"{o.output_norm}.weight":
        return (o.n_embd,), np.dtype(np.float32)
    if name == "rope_freqs.weight":
        return (o.head_dim // 2,), np.dtype(np.float32)
    i, kind = _layer_kind(name)
    return kind_shape(kind, plan, i)

def _scaled_epsilon(reader: GGUFReader, plan: StandinPlan) -> float:
    """The source's RMSNorm epsilon times c^2 = m d / W, in F32 like llama.cpp reads it, so the
    wider norms divide by exactly the source's rms (package docstring)."""
    s, o = plan.src, plan.out
    eps_key = f"{s.arch}.attention.layer_norm_rms_epsilon"
    eps_src = read_field(reader, eps_key)
    if not isinstance(eps_src, float):
        raise UnsupportedModelError(f"source lacks {eps_key}")
    return float(np.float32(eps_src) * np.float32(plan.copies * s.n_embd / o.n_embd))


# (numpy shape, dtype, raw GGML type or None) of a stand-in tensor, by name
_Info = Callable[[str], tuple[tuple[int, ...], np.dtype, object]]


def _nbytes(info: tuple[tuple[int, ...], np.dtype, object]) -> int:
    """The bytes of a tensor in the file, from its ``_Info`` (quant blocks are bytes of dtype uint8)."""
    shape, dtype, _ = info
    return int(np.prod(shape)) * dtype.itemsize


def _write_gguf(writer: GGUFWriter, reader: GGUFReader, plan: StandinPlan, eps: float, jobs: list[_Job],
                progress: bool, info: _Info, file_type: int = 1, tokenizer: dict | None = None) -> None:
    """Header, key/values and tensor infos (sizes from ``info``, nothing built yet), then
    each tensor as it is built, checked against the size already promised in the header."""
    from ...ui import Progress

    alignment = read_field(reader, "general.alignment")
    if alignment:
        writer.data_alignment = int(alignment)
    copy_metadata(reader, writer, plan, eps, file_type=file_type, tokenizer=tokenizer)
    for name, _ in jobs:
        shape, dtype, raw = info(name)
        writer.add_tensor_info(name, shape, dtype, _nbytes((shape, dtype, raw)), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    tick = Progress("make-standin", len(jobs), unit="tensors", quiet=not progress)
    for i, (name, make) in enumerate(jobs, 1):
        arr = make()
        expect = info(name)
        assert arr.shape == expect[0] and arr.dtype == expect[1], (name, arr.shape, arr.dtype, expect)
        writer.write_tensor_data(arr)
        tick.update(i, note=name)
    tick.close()


def write_standin_f16(src: Path, out: Path, width: int, layers: int, *, ffn: int | None = None,
                      ftype_for_checks: str = "f16", progress: bool = True, kv_heads: int | None = None,
                      attn_layers: int | None = None, heads: int | None = None, vocab: int | None = None,
                      before_write: Callable[[int, int], None] | None = None) -> StandinPlan:
    """Write the F16 stand-in, one tensor at a time (peak memory: the largest tensor).

    A quantized (gemma3) source with ``ftype_for_checks`` its own ftype is written in its own
    quant blocks instead (``plan.out.quantized``; see the gemma3 module), not in F16.
    ``before_write`` is given the file's tensor and other bytes once they are known and before the file is
    opened (the free-space check of ``output.room_check``): it raises to write nothing."""
    reader = open_source(src)
    plan = plan_standin(read_shape(reader), width, layers, ffn, ftype_for_checks, kv_heads=kv_heads,
                        attn_layers=attn_layers, heads=heads, vocab=vocab)
    eps = _scaled_epsilon(reader, plan)
    file_type, tokens, tokenizer = 1, None, None
    if vocab is not None:
        from .vocab import kept_tokens, vocab_fields

        tokens = kept_tokens(reader, vocab)
        tokenizer = vocab_fields(reader, tokens)
    if plan.src.arch == "gemma3":
        from .gemma3 import Gemma3Tensors

        builder = Gemma3Tensors(reader, plan, keep=plan.out.quantized is not None, tokens=tokens)
        jobs, info = list(builder.jobs()), builder.info
        if builder.keep:
            file_type = int(read_field(reader, "general.file_type"))
    else:
        builder = None
        jobs = list(_tensor_jobs(reader, plan))
        info = (lambda name: (*_shape_of(name, plan), None))
    if before_write is not None:
        before_write(sum(_nbytes(info(name)) for name, _ in jobs), metadata_bytes(reader.data_offset, len(jobs)))
    with gguf_file(out, plan.src.arch) as writer:
        _write_gguf(writer, reader, plan, eps, jobs, progress, info, file_type, tokenizer)
    if builder is not None and builder.inexact_scales and progress:
        print(f"make-standin: note: {builder.inexact_scales} embedding scales (f16 subnormals) did not divide "
              f"exactly by sqrt({plan.copies})", file=sys.stderr)
    return plan
