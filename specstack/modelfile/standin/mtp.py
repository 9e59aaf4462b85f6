"""Random-weight stand-ins with a NextN (MTP) block: a real MTP model's layout and cost, none of its knowledge.

``make_mtp_standin`` writes, for a named layout (``mtp_layouts.LAYOUTS``: qwen35moe, qwen35, glm4moe, step35), a GGUF
that llama.cpp loads as that architecture, with ``--layers`` trunk layers and the NextN block(s) llama.cpp's
``draft-mtp`` (and specstack's ``--drafter mtp``) drafts from. Unlike the zero-padded stand-ins (the package
docstring), nothing here computes a trained model's function: the weights are random. So such a file is good for

- cost: every decode step and every MTP draft step moves the bytes and does the FLOPs of the real layout
  (at its reduced depth), including a hybrid model's recurrent state, checkpoints and rollbacks;
- losslessness: speculative output must equal plain decoding whatever the drafts are;

and never for acceptance: a random head's drafts are almost never accepted.

Weights are N(0, 1/fan_in) (norms 1, as real GGUFs store them), so every product keeps its input's scale and
the activations stay finite in F16 and after quantization (the tests check the logits); the matrices that write
into the residual stream get 1/sqrt(2 n_layer) on top, and the output layer repeats the embedding's values
(``mtp_tensors.tensor_specs`` says why: greedy output then runs in repeats, so retrieval drafts are accepted at
times, at any width and depth). The tokenizer is copied from a source GGUF: the
bundled target's 4,096-token vocabulary keeps files small (the output layer and embedding of a real
248k-token vocabulary are ~1B parameters on their own); ``tokenizer`` may name a vocab-only GGUF for a real one.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from ...errors import InvalidParameterError, UnsupportedModelError
from .metadata import copy_field
from .mtp_layouts import MtpShape, mtp_shape
from .mtp_tensors import TensorSpec, key_values, tensor_specs
from .output import check_output, metadata_bytes, room_check
from .shape import FTYPES
from .source import open_source, read_field
from .writer import gguf_file

if TYPE_CHECKING:  # gguf is imported lazily: the rest of specstack runs without it
    from gguf import GGUFReader, GGUFWriter

# What a random-weight stand-in too big for the disk can give up.
SMALLER = "make a smaller stand-in (fewer --layers, a smaller --width, fewer --experts)"


def fill(spec: TensorSpec, seed: int = 0) -> np.ndarray:
    """The tensor's random values (``mtp_tensors.Init``), F16 or F32 as the spec says. Each tensor draws from
    its own generator, seeded by ``seed`` and its name (``same_as``'s name, to repeat that tensor's values),
    so a tensor's values do not depend on which tensors come before it."""
    dtype = np.float32 if spec.f32 else np.float16
    rng = np.random.default_rng([seed, zlib.crc32((spec.same_as or spec.name).encode())])
    if spec.init == "ones":
        return np.ones(spec.shape, dtype=dtype)
    if spec.init == "zeros":
        return np.zeros(spec.shape, dtype=dtype)
    if spec.init == "decay":
        return (-rng.uniform(1.0, 16.0, spec.shape)).astype(dtype)
    scale = {"matrix": spec.gain * spec.shape[-1] ** -0.5, "vector": spec.n ** -0.5, "bias": 0.02}[spec.init]
    x = rng.standard_normal(spec.shape, dtype=np.float32)
    x *= np.float32(scale)
    return x if spec.f32 else x.astype(np.float16)


def copy_tokenizer(reader: GGUFReader, writer: GGUFWriter) -> int:
    """Copy every ``tokenizer.*`` field of ``reader`` (token pieces as raw bytes: they need not be UTF-8);
    return the vocabulary size."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise UnsupportedModelError("the tokenizer source has no tokenizer.ggml.tokens; give --from a GGUF with a "
                                    "vocabulary (a model, or a vocab-only GGUF)")
    for f in reader.fields.values():
        if f.name.startswith("tokenizer."):
            copy_field(writer, f)
    return len(tokens.data)


def _n_vocab(reader: GGUFReader) -> int:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return 0 if tokens is None else len(tokens.data)


def vocab_size(tokenizer: Path) -> int:
    """How many tokens the GGUF at ``tokenizer`` has (0: none), i.e. the stand-in's vocabulary."""
    return _n_vocab(open_source(tokenizer))


