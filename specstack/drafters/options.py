"""The drafters' options: each flag, the config fields it sets, and the checks a request's options get.

Declared once here, beside the drafters: the CLI adds a flag per entry (``commands.common``), the server
builds a request's ``speculative`` keys from the same entries (``server.schema``), and both check values
through the drafters' own config dataclasses.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from .base import check_name, config_from_options, option_name
from .cascade import CascadeConfig
from .dflash import DFlashConfig
from .draft_model import DraftModelConfig
from .eagle3 import Eagle3Config
from .moe_self import MoeSelfConfig
from .mtp import MtpConfig
from .prompt_lookup import PromptLookupConfig
from .rest import RestConfig
from .suffix import SuffixConfig


@dataclass(frozen=True)
class DrafterFlag:
    """A flag that sets one field of one or more drafters' config dataclasses.

    Its dest is the field's option name (``drafters.base.option_name``), the key
    the drafters, the server's requests and bench result files use.  ``help``
    may say ``{default}``: the dataclass default, so each default is written once.
    """

    flag: str
    configs: Mapping[str, type]  # drafter name -> its config dataclass
    field: str
    type: Callable[[str], Any] | None  # None: an on/off switch
    help: str
    per_request: bool = True  # False: a server-side setting (files, model shape), not a request option

    def __post_init__(self) -> None:
        names = {option_name(self._field(cls)) for cls in self.configs.values()}
        if len(names) != 1:
            raise TypeError(f"{self.flag} sets fields with different option names: {sorted(names)}")

    def _field(self, cls: type) -> Field:
        found = [f for f in fields(cls) if f.name == self.field]
        if not found:
            raise TypeError(f"{self.flag}: {cls.__name__} has no field {self.field!r}")
        return found[0]

    @property
    def dest(self) -> str:
        return option_name(self._field(next(iter(self.configs.values()))))

    def help_text(self) -> str:
        defaults = {name: _shown(self._field(cls).default) for name, cls in self.configs.items()}
        shown = set(defaults.values())
        default = shown.pop() if len(shown) == 1 else ", ".join(f"{n} {d}" for n, d in defaults.items())
        return f"{'/'.join(self.configs)}: " + self.help.format(default=default)


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# Every drafter flag, declared once: add_drafter_args adds them and drafter_options reads them.
DRAFTER_FLAGS = (
    DrafterFlag("--cascade-min-len", {"cascade": CascadeConfig}, "min_len", int,
                "tokens a source must offer before later sources are skipped (default {default})"),
    DrafterFlag("--ngram-min", {"prompt-lookup": PromptLookupConfig}, "n_min", int, "shortest n-gram to match (default {default})"),
    DrafterFlag("--ngram-max", {"prompt-lookup": PromptLookupConfig}, "n_max", int, "longest n-gram to match (default {default})"),
    DrafterFlag("--draft-temp", {"draft-model": DraftModelConfig, "mtp": MtpConfig, "eagle3": Eagle3Config,
                                   "dflash": DFlashConfig},
                "draft_temp", float,
                "sampling temperature of the draft (default: the target's); output stays the target's distribution"),
    DrafterFlag("--draft-p-min", {"draft-model": DraftModelConfig, "mtp": MtpConfig, "eagle3": Eagle3Config,
                                   "dflash": DFlashConfig},
                "p_min", float,
                "stop drafting when the draft's confidence is below this (default {default})"),
    DrafterFlag("--suffix-factor", {"suffix": SuffixConfig}, "max_spec_factor", float,
                "cap a draft at this factor x the match length (default {default})"),
    DrafterFlag("--suffix-cache", {"suffix": SuffixConfig}, "cache_path", Path,
                "file to load the global tree from and save it to, so it survives restarts", per_request=False),
    DrafterFlag("--min-token-prob", {"suffix": SuffixConfig, "rest": RestConfig}, "min_token_prob", float,
                "stop a draft when its path probability falls below this (default: {default})"),
    DrafterFlag("--datastore", {"rest": RestConfig}, "datastore", Path, "datastore folder from `specstack datastore build`",
                per_request=False),
    DrafterFlag("--tree", {"suffix": SuffixConfig, "rest": RestConfig}, "tree", None,
                "draft token trees and verify all branches in one batch (greedy only; with sampling the best branch is verified)"),
    DrafterFlag("--draft-experts", {"moe-self": MoeSelfConfig}, "draft_experts", int,
                "active experts in the self-draft (default {default}); output stays the full model's", per_request=False),
)
# The drafter options a single request may set (the server's per-request keys): no paths, no model shape.
REQUEST_OPTIONS = tuple(f.dest for f in DRAFTER_FLAGS if f.per_request)
# Drafter options set by flags of other groups, which other commands read too: option -> args attribute.
SHARED_OPTIONS = {"draft_model": "model_draft", "seed": "seed"}  # -md (models), --seed (sampling)


def inapplicable(name: str, given: set[str]) -> DrafterFlag | None:
    """The first drafter option given (by dest) that no drafter ``name`` builds would read: it would be
    ignored without a word (``--tree`` with prompt-lookup, ``speculative.tree`` with draft-model)."""
    built = set(check_name(name))
    return next((f for f in DRAFTER_FLAGS if f.dest in given and not built & set(f.configs)), None)


# Required config fields that a request cannot set (the drafter name or the server's flags give them),
# filled in when a request's options are checked alone.
_NOT_FROM_REQUESTS: dict[type, dict[str, Any]] = {CascadeConfig: {"sources": ("prompt-lookup",)},
                                                  RestConfig: {"datastore": "(the server's --datastore)"}}


def check_drafter_options(options: Mapping[str, Any]) -> None:
    """Refuse a bad drafter option value before any drafter is built (a server request's ``speculative``).

    Each config class that a given option belongs to is built from all the given options, so its own
    checks (ranges, n_min <= n_max) run; the rules stay in the config dataclasses, written once.
    """
    classes = {cls for f in DRAFTER_FLAGS if f.dest in options for cls in f.configs.values()}
    for cls in classes:
        config_from_options(cls, options, **_NOT_FROM_REQUESTS.get(cls, {}))
