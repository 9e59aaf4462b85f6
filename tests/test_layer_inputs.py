"""A target's layer inputs for trained draft heads (issue 59, docs/design-eagle3-dflash.md steps 1 and 3).

- the six ``llama-ext.h`` functions llama-cpp-python does not bind resolve in the installed library, under the
  mangled names ``nm -D`` shows, and answer on the bundled target;
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from specstack.llama.backend import _HEAD_SYMBOLS, HeadApi, head_api, llama_cpp_module
from specstack.llama import LlamaModel, ModelConfig
from specstack.paths import DEFAULT_TARGET


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