def _write_header(writer: GGUFWriter, reader: GGUFReader, shape: MtpShape, specs: list[TensorSpec]) -> None:
    """General keys, the architecture's hyper-parameters, the tokenizer, ``specstack.standin.*`` and tensor infos."""
    from gguf import GGUFValueType as V

    lay = shape.layout
    writer.add_key_value("general.name", f"{lay.model} MTP stand-in (random, {shape.n_layer} layers)", V.STRING)
    writer.add_key_value("general.file_type", 1, V.UINT32)  # MOSTLY_F16; the quantizer writes its own
    for key, value, vtype in key_values(shape):
        if isinstance(value, list):
            writer.add_key_value(key, value, V.ARRAY, sub_type=V[vtype])
        else:
            writer.add_key_value(key, value, V[vtype])
    copy_tokenizer(reader, writer)
    writer.add_key_value("specstack.standin.layout", lay.name, V.STRING)
    writer.add_key_value("specstack.standin.random_weights", True, V.BOOL)
    writer.add_key_value("specstack.standin.source", str(read_field(reader, "general.name") or "?"), V.STRING)
    for spec in specs:
        dtype = np.dtype(np.float32 if spec.f32 else np.float16)
        writer.add_tensor_info(spec.name, spec.shape, dtype, spec.nbytes)


def write_mtp_f16(shape: MtpShape, tokenizer: Path, out: Path, *, progress: bool = True, seed: int = 0,
                  before_write: Callable[[int, int], None] | None = None) -> Path:
    """Write ``shape``'s random-weight F16 GGUF to ``out`` (via ``out.partial``), one tensor at a time: peak
    memory is the largest tensor (all experts of one matrix: 256 x 512 x 2048 in qwen35moe).  ``before_write``
    is given the file's tensor and other bytes before it is opened (``output.room_check``): it raises to write
    nothing."""
    from ...ui import Progress

    reader = open_source(tokenizer)
    n_vocab = _n_vocab(reader)
    specs = tensor_specs(shape, n_vocab)
    total = sum(s.nbytes for s in specs)
    if before_write is not None:
        before_write(total, metadata_bytes(reader.data_offset, len(specs)))
    tick = Progress("make-standin", total / 2**20, unit="MiB", quiet=not progress)  # weighted by bytes
    try:
        with gguf_file(out, shape.arch) as writer:
            _write_header(writer, reader, shape, specs)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            done = 0
            for spec in specs:
                writer.write_tensor_data(fill(spec, seed))
                done += spec.nbytes
                tick.update(done / 2**20, note=spec.name)
    finally:
        tick.close()
    return out


def make_mtp_standin(layout: str, out: Path, layers: int, ftype: str = "f16", *, width: int | None = None,
                     experts: int | None = None, nextn: int | None = None, tokenizer: Path | None = None, threads: int = 2,
                     progress: bool = True, seed: int = 0) -> MtpShape:
    """Write a random-weight stand-in of ``layout`` with ``layers`` trunk layers and its NextN block(s) to ``out``.

    ``width``, ``experts`` and ``nextn`` (step35's chained heads: how many) narrow it (``mtp_layouts.mtp_shape``); ``tokenizer`` is the GGUF whose
    vocabulary it takes (default: the bundled target). ``ftype`` "f16" writes it directly; "q8_0" and
    "q4_k_m" write F16 next to ``out`` and quantize that with llama.cpp (``make.quantize_gguf``).
    Returns the shape written. For cost and losslessness only: the weights are random (module docstring).
    The output's folder and free space are checked before anything is written (``output``).
    """
    from ...paths import DEFAULT_TARGET
    from .make import quantized_from_f16

    if ftype not in FTYPES:
        raise InvalidParameterError(f"unknown ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    shape = mtp_shape(layout, layers, width, experts, nextn)
    out = Path(out)
    check_output(out)
    src = Path(tokenizer) if tokenizer is not None else DEFAULT_TARGET
    room = room_check(out, None if ftype == "f16" else ftype, fix=SMALLER, progress=progress)
    if ftype == "f16":
        write_mtp_f16(shape, src, out, progress=progress, seed=seed, before_write=room)
        return shape
    quantized_from_f16(out, ftype, lambda tmp: write_mtp_f16(shape, src, tmp, progress=progress, seed=seed,
                                                             before_write=room),
                       threads=threads, progress=progress)
    return shape


def _is_nextn(name: str, n_layer: int) -> bool:
    """Whether tensor ``name`` belongs to a NextN block (block index >= the trunk's depth)."""
    parts = name.split(".")
    return parts[0] == "blk" and int(parts[1]) >= n_layer


def n_params(shape: MtpShape, n_vocab: int) -> tuple[int, int]:
    """(all parameters, parameters one token reads in the trunk: routed experts count n_expert_used of
    n_expert), for the CLI's report."""
    total = active = 0
    for spec in tensor_specs(shape, n_vocab):
        total += spec.n
        if "_exps." in spec.name:
            active += spec.n * shape.n_expert_used // shape.n_expert
        elif spec.name != "token_embd.weight" and not _is_nextn(spec.name, shape.n_layer):
            active += spec.n
    return total, active
