"""A target's layer inputs for trained draft heads (issue 59, docs/design-eagle3-dflash.md steps 1 and 3).

- the six ``llama-ext.h`` functions llama-cpp-python does not bind resolve in the installed library, under the
  mangled names ``nm -D`` shows, and answer on the bundled target;
- ``want_hidden(layers)`` on the bundled target (pycoder-6m, a ``llama``): the logits with layer inputs kept are
  bitwise those without (every call of a greedy generation under ``--exact on``, and raw calls of every kind); the
  staged rows are llama.cpp's own (``llama_get_embeddings_layer_inp``), side by side, for the kept tokens only;
  layer 0's input is the token's embedding row, read from the GGUF;
- bad input: a target whose graph exports no layer inputs (a small gemma3), an id past the target's layers, a second
  channel: a clear error before llama.cpp could abort the process.
"""

from __future__ import annotations

import ctypes

import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

from specstack.calibration import calibrate_target
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.errors import InvalidParameterError, UnsupportedModelError
from specstack.generation import GenerationConfig
from specstack.llama.backend import _HEAD_SYMBOLS, HeadApi, head_api, llama_cpp_module
from specstack.llama import LlamaModel, ModelConfig
from specstack.paths import DEFAULT_TARGET
from specstack.prompts import held_out_prompts

LAYERS = (1, 3, 5)  # the design note's layers for pycoder-6m's heads (inputs of blocks 1, 3, 5)
N_EMBD = 256


def _library() -> Path:
    return Path(llama_cpp_module().__file__).parent / "lib" / "libllama.so"


def test_each_head_function_resolves_in_the_installed_library():
    api = head_api()
    assert set(HeadApi._fields) == set(_HEAD_SYMBOLS)
    for field in HeadApi._fields:
        func = getattr(api, field)
        assert func is not None and callable(func), field
        names = _HEAD_SYMBOLS[field][0]
        assert func.__name__ in names, f"{field} bound as {func.__name__}"


def test_the_mangled_names_are_the_ones_the_library_exports():
    """The header is C++ without extern "C": each function is exported under its Itanium mangling only."""
    lib = _library()
    try:
        out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError):
        pytest.skip("nm is not available to list the library's symbols")
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    for field, (names, _, _) in _HEAD_SYMBOLS.items():
        assert names[1] in exported, f"{field}: {names[1]} not exported by {lib}"
        assert getattr(head_api(), field).__name__ == names[1]


def test_model_functions_answer_on_the_bundled_target():
    """pycoder-6m is a target, not a head: no target layer ids; its token embeddings are n_vocab x n_embd."""
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=64), role="target")
    try:
        api, lc = head_api(), model._lc
        assert api.model_target_layer_ids_n(model._model) == 0
        assert not api.model_target_layer_ids(model._model)
        assert api.model_dflash_selector_top_k(model._model) >= 0
        n_embd = int(lc.llama_model_n_embd(model._model))
        assert api.model_get_tok_embd(model._model, None) == model.n_vocab * n_embd
    finally:
        model.close()


# --- want_hidden(layers) -------------------------------------------------------------------------------------------
def exact_target(layers: tuple[int, ...] | None) -> LlamaModel:
    """pycoder-6m as a ``--exact on`` target (its exact call shapes measured, cached), keeping ``layers``' inputs."""
    model = calibrate_target(LlamaModel(ModelConfig(DEFAULT_TARGET), role="target"), "on").target
    if layers is not None:
        model.want_hidden(layers)
    return model


@pytest.fixture(scope="module")
def plain():
    model = exact_target(None)
    yield model
    model.close()


@pytest.fixture(scope="module")
def layered():
    model = exact_target(LAYERS)
    assert model.keeps_hidden and model.n_embd_out == len(LAYERS) * N_EMBD
    yield model
    model.close()


def _calls(model: LlamaModel, ids: list[int]) -> list[np.ndarray]:
    """Raw calls of every kind on a fresh sequence 0: a prefill chunk without outputs, one with every row out, a
    padded verification-sized call, single rows; each call's logits copied."""
    model.reset()
    out = [model.raw_call(ids[:20], outputs=False)]
    out.append(model.raw_call(ids[20:37]).copy())
    out.append(model.raw_call(ids[37:41], pad=2).copy())  # a padded call: the pads stage no rows
    for t in ids[41:45]:
        out.append(model.raw_call([t]).copy())
    model.reset()
    return out


