"""Mixture-of-experts targets: every drafter lossless, the moe-self draft, and the lossy --experts label."""

from __future__ import annotations

import json

import pytest

from specstack.cli import main
from specstack.draft_length import FixedK
from specstack.drafters import BuildContext, create
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.errors import SpecstackError
from specstack.paths import MODELS_DIR
from specstack.prompts import held_out_prompts
from specstack.llama import LlamaModel, ModelConfig

MOE = MODELS_DIR / "pycoder-moe.gguf"
PROMPTS = held_out_prompts(4)


@pytest.fixture(scope="module")
def moe():
    model = LlamaModel(ModelConfig(MOE), role="target")
    yield model
    model.close()


@pytest.fixture(scope="module")
def plain(moe):
    engine = Engine(moe, create("none", BuildContext(moe)))
    return [engine.generate(p, GenerationConfig(max_tokens=64)).run().output_ids for p in PROMPTS]


@pytest.mark.parametrize("name", ["prompt-lookup", "suffix", "draft-model", "moe-self", "cascade:suffix,moe-self",
                                  "fusion:suffix,moe-self"])
def test_every_drafter_is_lossless_on_an_moe_target(moe, plain, name):
    engine = Engine(moe, create(name, BuildContext(moe)), FixedK(4))
    for p, want in zip(PROMPTS, plain):
        gen = engine.generate(p, GenerationConfig(max_tokens=64)).run()
        assert gen.output_ids == want, name
        assert gen.stats.n_accepted > 0, (name, p[:40])


def test_moe_self_drafts_with_fewer_experts_and_is_accepted_often(moe, plain):
    drafter = create("moe-self", BuildContext(moe, options={"draft_experts": 1}))
    assert drafter.name == "moe-self" and drafter.model.path == moe.path
    engine = Engine(moe, drafter, FixedK(4))
    stats = [engine.generate(p, GenerationConfig(max_tokens=64)).run().stats for p in PROMPTS]
    accepted = sum(s.n_accepted for s in stats) / sum(s.n_drafted for s in stats)
    assert accepted > 0.4  # the 1-expert model agrees with the full one on ~78% of positions
    assert all(set(s.by_source) == {"moe-self"} for s in stats)


def test_moe_self_refuses_a_dense_target(target):
    with pytest.raises(SpecstackError, match="no experts"):
        create("moe-self", BuildContext(target))
    with pytest.raises(SpecstackError, match="not possible"):
        from specstack.modelfile.meta import read_gguf

        read_gguf(MOE, tensors=False).expert_override(9, "--experts")


def test_fewer_experts_is_labelled_lossy_and_really_differs(capsys):
    def run(*extra):
        assert main(["generate", "-m", str(MOE), "-f", str(prompt_file), "-n", "64", "--json", "--drafter", "none", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    import tempfile

    differs = 0
    for p in PROMPTS:
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(p)
        prompt_file = f.name
        full, reduced = run(), run("--experts", "1")
        assert full["lossy"] is False and full["experts"] == {"count": 8, "model_used": 2, "used": 2, "lossy": False}
        assert reduced["lossy"] is True and reduced["experts"]["used"] == 1
        differs += full["text"] != reduced["text"]
    assert differs > 0  # the label is honest: fewer experts changes the output
    main(["generate", "-m", str(MOE), "-p", "import os", "-n", "4", "--experts", "1"])
    assert "LOSSY" in capsys.readouterr().err
