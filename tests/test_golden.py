"""The bundled target's exact greedy output, and the transformers test: an always-right and an
always-wrong drafter both give exactly plain decoding's output."""

from __future__ import annotations

from typing import Sequence

from specstack.draft_length import FixedK
from specstack.drafters import BuildContext, create
from specstack.drafters.base import DraftRequest
from specstack.engine import Engine
from specstack.generation import GenerationConfig
from specstack.prompts import held_out_prompts
from specstack.types import Draft

PROMPT = held_out_prompts(4)[3]
# Recorded once from plain greedy decoding of pycoder-6m (llama-cpp-python 0.3.36, 2 threads, AVX-512).
GOLDEN = ("\nclass TestCopyTest(unittest.TestCase):\n    def test_functions(self):\n        # Test that the module is a "
          "module, so that the module\n        # module is a module, and the module.\n        # The")


def test_golden_greedy_output_byte_for_byte(target):
    gen = Engine(target, create("none", BuildContext(target))).generate(PROMPT, GenerationConfig(max_tokens=48)).run()
    assert gen.text.encode() == GOLDEN.encode()


class Oracle:
    """Knows the plain output: drafts it exactly (right) or a different token at every position (wrong)."""

    def __init__(self, prompt_len: int, output: Sequence[int], right: bool, n_vocab: int) -> None:
        self.name = "always-right" if right else "always-wrong"
        self.start, self.output, self.right, self.n_vocab = prompt_len, list(output), right, n_vocab

    def begin(self, prompt_ids, seq=0):
        pass

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            done = len(r.context) - self.start
            nxt = self.output[done : done + r.budget.max_tokens]
            out.append(Draft(tuple(t if self.right else (t + 1) % self.n_vocab for t in nxt), self.name))
        return out

    def advance(self, new_ids, n_accepted, seq=0):
        pass

    def end(self, seq=0, complete=True):
        pass


def test_always_right_and_always_wrong_drafters_give_plain_output(target):
    ids = target.tokenize(PROMPT)
    plain = Engine(target, create("none", BuildContext(target))).generate(ids, GenerationConfig(max_tokens=48)).run().output_ids
    for right in (True, False):
        engine = Engine(target, Oracle(len(ids), plain, right, target.n_vocab), FixedK(5))
        gen = engine.generate(ids, GenerationConfig(max_tokens=48)).run()
        assert gen.output_ids == plain
        if right:
            assert gen.stats.n_accepted == gen.stats.n_drafted > 0  # every draft token kept
        else:
            assert gen.stats.n_drafted > 0 and gen.stats.n_accepted == 0  # every one rejected
