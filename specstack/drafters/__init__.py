"""Draft sources, one module each, registered by kebab-case name.

Importing this package registers every built-in drafter.
"""

from . import cascade, dflash, draft_model, eagle3, fusion, moe_self, mtp, none, prompt_lookup, rest, suffix  # noqa: F401  (registration side effects)
from .base import DEFAULT_DRAFTER, BuildContext, Drafter, available, create, register

__all__ = ["DEFAULT_DRAFTER", "BuildContext", "Drafter", "available", "create", "register"]
