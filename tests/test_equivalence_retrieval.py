"""Losslessness of the retrieval drafters and of cascades on the real bundled pair.

Greedy output must equal plain decoding token for token, and each run must
have accepted draft tokens (otherwise the comparison proves nothing).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specstack.cli import main
from specstack.draft_length import FixedK
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.prompts import held_out_prompts

PROMPTS = held_out_prompts(14)[6:14]
MAX_TOKENS = 80
# Training-side stdlib files (never the held-out ones) for a small REST store.
CORPUS = ["typing.py", "functools.py", "collections/__init__.py", "argparse.py", "unittest/case.py"]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    lib = Path(os.path.dirname(os.__file__))
    files = [str(lib / f) for f in CORPUS if (lib / f).exists()]
    assert files, "the Python standard library is needed to build the test datastore"
    out = tmp_path_factory.mktemp("rest") / "store"
    assert main(["datastore", "build", *files, "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def plain(target):
    engine = Engine(target, create("none", BuildContext(target)))
    return [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS)).run().output_ids for p in PROMPTS]


def run_all(target, name, options=None, k=4):
    engine = Engine(target, create(name, BuildContext(target, options=options or {})))
    return [engine.generate(p, GenerationConfig(max_tokens=MAX_TOKENS), policy=FixedK(k)).run() for p in PROMPTS]


@pytest.mark.parametrize(
    "name",
    ["suffix", "rest", "cascade:prompt-lookup,suffix,draft-model", "cascade:suffix,prompt-lookup",
     "cascade:rest,draft-model"],
)
def test_retrieval_and_cascades_equal_plain_decoding(target, plain, store, name):
    gens = run_all(target, name, {"datastore": store})
    for gen, expected, prompt in zip(gens, plain, PROMPTS):
        assert gen.output_ids == expected, f"{name} diverged on {prompt[:60]!r}"
        # Per prompt: a prompt with no accepted draft would prove nothing about verification there.
        assert gen.stats.n_accepted > 0, f"{name}: nothing accepted on {prompt[:60]!r}"


def test_cascade_reports_each_source(target, store):
    gens = run_all(target, "cascade:prompt-lookup,draft-model", {"cascade_min_len": 2}, k=6)
    sources = set()
    for g in gens:
        sources |= {s for s, st in g.stats.by_source.items() if st.n_drafted}
    assert sources == {"prompt-lookup", "draft-model"}


def test_suffix_global_tree_learns_across_requests(target):
    """The same request twice: the second run drafts from the first one's output."""
    engine = Engine(target, create("suffix", BuildContext(target)))
    prompt = PROMPTS[0]
    first = engine.generate(prompt, GenerationConfig(max_tokens=MAX_TOKENS), policy=FixedK(8)).run()
    second = engine.generate(prompt, GenerationConfig(max_tokens=MAX_TOKENS), policy=FixedK(8)).run()
    assert second.output_ids == first.output_ids
    assert second.stats.n_accepted > first.stats.n_accepted
