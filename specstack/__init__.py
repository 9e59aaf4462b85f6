"""specstack: lossless speculative decoding for llama.cpp on CPUs.

The public API (see the README, "Use from Python")::

    import specstack
    target = specstack.LlamaModel(specstack.ModelConfig(specstack.DEFAULT_TARGET, n_slots=2))
    engine = specstack.Engine(target, specstack.create_drafter("prompt-lookup", specstack.BuildContext(target)))
    gen = engine.generate("def fib(n):", specstack.GenerationConfig(max_tokens=32))
    text = gen.run().text

Names are imported on first use, so ``import specstack`` stays cheap for
the commands that only read GGUF metadata.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # the engine
    "Engine": "engine", "Generation": "generation", "GenerationConfig": "generation", "MAX_DRAFT": "draft_length",
    # targets
    "LlamaModel": "llama", "ModelConfig": "llama", "BatchShapes": "llama", "Target": "llama",
    "EngineTarget": "llama", "Segment": "llama", "plan_calls": "llama",
    # sampling and verification
    "SamplingParams": "sampling", "Draft": "types", "VerifyResult": "types",
    # drafters
    "Drafter": "drafters.base", "DraftRequest": "drafters.base", "BuildContext": "drafters.base",
    "register_drafter": "drafters.base", "create_drafter": "drafters.base", "available_drafters": "drafters.base",
    "propose_one": "drafters.base",
    # draft length
    "Budget": "draft_length", "BatchLoad": "draft_length", "Advice": "draft_length", "StepOutcome": "draft_length",
    "DraftLengthPolicy": "draft_length", "FixedK": "draft_length", "WindowK": "draft_length",
    "HeuristicK": "draft_length", "CostK": "draft_length", "make_policy": "draft_length", "POLICIES": "draft_length",
    # calibration (exact call shapes, the cost curve) and the cost model it feeds
    "CostModel": "draft_length.costs", "calibrate": "calibration", "ensure_shapes": "calibration",
    "measure_shapes": "calibration", "calibrate_target": "calibration", "Calibration": "calibration",
    # statistics, errors, bundled files
    "GenerationStats": "metrics", "SpecstackError": "errors", "ModelLoadError": "errors",
    "InvalidParameterError": "errors", "ContextOverflowError": "errors", "VocabMismatchError": "errors",
    "DEFAULT_TARGET": "paths", "DEFAULT_DRAFT": "paths",
}
_RENAMED = {"register_drafter": "register", "create_drafter": "create", "available_drafters": "available"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specstack' has no attribute {name!r}")
    if module.startswith("drafters"):
        import_module(".drafters", __name__)  # registers the built-in drafters
    value = getattr(import_module(f".{module}", __name__), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
