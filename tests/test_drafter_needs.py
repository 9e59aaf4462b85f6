"""What drafters need, declared in the registry (``drafters.base.Needs``), and the one speculation spec.

The CLI, serve's roles, the worker and a request's checks ask the registry instead of matching drafter names, so a
compound name (``cascade:...``, ``fusion:...``, a bench method's ``@policy`` stripped) needs what its parts need.
"""

from __future__ import annotations

import pytest

from specstack.drafters.base import (Asked, Needs, available, check_target, needs_datastore, needs_of, offered_by,
                                     plain_drafters, reads_draft_model)
from specstack.errors import SpecstackError
from specstack.loading import SpeculationSpec
from specstack.modelfile.meta import read_gguf
from specstack.paths import DEFAULT_TARGET


def test_every_registered_drafter_declares_its_needs():
    parts = needs_of("cascade:" + ",".join(plain_drafters()))
    assert set(parts) == {"cascade", *plain_drafters()} and all(isinstance(n, Needs) for n in parts.values())
    assert set(available()) - set(parts) == {"fusion"}


def test_a_compound_name_needs_what_its_parts_need():
    assert reads_draft_model("cascade:suffix,draft-model") and not reads_draft_model("cascade:suffix,prompt-lookup")
    assert reads_draft_model("fusion:suffix,draft-model")
    assert needs_datastore("fusion:rest,draft-model") == "rest" and needs_datastore("suffix") is None
    assert not needs_of("rest")["rest"].servable and needs_of("draft-model")["draft-model"].servable


def test_the_target_check_refuses_in_the_words_asked():
    meta = read_gguf(DEFAULT_TARGET, tensors=False)
    assert check_target("cascade:suffix,prompt-lookup", meta, Asked("--drafter x")) is None  # nothing to check
    with pytest.raises(SpecstackError, match=r"^--drafter cascade:suffix,mtp: .*NextN"):
        check_target("cascade:suffix,mtp", meta, Asked("--drafter cascade:suffix,mtp"))
    with pytest.raises(SpecstackError, match="needs a mixture-of-experts model"):
        check_target("moe-self", DEFAULT_TARGET, Asked("--drafter moe-self"))  # a path: its metadata read there
    assert offered_by(meta) == []  # no draft head in the bundled target


def test_a_request_speculates_over_its_role_and_keeps_its_json_shape():
    role = SpeculationSpec(drafter="suffix", k_policy="cost", k=4, k_max=8, options={"p_min": 0.5})
    spec = role.with_request({"k_policy": "fixed", "k": 6, "n_min": 2})
    assert spec.settings() == {"drafter": "suffix", "k_policy": "fixed", "k": 6, "k_max": 8}
    assert spec.options == {"p_min": 0.5, "n_min": 2} and spec.requested == {"k_policy", "k", "n_min"}
    assert role.requested == frozenset() and spec == SpeculationSpec("suffix", "fixed", 6, 8, {"p_min": 0.5, "n_min": 2})
