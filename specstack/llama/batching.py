"""Batch shapes that keep llama.cpp's logits exact, and the plan that packs segments into calls.

Pure data and arithmetic (no llama_cpp): ``target.LlamaModel`` keeps every
call inside the ``BatchShapes`` measured for its model (``calibration.shapes.measure_shapes``)
by following ``plan_calls``; ``draft_length.costs`` prices verification through the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class BatchShapes:
    """Which ``llama_decode`` shapes compute a row exactly as plain decoding does.

    llama.cpp picks kernels by batch size, and some kernels even treat rows
    differently by their index in the batch (the repacked Q4_K kernels work
    in groups of 4 rows), so a row's logits and KV depend on the call it was
    computed in.  These limits are *measured per model* at load
    (``calibration.shapes.measure_shapes``) and every call that commits tokens keeps
    within them:

    min_rows: calls are padded to at least this many rows (2 where a
      one-row call runs other kernels than any larger one: F16 here).
    max_rows: the largest call whose every row matches plain decoding;
      longer verification batches are split into calls of at most this size.
    prefill_exact: a long prefill chunk computes KV exactly as decode steps
      do, so a generated token's KV can be reused as a later prompt's prefix.
    pad_logits: pad rows ask for logits too.  llama.cpp runs the last
      layer's feed-forward and the output matrix on the rows that want logits
      only, so dropping the pad's logits changes those calls' shapes; where
      that was measured to leave the real row unchanged (Gemma 3 Q4_K_M
      here), a padded step skips a whole vocabulary-wide output row.
    tree_exact: tree calls (``eval_tree``) within ``max_rows`` were measured
      to give every branch the logits of a chain call; where they were not
      (an AVX2 build, F16), exact mode verifies chains only.
    pending: the shapes are being measured in the background
      (``calibration.background``); meanwhile every call that commits
      tokens has one row (``PLAIN_ROWS``), which is plain decoding itself and
      so exact without any measurement.
    even_rows: a call gives each of its sequences the same number of rows,
      padding the shorter ones.  llama.cpp runs a batch over separate KV
      streams (the non-unified cache that exact mode keeps) as one graph only
      when every sequence has the same rows and the sequence ids run
      consecutively; anything else is split into several graphs, each paying
      the whole weight pass.  Off where the target shares one unified cache
      (``--exact off``): then any mix of sequences and rows is one graph, and
      a step pays for its real rows only.  Set by the target (``set_shapes``).
    pad_to: without exactness, a call of n rows is padded to ``pad_to[n - 1]``
      rows, the cheapest call of at least n rows on the model's measured cost
      curve (``calibration.curve.cheapest_sizes``).  llama.cpp's repacked Q4_K kernels
      take rows in groups of 4: on the 1B stand-in a 7-row call took 130 ms and
      the same 7 rows padded to 8 took 103 ms.  Pad rows ask for no logits.
      Empty: calls are not padded beyond ``min_rows``.  Set with the cost curve
      (``calibration.curve.calibrate``); never with exact shapes, whose pads are measured.
    """

    min_rows: int = 2
    max_rows: int = 1 << 20
    prefill_exact: bool = True
    settled: bool = False  # measured for this model, or chosen (INEXACT); else assumed
    exact: bool = True  # False: never pad or split (--exact off, or auto where exactness costs too much)
    pad_logits: bool = True
    tree_exact: bool | None = None  # tree calls measured equal to chains (None: not measured, no trees here)
    why: str = ""  # how the mode was chosen (``--exact``, or what auto measured), shown in every output
    pending: bool = False
    even_rows: bool = True
    pad_to: tuple[int, ...] = ()

    def rows_for(self, n: int) -> int:
        """The rows a call with ``n`` real rows is given (``padded_rows``)."""
        return padded_rows(n, self.min_rows, self.pad_to)

    def __post_init__(self) -> None:
        if not 1 <= self.min_rows <= max(self.max_rows, self.min_rows):
            raise ValueError(f"bad batch shapes: min_rows={self.min_rows}, max_rows={self.max_rows}")

    def to_dict(self) -> dict:
        return {"min_rows": self.min_rows, "max_rows": self.max_rows, "prefill_exact": self.prefill_exact,
                "exact": self.exact, "pad_logits": self.pad_logits, "tree_exact": self.tree_exact, "why": self.why,
                "pending": self.pending}

    @classmethod
    def from_dict(cls, data: object) -> "BatchShapes":
        """``to_dict``'s output read back (from the cost cache, which users can edit or damage): every field is
        checked, so a bad entry is one ValueError naming the field, never a TypeError inside the engine."""
        if not isinstance(data, dict):
            raise ValueError(f"shapes: expected an object, found {type(data).__name__}")
        missing = [f for f in _FIELD_TYPES if f not in data]
        unknown = [f for f in data if f not in _FIELD_TYPES]
        if missing or unknown:
            raise ValueError(f"shapes: {'missing ' + ', '.join(missing) if missing else 'unknown ' + ', '.join(unknown)}")
        for name, kinds in _FIELD_TYPES.items():
            value = data[name]
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise ValueError(f"shapes: {name} is {value!r}")
        if data["min_rows"] < 1 or data["max_rows"] < data["min_rows"]:
            raise ValueError(f"shapes: min_rows {data['min_rows']}, max_rows {data['max_rows']}")
        return cls(**data)


# What ``to_dict`` writes, and the types ``from_dict`` accepts back.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "min_rows": (int,), "max_rows": (int,), "prefill_exact": (bool,), "exact": (bool,), "pad_logits": (bool,),
    "tree_exact": (bool, type(None)), "why": (str,), "pending": (bool,)}

INEXACT = BatchShapes(min_rows=1, max_rows=1 << 20, prefill_exact=True, settled=True, exact=False,
                      why="--exact off")  # draft models, --exact off
# Until the shapes are measured (in the background, on a model never seen before): one row per call, no
# pads, no trees.  A verification is then split into one-row calls, each the very call plain decoding
# makes, so speculation cannot change the output; the cost policy, seeing no saving, drafts nothing.
PLAIN_ROWS = BatchShapes(min_rows=1, max_rows=1, prefill_exact=False, settled=True, tree_exact=False, pending=True,
                         why="measuring this model's exact call shapes in the background; until then plain one-row calls")


def prefill_call(prefill_chunk: int, batch_cap: int) -> int:
    """The prompt tokens of one prefill call: prefill calls end at multiples of this (``LlamaModel.prefill``),
    so which calls computed a prompt's KV follows from its length alone (``prompt_cache.reusable``)."""
    return max(1, min(prefill_chunk, batch_cap))