def test_logits_with_layer_inputs_are_bitwise_those_without(plain, layered):
    ids = plain.tokenize(held_out_prompts(1)[0])[:45]
    assert len(ids) == 45
    for a, b in zip(_calls(plain, ids), _calls(layered, ids)):
        assert a.shape == b.shape and np.array_equal(a, b)


def test_greedy_generation_with_layer_inputs_is_plain_decoding(plain, layered):
    """The engine's whole loop (prefill chunks, verification calls of the suffix drafter) under --exact on."""
    for prompt in held_out_prompts(3):
        outs = []
        for model in (plain, layered):
            engine = Engine(model, create("suffix", BuildContext(model)))
            outs.append(engine.generate(prompt, GenerationConfig(max_tokens=40)).run().output_ids)
        assert outs[0] == outs[1]


def test_staged_rows_are_llamas_layer_inputs_side_by_side(layered):
    layered.reset()
    ids = layered.tokenize("def add(a, b):\n    return a + b\n")[:12]
    layered.take_hidden(0)
    layered.raw_call(ids)
    api = head_api()
    floats = ctypes.POINTER(ctypes.c_float)  # the binding gives an address
    direct = [np.ctypeslib.as_array(ctypes.cast(api.get_embeddings_layer_inp(layered._ctx, lid), floats),
                                    shape=(len(ids), N_EMBD)).copy() for lid in LAYERS]
    side_by_side = np.concatenate(direct, axis=1)
    assert not np.array_equal(direct[0], direct[1])  # three different layers, not one copied
    layered.truncate(5)  # a cut drops the staged rows past it
    rows = layered.take_hidden(0)
    assert rows is not None and rows.start == 0 and rows.rows.shape == (5, len(LAYERS) * N_EMBD)
    assert np.array_equal(rows.rows, side_by_side[:5])
    layered.raw_call(ids[5:8], pad=2)  # the same tokens again at the same positions, and pads that stage nothing
    again = layered.take_hidden(0)
    assert again is not None and again.start == 5 and len(again) == 3
    assert np.allclose(again.rows, side_by_side[5:8], rtol=0, atol=1e-4)  # bitwise on specstack's kernels
    layered.reset()


def test_layer_zero_is_the_token_embedding(tmp_path):
    """Layer 0's input is the token's embedding row (llama: no scale), so staging reads rows in batch order."""
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=64), role="target")
    try:
        model.want_hidden((0,))
        ids = model.tokenize("import os\nprint(os.getcwd())\n")[:10]
        model.raw_call(ids, outputs=False)
        rows = model.take_hidden(0)
    finally:
        model.close()
    reader = gguf.GGUFReader(str(DEFAULT_TARGET))
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    table = np.asarray(emb.data).reshape(-1, N_EMBD).astype(np.float32)  # F16 rows, as ggml_get_rows converts them
    assert rows is not None and np.array_equal(rows.rows, table[ids])


def test_a_target_without_layer_inputs_is_refused(tmp_path):
    from test_standin import write_random_gemma3

    path = write_random_gemma3(tmp_path / "gemma3.gguf", d=64, n_layer=2, hd=64, n_ff=128)
    model = LlamaModel(ModelConfig(path, n_ctx=64), role="target")
    try:
        with pytest.raises(UnsupportedModelError, match="gemma3.gguf is gemma3, whose graph in this llama.cpp "
                                                        "exports no layer inputs"):
            model.want_hidden((1,))
        assert not model.keeps_hidden
        model.raw_call(model.tokenize("x = 1")[:3])  # still a working target: nothing was asked of llama.cpp
    finally:
        model.close()


def test_bad_layer_ids_and_a_second_channel_are_refused():
    model = LlamaModel(ModelConfig(DEFAULT_TARGET, n_ctx=64), role="target")
    try:
        with pytest.raises(InvalidParameterError, match=r"pycoder-6m.gguf has 6 layers, so each id must be one of 0..5"):
            model.want_hidden((1, 3, 6))
        with pytest.raises(InvalidParameterError, match="each once"):
            model.want_hidden((1, 1, 3))
        assert not model.keeps_hidden
        model.want_hidden(LAYERS)
        model.want_hidden(LAYERS)  # the same again: nothing to do
        with pytest.raises(InvalidParameterError, match="already keeps the inputs of layers 1, 3, 5"):
            model.want_hidden()
    finally:
        model.close()
