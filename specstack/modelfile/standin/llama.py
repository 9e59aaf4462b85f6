"""Layer placement for llama-architecture sources (dense and MoE), and llama.cpp's quant rule.

A llama stand-in holds every source layer once, in order, at slots that Q4_K_M quantizes like the
source's; the other slots hold zero-output copies. ``residual_copies`` picks m so that the norm
rescaling is exact (see the package docstring). LFM2 reuses ``use_more_bits`` and
``place_source_layers``.
"""

from __future__ import annotations

from typing import Sequence

from .shape import LayerLayout


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """Copied from llama.cpp src/llama-quant.cpp: Q4_K_M/Q5_K_M give attn_v and ffn_down of
    these layers Q6_K, so source layers must land on slots with the same verdict."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def live_layer_slots(n_src: int, n_out: int) -> list[int]:
    """Stand-in layer indices for the source layers, in order.

    Picks the earliest slots whose ``use_more_bits`` pattern equals the source's, so Q4_K_M gives
    each source layer the same tensor types in both models. Greedy earliest matching finds such a
    subsequence whenever one exists; otherwise the source layers go first.
    """
    slots: list[int] = []
    pos = 0
    for j in range(n_src):
        want = use_more_bits(j, n_src)
        while pos < n_out and use_more_bits(pos, n_out) != want:
            pos += 1
        if pos >= n_out:
            return list(range(n_src))
        slots.append(pos)
        pos += 1
    return slots


def residual_copies(d: int, width: int) -> int:
    """m: how many copies of the d source coordinates to keep, so that width / (m d) is a power
    of 4 (see the package docstring); 1 when width is not a whole multiple of d."""
    if width % d:
        return 1
    ratio = width // d
    while ratio % 4 == 0:
        ratio //= 4
    return ratio


def place_source_layers(fillers: Sequence[int], slots: Sequence[int]) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Per stand-in layer, the source layer it holds and whether it is live: source layer j at
    ``slots[j]`` (live), ``fillers[i]`` (a zero-output copy) everywhere else."""
    source, live = list(fillers), [False] * len(fillers)
    for j, slot in enumerate(slots):
        source[slot], live[slot] = j, True
    return tuple(source), tuple(live)


def llama_layer_layout(n_src: int, n_out: int) -> LayerLayout:
    """Source layers at ``live_layer_slots``; filler i copies source layer i mod n_src (realistic
    magnitudes, so no overflow, while writing nothing to the residual)."""
    slots = live_layer_slots(n_src, n_out)
    q4_ok = [use_more_bits(p, n_out) for p in slots] == [use_more_bits(j, n_src) for j in range(n_src)]
    source, live = place_source_layers([i % n_src for i in range(n_out)], slots)
    return LayerLayout(source, live, q4_ok)