def padded_rows(n: int, min_rows: int, pad_to: Sequence[int]) -> int:
    """The rows a call with ``n`` real rows is given: at least ``min_rows``, padded per ``pad_to``."""
    return max(n, min_rows, pad_to[n - 1] if 0 < n <= len(pad_to) else n)


@dataclass(frozen=True, slots=True)
class Segment:
    """Tokens to append to one sequence in a decode, with logits for rows ``logits_from``.. (none if ``len``)."""

    seq: int
    tokens: Sequence[int]
    logits_from: int = 0


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a segment inside one decode call: ``count`` real rows from ``start``, then ``pad`` throw-away rows."""

    segment: int
    start: int
    count: int
    pad: int


def decode_calls(shapes: BatchShapes, rows: Sequence[int], seqs: Sequence[int],
                 room: Sequence[int]) -> list[list[Piece]]:
    """The calls a target's ``decode`` makes for segments of ``rows[i]`` tokens on sequences ``seqs``, where
    ``room[i]`` positions are left after each: one call padded to ``shapes.rows_for`` (as far as room allows)
    when a single segment fits ``max_rows``, else ``plan_calls``.  ``LlamaModel.decode`` runs these calls and
    replay's recorded target (``bench.recorded``) prices them.

    >>> [[(p.count, p.pad) for p in c] for c in decode_calls(BatchShapes(min_rows=2), [1], [0], [100])]
    [[(1, 1)]]
    >>> [[(p.count, p.pad) for p in c] for c in decode_calls(BatchShapes(min_rows=1, pad_to=(1, 2, 4, 4)), [3], [0], [100])]
    [[(3, 1)]]
    """
    if len(rows) == 1 and rows[0] <= shapes.max_rows:
        n = rows[0]
        return [[Piece(0, 0, n, max(0, min(shapes.rows_for(n) - n, room[0])))]]
    return plan_calls(rows, seqs, shapes.min_rows, shapes.max_rows, room, shapes.even_rows, shapes.pad_to)


def plan_calls(rows: Sequence[int], seqs: Sequence[int], min_rows: int, max_rows: int,
               room: Sequence[int] | None = None, even: bool = True,
               pad_to: Sequence[int] = ()) -> list[list[Piece]]:
    """Group segments of ``rows[i]`` tokens into decode calls that keep every row exact.

    With ``even`` (``BatchShapes.even_rows``) each call has ``R`` rows per
    sequence (shorter pieces are padded; llama.cpp splits a multi-stream batch
    unevenly otherwise); without, pieces of any length share a call, padded on
    its last piece to ``min_rows`` or, for a call of ``t`` rows, to
    ``pad_to[t - 1]`` (``BatchShapes.pad_to``).  Every call
    has ``min_rows <= total <= max_rows`` rows.  A segment longer than
    ``max_rows`` is split into pieces verified one after another.  ``room[i]``
    caps the padding a segment's sequence can hold.  Pieces in a call are
    ordered by sequence id.

    >>> [[(p.segment, p.count, p.pad) for p in c] for c in plan_calls([3, 1], [0, 1], 2, 8)]
    [[(0, 3, 0), (1, 1, 2)]]
    >>> [[(p.segment, p.count, p.pad) for p in c] for c in plan_calls([3, 1], [0, 1], 2, 8, even=False)]
    [[(0, 3, 0), (1, 1, 0)]]
    >>> [[(p.segment, p.count, p.pad) for p in c] for c in plan_calls([5], [0], 1, 3)]
    [[(0, 3, 0)], [(0, 2, 0)]]
    """
    cap = max(max_rows, min_rows)
    room = room if room is not None else [cap] * len(rows)
    layers: list[list[tuple[int, int, int]]] = []  # layer -> (segment, start, count)
    for i, n in enumerate(rows):
        for j, start in enumerate(range(0, n, cap)):
            if j == len(layers):
                layers.append([])
            layers[j].append((i, start, min(cap, n - start)))
    calls: list[list[Piece]] = []
    for layer in layers:
        packed = _pack_even(layer, cap, min_rows, room) if even else _pack_uneven(layer, cap, min_rows, room, pad_to)
        for members in packed:
            members.sort(key=lambda p: seqs[p[0]])
            calls.append([Piece(seg, start, count, pad) for seg, start, count, pad in members])
    return calls


def _pack_even(layer: list[tuple[int, int, int]], cap: int, min_rows: int,
               room: Sequence[int]) -> list[list[tuple[int, int, int, int]]]:
    """Calls of ``R`` rows per piece (padded up to it), longest pieces first."""
    open_calls: list[tuple[int, list[tuple[int, int, int]]]] = []  # (R, pieces)
    for seg, start, count in sorted(layer, key=lambda p: -p[2]):
        for r, members in open_calls:
            if (len(members) + 1) * r <= cap and room[seg] >= r - count:
                members.append((seg, start, count))
                break
        else:
            open_calls.append((max(count, min(min_rows, count + room[seg])), [(seg, start, count)]))
    return [[(seg, start, count, r - count) for seg, start, count in members] for r, members in open_calls]


def _pack_uneven(layer: list[tuple[int, int, int]], cap: int, min_rows: int, room: Sequence[int],
                 pad_to: Sequence[int]) -> list[list[tuple[int, int, int, int]]]:
    """Calls of up to ``cap`` rows in all, first fit by length; the last piece pads a call to ``min_rows`` or
    its ``pad_to`` size."""
    open_calls: list[list[tuple[int, int, int]]] = []
    for piece in sorted(layer, key=lambda p: -p[2]):
        for members in open_calls:
            if sum(c for _, _, c in members) + piece[2] <= cap:
                members.append(piece)
                break
        else:
            open_calls.append([piece])
    out = []
    for members in open_calls:
        total = sum(c for _, _, c in members)
        short = min(cap, padded_rows(total, min_rows, pad_to)) - total
        seg = members[-1][0]
        pads = [0] * (len(members) - 1) + [max(0, min(short, room[seg]))]
        out.append([(s, start, c, pad) for (s, start, c), pad in zip(members, pads)])
    return out
