"""The draft length: one owner of how many tokens are drafted before each step.

``policies`` holds the k policies (``fixed``, ``window``, ``heuristic`` and the
default ``cost``), ``budget`` the values a policy hands the engine and drafters
(``Budget``, ``Advice``, ``StepOutcome``), ``acceptance`` the acceptance
estimators the policies learn from, and ``costs`` the cost model of a target
call that the ``cost`` policy prices drafts with (``CostModel``; measured by
``calibration``, which this package never imports).
"""

from .acceptance import AcceptanceBook, AcceptanceTracker, ConfidenceCalibration, best_k, expected_accepted
from .budget import DEFAULT_K, DEFAULT_K_MAX, MAX_DRAFT, SOLO, VERIFY_SLOPE, Advice, BatchLoad, Budget, DraftLengthPolicy, Go, KeepGoing, StepOutcome, slope_cost
from .policies import POLICIES, CostK, FixedK, HeuristicK, WindowK, check_k, make_policy

__all__ = [
    "AcceptanceBook", "AcceptanceTracker", "ConfidenceCalibration", "best_k", "expected_accepted",
    "DEFAULT_K", "DEFAULT_K_MAX", "MAX_DRAFT", "SOLO", "VERIFY_SLOPE", "Advice", "BatchLoad", "Budget", "DraftLengthPolicy", "Go", "KeepGoing", "StepOutcome",
    "slope_cost", "POLICIES", "CostK", "FixedK", "HeuristicK", "WindowK", "check_k", "make_policy",
]
