"""The stand-in's GGUF key/values: the source's, with the new shape, epsilon and name.

Everything else (tokenizer, rope, chat template) is copied as is, so llama.cpp tokenizes and
runs the stand-in like the source; only ``--vocab`` replaces the tokenizer's pieces (``vocab``).
``specstack.standin.*`` keys record the layout (source name, residual copies, live layers, and the
source's vocabulary size where ``--vocab`` cut it) for later checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .shape import StandinPlan
from .source import read_field

if TYPE_CHECKING:  # gguf is imported lazily: the rest of specstack runs without it
    from gguf import GGUFReader, GGUFWriter, ReaderField


def copy_metadata(reader: GGUFReader, writer: GGUFWriter, plan: StandinPlan, eps: float,
                  file_type: int = 1, tokenizer: dict[str, Any] | None = None) -> None:
    """Write the source's fields to ``writer`` with the stand-in's shape and epsilon ``eps``
    (general.file_type ``file_type``, F16 by default: the quantizer sets its own), then the
    ``specstack.standin.*`` keys. ``tokenizer`` replaces the values of those source fields (a smaller
    vocabulary: ``vocab.vocab_fields``), each written with the source field's own type."""
    from gguf import GGUFValueType as V

    o, arch = plan.out, plan.src.arch
    updates = {
        f"{arch}.embedding_length": o.n_embd,
        f"{arch}.feed_forward_length": o.n_ff,
        f"{arch}.expert_feed_forward_length": o.n_ff,
        f"{arch}.attention.head_count": o.n_head,
        f"{arch}.attention.head_count_kv": list(o.layer_kv) if arch == "lfm2" else o.n_head_kv,
        f"{arch}.block_count": o.n_layer,
    }
    swa = read_field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(swa, list):  # per-layer flags (gemma3): each layer keeps its source layer's
        updates[f"{arch}.attention.sliding_window_pattern"] = [swa[j] for j in plan.layer_source]
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = f.types[0]
        if tokenizer and f.name in tokenizer:
            if vtype == V.ARRAY:
                writer.add_key_value(f.name, tokenizer[f.name], V.ARRAY, sub_type=f.types[-1])
            else:
                writer.add_key_value(f.name, tokenizer[f.name], vtype)
        elif f.name in updates:
            val = updates[f.name]
            if isinstance(val, list) and vtype != V.ARRAY:
                vtype = V.ARRAY
            if vtype == V.ARRAY:  # lfm2's per-layer head_count_kv
                sub = f.types[-1] if len(f.types) > 1 else V.INT32
                writer.add_key_value(f.name, val if isinstance(val, list) else [val], V.ARRAY, sub_type=sub)
            else:
                writer.add_key_value(f.name, val, vtype)
        elif f.name == f"{arch}.attention.layer_norm_rms_epsilon":
            writer.add_key_value(f.name, eps, V.FLOAT32)
        elif f.name == "general.file_type":
            writer.add_key_value(f.name, file_type, V.UINT32)  # LLAMA_FTYPE_MOSTLY_F16 unless kept
        elif f.name == "general.name":
            writer.add_key_value(f.name, f"{f.contents()}-standin-w{o.n_embd}-l{o.n_layer}", V.STRING)
        else:
            copy_field(writer, f)
    src_name = read_field(reader, "general.name") or "?"
    writer.add_key_value("specstack.standin.source", str(src_name), V.STRING)
    writer.add_key_value("specstack.standin.residual_copies", plan.copies, V.UINT32)
    if plan.out.n_vocab != plan.src.n_vocab:
        writer.add_key_value("specstack.standin.source_vocab", plan.src.n_vocab, V.UINT32)
    writer.add_key_value("specstack.standin.live_layers",
                         [i for i, live in enumerate(plan.layer_live) if live], V.ARRAY, sub_type=V.INT32)


def copy_field(writer: GGUFWriter, f: ReaderField) -> None:
    """Write one of a source GGUF's key/values as it is (strings as raw bytes: token pieces need not be UTF-8)."""
    from gguf import GGUFValueType as V

    vtype = f.types[0]
    if vtype == V.ARRAY:
        sub = f.types[-1]
        val = [bytes(f.parts[i]) for i in f.data] if sub == V.STRING else f.contents()
        writer.add_key_value(f.name, val, V.ARRAY, sub_type=sub)
    elif vtype == V.STRING:
        writer.add_key_value(f.name, bytes(f.parts[-1]), V.STRING)
    else:
        writer.add_key_value(f.name, f.contents(), vtype)
