"""A trained draft head padded for a stand-in of its target (``modelfile.standin.head``, ``make-standin --head``):
on the stand-in it drafts what it drafts on the source, at the padded shape.

- the padded head's GGUF has the stand-in's width, heads, FFN and the layer ids of the stand-in blocks that hold the
  source's, and loads as llama.cpp's eagle3 beside the stand-in;
- beside the stand-in (F16, bit-exact) it drafts as the source head does beside the source: the same greedy output,
  the same drafts accepted (a wrong copy, norm scale or column block would change them);
- a file that is not an EAGLE-3 head, or a head of another target, is refused in one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from gguf import GGUFReader

from specstack.commands.bench import head_beside, register_make_standin
from specstack.errors import SpecstackError
from specstack.generation import GenerationConfig
from specstack.loading import TargetSpec, build_engine, load_calibrated
from specstack.modelfile.meta import read_gguf
from specstack.modelfile.standin import make_standin
from specstack.modelfile.standin.head import pad_head
from specstack.paths import DEFAULT_DRAFT, DEFAULT_TARGET, MODELS_DIR
from specstack.prompts import held_out_prompts

HEADS = {"eagle3": MODELS_DIR / "pycoder-6m-eagle3.gguf", "dflash": MODELS_DIR / "pycoder-6m-dflash.gguf"}


@pytest.fixture(scope="module", params=[(512, "eagle3"), (1024, "eagle3"), (512, "dflash")], ids=str)
def padded(request, tmp_path_factory) -> tuple[Path, Path, str]:
    """An F16 stand-in of pycoder-6m (width 512: two residual copies, norm scale 1; width 1024: one copy, norm scale
    1/2, which DFlash's shared q/k-norm epsilon would see: not exact there; 8 layers) and a bundled head padded for
    it, through the CLI."""
    width, arch = request.param
    folder = tmp_path_factory.mktemp(f"standin_{arch}")
    standin = folder / f"w{width}.gguf"
    parser = argparse.ArgumentParser()
    register_make_standin(parser.add_subparsers(dest="bench_command"))
    args = parser.parse_args(["make-standin", "--width", str(width), "--layers", "8", "--ffn", "1536",
                              "--head", str(HEADS[arch]), "-o", str(standin)])
    assert args.func(args) == 0
    return standin, head_beside(standin, arch), arch


def test_the_padded_head_has_the_stand_ins_shape(padded):
    standin, head, arch = padded
    meta, target = read_gguf(head).metadata, read_gguf(standin).metadata
    live = [int(i) for i in target["specstack.standin.live_layers"]]
    width = target["llama.embedding_length"]
    assert meta[f"{arch}.embedding_length"] == meta.get(f"{arch}.target_hidden_size", width) == width
    assert meta[f"{arch}.feed_forward_length"] == 1536
    heads = width // 32  # the source's head_dim and 2 query heads per KV head
    assert (meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]) == (heads, heads // 2)
    assert [int(i) for i in meta[f"{arch}.target_layers"]] == [live[1], live[3], live[5]] != [1, 3, 5]
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in GGUFReader(head).tensors}
    q_in = 2 * width if arch == "eagle3" else width  # EAGLE-3's q reads [embedding | g]
    assert shapes["fc.weight"] == (3 * width, width) and shapes["blk.0.attn_q.weight"] == (q_in, heads * 32)


def _drafts(model: Path, head: Path, drafter: str) -> tuple[list[list[int]], int, int, list[list[int]]]:
    """Greedy generations of ``drafter`` (fixed k 3) and plain ones on ``model``: outputs, accepted, drafted, plain
    outputs."""
    loaded = load_calibrated(TargetSpec(model=model, threads=1, exact="on", ctx=512))
    try:
        spec = build_engine(loaded, drafter, k=3, drafter_options={"draft_model": head})
        plain = build_engine(loaded, "none")
        outs, plains, accepted, drafted = [], [], 0, 0
        for prompt in held_out_prompts(3):
            r = spec.generate(prompt, GenerationConfig(max_tokens=48)).run()
            outs.append(r.output_ids)
            accepted, drafted = accepted + r.stats.n_accepted, drafted + r.stats.n_drafted
            plains.append(plain.generate(prompt, GenerationConfig(max_tokens=48)).run().output_ids)
        return outs, accepted, drafted, plains
    finally:
        loaded.target.close()


def test_the_padded_head_drafts_on_the_stand_in_as_the_head_on_its_source(padded):
    standin, head, arch = padded
    src_outs, src_acc, src_drafted, src_plain = _drafts(DEFAULT_TARGET, HEADS[arch], arch)
    outs, acc, drafted, plain = _drafts(standin, head, arch)
    assert outs == plain == src_plain == src_outs  # lossless, and the stand-in computes the source's function
    assert src_acc > src_drafted // 10 > 0  # the trained head's drafts are accepted ...
    assert (acc, drafted) == (src_acc, src_drafted)  # ... and padded, the same ones


def test_a_file_that_is_not_a_head_of_the_source_is_refused(padded, tmp_path):
    standin, _, _ = padded
    with pytest.raises(SpecstackError, match="an EAGLE-3 or DFlash one"):
        pad_head(DEFAULT_DRAFT, standin, tmp_path / "x.gguf")
    other = make_standin(DEFAULT_DRAFT, tmp_path / "draft-w512.gguf", 512, 4, progress=False)  # pycoder-1m's: 2 layers
    with pytest.raises(SpecstackError, match="was not trained for the stand-in's source"):
        pad_head(HEADS["eagle3"], other, tmp_path / "x.gguf")
    with pytest.raises(SpecstackError, match="no specstack.standin"):
        pad_head(HEADS["eagle3"], DEFAULT_TARGET, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
