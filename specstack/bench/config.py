"""What a bench run runs: ``BenchConfig`` (validated up front) and the small rules derived from it.

Kept apart from the run loop (runner.py) so the commands that are presets of the
bench (demo, tune) and the tests can build and check a configuration without a model.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..draft_length import DEFAULT_K_MAX, MAX_DRAFT  # the cost policy's own cap; demo and tune cap adaptive k there too
from ..errors import InvalidParameterError
from .results import PLAIN
from .workloads import Workload

__all__ = ["DEFAULT_K_MAX", "PEER_KERNELS", "BenchConfig", "adaptive_start", "peer_kernel_sets", "request_seed"]

# --peer-kernels: which ggml-cpu kernels llama.cpp's own binaries run on (peers.KERNELS), or both side by side,
# so a table tells the kernels' gain from the drafting's
PEER_KERNELS = ("stock", "specstack", "both")


@dataclass
class BenchConfig:
    """Everything that decides what runs; stored verbatim in results.json."""

    workload: Workload
    methods: list[str]  # speculative methods; plain ("none") always runs too
    ks: list[int]
    k_max: int | None = None  # cap for METHOD@POLICY; None: the largest of ks
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    repeat: int = 1
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    drafter_options: dict[str, Any] = field(default_factory=dict)
    cost_curve: bool = True
    cost_max_n: int = 32
    cost_depth: int = 200
    cost_reps: int = 7
    warmup: bool = True
    llama_cpp_bin: Path | None = None  # the stock-kernel peers' folder
    peers: list[str] = field(default_factory=lambda: ["auto"])
    peer_kernels: str | None = None  # one of PEER_KERNELS; None: stock, where --llama-cpp-bin runs peers

    def __post_init__(self) -> None:
        """Refuse a bad setting now: a benchmark that fails after minutes of measuring wastes them."""
        self.methods = [m for m in dict.fromkeys(self.methods) if m != PLAIN]
        if not self.ks or any(k < 1 for k in self.ks):
            raise InvalidParameterError(f"-k needs draft lengths >= 1 (got {self.ks})")
        if any(k > MAX_DRAFT for k in [*self.ks, self.k_max or 1]):
            raise InvalidParameterError(f"k must be <= {MAX_DRAFT}: verification batches stay under 64 tokens (see README)")
        if self.k_max is not None and self.k_max < 1:
            raise InvalidParameterError(f"--k-max must be >= 1 (got {self.k_max})")
        if self.drafter_options.get("cache_path") is not None:
            raise InvalidParameterError("cache_path is not allowed in a benchmark: a suffix tree saved across runs "
                                        "would already hold the outputs being measured (drafters are built fresh "
                                        "per group)")
        if self.repeat < 1:
            raise InvalidParameterError(f"--repeat must be >= 1 (got {self.repeat})")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise InvalidParameterError(f"--temp needs temperatures >= 0 (got {self.temperatures})")
        if self.cost_max_n < 1 or self.cost_reps < 1:
            raise InvalidParameterError("--cost-max-n and --cost-reps must be >= 1")
        if self.peer_kernels is not None and self.peer_kernels not in PEER_KERNELS:
            raise InvalidParameterError(f"--peer-kernels must be one of {', '.join(PEER_KERNELS)} "
                                        f"(got {self.peer_kernels!r})")

    @property
    def runs_peers(self) -> bool:
        """llama.cpp's binaries run beside ours where their stock folder or their kernels are named."""
        return self.llama_cpp_bin is not None or self.peer_kernels is not None

    @property
    def peer_kernel_sets(self) -> tuple[str, ...]:
        """The kernels the peers run on, stock first (``peer_kernel_sets``)."""
        return peer_kernel_sets(self.peer_kernels)

    def configurations(self) -> list[tuple[str, int]]:
        """(method, k) in run order for each request: plain first (the reference), then the rest.

        ``METHOD@POLICY`` (e.g. ``prompt-lookup@cost``) runs once with an
        adaptive k policy up to k_max (default: the largest --k); its k is that cap.
        """
        return configurations(self.methods, self.ks, self.k_max)


def split_method(method: str) -> tuple[str, str | None]:
    """A bench method, ``DRAFTER`` or ``DRAFTER@POLICY`` (``prompt-lookup@cost``), as (drafter, policy): the
    one reading of the '@' (the runner, replay, tune, the peers and the CLI's -md check all ask it). None: no
    '@', a fixed k per --k; a policy runs once, adaptive up to k_max."""
    drafter, at, policy = method.partition("@")
    return drafter, (policy if at else None)


def configurations(methods: list[str] | tuple[str, ...], ks: list[int] | tuple[int, ...],
                   k_max: int | None = None) -> list[tuple[str, int]]:
    """(method, k) in run order: plain first (the reference), then each method at every k, or once at its cap
    (``k_max``, default the largest k) where it names a policy (``split_method``)."""
    out: list[tuple[str, int]] = [(PLAIN, 0)]
    for m in methods:
        out += [(m, k_max or max(ks))] if split_method(m)[1] is not None else [(m, k) for k in ks]
    return out


def peer_kernel_sets(choice: str | None) -> tuple[str, ...]:
    """--peer-kernels as the kernel sets the peers run on: ``both`` is stock then specstack; None is stock."""
    choice = choice or "stock"
    return ("stock", "specstack") if choice == "both" else (choice,)


def adaptive_start(k_max: int) -> int:
    """The starting k of an adaptive policy capped at k_max (window and heuristic grow from it)."""
    return min(k_max, 4)


def request_seed(base: int, request_id: str) -> int:
    """A fixed seed per request: the same for every method, repeat and k."""
    return (base * 1_000_003 + zlib.crc32(request_id.encode())) % (2**31 - 1)
